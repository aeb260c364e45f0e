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
from values import parse_with_weights

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


SDPA_LAYER = """
    sx = Shape<start=0, end=2>(x)  t4 = Concat<axis=0>(sx, hd)  t3 = Concat<axis=0>(sx, m1)
    qm = MatMul(x, wq)  q = Add(qm, bq)  q4 = Reshape<allowzero=1>(q, t4)
    qt = Transpose<perm=[0,2,1,3]>(q4)
    km = MatMul(x, wk)  k = Add(km, bk)  k4 = Reshape<allowzero=1>(k, t4)
    kt = Transpose<perm=[0,2,1,3]>(k4)
    vm = MatMul(x, wv)  v = Add(vm, bv)  v4 = Reshape<allowzero=1>(v, t4)
    vt = Transpose<perm=[0,2,1,3]>(v4)
    sk = Shape(kt)  lead, second, last = Split<axis=0>(sk, sp)
    s1 = Concat<axis=0>(m1, second, last)  k3 = Reshape(kt, s1)
    k3t = Transpose<perm=[0,2,1]>(k3)
    s2 = Concat<axis=0>(lead, last, second)  ktt = Reshape(k3t, s2)
    qs = Mul(qt, c)  ks = Mul(ktt, c)  a = MatMul(qs, ks)  am = Add(a, mask)
    p = Softmax<axis=-1>(am)  o = MatMul(p, vt)  ot = Transpose<perm=[0,2,1,3]>(o)
    z = Reshape<allowzero=1>(ot, t3)  y = MatMul(z, wo)
"""


def _dynamo_sdpa_block() -> onnx.ModelProto:
    """One attention block as torch's dynamo exporter writes F.scaled_dot_product_attention
    with dynamic batch and sequence: run-time Reshape targets (allowzero=1), K transposed
    through a folded [B*H, L, D] view whose targets come from Split(Shape(K)), both
    operands scaled by the fourth root of the head size, and every value's shape declared
    (the exporter's value_info, symbolic dims by name)."""
    weights = {name: dims for p in "qkv" for name, dims in ((f"w{p}", [64, 64]), (f"b{p}", [64]))}
    weights["wo"] = [64, 64]
    text = f"""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[B,S,64] x, float[B,1,S,S] mask) => (float[B,S,64] y)
        <int64[1] m1 = {{-1}}, int64[2] hd = {{4, 16}}, int64[3] sp = {{2, 1, 1}},
         float c = {{0.5}}, float[N,S,16] k3, float[B,4,16,S] ktt, float[B,S,64] z>
        {{ {SDPA_LAYER} }}
    """
    model = onnx.parser.parse_model(text)
    rng = np.random.default_rng(0)
    model.graph.initializer.extend(
        numpy_helper.from_array(rng.normal(0, 0.2, dims).astype(np.float32), name)
        for name, dims in weights.items())
    return model


def test_dynamo_sdpa_with_dynamic_axes_becomes_multihead_attention(tmp_path) -> None:
    """The folded K transpose collapses into one Transpose (merged-lead-transpose-collapse),
    its shape arithmetic goes at once (a dead Shape reader of K would keep the attention
    pattern from matching), and the block becomes one MultiHeadAttention."""
    path = tmp_path / "sdpa.onnx"
    onnx.save(_dynamo_sdpa_block(), path)
    result = fusectl.optimize(str(path), target="onnxruntime")
    assert result.validation is not None and result.validation.passed
    fired = Counter(a.rule_id for a in result.rewrite.applications)
    ops = Counter(n.op_type for n in result.model.graph)
    assert fired["merged-lead-transpose-collapse"] == 1
    assert ops["MultiHeadAttention"] == 1 and ops["Softmax"] == 0
    assert ops["Split"] == 0


