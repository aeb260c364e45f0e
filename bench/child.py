"""Run one optimizer once in this (fresh) process and print its cost as one JSON line.

``python bench/child.py TOOL SRC DST [FUSECTL_ARGS...]``. The parent (bench/speed.py) starts a
new interpreter per run so every tool pays its own start-up and its peak RSS is its own
(VmHWM at exit covers the whole process). Imports are done and timed first, so ``run_s`` is
the optimization alone and ``import_s`` what a fresh process adds. The peers are
bench/peers.py's functions; fusectl runs its real CLI (``fusectl optimize SRC -o DST -q ...``)
in-process, exactly what a user types.
"""

from __future__ import annotations

import importlib
import json
import resource
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(HERE), str(ROOT)):  # this checkout's fusectl and rules/, and peers.py
    if path not in sys.path:
        sys.path.insert(0, path)

FUSECTL_FLAGS: dict[str, tuple[str, ...]] = {
    "fusectl": ("--no-validate",),
    "fusectl+validate": (),
    "fusectl-ort": ("--target", "onnxruntime", "--no-validate"),
}
"""fusectl as the benchmark runs it: onnx target without and with validation, and the
onnxruntime target (without validation; its model is what the latency benchmark needs)."""

PEER_IMPORTS: dict[str, tuple[str, ...]] = {
    "ort-basic": ("onnxruntime",),
    "ort-extended": ("onnxruntime",),
    "onnxsim": ("onnx", "onnxsim"),
    "onnxoptimizer": ("onnx", "onnxoptimizer"),
}
FUSECTL_IMPORTS = ("fusectl.cli", "fusectl.api", "fusectl.report", "fusectl.formats",
                   "fusectl.gates")
TOOLS: tuple[str, ...] = (*PEER_IMPORTS, *FUSECTL_FLAGS)


def _peak_rss() -> int:
    """Peak resident set size of this process in bytes: VmHWM, the high-water mark of this
    program's memory map. Not ``ru_maxrss``: Linux carries that over ``exec`` from the
    process that forked us, so every child would report at least the benchmark's own size."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, else KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit


def run(tool: str, src: str, dst: str, extra: list[str]) -> dict:
    """Import what ``tool`` needs, run it once; times, peak RSS and the error if any."""
    start = time.perf_counter()
    for module in PEER_IMPORTS.get(tool, FUSECTL_IMPORTS):
        importlib.import_module(module)
    import peers

    import_s = time.perf_counter() - start
    rss_after_imports = _peak_rss()
    start = time.perf_counter()
    if tool in FUSECTL_FLAGS:
        from fusectl.cli import main

        code = main(["optimize", src, "-o", dst, "-q", *FUSECTL_FLAGS[tool], *extra])
        error = None if code == 0 else f"fusectl exit code {code}"
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            error = peers.run(tool, src, dst)["error"]
    run_s = time.perf_counter() - start
    if error is None and not Path(dst).exists():
        error = "no model written"
    peak = _peak_rss()
    if tool in FUSECTL_FLAGS:
        from fusectl import ortprocess

        # validation runs onnxruntime in a child process: its peak counts (summed with ours,
        # an upper bound: the two peaks need not coincide)
        peak += ortprocess.peak_rss() or 0
    return {"import_s": import_s, "run_s": run_s, "peak_rss": peak,
            "import_rss": rss_after_imports, "error": error}


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] not in TOOLS:
        print(f"usage: python bench/child.py {{{','.join(TOOLS)}}} SRC DST [FUSECTL_ARGS...]",
              file=sys.stderr)
        return 2
    print(json.dumps(run(argv[0], argv[1], argv[2], argv[3:])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
