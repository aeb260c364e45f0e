"""The public Python API: an honest ``__all__`` and an ``optimize`` that leaves its input alone."""

from __future__ import annotations

import onnx
import onnx_ir as ir

import fusectl


def test_all_is_honest() -> None:
    for name in fusectl.__all__:
        assert hasattr(fusectl, name), name
    public = {n for n in vars(fusectl) if not n.startswith("_") and callable(getattr(fusectl, n))}
    assert {"optimize", "load_rule_set", "load_model", "save_model"} <= public


def test_optimize_ir_model_is_not_mutated(samples) -> None:
    model = ir.load(samples / "mlp.onnx")
    before = ir.to_proto(model).SerializeToString()
    result = fusectl.optimize(model)
    assert ir.to_proto(model).SerializeToString() == before
    assert result.passed and result.rewrite.counts() == {
        "matmul-add-to-gemm": 3, "transpose-cancel": 1,
    }
    assert result.nodes_after == result.nodes_before - 5
    assert result.bytes_saved == sum(a.bytes_saved for a in result.rewrite.applications)
    onnx.checker.check_model(ir.to_proto(result.model), full_check=True)


def test_rule_subset_and_targets(samples, tmp_path) -> None:
    rules = fusectl.load_rule_set(include=["transpose-*"])
    result = fusectl.optimize(samples / "mlp.onnx", rules=rules, check=False)
    assert result.validation is None
    assert set(result.rewrite.counts()) == {"transpose-cancel"}
    out = tmp_path / "m.onnx"
    fusectl.save_model(result.model, out)
    assert "Transpose" not in {n.op_type for n in onnx.load(out).graph.node}
