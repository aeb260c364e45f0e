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
