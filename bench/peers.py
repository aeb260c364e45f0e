"""The optimizers compared: onnxruntime (basic, extended), onnx-simplifier, onnxoptimizer and
fusectl (onnx and onnxruntime targets).

Each ``OPTIMIZERS[name](src, dst)`` reads the model at ``src`` and writes the optimized model to
``dst``. :func:`run` times one call and turns any failure into ``"failed: <one line>"``.
:func:`run_isolated` does the same in a child process (``python bench/peers.py NAME SRC DST``),
so a crash or a hang of a native optimizer cannot take the whole comparison down.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # use this checkout's fusectl and rules/, installed or not
    sys.path.insert(0, str(ROOT))

Optimizer = Callable[[str, str], None]


def _ort(level_name: str) -> Optimizer:
    def optimize(src: str, dst: str) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level_name)
        options.optimized_model_filepath = dst
        options.log_severity_level = 3
        ort.InferenceSession(src, options, providers=["CPUExecutionProvider"])

    optimize.__doc__ = f"onnxruntime's offline optimizer at {level_name}, CPU provider."
    return optimize


def onnxsim_simplify(src: str, dst: str) -> None:
    """onnx-simplifier with its defaults (constant folding, shape inference, its fusions)."""
    import onnx
    import onnxsim

    model, ok = onnxsim.simplify(onnx.load(src))
    if not ok:
        raise RuntimeError("onnxsim reported that the simplified model failed its check")
    onnx.save(model, dst)


def onnxoptimizer_fuse(src: str, dst: str) -> None:
    """onnxoptimizer with its fusion and elimination passes."""
    import onnx
    import onnxoptimizer

    passes = onnxoptimizer.get_fuse_and_elimination_passes()
    onnx.save(onnxoptimizer.optimize(onnx.load(src), passes), dst)


def _fusectl(target: str) -> Optimizer:
    def optimize(src: str, dst: str) -> None:
        import fusectl

        result = fusectl.optimize(src, target=target, check=False)
        fusectl.save_model(result.model, dst)

    optimize.__doc__ = f"fusectl's built-in rules, target {target}, no validation."
    return optimize


OPTIMIZERS: dict[str, Optimizer] = {
    "ort-basic": _ort("ORT_ENABLE_BASIC"),
    "ort-extended": _ort("ORT_ENABLE_EXTENDED"),
    "onnxsim": onnxsim_simplify,
    "onnxoptimizer": onnxoptimizer_fuse,
    "fusectl-onnx": _fusectl("onnx"),
    "fusectl-ort": _fusectl("onnxruntime"),
}
FUSECTL = ("fusectl-onnx", "fusectl-ort")
PEERS = tuple(name for name in OPTIMIZERS if name not in FUSECTL)


def one_line(error: BaseException | str) -> str:
    """The first non-empty line of an error, bounded."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return (lines[0] if lines else "unknown error")[:240]


def run(name: str, src: str, dst: str) -> dict:
    """Time ``OPTIMIZERS[name](src, dst)``: ``{"seconds", "error"}`` (error None or text)."""
    start = time.perf_counter()
    error = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            OPTIMIZERS[name](src, dst)
        if not Path(dst).exists():
            error = "failed: no model written"
    except Exception as e:  # noqa: BLE001 - every failure is a result here
        error = f"failed: {one_line(e)}"
    return {"seconds": round(time.perf_counter() - start, 3), "error": error}


def run_isolated(name: str, src: str, dst: str, timeout: float = 900.0) -> dict:
    """:func:`run` in a child process; crashes and timeouts become ``failed: ...`` results."""
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, __file__, name, src, dst], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"seconds": round(time.perf_counter() - start, 3),
                "error": f"failed: no result after {timeout:.0f} s (killed)"}
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    why = one_line(done.stderr.strip().splitlines()[-1]) if done.stderr.strip() else ""
    return {"seconds": round(time.perf_counter() - start, 3),
            "error": f"failed: exit code {done.returncode} {why}".strip()}


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in OPTIMIZERS:
        print(f"usage: python bench/peers.py {{{','.join(OPTIMIZERS)}}} SRC DST", file=sys.stderr)
        return 2
    print(json.dumps(run(*argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
