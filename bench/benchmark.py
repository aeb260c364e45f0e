"""The benchmark: tool speed, model speed and traffic of fusectl and its peers, in one run.

``python bench/benchmark.py`` runs every corpus model (bench/models.py) through every tool
several times in fresh processes (bench/speed.py), measures the traffic of each output
(bench/compare.py's ``measure``), times each output on onnxruntime at three optimization
levels (bench/latency.py), times the tools on synthetic graphs of 1k–100k nodes, profiles
fusectl (bench/profile_fusectl.py) and, where a fusectl model is slower than the original,
finds the rule responsible (bench/why_slower.py). It prints rich tables and writes
``bench/.results/bench-DATE.json`` (+ ``latest.json``) and ``bench/RESULTS.md``.
``--quick`` is a smoke run: two small models, one repetition, short latency budget, no scaling
and no profile; it writes its Markdown under ``bench/.results/`` instead of RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import child
import latency
import peers
import results
import speed
from rich.console import Console

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / ".results"
MARKDOWN = HERE / "RESULTS.md"
QUICK_MODELS = ("light_squeezenet", "mobilenetv2-ts")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        """Bad usage: one line on stderr, exit code 2 (argparse would add the usage)."""
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 small models, 1 rep, short latency, no scale/profile")
    parser.add_argument("--models", nargs="+", metavar="GLOB",
                        help="corpus models to run (name globs; default all)")
    parser.add_argument("--tools", nargs="+", default=list(child.TOOLS), choices=child.TOOLS)
    parser.add_argument("--once-tools", nargs="*", default=["fusectl-ort"], metavar="TOOL",
                        help="tools run once per model, not --reps times (default fusectl-ort: "
                             "its model is needed, its speed is fusectl's)")
    parser.add_argument("--reps", type=int, default=3, help="runs per tool and model (3)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per tool run")
    parser.add_argument("--levels", nargs="+", default=list(latency.LEVELS),
                        choices=list(latency.LEVELS))
    parser.add_argument("--latency-budget", type=float, default=4.0,
                        help="seconds of timed latency rounds per model and level (4)")
    parser.add_argument("--scale", nargs="*", type=int, default=list(speed.SCALE_SIZES),
                        metavar="NODES", help="synthetic graph sizes (none: skip)")
    parser.add_argument("--scale-tools", nargs="+", choices=child.TOOLS,
                        default=[*peers.PEERS, "fusectl"])
    parser.add_argument("--scale-timeout", type=float, default=100.0,
                        help="seconds per peer run on a synthetic graph: a peer stops at the "
                             "first size it would exceed this (100)")
    parser.add_argument("--scale-timeout-fusectl", type=float, default=600.0,
                        help="the same limit for fusectl (600)")
    parser.add_argument("--profile-limit", type=float, default=300.0,
                        help="profile the largest synthetic graph fusectl optimized within "
                             "this many seconds (300)")
    parser.add_argument("--no-traffic", action="store_true")
    parser.add_argument("--no-latency", action="store_true")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--no-why", action="store_true",
                        help="do not look for the rule that makes a fusectl model slower")
    parser.add_argument("--json", type=Path, help="where to write the JSON (default "
                        "bench/.results/bench-DATE.json and latest.json)")
    parser.add_argument("--markdown", type=Path,
                        help="where to write the summary (default bench/RESULTS.md; with "
                             "--quick bench/.results/RESULTS-quick.md)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if args.quick:
        args.models = args.models or list(QUICK_MODELS)
        args.reps = 1
        args.scale = []
        args.no_profile = args.no_why = True
        args.latency_budget = min(args.latency_budget, 0.5)
    args.latency = {"budget_s": args.latency_budget, "warmup": 10,
                    "min_runs": 3 if args.quick else 10, "max_runs": 200}
    if args.markdown is None:
        args.markdown = RESULTS_DIR / "RESULTS-quick.md" if args.quick else MARKDOWN
    return args


def code_fingerprint() -> dict:
    """The commit and a hash of fusectl/ and rules/ as they are on disk: recorded at the
    start and the end, so a run that spanned an edit says so (each tool run imports the
    checkout afresh)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted([*root.glob("fusectl/**/*.py"), *root.glob("rules/*.yaml")]):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"commit": commit or "unknown", "tree": digest.hexdigest()[:12]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import suite  # torch, onnx-ir, fusectl: imported once the arguments are known good

    console = Console() if Console().is_terminal else Console(width=200)
    started = time.perf_counter()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": suite.machine(), "python": platform.python_version(),
            "versions": suite.compare.versions(), "code": code_fingerprint(),
            "config": {"quick": args.quick, "reps": args.reps, "tools": args.tools,
                       "once_tools": args.once_tools, "levels": args.levels,
                       "latency": args.latency, "scale": args.scale,
                       "scale_tools": args.scale_tools, "scale_timeout": args.scale_timeout}}
    entries = suite.select(args.models, console.print)
    if not entries:
        print(f"error: no corpus model matches {' '.join(args.models or [])!r} "
              "(see bench/README.md for the names)", file=sys.stderr)
        return 2
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    data: dict = {"meta": meta, "models": [], "scale": [], "profile": [], "why": []}
    with tempfile.TemporaryDirectory(prefix="fusectl-bench-") as tmp, \
            console.status("benchmark") as status:
        say = status.update
        for entry in entries:
            data["models"].append(suite.bench_model(entry, args, Path(tmp), say))
            for path in Path(tmp).glob(f"{entry.name}.*"):
                path.unlink()
        if args.scale:
            data["scale"] = speed.measure_scale(sorted(args.scale), args.scale_tools,
                                                args.reps, args.scale_timeout, say=say,
                                                fusectl_timeout=args.scale_timeout_fusectl)
        by_name = {e.name: e for e in entries}
        if not args.no_why and not args.no_latency:
            data["why"] = suite.explain(results.worst_cases(data["models"]), by_name,
                                        args.latency_budget, say)
        if not args.no_profile:
            largest = suite.largest_profiled(data["scale"], args.profile_limit)
            data["profile"] = suite.profiles(data["models"], by_name, largest, say)
    meta["machine"]["load_after"] = os.getloadavg()[0]
    meta["seconds"] = time.perf_counter() - started
    meta["code_after"] = code_fingerprint()
    text = json.dumps(data, indent=1)  # saved first: a failing table must not lose the run
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for path in ([args.json] if args.json else [RESULTS_DIR / f"bench-{stamp}.json",
                                                 RESULTS_DIR / "latest.json"]):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        console.print(f"wrote {path}")
    results.print_tables(data, console)
    previous = args.markdown.read_text() if args.markdown.exists() else ""
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text(results.markdown(data, results.kept_findings(previous)))
    console.print(f"wrote {args.markdown} ({meta['seconds'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
