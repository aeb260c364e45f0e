"""Rotary embeddings: the table proofs of halves.py (repeats_halves, repeats_pairs,
half_table, pair_table, positions, batch_source, axis_dim) and Llama- and GPT-J-style
attention blocks whose q/k rotations and attention fuse on both targets."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import pytest
from onnx import numpy_helper

import fusectl
from fusectl import expr
from fusectl.halves import MAX_NODES, repeats_halves, repeats_pairs
from fusectl.modelio import from_proto

HEAD = '<ir_version: 8, opset_import: ["" : 17]>\n'


def _values(text: str) -> dict:
    model = from_proto(onnx.shape_inference.infer_shapes(onnx.parser.parse_model(HEAD + text)))
    values = {v.name: v for n in model.graph for v in n.outputs}
    values.update({v.name: v for v in model.graph.inputs})
    values.update(model.graph.initializers)
    return values


TABLES = """g (int64[B,S] pos, float[2,6,8] t, float[B,S,4] f) => (float[B,1,S,8] c)
    <float[1,4,1] inv, int64[1] one = {1}, float k = {0.5}, float[8] row>
    {
      pe = Unsqueeze(pos, one)  pf = Cast<to=1>(pe)  fr = MatMul(inv, pf)
      ft = Transpose<perm=[0,2,1]>(fr)  emb = Concat<axis=-1>(ft, ft)
      co = Cos(emb)  scaled = Mul(co, k)  h = Cast<to=10>(scaled)  c = Unsqueeze(co, one)
      other = Concat<axis=-1>(ft, f)  wrong_axis = Concat<axis=0>(ft, ft)
      moved = Transpose<perm=[0,2,1]>(emb)  by_row = Mul(emb, row)
      gathered = Gather<axis=-1>(emb, one)  input_table = Cos(t)
    }"""


@pytest.mark.parametrize("name", ["emb", "co", "scaled", "h", "c"])
def test_tables_built_from_concat_of_twins_are_proven(name: str) -> None:
    assert repeats_halves(_values(TABLES)[name])


@pytest.mark.parametrize("name", ["other", "moved", "by_row", "gathered", "input_table", "t", "f"])
def test_tables_not_proven(name: str) -> None:
    # different halves, the last axis moved, a per-column factor, columns picked, graph inputs
    assert not repeats_halves(_values(TABLES)[name])


def test_concat_along_another_axis_is_not_a_twin() -> None:
    values = _values(TABLES)
    assert values["wrong_axis"].shape[-1] == 4 and not repeats_halves(values["wrong_axis"])


def test_constant_tables_are_checked_by_value() -> None:
    values = _values("""g (float[2] x) => (float[2] y) <float[3,4] same = {1, 2, 1, 2, 3, 4, 3, 4,
        5, 6, 5, 6}, float[3,4] differ = {1, 2, 1, 2, 3, 4, 3, 5, 5, 6, 5, 6},
        float[3,3] odd = {1, 2, 1, 3, 4, 3, 5, 6, 5}, int64[3] idx = {0, 2, 2}>
        { y = Identity(x)  g = Gather(same, idx)  gl = Gather<axis=1>(same, idx) }""")
    assert repeats_halves(values["same"]) and repeats_halves(values["g"])
    assert not repeats_halves(values["differ"])
    assert not repeats_halves(values["odd"])
    assert not repeats_halves(values["gl"])  # gathered along the last axis: columns move


# emb [8,8] and e3 [4,2,8] repeat halves; head and flat are graph outputs whose declared
# [8,8] is wrong (nothing checks it): head and head1 are emb[:, :4] (f itself), flat is
# [64,1]
ROWS = """g (float[8,4] f, float[4,2,4] g)
    => (float[8,8] head, float[8,8] head1, float[8,8] flat)
    <int64[1] zero = {0}, int64[1] one = {1}, int64[1] four = {4}, int64[1] last = {-1}>
    {
      emb = Concat<axis=-1>(f, f)  moved = Transpose<perm=[1,0]>(emb)
      head = Slice(emb, zero, four, last)  head1 = Slice(emb, zero, four, one)
      rows = Slice(emb, zero, four, zero)
      e3 = Concat<axis=-1>(g, g)  kept = Transpose<perm=[1,0,2]>(e3)
      flat = Flatten<axis=3>(e3)  flat2 = Flatten<axis=2>(e3)
    }"""


@pytest.mark.parametrize("name", ["emb", "rows", "e3", "kept", "flat2"])
def test_ops_moving_whole_rows_keep_the_halves(name: str) -> None:
    assert repeats_halves(_values(ROWS)[name])


def test_a_square_table_transposed_is_not_proven() -> None:
    """[8,8] both ways: the last dims agree, but the columns of the twins became rows."""
    values = _values(ROWS)
    assert values["moved"].shape == values["emb"].shape
    assert not repeats_halves(values["moved"])


@pytest.mark.parametrize("name", [
    "head",  # a Slice along the last axis: its first half, not the table
    "head1",  # the same axis counted from the front
    "flat",  # a Flatten at axis = rank: one column
])
def test_a_slice_or_flatten_of_the_last_axis_is_not_proven(name: str) -> None:
    """With truthful dims neither can keep the last dim and change it (a same-length Slice
    takes it whole or reversed, a Flatten at the rank leaves a dim of 1); here the declared
    dims say it is kept, and only the check of the op itself refuses."""
    values = _values(ROWS)
    assert values[name].shape[-1] == values["emb"].shape[-1] == 8
    assert not repeats_halves(values[name])


def test_long_chains_give_up() -> None:
    chain = "  ".join(f"a{i + 1} = Cos(a{i})" for i in range(MAX_NODES + 2))
    values = _values(f"""g (float[2,4] f) => (float[2,8] a{MAX_NODES + 2})
        {{ a0 = Concat<axis=-1>(f, f)  {chain} }}""")
    assert repeats_halves(values["a3"])
    assert not repeats_halves(values[f"a{MAX_NODES + 2}"])


def test_half_table_and_positions() -> None:
    table = np.concatenate([np.arange(12.0).reshape(2, 1, 3, 2)] * 2, axis=-1)
    assert expr.FUNCTIONS["half_table"](table, 3).shape == (2, 3, 2)
    rows = expr.FUNCTIONS["half_table"](table, 2)
    np.testing.assert_array_equal(rows, np.arange(12.0).reshape(6, 2))
    np.testing.assert_array_equal(expr.FUNCTIONS["half_table"](table[0, 0], 3),
                                  np.arange(6.0).reshape(1, 3, 2))
    np.testing.assert_array_equal(expr.FUNCTIONS["positions"](2, 3), [[0, 1, 2], [3, 4, 5]])
    with pytest.raises(expr.NoMatch):
        expr.FUNCTIONS["positions"]("B", 3)
    with pytest.raises(expr.NoMatch):
        expr.FUNCTIONS["half_table"](np.zeros((2, 3)), 3)


# repeat_interleave as the exporters write it: a last dim of 1 tiled, expanded or stacked
# to 2, merged by a Reshape; a Gather of paired indices; constants checked by value.
PAIRS = """g (float[B,S,4] f, float[2,6,8] t) => (float[B,S,8] c)
    <int64[1] m1 = {-1}, int64[4] rep = {1, 1, 1, 2}, int64[4] ex = {1, 1, 1, 2},
     int64[3] flat = {0, 0, 8}, int64[3] rep3 = {1, 1, 2}, int64[2] u24 = {2, 4},
     int64[5] rep5 = {1, 1, 1, 1, 2}, int64[4] tsh = {0, 0, 1, -1}, float k = {0.5},
     int64[8] pairs = {0, 0, 1, 1, 2, 2, 3, 3}, int64[8] spread = {0, 1, 2, 3, 0, 1, 2, 3},
     int64[8] neg = {0, -4, 1, 1, 2, 2, 3, 3}, float[2,4] same = {1, 1, 2, 2, 3, 3, 4, 4},
     float[2,4] differ = {1, 1, 2, 3, 3, 3, 4, 4}, int64[2] cut = {0, 4}>
    {
      fu = Unsqueeze(f, m1)  tiled = Tile(fu, rep)  c = Reshape(tiled, flat)
      expanded = Expand(fu, ex)  ce = Reshape(expanded, flat)  cos = Cos(ce)  scaled = Mul(cos, k)
      stacked = Concat<axis=-1>(fu, fu)  cs = Reshape(stacked, flat)
      f5 = Unsqueeze(f, u24)  t5 = Tile(f5, rep5)  c4 = Reshape(t5, tsh)
      gathered = Gather<axis=-1>(f, pairs)  halves = Concat<axis=-1>(f, f)  flat_f = Tile(f, rep3)
      spread_g = Gather<axis=-1>(f, spread)  neg_g = Gather<axis=-1>(f, neg)
      mixed = Concat<axis=-1>(fu, stacked)  g2 = Gather(same, cut)
    }"""


@pytest.mark.parametrize("name", [
    "c", "ce", "cos", "scaled", "cs", "c4", "gathered", "same", "g2",
    "tiled",  # [B, S, 4, 2]: each row of 2 is one value twice
    "neg_g",  # -4 is index 0 of 4: the indices pair up once normalized
])
def test_interleaved_tables_are_proven(name: str) -> None:
    assert repeats_pairs(_values(PAIRS)[name])


@pytest.mark.parametrize("name", [
    "halves",  # Concat(f, f): the halves repeat, not the pairs
    "flat_f",  # Tile by 2 of a wide last axis: the halves again
    "spread_g", "differ", "t", "f", "mixed",
])
def test_interleaved_tables_not_proven(name: str) -> None:
    assert not repeats_pairs(_values(PAIRS)[name])


def test_tiling_by_two_proves_the_halves() -> None:
    assert repeats_halves(_values(PAIRS)["flat_f"])
    assert not repeats_halves(_values(PAIRS)["c"])  # each value twice in a row


def test_pair_table_batch_source_and_axis_dim() -> None:
    table = np.repeat(np.arange(12.0).reshape(2, 3, 1, 2), 2, axis=-1)  # [B, S, 1, D]
    np.testing.assert_array_equal(expr.FUNCTIONS["pair_table"](table, 3, 2),
                                  np.arange(12.0).reshape(2, 3, 2))
    np.testing.assert_array_equal(expr.FUNCTIONS["pair_table"](table, 2, 2),
                                  np.arange(12.0).reshape(6, 2))
    with pytest.raises(expr.NoMatch):  # the heads' axis must be 1
        expr.FUNCTIONS["pair_table"](table, 3, 1)
    for axis in (4, "a", True):  # and an axis of the table
        with pytest.raises(expr.NoMatch):
            expr.FUNCTIONS["pair_table"](table, 3, axis)
    values = _values("""g (float[B,S,4,16] x) => (float[B,S,4,8] a)
        <int64[2] parts = {8, 8}, int64[3] flat = {0, -1, 32}>
        { a, b = Split<axis=-1>(x, parts)  r = Reshape(a, flat)
          c, d = Split<axis=0>(x, parts) }""")
    batch_source = expr.FUNCTIONS["batch_source"]
    assert batch_source(values["a"]) is values["x"]  # split along the heads' last axis
    assert batch_source(values["c"]) is values["c"]  # split along the batch itself
    assert batch_source(values["r"]) is values["r"]
    axis_dim = expr.FUNCTIONS["axis_dim"]
    values["r"].shape = ir.Shape(["B", None, 32])  # a row count the inference lost
    with pytest.raises(expr.NoMatch):
        expr.FUNCTIONS["shape"](values["r"])
    assert axis_dim(values["r"], -1) == 32 and axis_dim(values["x"], 0) == "B"
    with pytest.raises(expr.NoMatch):
        axis_dim(values["r"], 1)
    with pytest.raises(expr.NoMatch):
        axis_dim(values["r"], 3)


HEADS = """
      pe = Unsqueeze(pos, one)  pf = Cast<to=1>(pe)  fr = MatMul(inv, pf)
      ft = Transpose<perm=[0,2,1]>(fr)  emb = Concat<axis=-1>(ft, ft)
      co = Cos(emb)  si = Sin(emb)  c = Unsqueeze(co, one)  s = Unsqueeze(si, one)
      q = MatMul(h, wq)  k = MatMul(h, wk)  v = MatMul(h, wv)
      q4 = Reshape(q, heads)  qt = Transpose<perm=[0,2,1,3]>(q4)
      k4 = Reshape(k, heads)  kt = Transpose<perm=[0,2,1,3]>(k4)
      v4 = Reshape(v, heads)  vt = Transpose<perm=[0,2,1,3]>(v4)"""
"""Llama's tables from position ids (inv_freq @ positions, Concat(f, f), Cos/Sin, Unsqueeze)
and heads split from the h projections: the start of both attention blocks below."""


def _with_weights(model: onnx.ModelProto, shapes: dict[str, tuple[int, int]]
                  ) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    for name, dims in shapes.items():
        weight = rng.normal(0, 0.3, dims).astype(np.float32)
        model.graph.initializer.append(numpy_helper.from_array(weight, name))
    inv = (1.0 / 10000 ** (np.arange(0, 8, 2) / 8)).astype(np.float32).reshape(1, 4, 1)
    model.graph.initializer.append(numpy_helper.from_array(inv, "inv"))
    return model


def _llama_block(batch: int | str, seq: int | str, pos_batch: int | str) -> onnx.ModelProto:
    """One Llama attention: q/k/v projections, heads split, q and k rotated with tables built
    from position ids (rotate_half written with two Slices), scaled softmax attention."""
    text = f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[{batch},{seq},32] h, int64[{pos_batch},{seq}] pos) => (float[{batch},{seq},32] out)
    <float[32,32] wq, float[32,32] wk, float[32,32] wv, float[32,32] wo, float[1,4,1] inv,
     int64[4] heads = {{0, 0, 4, 8}}, int64[3] merged = {{0, 0, 32}}, int64[1] one = {{1}},
     int64[1] s0 = {{0}}, int64[1] s4 = {{4}}, int64[1] send = {{9223372036854775807}},
     int64[1] last = {{-1}}, float scale = {{0.35355339}}>
    {{
      {HEADS}
      q1 = Slice(qt, s0, s4, last)  q2 = Slice(qt, s4, send, last)  qn = Neg(q2)
      qr = Concat<axis=-1>(qn, q1)  qa = Mul(qt, c)  qb = Mul(qr, s)  qe = Add(qa, qb)
      k1 = Slice(kt, s0, s4, last)  k2 = Slice(kt, s4, send, last)  kn = Neg(k2)
      kr = Concat<axis=-1>(kn, k1)  ka = Mul(kt, c)  kb = Mul(kr, s)  ke = Add(ka, kb)
      kT = Transpose<perm=[0,1,3,2]>(ke)
      sc = MatMul(qe, kT)  ss = Mul(sc, scale)  p = Softmax<axis=-1>(ss)  o = MatMul(p, vt)
      ot = Transpose<perm=[0,2,1,3]>(o)  om = Reshape(ot, merged)  out = MatMul(om, wo)
    }}"""
    square = (32, 32)
    return _with_weights(onnx.parser.parse_model(text),
                         {"wq": square, "wk": square, "wv": square, "wo": square})


