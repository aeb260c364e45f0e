"""Decode steps of decoders exported with a KV cache: the new token's heads are concatenated
to the cache (the present key and value are graph outputs) and attention runs over the
whole cache. At one token the exporters' head Transposes move only a dim of 1, so fusectl's
layout rules make them views before the attention rules look."""

from __future__ import annotations

from collections import Counter

import onnx
import pytest
from values import parse_with_weights, rename_dim

import fusectl

# the projections split into heads, the new key and value heads appended to the cache
CACHED_HEADS = """
      q = MatMul(x, wq)  k = MatMul(x, wk)  v = MatMul(x, wv)
      q4 = Reshape(q, qheads)  qt = Transpose<perm=[0,2,1,3]>(q4)
      k4 = Reshape(k, kvheads)  kt = Transpose<perm=[0,2,1,3]>(k4)
      v4 = Reshape(v, kvheads)  vt = Transpose<perm=[0,2,1,3]>(v4)
      present_k = Concat<axis=-2>(past_k, kt)  present_v = Concat<axis=-2>(past_v, vt)
"""

# GPT-2 with past: one token, 4 heads of 16, a cache of 8 positions
DECODE_STEP = """
    <ir_version: 8, opset_import: ["" : {opset}]>
    g (float[2,1,64] x, float[2,4,8,16] past_k, float[2,4,8,16] past_v, float[2,1,1,9] mask)
      => (float[2,1,64] y, float[2,4,9,16] present_k, float[2,4,9,16] present_v)
    <int64[4] qheads = {{2, 1, 4, 16}}, int64[4] kvheads = {{2, 1, 4, 16}},
     int64[3] merged = {{2, 1, 64}}, float scale = {{4.0}},
     float[64,64] wq, float[64,64] wk, float[64,64] wv>
    {{ {cached}
      keys = Transpose<perm=[0,1,3,2]>(present_k)
      s = MatMul(qt, keys)  sd = Div(s, scale)  sm = Add(sd, mask)  p = Softmax<axis=-1>(sm)
      o = MatMul(p, present_v)  ot = Transpose<perm=[0,2,1,3]>(o)  y = Reshape(ot, merged)
    }}
"""

# transformers' pack_gqa at one token: 4 query heads over 2 kv heads, the query
# reshaped to [B, kv_heads, 2, D] rows, the padding mask of one row shared by them
PACKED_GQA_STEP = """
    <ir_version: 10, opset_import: ["" : 23]>
    g (float[2,1,64] x, float[2,2,8,16] past_k, float[2,2,8,16] past_v, float[2,1,1,9] mask)
      => (float[2,1,64] y, float[2,2,9,16] present_k, float[2,2,9,16] present_v)
    <int64[4] qheads = {{2, 1, 4, 16}}, int64[4] kvheads = {{2, 1, 2, 16}},
     int64[4] packed = {{2, 2, 2, 16}}, int64[4] unpacked = {{2, 4, 1, 16}},
     int64[3] merged = {{2, 1, 64}}, float scale = {{0.25}},
     float[64,64] wq, float[64,32] wk, float[64,32] wv>
    {{ {cached}
      qp = Reshape(qt, packed)  keys = Transpose<perm=[0,1,3,2]>(present_k)
      qs = Mul(qp, scale)  s = MatMul(qs, keys)  sm = Add(s, mask)  p = Softmax<axis=-1>(sm)
      o = MatMul(p, present_v)  ou = Reshape(o, unpacked)  ot = Transpose<perm=[0,2,1,3]>(ou)
      y = Reshape(ot, merged)
    }}
"""


@pytest.mark.parametrize("target", ["onnxruntime", "onnx"])
def test_a_decode_step_with_a_cache_becomes_one_attention(tmp_path, target: str) -> None:
    path = tmp_path / "decode.onnx"
    opset = 17 if target == "onnxruntime" else 23
    onnx.save(parse_with_weights(DECODE_STEP.format(opset=opset, cached=CACHED_HEADS)), path)
    result = fusectl.optimize(str(path), target=target)
    assert result.validation is not None and result.validation.passed
    ops = Counter(n.op_type for n in result.model.graph)
    fused = "MultiHeadAttention" if target == "onnxruntime" else "Attention"
    assert ops[fused] == 1 and ops["Softmax"] == 0 and ops["Transpose"] == 0
    # the op reads the past and writes the present itself
    assert ops["Concat"] == 0
    attention = next(n for n in result.model.graph if n.op_type == fused)
    assert [v.name for v in attention.outputs[1:3]] == ["present_k", "present_v"]
    # the cache stays what the next step reads
    outputs = [v.name for v in result.model.graph.outputs]
    assert outputs == ["y", "present_k", "present_v"]


