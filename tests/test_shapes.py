"""shapes.infer_node: values made by rules get types and shapes, contrib kernels included;
shapes.merge_inferred_shapes: onnx's inferred types land on the IR values."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto
from onnx import helper as oh

from fusectl.shapes import infer_node, infer_proto_shapes, merge_inferred_shapes

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


# --------------------------------------------------------------------------- merging


def _merged(proto: onnx.ModelProto, **kwargs: bool) -> tuple[ir.Model, bool]:
    """The IR of ``proto`` with onnx's inferred types merged in, and whether they changed it."""
    model = ir.serde.deserialize_model(proto)
    changed = merge_inferred_shapes(model.graph, infer_proto_shapes(proto).graph, **kwargs)
    return model, changed


def _values(model: ir.Model) -> dict[str, ir.Value]:
    return {v.name: v for node in model.graph for v in node.outputs}


def _chain_model(declared: list[int | str | None] | None = None) -> onnx.ModelProto:
    """x[2,3] -> Relu -> Neg -> Transpose -> y: two values of one type, then a [3,2]."""
    graph = oh.make_graph(
        [oh.make_node("Relu", ["x"], ["a"]), oh.make_node("Neg", ["a"], ["b"]),
         oh.make_node("Transpose", ["b"], ["y"], perm=[1, 0])], "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, declared)])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])


def test_merged_values_of_one_type_get_shapes_of_their_own() -> None:
    model, changed = _merged(_chain_model())
    values = _values(model)
    assert changed
    assert [(values[n].dtype, values[n].shape) for n in "aby"] == [
        (ir.DataType.FLOAT, ir.Shape([2, 3])), (ir.DataType.FLOAT, ir.Shape([2, 3])),
        (ir.DataType.FLOAT, ir.Shape([3, 2]))]
    values["a"].shape[0] = 5  # an unfrozen shape, as before; b's is not the same object
    assert values["b"].shape == ir.Shape([2, 3])
    assert values["a"].type is not values["b"].type


def test_merging_again_changes_nothing() -> None:
    proto = _chain_model()
    model, _ = _merged(proto)
    assert not merge_inferred_shapes(model.graph, infer_proto_shapes(proto).graph)


def test_a_vaguer_declared_output_is_refined_unless_the_signature_is_kept() -> None:
    model, _ = _merged(_chain_model(["N", None]))
    assert model.graph.outputs[0].shape == ir.Shape([3, 2])
    kept, _ = _merged(_chain_model(["N", None]), keep_signature=True)
    assert kept.graph.outputs[0].shape == ir.Shape(["N", None])


def test_sequences_and_subgraph_values_are_typed() -> None:
    then = oh.make_graph([oh.make_node("Neg", ["x"], ["t"])], "then", [],
                         [oh.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    other = oh.make_graph([oh.make_node("Abs", ["x"], ["e"])], "else", [],
                          [oh.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    graph = oh.make_graph(
        [oh.make_node("SequenceConstruct", ["x", "x"], ["seq"]),
         oh.make_node("SequenceAt", ["seq", "zero"], ["first"]),
         oh.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)], "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [4]),
         oh.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [oh.make_tensor_value_info("first", TensorProto.FLOAT, None),
         oh.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [oh.make_tensor("zero", TensorProto.INT64, [], [0])])
    model, _ = _merged(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]))
    values = _values(model)
    assert values["seq"].type == ir.SequenceType(ir.TensorType(ir.DataType.FLOAT))
    assert values["first"].shape == ir.Shape([4])
    branches = model.graph[2].attributes
    for name in ("then_branch", "else_branch"):
        (out,) = branches[name].as_graph().outputs
        assert (out.dtype, out.shape) == (ir.DataType.FLOAT, ir.Shape([4]))


# --------------------------------------------------------------------------- refining


def test_refine_fills_open_dims_from_inference() -> None:
    # A replacement's output inherits the old one's shape; a constant target [0, 0, -1, 16]
    # on [B, S, 64] proves 4 heads, which the old run-time target did not.
    x = _value("x", ["B", "S", 64])
    target = ir.Value(name="t", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([4]),
                      const_value=ir.tensor(np.array([0, 0, -1, 16], np.int64)))
    node = ir.Node("", "Reshape", [x, target])
    out = node.outputs[0]
    out.type, out.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape(["B", None, "h", 16])
    assert infer_node(node, OPSETS)
    assert out.shape == ir.Shape(["B", None, "h", 16])  # without refine: left as it was
    assert infer_node(node, OPSETS, refine=True)
    # a number for a symbol, a name for an unknown dim; known numbers never change
    assert out.shape == ir.Shape(["B", "S", 4, 16])
    # a known number is never replaced, even where inference says otherwise
    out.shape = ir.Shape([2, None, 8, 16])
    assert infer_node(node, OPSETS, refine=True)
    assert out.shape == ir.Shape([2, "S", 8, 16])


def test_refine_names_a_minted_dim() -> None:
    """``unk__21`` stood for a Reshape's -1 that a rewrite replaced by a product of named
    dims: it names nothing, so the inferred name replaces it; a name the model gave stays."""
    p, v = _value("p", ["B", 4, "S", "S"]), _value("v", ["B", 4, "S", 16])
    node = ir.Node("", "MatMul", [p, v])
    out = node.outputs[0]
    out.type, out.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape(["unk__21", 4, "S", 16])
    assert infer_node(node, OPSETS, refine=True)
    assert out.shape == ir.Shape(["B", 4, "S", 16])
    out.shape = ir.Shape(["N", 4, "S", 16])
    assert infer_node(node, OPSETS, refine=True)
    assert out.shape == ir.Shape(["N", 4, "S", 16])


def test_refine_leaves_graph_outputs_as_declared() -> None:
    x = _value("x", ["B", 64])
    node = ir.Node("", "Relu", [x])
    graph = ir.Graph([x], node.outputs, nodes=[node])
    out = node.outputs[0]
    out.type, out.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape(["N", None])
    assert infer_node(node, OPSETS, refine=True)
    assert out.shape == ir.Shape(["N", None]) and graph.outputs[0] is out


def test_fused_matmul_transposes_its_operands_for_the_shape() -> None:
    q, k = _value("q", ["B", 4, "S", 16]), _value("k", ["B", 4, "L", 16])
    node = ir.Node("com.microsoft", "FusedMatMul", [q, k], attributes=[
        ir.AttrFloat32("alpha", 0.25), ir.AttrInt64("transB", 1)])
    assert infer_node(node, OPSETS)
    assert node.outputs[0].shape == ir.Shape(["B", 4, "S", "L"])
    assert [use.node for use in k.uses()] == [node]  # the MatMul twin let go of its inputs
    plain = ir.Node("com.microsoft", "FusedMatMul", [_value("a", [3, 5]), _value("b", [5, 2])])
    assert infer_node(plain, OPSETS) and plain.outputs[0].shape == ir.Shape([3, 2])


def test_fused_matmul_batch_transposes_stay_untyped() -> None:
    node = ir.Node("com.microsoft", "FusedMatMul", [_value("a", [2, 3, 5]),
                                                      _value("b", [2, 5, 4])],
                   attributes=[ir.AttrInt64("transBatchA", 1)])
    assert not infer_node(node, OPSETS)
    assert node.outputs[0].shape is None


def test_multihead_attention_takes_the_query_rows_and_the_value_width() -> None:
    q, k = _value("q", ["B", "S", 32]), _value("k", ["B", "L", 32])
    packed = ir.Node("com.microsoft", "MultiHeadAttention", [q, k, _value("v", ["B", "L", 24])],
                     attributes=[ir.AttrInt64("num_heads", 4)])
    assert infer_node(packed, OPSETS)
    assert packed.outputs[0].shape == ir.Shape(["B", "S", 24])
    heads = ir.Node("com.microsoft", "MultiHeadAttention",
                    [_value("q24", ["B", "S", 24]), _value("k4", ["B", 4, "L", 6]),
                     _value("v4", ["B", 4, "L", 6])],
                    attributes=[ir.AttrInt64("num_heads", 4)])
    assert infer_node(heads, OPSETS) and heads.outputs[0].shape == ir.Shape(["B", "S", 24])
    packed_qkv = ir.Node("com.microsoft", "MultiHeadAttention",
                         [_value("qkv", ["B", "S", 4, 3, 8])],
                         attributes=[ir.AttrInt64("num_heads", 4)])
    assert not infer_node(packed_qkv, OPSETS) and packed_qkv.outputs[0].shape is None


def _layer_norm_below_17() -> ir.Model:
    """onnxruntime's LayerNormalization at opset 16 (no onnx schema), then a MatMul whose
    output is reshaped to heads by a target computed from Shape (data propagation)."""
    rng = np.random.default_rng(0)
    nodes = [
        oh.make_node("LayerNormalization", ["x", "g", "b"], ["n"], axis=-1),
        oh.make_node("MatMul", ["n", "w"], ["m"]),
        oh.make_node("Relu", ["m"], ["r"]),
    ]
    inits = [oh.make_tensor("g", TensorProto.FLOAT, [8], np.ones(8)),
             oh.make_tensor("b", TensorProto.FLOAT, [8], np.zeros(8)),
             oh.make_tensor("w", TensorProto.FLOAT, [8, 8], rng.normal(size=64))]
    nodes += [oh.make_node("Shape", ["r"], ["s"], start=0, end=2),
              oh.make_node("Concat", ["s", "heads"], ["t"], axis=0),
              oh.make_node("Reshape", ["r", "t"], ["y"])]
    inits.append(oh.make_tensor("heads", TensorProto.INT64, [2], [2, 4]))
    out = oh.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                 ["B", 3, 8])], [out], inits)
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 16)], ir_version=8)
    return ir.serde.deserialize_model(proto)


def test_inference_reaches_past_a_kernel_onnx_has_no_schema_for() -> None:
    from fusectl.shapes import infer_model_shapes

    model = _layer_norm_below_17()
    assert infer_model_shapes(model)
    values = {v.name: v for node in model.graph for v in node.outputs}
    assert values["n"].dtype == ir.DataType.FLOAT and list(values["n"].shape) == \
        [ir.SymbolicDim("B"), 3, 8]
    assert values["r"].dtype == ir.DataType.FLOAT
    # the Shape-computed target is known only to the whole-model pass (data propagation)
    assert [d if isinstance(d, int) else d.value for d in values["y"].shape] == ["B", 3, 2, 4]
