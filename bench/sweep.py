"""Every model of a folder through ``fusectl optimize``: exit code, nodes and key ops after.

Run by hand before and after a rule change, and compare::

    python bench/sweep.py MODELS_DIR --out before.tsv [--target onnxruntime] [-- FUSECTL_ARGS...]
    python bench/sweep.py MODELS_DIR --out after.tsv --compare before.tsv

Each model runs in its own process (the CLI, as users run it, with validation unless
``--no-validate`` is among the ARGS), two at a time. A line of the TSV: model, exit code,
nodes before, nodes after, then the counts of the ops that show what did not fuse
(Softmax, Transpose, Concat, Reshape), then the last line of stderr for a non-zero exit.
Models are named by their path under MODELS_DIR.
``--compare`` prints only the models whose line changed. Folders are searched recursively;
``*.opt.onnx`` files are skipped.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import onnx

WATCHED = ("Softmax", "Transpose", "Concat", "Reshape")
TIMEOUT = 600


def _ops(path: Path) -> Counter:
    model = onnx.load(str(path), load_external_data=False)
    return Counter(node.op_type for node in model.graph.node)


def run_one(model: Path, folder: Path, args: list[str]) -> list[str]:
    """One TSV row for ``model``, named by its path under ``folder``."""
    with tempfile.TemporaryDirectory() as tmp:
        out, report = Path(tmp) / "out.onnx", Path(tmp) / "report.json"
        command = [sys.executable, "-m", "fusectl", "optimize", str(model), "-o", str(out),
                   "--json", str(report), *args]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT)
            code, error = done.returncode, (done.stderr.strip().splitlines() or [""])[-1]
        except subprocess.TimeoutExpired:
            code, error = "timeout", f"over {TIMEOUT} s"
        before = sum(_ops(model).values())
        after = _ops(out) if out.exists() else Counter()
        row = [str(model.relative_to(folder)), str(code), str(before),
               str(sum(after.values()) if after else "-")]
        row += [str(after[op]) if after else "-" for op in WATCHED]
        if report.exists() and code != 0:
            error = json.loads(report.read_text()).get("status", error)
        return row + ([error[:160]] if code != 0 else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="TSV to write")
    parser.add_argument("--target", default="onnx")
    parser.add_argument("--compare", type=Path, help="an earlier TSV: print what changed")
    parser.add_argument("--jobs", type=int, default=2)
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    options = parser.parse_args(argv[:len(argv) - len(extra) - (1 if "--" in argv else 0)])
    options.args = extra
    models = sorted(p for p in options.folder.rglob("*.onnx") if not p.name.endswith(".opt.onnx"))
    args = ["--target", options.target, *options.args]
    with ThreadPoolExecutor(options.jobs) as pool:
        rows = list(pool.map(lambda m: run_one(m, options.folder, args), models))
    header = ["model", "exit", "before", "after", *WATCHED]
    options.out.write_text("\n".join("\t".join(r) for r in [header, *rows]) + "\n")
    failed = [r for r in rows if r[1] != "0"]
    print(f"{len(rows)} models, {len(failed)} exit non-zero -> {options.out}")
    for row in failed:
        print("  " + "\t".join(row))
    if options.compare:
        old = {line.split("\t")[0]: line for line in options.compare.read_text().splitlines()[1:]}
        for row in rows:
            line = "\t".join(row)
            if old.get(row[0]) != line:
                print(f"- {old.get(row[0], '(new)')}\n+ {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
