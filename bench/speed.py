"""Tool speed: wall time and peak RSS of every optimizer, each run in a fresh child process.

:func:`measure_model` runs each tool ``reps`` times on one model (the repetitions interleave
the tools, so a burst of load from another process spreads over all of them rather than
hitting one), keeping the first run's output for the latency and traffic measurements.
:func:`measure_scale` does the same on bench/scale.py's Conv+BatchNormalization+Relu chains
of growing size, to show how each tool's time grows with the node count.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import child
import onnx
import peers
import stats

CHILD = Path(child.__file__).resolve()
SCALE_SIZES = (1_000, 10_000, 50_000, 100_000)
Say = Callable[[str], None]


def run_tool(tool: str, src: str | Path, dst: str | Path, extra: Sequence[str] = (),
             timeout: float = 900.0) -> dict:
    """One run of ``tool`` in a fresh interpreter (bench/child.py).

    Returns child.py's record (``import_s``, ``run_s``, ``peak_rss``, ``import_rss``,
    ``error``) plus ``wall_s``, the whole process from the parent's side. A crash or a
    timeout becomes an ``error`` with the time spent.
    """
    Path(dst).unlink(missing_ok=True)
    command = [sys.executable, str(CHILD), tool, str(src), str(dst), *extra]
    env = {**os.environ, "PYTHONPATH": str(peers.ROOT), "NO_COLOR": "1"}
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"wall_s": time.perf_counter() - start, "error": f"timeout after {timeout:.0f} s"}
    wall = time.perf_counter() - start
    lines = done.stdout.strip().splitlines()
    try:
        record = json.loads(lines[-1]) if lines else {}
    except ValueError:
        record = {}
    if not record:
        why = peers.one_line(done.stderr) if done.stderr.strip() else "no output"
        record = {"error": f"exit code {done.returncode}: {why}"}
    elif record.get("error") and done.stderr.strip():
        record["error"] += f": {peers.one_line(done.stderr.strip().splitlines()[-1])}"
    record["wall_s"] = wall
    return record


def summarize(runs: list[dict]) -> dict:
    """Median and min–max of each measure over the runs that succeeded."""
    ok = [r for r in runs if not r.get("error")]
    summary = {key: stats.spread([r[key] for r in ok])
               for key in ("run_s", "wall_s", "peak_rss", "import_s")}
    errors = sorted({r["error"] for r in runs if r.get("error")})
    return {**summary, "ok": len(ok), "runs": len(runs), "errors": errors, "samples": runs}


def validation_args(input_ranges: dict[str, Sequence[int]]) -> list[str]:
    """fusectl flags that give integer inputs the corpus' value ranges (token ids < vocab)."""
    return [f"--input-range={name}={lo}:{hi}" for name, (lo, hi) in input_ranges.items()]


def measure_model(name: str, src: str, tools: Sequence[str], reps: int, keep_dir: Path,
                  input_ranges: dict | None = None, timeout: float = 900.0,
                  say: Say = print) -> dict[str, dict]:
    """Every tool ``reps`` times on one model; the first run's output is kept as
    ``keep_dir/NAME.TOOL.onnx``. Returns ``{tool: summary + {"output": path or None}}``."""
    keep_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {tool: [] for tool in tools}
    extra = validation_args(input_ranges or {})
    with tempfile.TemporaryDirectory(prefix="fusectl-speed-") as tmp:
        for rep in range(reps):
            for tool in tools:
                say(f"tool speed: {name}: {tool} ({rep + 1}/{reps})")
                dst = keep_dir / f"{name}.{tool}.onnx" if rep == 0 else Path(tmp) / "out.onnx"
                flags = extra if tool == "fusectl+validate" else []
                runs[tool].append(run_tool(tool, src, dst, flags, timeout))
                if rep:
                    dst.unlink(missing_ok=True)
                    Path(str(dst) + ".data").unlink(missing_ok=True)
    result = {}
    for tool in tools:
        output = keep_dir / f"{name}.{tool}.onnx"
        result[tool] = {**summarize(runs[tool]),
                        "output": str(output) if output.exists() else None}
    return result


def predicted_seconds(points: list[tuple[int, float]], nodes: int) -> float:
    """Extrapolate a tool's time to ``nodes`` from its last two (nodes, seconds) points:
    the power law through them (at least linear), or linear from a single point."""
    n2, t2 = points[-1]
    exponent = 1.0
    if len(points) > 1:
        n1, t1 = points[-2]
        if t1 > 0 and t2 > 0 and n2 != n1:
            exponent = max(1.0, math.log(t2 / t1) / math.log(n2 / n1))
    return t2 * (nodes / n2) ** exponent


def measure_scale(sizes: Sequence[int], tools: Sequence[str], reps: int, timeout: float,
                  big_reps: int = 1, say: Say = print,
                  fusectl_timeout: float = 600.0) -> list[dict]:
    """Each tool on Conv+BN+Relu chains of about ``sizes`` nodes (``reps`` runs up to 10k
    nodes, ``big_reps`` above). A tool that timed out, or whose extrapolated time exceeds its
    limit, is not run on the larger graphs (recorded as skipped, with the reason): some tools
    are quadratic and would take most of the benchmark's time. The limit is ``timeout`` for
    the peers and the larger ``fusectl_timeout`` for fusectl, whose scaling is the point."""
    import scale  # bench/scale.py (may import fusectl at the top: our sys.path has the root)

    rows = []
    history: dict[str, list[tuple[int, float]]] = {tool: [] for tool in tools}
    stopped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="fusectl-scale-") as tmp:
        for size in sizes:
            src = Path(tmp) / f"chain{size}.onnx"
            model = scale.conv_bn_relu_chain(size)
            onnx.save(model, src)
            row = {"size": size, "nodes": len(model.graph.node), "tools": {}}
            del model
            for tool in tools:
                limit = fusectl_timeout if tool in child.FUSECTL_FLAGS else timeout
                if tool not in stopped and history[tool]:
                    guess = predicted_seconds(history[tool], row["nodes"])
                    if guess > limit:
                        stopped[tool] = f"skipped: about {guess:.0f} s expected (limit " \
                                        f"{limit:.0f} s)"
                if tool in stopped:
                    row["tools"][tool] = {"skipped": stopped[tool]}
                    continue
                runs = []
                for rep in range(reps if size <= 10_000 else big_reps):
                    say(f"scale: {size} nodes: {tool} ({rep + 1})")
                    runs.append(run_tool(tool, src, Path(tmp) / "out.onnx", timeout=limit))
                    if (runs[-1].get("error") or "").startswith("timeout"):
                        stopped[tool] = f"skipped: timed out on {size} nodes"
                        break
                summary = summarize(runs)
                row["tools"][tool] = summary
                if summary["run_s"]:
                    history[tool].append((row["nodes"], summary["run_s"]["median"]))
            src.unlink()
            rows.append(row)
    return rows
