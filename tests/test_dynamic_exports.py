"""Models exported with dynamic axes (optimum's batch_size / sequence_length): the rules must
fire on them as on fixed-shape exports.

TorchScript writes ``x.view(b, s, heads, d)`` with b and s read from the block's input by
Shape/Gather, not from x; below opset 14 onnx's inference then types nothing after the first
Reshape. The chain of fixes tested here: the run-time target becomes [0, 0, 4, 16] (dims of
another value equal by name), the new Reshape's output gets the head count the old one lacked
(refined shapes), and typing flows on through readers with several inputs (the Div of a
decomposed LayerNorm) and through contrib kernels (FusedMatMul), so the next layer's rules see
shapes too."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx.parser
import pytest
from onnx import numpy_helper

import fusectl

LAYER = """
    q{i} = MatMul(h{i}, w{i})  qb{i} = Add(q{i}, bq{i})
    s{i} = Shape(h{i})  b{i} = Gather(s{i}, i0)  l{i} = Gather(s{i}, i1)
    ub{i} = Unsqueeze<axes=[0]>(b{i})  ul{i} = Unsqueeze<axes=[0]>(l{i})
    t4{i} = Concat<axis=0>(ub{i}, ul{i}, heads)  r4{i} = Reshape(qb{i}, t4{i})
    p{i} = Transpose<perm=[0,2,1,3]>(r4{i})  kt{i} = Transpose<perm=[0,2,3,1]>(r4{i})
    a{i} = MatMul(p{i}, kt{i})  sm{i} = Softmax<axis=-1>(a{i})  c{i} = MatMul(sm{i}, p{i})
    o{i} = Transpose<perm=[0,2,1,3]>(c{i})
    t3{i} = Concat<axis=0>(ub{i}, ul{i}, hid)  r3{i} = Reshape(o{i}, t3{i})
    res{i} = Add(r3{i}, h{i})
    m{i} = ReduceMean<axes=[-1]>(res{i})  d{i} = Sub(res{i}, m{i})  sq{i} = Pow(d{i}, two)
    v{i} = ReduceMean<axes=[-1]>(sq{i})  ve{i} = Add(v{i}, eps)  sd{i} = Sqrt(ve{i})
    n{i} = Div(d{i}, sd{i})  sc{i} = Mul(n{i}, g{i})  h{j} = Add(sc{i}, be{i})
"""


def _dynamic_block(layers: int = 2) -> onnx.ModelProto:
    """``layers`` attention-like blocks, each ending in a decomposed LayerNorm, with
    run-time Reshape targets read from the block input's shape, at opset 11."""
    weights = [(f"{name}{i}", dims) for i in range(layers)
               for name, dims in (("w", [64, 64]), ("bq", [64]), ("g", [64]), ("be", [64]))]
    declared = ", ".join(f"float{dims} {name}" for name, dims in weights)
    body = "".join(LAYER.format(i=i, j=i + 1) for i in range(layers))
    text = f"""
        <ir_version: 7, opset_import: ["" : 11]>
        g (float[batch_size,sequence_length,64] h0, {declared})
          => (float[batch_size,sequence_length,64] h{layers})
        <int64 i0 = {{0}}, int64 i1 = {{1}}, int64[2] heads = {{4, 16}},
         int64[1] hid = {{64}}, float two = {{2.0}}, float eps = {{1e-5}}>
        {{ {body} }}
    """
    model = onnx.parser.parse_model(text)
    rng = np.random.default_rng(0)
    del model.graph.input[1:]  # the weights are initializers, not inputs
    model.graph.initializer.extend(
        numpy_helper.from_array(rng.normal(0, 0.2, dims).astype(np.float32), name)
        for name, dims in weights)
    return model


@pytest.mark.parametrize("target", ["onnx", "onnxruntime"])
def test_every_layer_of_a_dynamic_export_is_rewritten(tmp_path, target: str) -> None:
    path = tmp_path / "dynamic.onnx"
    onnx.save(_dynamic_block(), path)
    result = fusectl.optimize(str(path), target=target)
    assert result.validation is not None and result.validation.passed
    fired = Counter(a.rule_id for a in result.rewrite.applications)
    ops = Counter(n.op_type for n in result.model.graph)
    assert fired["reshape-runtime-target"] == 4  # both Reshapes of both layers
    assert ops["Shape"] == ops["Gather"] == ops["Concat"] == 0
    if target == "onnxruntime":
        # both LayerNorms, the second only once typing reached it through the first layer
        assert ops["LayerNormalization"] == 2 and ops["ReduceMean"] == 0
