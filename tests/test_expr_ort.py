"""Tests for the expression functions the onnxruntime-target rules add (op_type)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from fusectl import expr
from fusectl.expr import NoMatch, parse


def _node(domain: str, op_type: str) -> ir.Node:
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    return ir.Node(domain, op_type, [x], num_outputs=1)


def test_op_type_names_the_producer_of_a_value() -> None:
    node = _node("", "Relu")
    assert expr.FUNCTIONS["op_type"](node.outputs[0]) == "Relu"


def test_op_type_reads_ai_onnx_as_the_onnx_domain() -> None:
    node = _node("ai.onnx", "Tanh")
    assert expr.FUNCTIONS["op_type"](node.outputs[0]) == "Tanh"


def test_op_type_prefixes_other_domains() -> None:
    node = _node("com.microsoft", "FusedMatMul")
    assert expr.FUNCTIONS["op_type"](node.outputs[0]) == "com.microsoft.FusedMatMul"


def test_op_type_of_a_graph_input_is_no_match() -> None:
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    with pytest.raises(NoMatch, match="not produced by a node"):
        expr.FUNCTIONS["op_type"](x)


@pytest.mark.parametrize("value", [None, 1.0, "Relu", np.zeros(2)])
def test_op_type_of_a_non_value_is_no_match(value: object) -> None:
    with pytest.raises(NoMatch):
        expr.FUNCTIONS["op_type"](value)


def test_op_type_in_an_expression() -> None:
    node = _node("", "Sigmoid")
    parsed = parse('op_type(z) in ["Relu", "Sigmoid"]', ["z"])
    assert parsed.evaluate({"z": node.outputs[0]}) is True
    parsed = parse('op_type(z) == "Relu"', ["z"])
    assert parsed.evaluate({"z": node.outputs[0]}) is False


@pytest.mark.parametrize("value", [1e-50, 0.0, float("inf"), 1e39, float("nan")])
def test_float32_scale_refuses_what_rounds_to_zero_or_is_not_finite(value: float) -> None:
    """onnxruntime refuses Attention's scale 0; MultiHeadAttention reads 0 as 1/sqrt(D)."""
    with pytest.raises(NoMatch, match="0 or not finite"):
        expr.FUNCTIONS["float32_scale"](value)


def test_float32_scale_keeps_normal_and_negative_scales() -> None:
    assert expr.FUNCTIONS["float32_scale"](0.125) == 0.125
    assert expr.FUNCTIONS["float32_scale"](-2.0) == -2.0
    assert expr.FUNCTIONS["float32_scale"](1e-30) == pytest.approx(1e-30, rel=1e-6)
