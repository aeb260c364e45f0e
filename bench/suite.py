"""The measurements of one benchmark run, model by model (bench/benchmark.py is the command).

For each corpus model: tool speed (bench/speed.py), traffic of each output (bench/compare.py's
``measure``), latency of each output (bench/latency.py); then the rule that makes the worst
fusectl model slower (bench/why_slower.py) and profiles of fusectl (bench/profile_fusectl.py).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import compare
import latency
import models
import onnx
import onnx_ir as ir
import peers
import results
import speed
import why_slower

from fusectl.validate import ValidationOptions, generate_inputs

HERE = Path(__file__).resolve().parent
Say = Callable[[str], None]


def machine() -> dict:
    """CPU model, cores, RAM and load: what makes numbers comparable across runs."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_bytes": ram,
            "platform": platform.platform(), "load_before": os.getloadavg()[0]}


def _options(entry: models.Entry) -> ValidationOptions:
    ranges = {k: (float(v[0]), float(v[1])) for k, v in entry.input_ranges.items()}
    return ValidationOptions(seed=0, input_ranges=ranges)


def traffic_of(entry: models.Entry, outputs: dict[str, str | None]) -> dict:
    """compare.py's measure (nodes, kernels, bytes) of the original and every output."""
    found = {}
    for name, path in {"original": entry.path, **outputs}.items():
        if not path:
            continue
        try:
            measured = compare.measure(path, entry)
            measured.pop("ops", None)
            found[name] = measured
        except Exception as e:  # noqa: BLE001 - recorded, the benchmark goes on
            found[name] = {"error": peers.one_line(e)}
    return found


def variant_feeds(variants: dict[str, str], options: ValidationOptions) -> dict[str, dict]:
    """Each variant's inputs: the original's arrays, plus generated ones for inputs only the
    variant has (onnxruntime's saved model of an IR < 4 model lists folded-away shape
    initializers as required inputs; their values are unused)."""
    base = generate_inputs(ir.load(variants["original"]), options)
    found = {}
    for name, path in variants.items():
        own = base if name == "original" else generate_inputs(ir.load(path), options)
        found[name] = {k: base.get(k, v) for k, v in own.items()}
    return found


def latency_of(entry: models.Entry, outputs: dict[str, str | None], levels: list[str],
               settings: dict, say: Say) -> dict:
    """Latency of the original and every output at each level (interleaved rounds)."""
    variants = {"original": entry.path, **{k: v for k, v in outputs.items() if v}}
    feeds = variant_feeds(variants, _options(entry))
    found = {}
    for level in levels:
        say(f"latency: {entry.name}: {level}")
        found[level] = latency.measure(variants, feeds, level, **settings)
    return found


def bench_model(entry: models.Entry, args: argparse.Namespace, keep: Path, say: Say) -> dict:
    record = {"model": entry.name, "source": entry.source, "nodes": entry.nodes}
    once = [t for t in args.once_tools if t in args.tools]
    record["speed"] = speed.measure_model(
        entry.name, entry.path, [t for t in args.tools if t not in once], args.reps, keep,
        entry.input_ranges, args.timeout, say)
    record["speed"].update(speed.measure_model(entry.name, entry.path, once, 1, keep,
                                               entry.input_ranges, args.timeout, say))
    outputs = {name: record["speed"][name]["output"] for name in results.VARIANTS
               if name in record["speed"]}
    if not args.no_traffic:
        say(f"traffic: {entry.name}")
        record["traffic"] = traffic_of(entry, outputs)
    if not args.no_latency:
        record["latency"] = latency_of(entry, outputs, args.levels, args.latency, say)
    return record


def explain(cases: list[dict], entries: dict[str, models.Entry], budget: float,
            say: Say) -> list[dict]:
    found = []
    for case in cases:
        entry = entries[case["model"]]
        say(f"why slower: {entry.name} {case['target']} {case['level']}")
        ranges = _options(entry).input_ranges
        with tempfile.TemporaryDirectory(prefix="fusectl-why-") as tmp:
            try:
                why = why_slower.leave_one_out(entry.path, case["target"], case["level"],
                                               Path(tmp), ranges, budget)
            except Exception as e:  # noqa: BLE001 - recorded
                found.append({**case, "error": peers.one_line(e)})
                continue
        found.append({**why, "name": entry.name, "ratio_in_run": case["ratio"]})
    return found


def profile_child(model: str | Path, name: str, fusectl_args: list[str], say: Say) -> dict:
    """bench/profile_fusectl.py in a fresh process (so imports are part of the profile)."""
    say(f"profiling fusectl on {name}")
    with tempfile.TemporaryDirectory(prefix="fusectl-prof-") as tmp:
        out = Path(tmp) / "profile.json"
        done = subprocess.run([sys.executable, str(HERE / "profile_fusectl.py"), "--json",
                               str(out), str(model), *fusectl_args], capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(peers.ROOT)})
        if done.returncode != 0 or not out.exists():
            return {"name": name, "error": peers.one_line(done.stderr or "no profile")}
        return {"name": name, **json.loads(out.read_text())}


def largest_profiled(scale_rows: list[dict], limit: float = 300.0) -> int:
    """The largest synthetic graph fusectl optimized within ``limit`` seconds (0: none):
    profiling costs a run or more, so a graph fusectl takes 10 minutes on is not profiled."""
    done = [row["size"] for row in scale_rows
            if (row["tools"].get("fusectl", {}).get("run_s") or {}).get("median", limit + 1)
            <= limit]
    return max(done, default=0)


def profiles(records: list[dict], entries: dict[str, models.Entry], largest: int,
             say: Say) -> list[dict]:
    """Profile fusectl (with validation) on the slowest corpus model, and without validation
    on the synthetic graph of ``largest`` nodes (none when 0)."""
    import scale

    found = []
    timed = [(r["speed"]["fusectl+validate"]["run_s"]["median"], r["model"]) for r in records
             if (r["speed"].get("fusectl+validate") or {}).get("run_s")]
    if timed:
        _, slowest = max(timed)
        entry = entries[slowest]
        found.append(profile_child(entry.path, slowest,
                                   speed.validation_args(entry.input_ranges), say))
    if largest:
        with tempfile.TemporaryDirectory(prefix="fusectl-prof-") as tmp:
            path = Path(tmp) / f"chain{largest}.onnx"
            onnx.save(scale.conv_bn_relu_chain(largest), path)
            found.append(profile_child(path, f"synthetic {largest:,} nodes",
                                       ["--no-validate"], say))
    return [p for p in found if "error" not in p] + [p for p in found if "error" in p]


def select(globs: list[str] | None, log: Say) -> list[models.Entry]:
    """The corpus models the globs name (all without globs). The torch exports are built
    (when missing) only if a glob may name one: plain light-model names never need torch."""
    light = models.light_models()
    light_only = globs and all(not any(c in g for c in "*?[") and
                               any(e.name == g for e in light) for g in globs)
    corpus = light if light_only else [e for e in models.corpus(log=log) if e.path]
    return [e for e in corpus if not globs or any(fnmatch.fnmatch(e.name, g) for g in globs)]
