"""Model speed: onnxruntime CPU latency of a model and of its optimized variants.

Every variant gets a session at each optimization level (ORT_DISABLE_ALL, ORT_ENABLE_BASIC,
ORT_ENABLE_ALL) with ``intra_op_num_threads=1`` and ``inter_op_num_threads=1``: one core per
run keeps the numbers stable on a shared 2-core machine and compares the graphs rather than
the thread pool. The variants of one model are timed in interleaved rounds (each round runs
every variant once, in a shuffled order), so a burst of load from another process slows all
variants alike instead of one. Warm-up and run counts adapt to the model's size within a
time budget; the counts used are recorded.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping

import numpy as np
import onnxruntime as ort
import stats

LEVELS: dict[str, ort.GraphOptimizationLevel] = {
    "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def session(path: str, level: str) -> ort.InferenceSession:
    """A single-threaded CPU session of the model at ``path`` at optimization ``level``."""
    options = ort.SessionOptions()
    options.graph_optimization_level = LEVELS[level]
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def _runner(sess: ort.InferenceSession, feeds: Mapping[str, np.ndarray]) -> Callable[[], float]:
    wanted = {i.name for i in sess.get_inputs()}
    mine = {k: v for k, v in feeds.items() if k in wanted}

    def once() -> float:
        start = time.perf_counter()
        sess.run(None, mine)
        return time.perf_counter() - start

    return once


def plan(round_s: float, budget_s: float, warmup: int, min_runs: int,
         max_runs: int) -> tuple[int, int]:
    """(warm-up rounds, timed rounds) for rounds of ``round_s`` seconds: ``warmup`` warm-ups
    when they fit in a fifth of the budget (at least 2), and as many timed rounds as the
    budget holds within ``[min_runs, max_runs]``."""
    round_s = max(round_s, 1e-6)
    warm = max(2, min(warmup, math.floor(0.2 * budget_s / round_s)))
    runs = max(min_runs, min(max_runs, math.floor(budget_s / round_s)))
    return warm, runs


def measure(variants: Mapping[str, str], feeds: Mapping[str, Mapping[str, np.ndarray]],
            level: str, budget_s: float = 6.0, warmup: int = 10, min_runs: int = 10,
            max_runs: int = 200, seed: int = 0) -> dict:
    """Latency of each variant (name -> model path) at ``level``, interleaved; ``feeds``
    gives each variant's inputs by variant name (an optimizer may add or drop inputs).

    Returns ``{"warmup", "runs", "variants": {name: spread of seconds | {"error"}}}``.
    """
    sessions, result = {}, {}
    for name, path in variants.items():
        try:
            sessions[name] = _runner(session(path, level), feeds[name])
            sessions[name]()  # first run: allocations, lazy init; not counted
        except Exception as e:  # noqa: BLE001 - a variant that does not run is a result
            result[name] = {"error": " ".join(str(e).split())[:200]}
            sessions.pop(name, None)
    if not sessions:
        return {"warmup": 0, "runs": 0, "variants": result}
    round_s = sum(run() for run in sessions.values())
    warm, runs = plan(round_s, budget_s, warmup, min_runs, max_runs)
    for _ in range(warm):
        for run in sessions.values():
            run()
    samples: dict[str, list[float]] = {name: [] for name in sessions}
    order = list(sessions)
    shuffle = random.Random(seed).shuffle
    for _ in range(runs):
        shuffle(order)
        for name in order:
            samples[name].append(sessions[name]())
    result.update({name: stats.spread(times) for name, times in samples.items()})
    return {"warmup": warm, "runs": runs,
            "variants": {name: result[name] for name in variants if name in result}}