@pytest.mark.parametrize(("batch", "seq", "pos_batch"),
                         [("B", "S", "B"), (2, 6, 2), (2, 6, 1), ("B", "S", 1)])
def test_llama_attention_fuses_on_onnxruntime(batch, seq, pos_batch) -> None:
    result = fusectl.optimize(from_proto(_llama_block(batch, seq, pos_batch)),
                              target="onnxruntime")
    ops = Counter(n.op_type for n in result.model.graph)
    assert result.validation.passed
    assert ops["RotaryEmbedding"] == 2 and ops["MultiHeadAttention"] == 1
    assert ops["Neg"] == 0 and ops["Softmax"] == 0


@pytest.mark.parametrize(("batch", "seq", "pos_batch"), [("B", "S", "B"), (2, 6, 1)])
def test_llama_attention_fuses_on_onnx_opset_23(batch, seq, pos_batch) -> None:
    result = fusectl.optimize(from_proto(_llama_block(batch, seq, pos_batch)), opset=23)
    ops = Counter(n.op_type for n in result.model.graph)
    assert result.validation.passed
    assert ops["RotaryEmbedding"] == 2 and ops["Attention"] == 1 and ops["Neg"] == 0


def test_llama_rotation_is_left_alone_below_opset_23_on_onnx() -> None:
    result = fusectl.optimize(from_proto(_llama_block(2, 6, 2)))
    ops = Counter(n.op_type for n in result.model.graph)
    assert result.validation.passed and ops["RotaryEmbedding"] == 0 and ops["Neg"] == 2


