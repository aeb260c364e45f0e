"""Which fusion makes a fusectl model slower than the original on onnxruntime?

``python bench/why_slower.py MODEL [--target onnx|onnxruntime] [--level all]`` optimizes the
model once with every built-in rule and once per fired rule with that rule skipped (what
``fusectl optimize --skip-rule ID`` does), then times the original, the full fusectl model and
every leave-one-out model in the same interleaved rounds (bench/latency.py), plus the model
with no rule at all (fusectl's constant folding and tidying alone). A rule whose
removal brings the latency back to the original's (or below) is the one that costs time.
Leave-one-out rather than bisection: a model fires a handful of rules, and one session per
rule also shows rules that cost time only together with others.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import latency
import onnx_ir as ir
import peers  # noqa: F401 - puts this checkout first on sys.path
import stats

import fusectl
from fusectl.validate import ValidationOptions, generate_inputs

NO_RULES = "fusectl, no rules"
"""The variant with every rule skipped: what fusectl's preparation alone (constant folding,
shape inference, tidying) does to the latency."""


def fired_rules(model: str | Path, target: str) -> Counter[str]:
    """How often each rule fired on ``model`` (no validation)."""
    result = fusectl.optimize(model, target=target, check=False)
    return Counter(app.rule_id for app in result.rewrite.applications)


def leave_one_out(model: str | Path, target: str, level: str, out_dir: Path,
                  input_ranges: Mapping[str, tuple[float, float]] | None = None,
                  budget_s: float = 6.0) -> dict:
    """Latency of the original, the fusectl model and each fusectl model minus one fired
    rule, at ``level``; ``{"fired": {rule: count}, "latency": latency.measure(...)}``."""
    fired = fired_rules(model, target)
    variants = {"original": str(model)}
    every = fusectl.load_rule_set(target=target)
    for skipped in (None, "*", *sorted(fired)):
        rules = [r for r in every if skipped not in (r.id, "*")]
        result = fusectl.optimize(model, rules=rules, target=target, check=False)
        name = {None: "fusectl", "*": NO_RULES}.get(skipped, f"skip {skipped}")
        path = out_dir / f"{ {None: 'all', '*': 'none'}.get(skipped, skipped)}.onnx"
        fusectl.save_model(result.model, path)
        variants[name] = str(path)
    options = ValidationOptions(seed=0, input_ranges=dict(input_ranges or {}))
    feeds = generate_inputs(ir.load(str(model)), options)  # fusectl keeps the signature
    timed = latency.measure(variants, dict.fromkeys(variants, feeds), level, budget_s=budget_s)
    return {"model": str(model), "target": target, "level": level, "fired": dict(fired),
            "latency": timed}


def verdict(result: dict) -> list[dict]:
    """Per skipped rule: its latency and ratio to the original and to the full fusectl
    model, the rule that helps most first (lowest latency without it)."""
    variants = result["latency"]["variants"]
    original, full = variants.get("original"), variants.get("fusectl")
    rows = []
    for name, timing in variants.items():
        if not name.startswith("skip ") or "median" not in (timing or {}):
            continue
        rows.append({"rule": name[5:], "fired": result["fired"].get(name[5:], 0),
                     "latency": timing, "vs_original": stats.ratio(timing, original),
                     "vs_original_min": min_ratio(timing, original),
                     "vs_fusectl": stats.ratio(timing, full)})
    return sorted(rows, key=lambda r: r["latency"]["median"])


def min_ratio(mine: dict | None, theirs: dict | None) -> float | None:
    """Fastest run over fastest run: load from other processes only ever adds time, so on a
    shared machine this ratio moves less than the medians'."""
    if not mine or not theirs or not theirs.get("min"):
        return None
    return mine["min"] / theirs["min"]


def print_result(result: dict) -> None:
    variants = result["latency"]["variants"]
    original = variants.get("original")
    print(f"{result['model']} target {result['target']}, ORT level {result['level']}, "
          f"{result['latency']['runs']} runs (1 thread), milliseconds, median (min-max), "
          "x original by median and by min:")
    for name in ("original", "fusectl", NO_RULES):
        timing = variants.get(name)
        print(f"  {name:40} {stats.fmt_spread(timing, 1e3, 3):>28}  "
              f"x{stats.fmt_ratio(stats.ratio(timing, original))}  "
              f"x{stats.fmt_ratio(min_ratio(timing, original))}")
    for row in verdict(result):
        print(f"  {'skip ' + row['rule']:40} {stats.fmt_spread(row['latency'], 1e3, 3):>28}  "
              f"x{stats.fmt_ratio(row['vs_original'])}  x{stats.fmt_ratio(row['vs_original_min'])}"
              f"  (fired {row['fired']}x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--target", default="onnx", choices=["onnx", "onnxruntime"])
    parser.add_argument("--level", default="all", choices=list(latency.LEVELS))
    parser.add_argument("--budget", type=float, default=6.0,
                        help="seconds of timed rounds (default 6)")
    args = parser.parse_args(argv)
    if not args.model.is_file():
        print(f"error: {args.model}: no such model file", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="fusectl-why-") as tmp:
        print_result(leave_one_out(args.model, args.target, args.level, Path(tmp),
                                   budget_s=args.budget))
    return 0


if __name__ == "__main__":
    sys.exit(main())
