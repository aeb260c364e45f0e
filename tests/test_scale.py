"""Linear cost, guarded by counts rather than time (SPEC §8: cost grows linearly).

The Python function calls made by ``fusectl.optimize`` (load, prepare, rewrite, measure; no
validation) are counted with ``sys.setprofile`` on graphs of N and 4N nodes built by
``bench/scale.py``. Linear work gives a ratio near 4; anything quadratic would push it towards
16. ``python bench/scale.py`` gives the times.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import onnx
import pytest

import fusectl

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_scale", ROOT / "bench" / "scale.py")
bench_scale = importlib.util.module_from_spec(_spec)
sys.modules["bench_scale"] = bench_scale
_spec.loader.exec_module(bench_scale)

#: Linear plus a fixed per-run overhead stays under 4; 25 % slack for what varies.
MAX_RATIO = 5.0


@pytest.fixture(scope="module")
def rules() -> list:
    return fusectl.load_rule_set()


def calls_to_optimize(path: Path, rules: list) -> tuple[int, fusectl.OptimizeResult]:
    """Python-level calls (functions and builtins) made while optimizing ``path``."""
    count = 0

    def profile(_frame, event, _arg):  # type: ignore[no-untyped-def]
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        result = fusectl.optimize(path, rules=rules, check=False)
    finally:
        sys.setprofile(None)
    return count, result


@pytest.mark.parametrize(("kind", "small"), [("chain", 150), ("mixed", 150), ("shared", 600)])
def test_work_grows_linearly_with_nodes(tmp_path: Path, rules: list, kind: str,
                                        small: int) -> None:
    """``shared`` is larger: its quadratic risk (a walk downstream of every cancelled
    pair) only shows above the fixed costs from a few hundred nodes on."""
    counts = {}
    large = 4 * small
    for nodes in (small, large):
        path = tmp_path / f"{kind}{nodes}.onnx"
        onnx.save(bench_scale.BUILDERS[kind](nodes), path)
        counts[nodes], result = calls_to_optimize(path, rules)
        assert result.rewrite.applications, "the rules must fire for the count to mean much"
        assert result.rewrite.converged
    ratio = counts[large] / counts[small]
    assert ratio < MAX_RATIO, f"{kind}: 4x the nodes cost {ratio:.2f}x the calls {counts}"