def test_a_packed_grouped_query_step_keeps_its_rows_at_opset_23(tmp_path) -> None:
    path = tmp_path / "packed.onnx"
    onnx.save(parse_with_weights(PACKED_GQA_STEP.format(cached=CACHED_HEADS)), path)
    result = fusectl.optimize(str(path))
    assert result.validation is not None and result.validation.passed
    ops = Counter(n.op_type for n in result.model.graph)
    assert ops["Attention"] == 1 and ops["Softmax"] == 0
    # the one-row mask is expanded to the 2 packed rows, which onnxruntime requires
    attention = next(n for n in result.model.graph if n.op_type == "Attention")
    mask = attention.inputs[3]
    assert mask is not None and mask.producer() is not None
    assert mask.producer().op_type == "Expand"
    assert [d for d in mask.shape] == [2, 1, 2, 9]


# the first step of a use_cache export: no past, the new heads returned as the present
FIRST_STEP = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,6,64] x, float[1,1,6,6] mask)
      => (float[2,6,64] y, float[2,4,6,16] present_k, float[2,4,6,16] present_v)
    <int64[4] heads = {2, 6, 4, 16}, int64[3] merged = {2, 6, 64}, float scale = {4.0},
     float[64,64] wq, float[64,64] wk, float[64,64] wv>
    {
      q = MatMul(x, wq)  k = MatMul(x, wk)  v = MatMul(x, wv)
      q4 = Reshape(q, heads)  qt = Transpose<perm=[0,2,1,3]>(q4)
      k4 = Reshape(k, heads)  present_k = Transpose<perm=[0,2,1,3]>(k4)
      v4 = Reshape(v, heads)  present_v = Transpose<perm=[0,2,1,3]>(v4)
      keys = Transpose<perm=[0,1,3,2]>(present_k)
      s = MatMul(qt, keys)  sd = Div(s, scale)  sm = Add(sd, mask)  p = Softmax<axis=-1>(sm)
      o = MatMul(p, present_v)  ot = Transpose<perm=[0,2,1,3]>(o)  y = Reshape(ot, merged)
    }
"""


def test_the_first_step_writes_the_present_from_the_op(tmp_path) -> None:
    path = tmp_path / "first.onnx"
    onnx.save(parse_with_weights(FIRST_STEP), path)
    result = fusectl.optimize(str(path), target="onnxruntime")
    assert result.validation is not None and result.validation.passed
    ops = Counter(n.op_type for n in result.model.graph)
    assert ops["MultiHeadAttention"] == 1 and ops["Transpose"] == 0 and ops["Softmax"] == 0
    attention = next(n for n in result.model.graph if n.op_type == "MultiHeadAttention")
    assert [v.name for v in attention.outputs[1:]] == ["present_k", "present_v"]


# Llama-style grouped-query attention: 4 query heads over 2 kv heads, torch's repeat_kv
# copies of the cache (Unsqueeze, Expand, Reshape) in front of the product
GQA_STEP = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,{s},64] x, float[2,2,{p},16] past_k, float[2,2,{p},16] past_v,
       float[2,1,{s},{t}] mask)
      => (float[2,{s},64] y, float[2,2,{t},16] present_k, float[2,2,{t},16] present_v)
    <int64[4] qheads = {{2, {s}, 4, 16}}, int64[4] kvheads = {{2, {s}, 2, 16}},
     int64[1] ax = {{2}}, int64[5] repeat = {{2, 2, 2, {t}, 16}},
     int64[4] heads = {{2, 4, {t}, 16}},
     int64[3] merged = {{2, {s}, 64}}, float scale = {{4.0}},
     float[64,64] wq, float[64,32] wk, float[64,32] wv>
    {{ {cached}
      ku = Unsqueeze(present_k, ax)  ke = Expand(ku, repeat)  kr = Reshape(ke, heads)
      vu = Unsqueeze(present_v, ax)  ve = Expand(vu, repeat)  vr = Reshape(ve, heads)
      keys = Transpose<perm=[0,1,3,2]>(kr)
      s = MatMul(qt, keys)  sd = Div(s, scale)  sm = Add(sd, mask)  p = Softmax<axis=-1>(sm)
      o = MatMul(p, vr)  ot = Transpose<perm=[0,2,1,3]>(o)  y = Reshape(ot, merged)
    }}
"""


