"""Where fusectl's time goes: ``fusectl optimize`` under pyinstrument, summed by stage.

``python bench/profile_fusectl.py [--json FILE] MODEL [FUSECTL_ARGS...]`` profiles one run of
the CLI in this process (imports included, as a user pays them) and prints the stages and the hot
spots. The benchmark (bench/benchmark.py) calls :func:`profile` on its slowest corpus model
and on the largest synthetic graph. pyinstrument samples the stack every millisecond, so the
times are estimates; the stage split is what matters.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

STAGES: tuple[tuple[str, str, str], ...] = (
    # (stage, file suffix, function): the outermost frame that matches names the stage
    ("rules: parse YAML", "fusectl/rulefile.py", "load_rules"),
    ("rules: compile", "fusectl/compile.py", "compile_rules"),
    ("load model", "fusectl/modelio.py", "load_model"),
    ("prepare: fold + shape inference", "fusectl/prepare.py", "prepare"),
    ("rewrite: match + replace", "fusectl/rewrite.py", "apply_rules"),
    ("traffic model", "fusectl/traffic.py", "measure"),
    ("validate on onnxruntime", "fusectl/validate.py", "run_reference"),
    ("validate on onnxruntime", "fusectl/validate.py", "check_candidate"),
    ("save model", "fusectl/modelio.py", "save_model"),
    ("report", "fusectl/report.py", "optimize_json"),
    ("imports", "", "<module>"),
)


def _stage(frame) -> str | None:
    path = (frame.file_path or "").replace("\\", "/")
    for stage, suffix, function in STAGES:
        if frame.function == function and path.endswith(suffix):
            return stage
    return None


def _short(frame) -> str:
    path = (frame.file_path or "?").replace("\\", "/")
    for marker in ("/fusectl/", "/site-packages/", "/lib/python"):
        if marker in path:
            path = path.split(marker, 1)[1]
            path = ("fusectl/" + path) if marker == "/fusectl/" else path
            break
    return f"{path}:{frame.function}"


def summarize(root, top: int = 12) -> dict:
    """Seconds per stage, and the hot spots: fusectl functions by inclusive time (a call
    chain shown once), any function and any file by self time; each with its share."""
    total = root.time or 1e-9
    stages: dict[str, float] = defaultdict(float)
    inclusive: dict[str, float] = defaultdict(float)
    self_time: dict[str, float] = defaultdict(float)

    def walk(frame, stage: str | None, open_names: frozenset[str]) -> None:
        here = _stage(frame)
        if here and stage is None:
            stages[here] += frame.time
        stage = stage or here
        name = _short(frame)
        if name.startswith("fusectl/") and name not in open_names:  # recursion counted once
            inclusive[name] += frame.time
            open_names = open_names | {name}
        if not frame.is_synthetic:
            self_time[name] += frame.total_self_time
        for child in frame.children:
            walk(child, stage, open_names)

    walk(root, None, frozenset())
    stages["other"] = max(0.0, total - sum(stages.values()))

    def ranked(table: dict[str, float], collapse: bool = False) -> list[dict]:
        rows: list[dict] = []
        for where, seconds in sorted(table.items(), key=lambda kv: -kv[1]):
            if collapse and rows and rows[-1]["seconds"] - seconds < 0.01 * total:
                continue  # a call chain (f calls g calls h): keep its outermost function
            rows.append({"where": where, "seconds": seconds, "percent": 100.0 * seconds / total})
        return rows[:top]

    by_file: dict[str, float] = defaultdict(float)
    for where, seconds in self_time.items():
        by_file[where.rsplit(":", 1)[0]] += seconds
    skip = {"fusectl/cli.py:main", "fusectl/cli.py:optimize", "fusectl/api.py:optimize"}
    return {"total_s": total,
            "stages": [{"stage": k, "seconds": v, "percent": 100.0 * v / total}
                       for k, v in sorted(stages.items(), key=lambda kv: -kv[1])],
            "fusectl_inclusive": ranked({k: v for k, v in inclusive.items() if k not in skip},
                                        collapse=True),
            "self_time": ranked(self_time),
            "self_time_by_file": ranked(by_file)}


def profile(model: str | Path, args: Sequence[str] = ()) -> dict:
    """Profile ``fusectl optimize MODEL -q ARGS`` (output to a temporary file)."""
    from pyinstrument import Profiler

    with tempfile.TemporaryDirectory(prefix="fusectl-profile-") as tmp:
        profiler = Profiler(interval=0.001)
        start = time.perf_counter()
        profiler.start()
        from fusectl.cli import main

        code = main(["optimize", str(model), "-o", str(Path(tmp) / "out.onnx"), "-q", *args])
        profiler.stop()
        wall = time.perf_counter() - start
    result = summarize(profiler.last_session.root_frame())
    return {"model": str(model), "args": list(args), "exit_code": code, "wall_s": wall,
            **result}


def print_summary(result: dict) -> None:
    print(f"{result['model']} {' '.join(result['args'])}: {result['total_s']:.2f} s sampled")
    for title, key, label in (("stages", "stages", "stage"),
                              ("fusectl functions (inclusive)", "fusectl_inclusive", "where"),
                              ("self time", "self_time", "where"),
                              ("self time by file", "self_time_by_file", "where")):
        print(f"  {title}:")
        for row in result[key]:
            print(f"    {row['percent']:5.1f}%  {row['seconds']:7.2f} s  {row[label]}")


def main(argv: list[str]) -> int:
    json_path = None
    if argv[:1] == ["--json"] and len(argv) > 1:
        json_path, argv = argv[1], argv[2:]
    if not argv or argv[0].startswith("-"):
        print("usage: python bench/profile_fusectl.py [--json FILE] MODEL [FUSECTL_ARGS...]",
              file=sys.stderr)
        return 2
    if not Path(argv[0]).is_file():
        print(f"error: {argv[0]}: no such model file", file=sys.stderr)
        return 2
    result = profile(argv[0], argv[1:])
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))
    print_summary(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