def _partial_rotary(batch: int | str) -> onnx.ModelProto:
    """Phi-2's partial rotary: the first 8 of 16 head dims rotate, the rest pass through,
    every split written as Slices."""
    return onnx.parser.parse_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[{batch},4,6,16] x, int64[{batch},6] pos) => (float[{batch},4,6,16] z)
    <float[1,4,1] inv = {{1.0, 0.1, 0.01, 0.001}}, int64[1] one = {{1}}, int64[1] s0 = {{0}},
     int64[1] s4 = {{4}}, int64[1] s8 = {{8}}, int64[1] send = {{9223372036854775807}},
     int64[1] last = {{-1}}>
    {{
      pe = Unsqueeze(pos, one)  pf = Cast<to=1>(pe)  fr = MatMul(inv, pf)
      ft = Transpose<perm=[0,2,1]>(fr)  emb = Concat<axis=-1>(ft, ft)
      co = Cos(emb)  si = Sin(emb)  c = Unsqueeze(co, one)  s = Unsqueeze(si, one)
      xr = Slice(x, s0, s8, last)  xp = Slice(x, s8, send, last)
      x1 = Slice(xr, s0, s4, last)  x2 = Slice(xr, s4, send, last)  n = Neg(x2)
      r = Concat<axis=-1>(n, x1)  a = Mul(xr, c)  b = Mul(r, s)  y = Add(a, b)
      z = Concat<axis=-1>(y, xp)
    }}""")


@pytest.mark.parametrize("batch", ["B", 2])
@pytest.mark.parametrize(("target", "opset"), [("onnxruntime", None), ("onnx", 23)])
def test_partial_rotary_becomes_one_op(batch, target, opset) -> None:
    result = fusectl.optimize(from_proto(_partial_rotary(batch)), target=target, opset=opset)
    ops = Counter(n.op_type for n in result.model.graph)
    assert result.validation.passed
    assert ops["RotaryEmbedding"] == 1 and ops["Split"] == 0 and ops["Neg"] == 0
    (rotary,) = [n for n in result.model.graph if n.op_type == "RotaryEmbedding"]
    assert rotary.attributes["rotary_embedding_dim"].value == 8


def _grouped_query_block(batch: int | str) -> onnx.ModelProto:
    """Llama 3 style: 4 query heads share 2 kv heads, repeated by torch's repeat_kv
    (Unsqueeze, Expand, Reshape) after the keys are rotated."""
    model = onnx.parser.parse_model(f"""
    <ir_version: 8, opset_import: ["" : 18]>
    g (float[{batch},6,32] h, int64[{batch},6] pos) => (float[{batch},6,32] out)
    <float[32,32] wq, float[32,16] wk, float[32,16] wv, float[1,4,1] inv,
     int64[4] heads = {{0, 0, -1, 8}}, int64[3] merged = {{0, 0, 32}}, int64[1] one = {{1}},
     int64[1] two = {{2}}, int64[5] rep = {{1, 1, 2, 1, 1}}, int64[4] flat = {{0, 4, 6, 8}},
     int64[2] halves = {{4, 4}}, float scale = {{0.35355339}}>
    {{
      {HEADS}
      q1, q2 = Split<axis=-1>(qt, halves)  qn = Neg(q2)  qr = Concat<axis=-1>(qn, q1)
      qa = Mul(qt, c)  qb = Mul(qr, s)  qe = Add(qa, qb)
      k1, k2 = Split<axis=-1>(kt, halves)  kn = Neg(k2)  kr = Concat<axis=-1>(kn, k1)
      ka = Mul(kt, c)  kb = Mul(kr, s)  ke = Add(ka, kb)
      ku = Unsqueeze(ke, two)  kx5 = Expand(ku, rep)  kx = Reshape(kx5, flat)
      vu = Unsqueeze(vt, two)  vx5 = Expand(vu, rep)  vx = Reshape(vx5, flat)
      kT = Transpose<perm=[0,1,3,2]>(kx)  qk = MatMul(qe, kT)  sc = Mul(qk, scale)
      p = Softmax<axis=-1>(sc)  o = MatMul(p, vx)
      ot = Transpose<perm=[0,2,1,3]>(o)  out = Reshape(ot, merged)
    }}""")
    return _with_weights(model, {"wq": (32, 32), "wk": (32, 16), "wv": (32, 16)})


def test_grouped_query_attention_reads_the_kv_heads_on_opset_23() -> None:
    result = fusectl.optimize(from_proto(_grouped_query_block(2)), opset=23)
    ops = Counter(n.op_type for n in result.model.graph)
    assert result.validation.passed
    assert ops["Attention"] == 1 and ops["RotaryEmbedding"] == 2
    assert ops["Expand"] == 0 and ops["Softmax"] == 0


def _gptj_block(batch: int | str, seq: int | str) -> onnx.ModelProto:
    """One GPT-J attention: [B, S, H, D] heads whose first 4 of 8 dims rotate in pairs
    (rotate_every_two), tables gathered by position from a sin|cos cache and repeated by
    repeat_interleave (Unsqueeze + Tile + Reshape, as the TorchScript exporter writes it),
    the heads transposed only for the attention."""
    text = f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[{batch},{seq},32] h, int64[{batch},{seq}] pos) => (float[{batch},{seq},32] out)
    <float[32,32] wq, float[32,32] wk, float[32,32] wv, float[16,4] cache,
     int64[4] heads = {{0, 0, 4, 8}}, int64[3] merged = {{0, 0, 32}}, int64[2] halves = {{2, 2}},
     int64[2] parts = {{4, 4}}, int64[2] u24 = {{2, 4}}, int64[5] rep = {{1, 1, 1, 1, 2}},
     int64[4] tsh = {{0, 0, 1, -1}}, int64[1] m1 = {{-1}}, int64[1] z = {{0}},
     int64[1] o = {{1}}, int64[1] big = {{9223372036854775807}}, int64[1] ax = {{3}},
     int64[1] st = {{2}}, int64[4] back = {{0, 0, 4, -1}}, float scale = {{0.35355339}}>
    {{
      g = Gather(cache, pos)  sn, cs = Split<axis=-1>(g, halves)
      su = Unsqueeze(sn, u24)  cu = Unsqueeze(cs, u24)  s5 = Tile(su, rep)  c5 = Tile(cu, rep)
      s = Reshape(s5, tsh)  c = Reshape(c5, tsh)
      q = MatMul(h, wq)  k = MatMul(h, wk)  v = MatMul(h, wv)
      q4 = Reshape(q, heads)  k4 = Reshape(k, heads)  v4 = Reshape(v, heads)
      qr, qp = Split<axis=-1>(q4, parts)  kr, kp = Split<axis=-1>(k4, parts)
      qe = Slice(qr, z, big, ax, st)  qo = Slice(qr, o, big, ax, st)  qn = Neg(qo)
      qnu = Unsqueeze(qn, m1)  qeu = Unsqueeze(qe, m1)  qst = Concat<axis=-1>(qnu, qeu)
      qrot = Reshape(qst, back)  qa = Mul(qr, c)  qb = Mul(qrot, s)  qy = Add(qa, qb)
      ke = Slice(kr, z, big, ax, st)  ko = Slice(kr, o, big, ax, st)  kn = Neg(ko)
      knu = Unsqueeze(kn, m1)  keu = Unsqueeze(ke, m1)  kst = Concat<axis=-1>(knu, keu)
      krot = Reshape(kst, back)  ka = Mul(kr, c)  kb = Mul(krot, s)  ky = Add(ka, kb)
      qf = Concat<axis=-1>(qy, qp)  kf = Concat<axis=-1>(ky, kp)
      qt = Transpose<perm=[0,2,1,3]>(qf)  kt = Transpose<perm=[0,2,3,1]>(kf)
      vt = Transpose<perm=[0,2,1,3]>(v4)
      sc = MatMul(qt, kt)  ss = Mul(sc, scale)  p = Softmax<axis=-1>(ss)  a = MatMul(p, vt)
      at = Transpose<perm=[0,2,1,3]>(a)  out = Reshape(at, merged)
    }}"""
    model = _with_weights(onnx.parser.parse_model(text),
                          {"wq": (32, 32), "wk": (32, 32), "wv": (32, 32)})
    angles = np.arange(16)[:, None] * (1.0 / 10000 ** (np.arange(0, 4, 2) / 4))[None]
    cache = np.concatenate([np.sin(angles), np.cos(angles)], axis=-1).astype(np.float32)
    model.graph.initializer.append(numpy_helper.from_array(cache, "cache"))
    return model