@pytest.mark.parametrize(("tokens", "fused"), [(1, True), (3, False)])
def test_grouped_query_decode_reads_the_cache_once(tmp_path, tokens: int, fused: bool) -> None:
    path = tmp_path / "gqa.onnx"
    text = GQA_STEP.format(s=tokens, p=8, t=8 + tokens, cached=CACHED_HEADS)
    onnx.save(parse_with_weights(text), path)
    result = fusectl.optimize(str(path), target="onnxruntime")
    assert result.validation is not None and result.validation.passed
    ops = Counter(n.op_type for n in result.model.graph)
    assert ops["Softmax"] == 0
    if fused:  # no copies of the cache, no Concat: the op writes the present
        assert ops["GroupQueryAttention"] == 1
        assert ops["Expand"] == ops["Concat"] == ops["Transpose"] == 0
    else:  # several new tokens over a past in a batch of 2: onnxruntime's kernel refuses
        assert ops["GroupQueryAttention"] == 0 and ops["MultiHeadAttention"] == 1


# optimum's GPT-2 export with dynamic axes: the mask over past + new tokens is declared as
# [batch, "past + seq"] and expanded to a length the graph computes as Shape(past)[2] +
# Shape(x)[1]; a name for that sum is what shows the mask as long as the cache
DYNAMIC_STEP = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[batch,seq,64] x, float[batch,4,past,16] past_k, float[batch,4,past,16] past_v,
       float[batch,1,1,TOTAL] mask)
      => (float[batch,seq,64] y, float[batch,4,TOTAL,16] present_k,
          float[batch,4,TOTAL,16] present_v)
    <int64[4] qheads = {{0, 0, 4, 16}}, int64[4] kvheads = {{0, 0, 4, 16}},
     int64[3] merged = {{0, 0, 64}}, float scale = {{4.0}}, int64 i0 = {{0}}, int64 i1 = {{1}},
     int64 i2 = {{2}}, int64[1] a0 = {{0}}, int64[1] one = {{1}},
     float[64,64] wq, float[64,64] wk, float[64,64] wv>
    {{ {cached}
      sx = Shape(x)  b = Gather<axis=0>(sx, i0)  s = Gather<axis=0>(sx, i1)
      sp = Shape(past_k)  p = Gather<axis=0>(sp, i2)  total = Add({first}, {second})
      ub = Unsqueeze(b, a0)  us = Unsqueeze(s, a0)  ut = Unsqueeze(total, a0)
      target = Concat<axis=0>(ub, one, us, ut)  em = Expand(mask, target)
      keys = Transpose<perm=[0,1,3,2]>(present_k)
      sc = MatMul(qt, keys)  sd = Div(sc, scale)  sm = Add(sd, em)  pr = Softmax<axis=-1>(sm)
      o = MatMul(pr, present_v)  ot = Transpose<perm=[0,2,1,3]>(o)  y = Reshape(ot, merged)
    }}
"""


@pytest.mark.parametrize("order", [("p", "s"), ("s", "p")])
def test_a_dynamic_decode_step_with_optimums_names_becomes_one_attention(
        tmp_path, order: tuple[str, str]) -> None:
    """Either order of the Add names the sum as the inputs declare it: the expanded mask
    is then as long as the keys, and the attention fuses with the cache."""
    proto = rename_dim(parse_with_weights(DYNAMIC_STEP.format(
        cached=CACHED_HEADS, first=order[0], second=order[1])), "TOTAL", "past + seq")
    path = tmp_path / "dynamic.onnx"
    onnx.save(proto, path)
    result = fusectl.optimize(str(path), target="onnxruntime")
    assert result.validation is not None and result.validation.passed
    assert result.validation.input_shapes["mask"] == (2, 1, 1, 16)  # past 8 + seq 8
    ops = Counter(n.op_type for n in result.model.graph)
    assert ops["MultiHeadAttention"] == 1 and ops["Softmax"] == 0 and ops["Transpose"] == 0
    attention = next(n for n in result.model.graph if n.op_type == "MultiHeadAttention")
    assert [v.name for v in attention.outputs[1:]] == ["present_k", "present_v"]