CLASSIC_BERT = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (int64[batch_size,sequence_length] input_ids,
       int64[batch_size,sequence_length] attention_mask)
      => (float[batch_size,sequence_length,64] y)
    <float[256,64] tok, float[64,64] pos, float[64,64] wq, float[64,64] wk, float[64,64] wv,
     float[64,64] wo, int64 one = {1}, int64 zero = {0}, int64[4] heads = {0, 0, 4, 16},
     int64[3] merged = {0, 0, 64}, int64[2] ax12 = {1, 2}, int64[1] ax0 = {0},
     float fone = {1.0}, float lowest = {-3.4028234663852886e+38}, float c = {4.0}>
    {
      sh = Shape(input_ids)  n = Gather<axis=0>(sh, one)  ids = Range(zero, n, one)
      pids = Unsqueeze(ids, ax0)  pe = Gather(pos, pids)  te = Gather(tok, input_ids)
      x = Add(te, pe)
      m4 = Unsqueeze(attention_mask, ax12)  mf = Cast<to=1>(m4)  inv = Sub(fone, mf)
      mask = Mul(inv, lowest)
      q = MatMul(x, wq)  k = MatMul(x, wk)  v = MatMul(x, wv)
      q4 = Reshape(q, heads)  qt = Transpose<perm=[0,2,1,3]>(q4)
      k4 = Reshape(k, heads)  kt = Transpose<perm=[0,2,3,1]>(k4)
      v4 = Reshape(v, heads)  vt = Transpose<perm=[0,2,1,3]>(v4)
      a = MatMul(qt, kt)  s = Div(a, c)  am = Add(s, mask)  p = Softmax<axis=-1>(am)
      o = MatMul(p, vt)  ot = Transpose<perm=[0,2,1,3]>(o)  z = Reshape(ot, merged)
      y = MatMul(z, wo)
    }
"""


def _classic_bert() -> onnx.ModelProto:
    """The embeddings and one attention block as TorchScript exports transformers 4.x's BERT
    with dynamic axes: position ids from ``Range(0, input_ids.size(1), 1)``, the padding
    mask ``(1 - mask[:, None, None, :]) * lowest`` of shape [batch, 1, 1, sequence]."""
    return parse_with_weights(CLASSIC_BERT)


def test_classic_export_names_the_position_range_and_fuses_masked_attention(tmp_path) -> None:
    """onnx's inference gives the Range a fresh symbol and the embeddings' sum another, so
    the mask's key length (sequence_length) could not be shown equal to the keys'. Named,
    the attention becomes one MultiHeadAttention whose [B,1,1,L] mask is expanded to the
    run-time query length."""
    path = tmp_path / "bert.onnx"
    onnx.save(_classic_bert(), path)
    result = fusectl.optimize(str(path), target="onnxruntime")
    assert result.validation is not None and result.validation.passed
    ops = Counter(n.op_type for n in result.model.graph)
    assert ops["MultiHeadAttention"] == 1 and ops["Softmax"] == 0 and ops["Expand"] == 1
    (embeddings,) = [n for n in result.model.graph if n.op_type == "Add"
                     and n.outputs[0].shape is not None and n.outputs[0].shape.rank() == 3]
    assert [d if isinstance(d, int) else d.value for d in embeddings.outputs[0].shape] == [
        "batch_size", "sequence_length", 64]


TS5_BERT = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (int64[batch_size,sequence_length] input_ids,
       int64[batch_size,sequence_length] attention_mask)
      => (float[batch_size,sequence_length,64] y)
    <float[256,64] tok, float[64,64] pos, int64[1,64] positions, float[64,64] wq,
     float[64,64] wk, float[64,64] wv, float[64,64] wo, float ninf,
     int64 i0 = {0}, int64 i1 = {1}, int64[1] a0 = {0}, int64[1] a1 = {1},
     int64[3] a123 = {1, 2, 3}, int64[3] a013 = {0, 1, 3}, int64[3] a012 = {0, 1, 2},
     int64[1] m1 = {-1}, int64[1] d16 = {16}, int64[4] m1x4 = {-1, -1, -1, -1},
     int64[4] one4 = {1, 1, 1, 1}, float zf = {0.0}, float c = {0.25}, bool yes = {1}>
    {
      sh = Shape(input_ids)  n = Gather<axis=0>(sh, i1)  nu = Unsqueeze(n, a0)
      ids = Slice(positions, a0, nu, a1)  pe = Gather(pos, ids)  te = Gather(tok, input_ids)
      x = Add(te, pe)
      mb = Cast<to=9>(attention_mask)
      xs = Shape(x)  bsz = Gather<axis=0>(xs, i0)  qlen = Gather<axis=0>(xs, i1)
      ms = Shape(mb)  klen = Gather<axis=0>(ms, i1)
      rb = Range(i0, bsz, i1)  rq = Range(i0, qlen, i1)  rk = Range(i0, klen, i1)
      b4 = Unsqueeze(rb, a123)  q4i = Unsqueeze(rq, a013)  k4i = Unsqueeze(rk, a012)
      qok = GreaterOrEqual(q4i, i0)  qm = And(yes, qok)
      kl1 = Gather<axis=0>(ms, a1)  flat = Flatten<axis=2>(mb)  off = Mul(b4, kl1)
      idx = Add(k4i, off)  g5 = Gather<axis=0>(flat, idx)  ish = Shape(idx)
      g1 = Reshape(g5, m1)  pad = Reshape(g1, ish)  both = And(qm, pad)
      ub = Unsqueeze(bsz, a0)  uq = Unsqueeze(qlen, a0)  uk = Unsqueeze(klen, a0)
      tgt = Concat<axis=0>(ub, m1, uq, uk)  eq = Equal(tgt, m1x4)  tg = Where(eq, one4, tgt)
      me = Expand(both, tg)  mask = Where(me, zf, ninf)
      h4 = Concat<axis=0>(ub, uq, m1, d16)  t3 = Concat<axis=0>(ub, uq, m1)
      q = MatMul(x, wq)  k = MatMul(x, wk)  v = MatMul(x, wv)
      q4 = Reshape(q, h4)  qt = Transpose<perm=[0,2,1,3]>(q4)
      k4 = Reshape(k, h4)  kt = Transpose<perm=[0,2,3,1]>(k4)
      v4 = Reshape(v, h4)  vt = Transpose<perm=[0,2,1,3]>(v4)
      a = MatMul(qt, kt)  s = Mul(a, c)  am = Add(s, mask)  p = Softmax<axis=-1>(am)
      nan = IsNaN(p)  pg = Where(nan, zf, p)
      o = MatMul(pg, vt)  ot = Transpose<perm=[0,2,1,3]>(o)  z = Reshape(ot, t3)
      y = MatMul(z, wo)
    }
"""