@pytest.mark.parametrize(("batch", "seq"), [("B", "S"), (2, 6)])
@pytest.mark.parametrize(("target", "opset", "attention"),
                         [("onnxruntime", None, "MultiHeadAttention"), ("onnx", 23, "Attention")])
def test_gptj_interleaved_partial_rotary_fuses(batch, seq, target, opset, attention) -> None:
    result = fusectl.optimize(from_proto(_gptj_block(batch, seq)), target=target, opset=opset)
    ops = Counter(n.op_type for n in result.model.graph)
    assert result.validation.passed
    assert ops["RotaryEmbedding"] == 2 and ops[attention] == 1
    # a per-batch table read by position: the ids of a dynamic batch are built at run time
    shape_concats = 1 if target == "onnxruntime" and batch == "B" else 0
    assert ops["Neg"] == 0 and ops["Split"] <= 1 and ops["Concat"] == shape_concats
    for rotary in (n for n in result.model.graph if n.op_type == "RotaryEmbedding"):
        assert rotary.attributes["interleaved"].value == 1
        assert rotary.attributes["rotary_embedding_dim"].value == 4


def test_pairs_are_not_proven_from_a_stale_declared_width() -> None:
    """t is declared [8, M, 2] but is [8, M, 16/M] at run time (the Expand target is computed):
    the pairs proof reads widths from the ops that build them, so nothing fuses (the
    validator's M = 8 makes the declaration true and could not tell; M = 16 breaks it)."""
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8,4,16] x, float[8,M] f) => (float[2,8,4,16] y)
    <int64[1] m1 = {-1}, int64[1] z = {0}, int64[1] o = {1}, int64[1] big = {9223372036854775807},
     int64[1] ax = {3}, int64[1] st = {2}, int64[4] back = {0, 0, 0, -1}, int64[1] eight = {8},
     int64[1] sixteen = {16}, int64[1] two = {2}, int64[4] tsh = {1, 8, 1, 16}>
    {
      sf = Shape(f)  mm = Slice(sf, o, two)  kk = Div(sixteen, mm)
      es = Concat<axis=0>(eight, mm, kk)
      fu = Unsqueeze(f, m1)  t = Expand(fu, es)  e = Reshape(t, tsh)  c = Cos(e)  s = Sin(e)
      xe = Slice(x, z, big, ax, st)  xo = Slice(x, o, big, ax, st)  n = Neg(xo)
      nu = Unsqueeze(n, m1)  eu = Unsqueeze(xe, m1)  k = Concat<axis=-1>(nu, eu)
      r = Reshape(k, back)  a = Mul(x, c)  b = Mul(r, s)  y = Add(a, b)
    }""")
    model.graph.value_info.append(onnx.helper.make_tensor_value_info("t", 1, [8, "M", 2]))
    for target, opset in (("onnxruntime", None), ("onnx", 23)):
        result = fusectl.optimize(from_proto(model), target=target, opset=opset, check=False)
        assert result.ops_after["RotaryEmbedding"] == 0, target
