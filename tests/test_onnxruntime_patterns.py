"""Patterns of onnxruntime's own transformer-fusion tests, rebuilt here with onnx's helpers.

onnxruntime's test generators write BERT blocks at opset 16 with onnxruntime's
LayerNormalization in the default domain, which onnx has no schema for before opset 17: onnx's
shape inference stops there, and until fusectl typed past it (``shapes._type_past_unschemed_ops``)
no attention behind a LayerNorm fused (dtype unknown).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

import fusectl

HIDDEN, HEADS = 16, 2


def _bert_block(opset: int) -> onnx.ModelProto:
    """LayerNorm(x + skip) -> Q/K/V projections -> 2-head attention with a padding mask
    ((1 - mask) * -10000) -> output projection -> residual -> LayerNorm."""
    rng = np.random.default_rng(7)
    inits: list[TensorProto] = []

    def weight(name: str, *shape: int) -> str:
        inits.append(nh.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name))
        return name

    def const(name: str, values: list, dtype: type = np.int64) -> str:
        inits.append(nh.from_array(np.array(values, dtype), name))
        return name

    head = HIDDEN // HEADS
    nodes = [
        oh.make_node("Add", ["x", "skip"], ["sum"]),
        oh.make_node("LayerNormalization", ["sum", weight("g1", HIDDEN), weight("b1", HIDDEN)],
                     ["ln"], axis=-1, epsilon=1e-5),
    ]
    heads = const("heads", [0, 0, HEADS, head])
    for name, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
        nodes += [
            oh.make_node("MatMul", ["ln", weight(f"w{name}", HIDDEN, HIDDEN)], [f"{name}_mm"]),
            oh.make_node("Add", [f"{name}_mm", weight(f"b{name}", HIDDEN)], [f"{name}_a"]),
            oh.make_node("Reshape", [f"{name}_a", heads], [f"{name}_r"]),
            oh.make_node("Transpose", [f"{name}_r"], [f"{name}t"], perm=perm),
        ]
    nodes += [
        oh.make_node("Unsqueeze", ["mask", const("ax1", [1])], ["m1"]),
        oh.make_node("Unsqueeze", ["m1", const("ax2", [2])], ["m2"]),
        oh.make_node("Cast", ["m2"], ["mf"], to=TensorProto.FLOAT),
        oh.make_node("Sub", [const("one", [1.0], np.float32), "mf"], ["inv"]),
        oh.make_node("Mul", ["inv", const("big", [-10000.0], np.float32)], ["bias"]),
        oh.make_node("MatMul", ["qt", "kt"], ["qk"]),
        oh.make_node("Div", ["qk", const("scale", [np.sqrt(head)], np.float32)], ["qs"]),
        oh.make_node("Add", ["qs", "bias"], ["qm"]),
        oh.make_node("Softmax", ["qm"], ["p"], axis=3),
        oh.make_node("MatMul", ["p", "vt"], ["ctx"]),
        oh.make_node("Transpose", ["ctx"], ["ctxt"], perm=[0, 2, 1, 3]),
        oh.make_node("Reshape", ["ctxt", const("flat", [0, 0, HIDDEN])], ["merged"]),
        oh.make_node("MatMul", ["merged", weight("wo", HIDDEN, HIDDEN)], ["om"]),
        oh.make_node("Add", ["om", weight("bo", HIDDEN)], ["oa"]),
        oh.make_node("Add", ["oa", "ln"], ["res"]),
        oh.make_node("LayerNormalization", ["res", weight("g2", HIDDEN), weight("b2", HIDDEN)],
                     ["y"], axis=-1, epsilon=1e-5),
    ]
    graph = oh.make_graph(
        nodes, "bert",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", HIDDEN]),
         oh.make_tensor_value_info("skip", TensorProto.FLOAT, ["batch", "seq", HIDDEN]),
         oh.make_tensor_value_info("mask", TensorProto.INT64, ["batch", "seq"])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", HIDDEN])], inits)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)], ir_version=8)


def test_attention_behind_onnxruntimes_layernorm_below_opset_17_fuses(tmp_path) -> None:
    for opset in (16, 17):  # 17: onnx's own LayerNormalization, inferred all along
        path = tmp_path / f"bert{opset}.onnx"
        path.write_bytes(_bert_block(opset).SerializeToString())
        result = fusectl.optimize(str(path), target="onnxruntime")
        ops = Counter(n.op_type for n in result.model.graph)
        assert result.passed, opset
        assert ops["MultiHeadAttention"] == 1 and ops["Softmax"] == 0, (opset, ops)
        assert ops["LayerNormalization"] == 2


def test_onnxruntimes_layernorm_takes_the_scale_type(tmp_path) -> None:
    """Below opset 17 onnxruntime's LayerNormalization (and SimplifiedLayerNormalization)
    gives a float32 input normalized with a float16 scale a float16 output; typed as the
    input, the Add after it broke onnx's inference (an internal error) and the Cast back to
    float32 looked like a no-op and was dropped (a model onnxruntime refuses)."""
    rng = np.random.default_rng(3)
    for op in ("LayerNormalization", "SimplifiedLayerNormalization"):
        norm_inputs = ["x", "s", "b"] if op == "LayerNormalization" else ["x", "s"]
        nodes = [oh.make_node(op, norm_inputs, ["y"], axis=-1, epsilon=1e-5),
                 oh.make_node("Add", ["y", "c"], ["a"]),
                 oh.make_node("Cast", ["a"], ["f"], to=TensorProto.FLOAT),
                 oh.make_node("Mul", ["f", "x"], ["z"])]
        inits = [nh.from_array(rng.normal(1, 0.1, 8).astype(np.float16), n)
                 for n in ("s", "b", "c")]
        graph = oh.make_graph(nodes, "mixed",
                              [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [oh.make_tensor_value_info("z", TensorProto.FLOAT, [2, 8])],
                              inits)
        path = tmp_path / f"{op}.onnx"
        path.write_bytes(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 16)],
                                       ir_version=8).SerializeToString())
        for target in ("onnx", "onnxruntime"):
            result = fusectl.optimize(str(path), target=target)
            assert result.passed, (op, target)
            y = next(n for n in result.model.graph if n.op_type == op).outputs[0]
            assert y.dtype == ir.DataType.FLOAT16, (op, target, y.dtype)
            assert any(n.op_type == "Cast" for n in result.model.graph)