def _transformers5_bert() -> onnx.ModelProto:
    """The embeddings and one attention block as TorchScript exports transformers 5's BERT
    with dynamic axes: position ids sliced from a buffer to the run-time length, the mask
    built from index ranges (batch, query, key) and the padding mask gathered from a
    Flatten of it, expanded with torch's ``Where(Equal(s, -1), 1, s)`` and turned additive
    by ``Where(mask, 0, -inf)``; heads split with a ``-1`` beside the run-time dims."""
    return parse_with_weights(TS5_BERT, {
        "positions": np.arange(64, dtype=np.int64).reshape(1, 64),
        "ninf": np.array(-np.inf, np.float32)})


def test_transformers5_export_names_every_dim_and_fuses_masked_attention(tmp_path) -> None:
    """onnx's inference mints symbols for the sliced positions, the Flatten, the expanded
    mask and every ``-1``; named (symdims), the block becomes one MultiHeadAttention."""
    path = tmp_path / "bert5.onnx"
    onnx.save(_transformers5_bert(), path)
    result = fusectl.optimize(str(path), target="onnxruntime")
    assert result.validation is not None and result.validation.passed
    ops = Counter(n.op_type for n in result.model.graph)
    assert ops["MultiHeadAttention"] == 1 and ops["Softmax"] == 0
    minted = [n.name for n in result.model.graph for v in n.outputs if v.shape is not None
              and any(not isinstance(d, int) and (d.value or "unk").startswith("unk")
                      for d in v.shape)]
    assert minted == []


def test_transformers5_export_fuses_guarded_attention_on_the_onnx_target(tmp_path) -> None:
    """The same block at opset 23: the -inf mask keeps torch's NaN guard, which moves after
    the Attention op (a row masked entirely must still come out 0)."""
    path = tmp_path / "bert5.onnx"
    onnx.save(_transformers5_bert(), path)
    result = fusectl.optimize(str(path), opset=23)
    assert result.validation is not None and result.validation.passed
    ops = Counter(n.op_type for n in result.model.graph)
    assert ops["Attention"] == 1 and ops["Softmax"] == 0 and ops["IsNaN"] == 1
    guard = next(n for n in result.model.graph if n.op_type == "IsNaN")
    assert guard.inputs[0].producer().op_type == "Attention"
