"""shapes.infer_node: values made by rules get types and shapes, contrib kernels included."""

from __future__ import annotations

import onnx_ir as ir

from fusectl.shapes import infer_node

OPSETS = {"": 17, "com.microsoft": 1}


def _value(name: str, dims: list[int | str]) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(dims))


def test_elementwise_contrib_kernel_is_shaped_like_its_input() -> None:
    x = _value("x", ["N", 16])
    node = ir.Node("com.microsoft", "Gelu", [x])
    assert infer_node(node, OPSETS)
    assert node.outputs[0].shape == ir.Shape(["N", 16])
    assert node.outputs[0].dtype == ir.DataType.FLOAT


def test_fused_conv_is_shaped_like_a_conv() -> None:
    # [1,3,8,8] * [4,3,3,3], stride 2, pads 1: (8 + 2 - 3) // 2 + 1 = 4
    x, w = _value("x", [1, 3, 8, 8]), _value("w", [4, 3, 3, 3])
    node = ir.Node("com.microsoft", "FusedConv", [x, w], attributes=[
        ir.AttrString("activation", "Relu"), ir.AttrInt64s("strides", [2, 2]),
        ir.AttrInt64s("pads", [1, 1, 1, 1])])
    assert infer_node(node, OPSETS)
    assert node.outputs[0].shape == ir.Shape([1, 4, 4, 4])
    assert [use.node for use in x.uses()] == [node]  # the Conv twin let go of its inputs


def test_unknown_contrib_kernel_stays_untyped() -> None:
    node = ir.Node("com.microsoft", "SomethingNew", [_value("x", [2, 3])])
    assert not infer_node(node, OPSETS)
    assert node.outputs[0].shape is None and node.outputs[0].type is None
