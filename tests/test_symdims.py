"""Tests for fusectl.symdims: the length of Range(0, n, 1) over a named dim gets that name,
and onnx's inference carries it on; every other Range is left to onnx."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
import onnx.parser
import onnx_ir as ir
import pytest
from values import parse_with_weights, rename_dim

from fusectl import symdims
from fusectl.modelio import from_proto
from fusectl.shapeexpr import is_minted


def _model(start: int = 0, delta: int = 1, source: str = "x") -> ir.Model:
    text = f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch,seq] x, float[batch,unk__9] u, float[1,64] p) => (float[batch,16] y)
        <int64 one = {{1}}, int64 start = {{{start}}}, int64 delta = {{{delta}}},
         int64[1] ax = {{0}}>
        {{
          sh = Shape({source})  n = Gather<axis=0>(sh, one)  r = Range(start, n, delta)
          ru = Unsqueeze(r, ax)  rf = Cast<to=1>(ru)  s = Add(x, rf)
          y = ReduceSum<keepdims=0>(s, ax)
        }}
    """
    return from_proto(onnx.parser.parse_model(text))


def _dims(model: ir.Model, name: str) -> list[int | str | None] | None:
    """The value's dims, None when it has no shape (onnx infers none for Pad with axes)."""
    value = next(out for node in model.graph for out in node.outputs if out.name == name)
    if value.shape is None:
        return None
    return [d if isinstance(d, int) else d.value for d in value.shape]


def test_range_over_a_named_dim_is_named_and_the_name_flows_on() -> None:
    model = _model()
    assert _dims(model, "r")[0] != "seq"  # what onnx's inference gives: a fresh symbol
    assert symdims.name_lost_dims(model)
    assert _dims(model, "r") == ["seq"]
    assert _dims(model, "s") == ["batch", "seq"]  # no fresh symbol for the broadcast sum
    assert not symdims.name_lost_dims(model)  # named already: nothing to do


@pytest.mark.parametrize(("start", "delta", "source"), [
    (1, 1, "x"),  # length seq - 1
    (0, 2, "x"),  # length ceil(seq / 2)
    (0, 1, "u"),  # a symbol onnx minted is no name
    (0, 1, "p"),  # a static dim: onnx's own inference computes it
])
def test_other_ranges_are_left_alone(start: int, delta: int, source: str) -> None:
    model = _model(start, delta, source)
    before = _dims(model, "r")
    assert not symdims.name_lost_dims(model)
    assert _dims(model, "r") == before


def test_shapes_are_kept_when_onnx_inference_fails(monkeypatch) -> None:
    model = _model()
    before = {out.name: out.shape for node in model.graph for out in node.outputs}
    monkeypatch.setattr(symdims, "try_infer_model_shapes", lambda model: None)
    assert not symdims.name_lost_dims(model)
    after = {out.name: out.shape for node in model.graph for out in node.outputs}
    assert after == before


PREFIX = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[B,S,64] x, float[T] v, int64[B,S] ids) => (float[B,S,64] y)
    <float[1,1,64] cls, int64[1,64] positions, int64 i0 = {0}, int64 i1 = {1},
     int64[1] a0 = {0}, int64[1] a1 = {1}, int64[1] m1 = {-1}, int64[1] d16 = {16},
     int64[1] d48 = {48}, int64[3] m1x3 = {-1, -1, -1}, int64[3] one3 = {1, 1, 1},
     int64[1] big = {9223372036854775807}, int64[1] m2 = {-2}, int64[1] p2 = {2},
     int64[6] pad1 = {0, 0, 0, 0, 1, 0}, int64[6] pad2 = {0, 2, 0, 0, 2, 0},
     int64[1] huge = {-9223372036854775807}>
    {
      sh = Shape(x)  b = Gather<axis=0>(sh, i0)  s = Gather<axis=0>(sh, i1)
      ub = Unsqueeze(b, a0)  us = Unsqueeze(s, a0)  y = Identity(x)
"""

CASES = {
    # name: (nodes, value, dims expected)
    "reshape-splits-heads": ("t = Concat<axis=0>(ub, us, m1, d16)  r = Reshape(x, t)",
                             "r", ["B", "S", 4, 16]),
    "reshape-merges-heads": ("t = Concat<axis=0>(ub, us, m1, d16)  h = Reshape(x, t)"
                             "  t3 = Concat<axis=0>(ub, us, m1)  r = Reshape(h, t3)",
                             "r", ["B", "S", 64]),
    "reshape-to-a-product": ("t = Concat<axis=0>(ub, m1)  r = Reshape(x, t)", "r", ["B", "64*S"]),
    "expand-written-by-torch": ("t = Concat<axis=0>(ub, m1, m1)  e = Equal(t, m1x3)"
                                "  w = Where(e, one3, t)  r = Expand(cls, w)",
                                "r", ["B", 1, 64]),
    "slice-to-the-length": ("r = Slice(positions, a0, us, a1)", "r", [1, "S"]),
    "flatten": ("r = Flatten<axis=2>(ids)", "r", ["B*S", 1]),
    "flatten-negative-axis": ("r = Flatten<axis=-1>(x)", "r", ["B*S", 64]),
    "constant-of-shape": ("t = Concat<axis=0>(ub, m1, m1)  e = Equal(t, m1x3)"
                          "  w = Where(e, one3, t)  r = ConstantOfShape(w)", "r", ["B", 1, 1]),
    # MobileBERT's trigram embedding: x[:, 1:] and x[:, :-1], each padded back by a row
    "slice-drops-the-first": ("r = Slice(x, a1, big, a1)", "r", ["B", "S - 1", 64]),
    "slice-drops-the-last": ("r = Slice(x, a0, m1, a1)", "r", ["B", "S - 1", 64]),
    # onnxruntime clamps a slice: 2 from each end of S = 3 leave 0, not -1
    "slice-drops-both-ends": ("r = Slice(x, p2, m2, a1)", "r", ["B", "Max(0, S - 4)", 64]),
    "pad-of-a-clamped-slice": ("sl = Slice(x, p2, m2, a1)  r = Pad(sl, pad2)", "r",
                               ["B", "Max(0, S - 4) + 4", 64]),
    "pad-restores-the-length": ("sl = Slice(x, a1, big, a1)  r = Pad(sl, pad1)", "r",
                                ["B", "S", 64]),
    "concat-along-a-named-axis": ("r = Concat<axis=1>(x, x)", "r", ["B", "2*S", 64]),
    "concat-of-a-slice-and-its-pad": (
        "sl = Slice(x, a1, big, a1)  pd = Pad(sl, pad1)  r = Concat<axis=-1>(pd, x)", "r",
        ["B", "S", 128]),
    "second-round": (  # e is named in the first round; the Reshape reads its Shape in the next
        "t = Concat<axis=0>(ub, m1, m1)  e = Equal(t, m1x3)  w = Where(e, one3, t)"
        "  ex = Expand(cls, w)  se = Shape(ex)  be = Gather<axis=0>(se, a0)"
        "  t2 = Concat<axis=0>(be, m1)  r = Reshape(x, t2)", "r", ["B", "64*S"]),
    # DETR's object queries: weight.unsqueeze(0).repeat(batch_size, 1, 1); B copies of B
    "tile-by-a-named-repeat": ("t = Concat<axis=0>(ub, a1, a1)  r = Tile(cls, t)", "r",
                               ["B", 1, 64]),
    "tile-a-named-axis": ("t = Concat<axis=0>(ub, a1, a1)  r = Tile(x, t)", "r",
                          ["B*B", "S", 64]),
    # x[:, -S:] of a static buffer and of the axis named S itself (torch's Neg of a size)
    "tail-of-a-buffer": ("n = Neg(s)  u = Unsqueeze(n, a0)  r = Slice(positions, u, big, a1)",
                         "r", [1, "S"]),
    "tail-of-the-axis": ("n = Neg(s)  u = Unsqueeze(n, a0)  r = Slice(x, u, big, a1)", "r",
                         ["B", "S", 64]),
    # MPT's ALiBi table cut to the sequence: table[:, 64 - S:] of a 64-long axis
    "tail-counted-from-the-buffer-length": (
        "c = Constant<value = int64 {64}>()  t = Sub(c, s)  u = Unsqueeze(t, a0)"
        "  r = Slice(positions, u, big, a1)", "r", [1, "S"]),
    # qkv.chunk(3, dim=2) with bounds computed from the shape: the other dims stay named
    "constant-slice-of-a-static-axis": (
        "c2 = Constant<value = int64 {2}>()  c4 = Constant<value = int64 {4}>()"
        "  w = Gather<axis=0>(sh, c2)  q = Div(w, c4)  st = Unsqueeze(q, a0)  en = Add(st, st)"
        "  ax = Constant<value = int64[1] {2}>()  r = Slice(x, st, en, ax)", "r",
        ["B", "S", 16]),
}


def _case(nodes: str) -> ir.Model:
    positions = np.arange(64, dtype=np.int64).reshape(1, 64)
    return from_proto(parse_with_weights(PREFIX + nodes + "\n}", {"positions": positions}))


@pytest.mark.parametrize("case", sorted(CASES))
def test_shape_arithmetic_names_what_onnx_left_unknown(case: str) -> None:
    nodes, value, expected = CASES[case]
    model = _case(nodes)
    assert _dims(model, value) != expected  # onnx's inference alone: fresh symbols
    assert symdims.name_lost_dims(model)
    assert _dims(model, value) == expected


@pytest.mark.parametrize("nodes", [
    "t = Concat<axis=0>(ub, m1, d48)  r = Reshape(x, t)",  # S*64/48 is no whole product
    "t = Concat<axis=0>(m1, m1)  r = Reshape(x, t)",  # two -1
    "r = Slice(positions, a1, us, a1)",  # from 1: S - 1 long
    "r = Slice(x, m1, big, a1)",  # the last one: 1 long, or 0 when S is 0
    "sl = Slice(x, m1, big, a1)  r = Concat<axis=1>(x, sl)",  # S + a symbol onnx minted
    "r = Slice(x, a1, big, a1, p2)",  # every second one
    "r = Slice(x, a0, huge, a1)",  # x[:, :-huge]: empty, no name
    "t = Concat<axis=0>(ub, m1)  pd = Concat<axis=0>(a0, t, a0, a1)  r = Pad(v, pd)",
    "t = Concat<axis=0>(us)  r = Expand(v, t)",  # T against S: either, or an error
    # B or S equal to 16 cannot be told: the Where picks either
    "t = Concat<axis=0>(ub, us)  e = Equal(t, d16)  w = Where(e, t, d16)  r = Expand(v, w)",
])
def test_what_the_arithmetic_cannot_tell_stays_unknown(nodes: str) -> None:
    model = _case(nodes)
    (value,) = [n.outputs[0] for n in model.graph if n.outputs[0].name == "r"]
    before = value.shape
    assert not symdims.name_lost_dims(model)
    assert value.shape == before


@pytest.mark.parametrize(("current", "computed", "expected"), [
    (None, ["B", 4], ["B", 4]),  # untyped: a whole shape
    (None, ["B", None], ["B", None]),  # untyped: a name, the rest unknown
    (None, [None, 1024], None),  # untyped, nothing named: a fresh symbol would split sizes
    (["unk__1", 4], ["B", 4], ["B", 4]),  # a minted symbol gives way to a name
    ([None, 4], ["unk__2", 4], ["unk__2", 4]),  # a copy of a minted symbol where none was
    (["unk__1", 4], ["unk__2", 4], None),  # one minted symbol for another: nothing new
    (["B", 4], ["S", 4], None),  # onnx's own names are kept, nothing mixed
    (["B", 4], ["B", 4, 1], None),  # another rank
])
def test_what_a_computed_shape_adds(current, computed, expected) -> None:
    assert symdims._better(current, computed) == expected



# ------------------------------------------------------------- anonymous input dims


ANONYMOUS = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (int64[1,?] ids, float[?,5] other) => (float[?,?,4,4] y)
    <float[50,16] emb, int64[1] a0 = {0}, int64[1] a1 = {1}, int64[1] hd = {4}>
    {
      e = Gather(emb, ids)  h = Relu(e)  sh = Shape(h)  s0 = Gather<axis=0>(sh, a0)
      s1 = Gather<axis=0>(sh, a1)  t = Concat<axis=0>(s0, s1, hd, hd)  y = Reshape(h, t)
    }
"""


def test_anonymous_input_dims_get_one_name_each_until_saved() -> None:
    """onnx mints a fresh symbol for ``[1, ?]`` at every value it reaches; named, the
    embedding and the Reshape built from its length read one name; forgotten again, no
    name is left."""
    model = from_proto(parse_with_weights(ANONYMOUS))
    assert str(_dims(model, "e")[1]).startswith("unk__")
    assert symdims.name_anonymous_input_dims(model) is True
    ids, other = model.graph.inputs
    assert [d if isinstance(d, int) else d.value for d in ids.shape] == [1, "anon__0_1"]
    assert other.shape[0].value == "anon__1_0"
    assert _dims(model, "e") == _dims(model, "h") == [1, "anon__0_1", 16]
    symdims.name_lost_dims(model)
    assert _dims(model, "y") == [1, "anon__0_1", 4, 4]  # the heads' Reshape, read off it
    symdims.forget_stand_ins(model)
    assert ids.shape[1].value is None and other.shape[0].value is None
    text = ir.serde.serialize_model(model).SerializeToString()
    assert b"anon__" not in text


def test_named_and_static_inputs_get_no_stand_in() -> None:
    model = _model()
    before = [v.shape for v in model.graph.inputs]
    assert symdims.name_anonymous_input_dims(model) is False
    assert [v.shape for v in model.graph.inputs] == before


def test_the_traffic_model_does_not_count_a_stand_in_as_one() -> None:
    from fusectl.traffic import unbound_dim
    assert unbound_dim("anon__0_1") is None and unbound_dim("sequence") == 1


def test_inputs_whose_names_differ_only_in_punctuation_get_different_stand_ins() -> None:
    """``a.b`` and ``a_b``: names made from the input's name would collide and make two
    unrelated dims equal (the review's wrong model); they are numbered by position."""
    model = from_proto(onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[?] "a.b", float[?] a_b) => (float[?] y, float[?] z)
        { y = Relu("a.b")  z = Relu(a_b) }
    """))
    assert symdims.name_anonymous_input_dims(model)
    assert _dims(model, "y") != _dims(model, "z")


def test_a_model_with_names_like_stand_ins_gets_none() -> None:
    model = from_proto(onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[anon__0_0] x, float[?] u) => (float[anon__0_0] y, float[?] z)
        { y = Relu(x)  z = Relu(u) }
    """))
    assert symdims.name_anonymous_input_dims(model) is False
    assert model.graph.inputs[1].shape[0].value is None


def test_stand_ins_are_forgotten_inside_subgraphs_too() -> None:
    model = from_proto(onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[?,4] x, bool c) => (float[?,4] y)
        {
          r = Relu(x)
          y = If(c) <then_branch = t () => (float[?,4] a) { a = Neg(r) },
                     else_branch = e () => (float[?,4] b) { b = Abs(r) }>
        }
    """))
    assert symdims.name_anonymous_input_dims(model)
    inner = [v.shape for g in model.graphs() if g is not model.graph
             for n in g for v in n.outputs]
    assert any(s is not None and "anon__" in str(s) for s in inner)
    symdims.forget_stand_ins(model)
    assert b"anon__" not in ir.serde.serialize_model(model).SerializeToString()


def test_a_slice_of_a_dynamic_axis_to_another_dim_stays_unnamed() -> None:
    """x[:, :S] of an [B, L] input may be shorter than S (L < S): naming it S would let
    prepare move reads of its shape to S and change what ConstantOfShape builds."""
    proto = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B, L] x, float[B, S] y) => (float[?] c, float[B] z)
        <int64[1] i0 = {0}, int64[1] i1 = {1}, int64[1] a1 = {1}>
        {
          sy = Shape(y)  s = Gather<axis=0>(sy, i1)  sl = Slice(x, i0, s, a1)
          r = Relu(sl)  sr = Shape(r)  n = Gather<axis=0>(sr, i1)
          c = ConstantOfShape(n)  z = ReduceSum<keepdims=0>(r, i1)
        }""")
    from fusectl.prepare import prepare
    model = from_proto(proto)
    prepare(model)
    assert _dims(model, "sl")[1] != "S"
    import onnxruntime as ort
    feeds = {"x": np.ones((2, 3), np.float32), "y": np.ones((2, 5), np.float32)}
    after = ir.serde.serialize_model(model)
    shapes = [[o.shape for o in ort.InferenceSession(
        p.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)]
        for p in (proto, after)]
    assert shapes[0] == shapes[1] == [(3,), (2,)]


# ------------------------------------------------------------- sums of named dims

# optimum's names: a mask over past + new tokens, a cache of past tokens
SUMS = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (int64[batch,seq] ids, float[batch,4,past,8] pk, int64[batch,TOTAL] mask)
      => (int64[?] y)
    <int64 i0 = {{0}}, int64 i1 = {{1}}, int64 i2 = {{2}}, int64[1] a0 = {{0}},
     int64[1] a1 = {{1}}, int64[1] two = {{2}}, int64[1] big = {{9223372036854775807}},
     int64 four = {{4}}, int64 minus = {{-1}}, int64[1] m1 = {{-1}}, int64[1] d8 = {{8}}>
    {{
      si = Shape(ids)  b = Gather<axis=0>(si, i0)  s = Gather<axis=0>(si, i1)
      sp = Shape(pk)  p = Gather<axis=0>(sp, i2)  ub = Unsqueeze(b, a0)
      up = Unsqueeze(p, a0)  us = Unsqueeze(s, a0)
      {nodes}
      y = Shape(r)
    }}
"""


def _sums(nodes: str) -> ir.Model:
    proto = onnx.parser.parse_model(SUMS.format(nodes=nodes))
    return from_proto(rename_dim(proto, "TOTAL", "past + seq"))


@pytest.mark.parametrize(("nodes", "expected"), [
    # torch's arange(past + seq): the sum spelled as declared, either order of the Add
    ("t = Add(p, s)  r = Range(i0, t, i1)", ["past + seq"]),
    ("t = Add(s, p)  r = Range(i0, t, i1)", ["past + seq"]),
    ("t = Add(up, us)  c = Concat<axis=0>(ub, t)  r = Expand(mask, c)", ["batch", "past + seq"]),
    # a named dim plus a number, and back (nn.Unfold's block count: (S + 8) - 8)
    ("t = Add(p, two)  r = Range(i0, t, i1)", ["past + 2"]),
    ("t = Add(two, p)  u = Add(t, s)  r = Range(i0, u, i1)", ["past + seq + 2"]),
    ("t = Add(s, four)  u = Sub(t, four)  r = Range(i0, u, i1)", ["seq"]),
    ("t = Add(s, four)  u = Sub(t, s)  w = Unsqueeze(u, a0)  r = ConstantOfShape(w)", [4]),
    # position_ids[:, past:] of the mask's cumsum: the new tokens
    ("r = Slice(mask, up, big, a1)", ["batch", "seq"]),
    ("r = Slice(mask, us, big, a1)", ["batch", "past"]),
    ("t = Add(p, s)  u = Unsqueeze(t, a0)  c = Concat<axis=0>(ub, u)  e = Expand(mask, c)"
     "  r = Slice(e, up, big, a1)", ["batch", "seq"]),
    # products and exact quotients: BLOOM folds the heads into the batch, [4*batch, L, 8]
    ("t = Mul(b, four)  u = Unsqueeze(t, a0)  c = Concat<axis=0>(u, m1, d8)  r = Reshape(pk, c)",
     ["4*batch", "past", 8]),
    ("t = Mul(s, b)  r = Range(i0, t, i1)", ["batch*seq"]),
    ("t = Mul(b, four)  q = Div(t, four)  r = Range(i0, q, i1)", ["batch"]),
])
def test_sums_and_products_of_named_dims_are_named(nodes: str, expected: list) -> None:
    model = _sums(nodes)
    assert _dims(model, "r") != expected
    assert symdims.name_lost_dims(model)
    assert _dims(model, "r") == expected


@pytest.mark.parametrize("nodes", [
    "t = Sub(p, s)  r = Range(i0, t, i1)",
    "t = Div(b, four)  r = Range(i0, t, i1)",  # batch / 4 truncates: no product of names
    "t = Mul(b, minus)  r = Range(i0, t, i1)",  # -batch is no size
    "t = Sub(p, two)  r = Range(i0, t, i1)",  # past - 2: past may be 1
    "t = Add(p, two)  u = Sub(t, s)  r = Range(i0, u, i1)",  # past + 2 - seq
    "r = Slice(mask, ub, big, a1)",  # batch is no term of past + seq
    "r = Slice(mask, up, us, a1)",  # from past to seq: not to the end
    "r = Slice(mask, up, big, a1, two)",  # every second one
])
def test_what_is_no_sum_or_product_of_named_dims_stays_unknown(nodes: str) -> None:
    """The computed axis keeps no name (the others may: a Slice along axis 1 keeps the
    batch)."""
    model = _sums(nodes)
    symdims.name_lost_dims(model)
    assert is_minted(_dims(model, "r")[-1])


@pytest.mark.parametrize(("size", "delta", "expected"), [
    ("S", -1, "S - 1"),
    ("S - 1", 1, "S"),
    ("past + seq", 1, "past + seq + 1"),
    ("Max(0, S - 4)", 4, "Max(0, S - 4) + 4"),
    (3, -1, 2),
    (3, -4, None),  # no size below 0
    ("unk__3", 1, None),  # a symbol onnx minted names nothing
    ("seq-len", -1, None),  # sympy would read a difference of two names
    ("seq + past", 1, None),  # and reorder this sum: the name would change
    ("h/2", 1, None),  # a name is no quotient: two h/2 would add up to h
    ("seq len", 1, None),  # onnx-ir's parser cannot read it: no arithmetic, no crash
    ("batch[0]", 1, None),
    (None, 1, None),
])
def test_a_named_dim_shifted_by_a_number(size, delta, expected) -> None:
    assert symdims._shifted(size, delta) == expected


@pytest.mark.parametrize(("sizes", "expected"), [
    (["S", "S"], "2*S"),
    (["past + seq", "seq", 2], "past + 2*seq + 2"),
    ([3, 4], 7),
    (["S", "unk__3"], None),
    (["h/2", "h/2"], None),
    (["seq len", "S"], None),
])
def test_a_sum_of_dims(sizes, expected) -> None:
    assert symdims._sum(sizes) == expected


def test_a_concat_of_many_inputs_gets_no_summed_name() -> None:
    """A sum of hundreds of names is costly (sympy) and names nothing a rule reads."""
    count = symdims.MAX_CONCAT_INPUTS + 1
    inputs = ", ".join(f"float[1, d{i}] x{i}" for i in range(count))
    names = ", ".join(f"x{i}" for i in range(count))
    model = from_proto(onnx.parser.parse_model(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g ({inputs}) => (float[1, ?] y) {{ r = Concat<axis=1>({names})  y = Relu(r) }}"""))
    symdims.name_lost_dims(model)
    assert is_minted(_dims(model, "r")[1])


def test_a_concat_of_the_past_and_new_tokens_is_their_sum() -> None:
    """A mask over past + seq tokens concatenated with seq more: no graph output declares
    the sum, so it is computed (and spelled as onnx-ir spells sums)."""
    model = _sums("r = Concat<axis=1>(mask, ids)")
    assert _dims(model, "r") != ["batch", "past + 2*seq"]
    assert symdims.name_lost_dims(model)
    assert _dims(model, "r") == ["batch", "past + 2*seq"]


def test_a_pad_along_given_axes_grows_those() -> None:
    """Opset 18's axes input: the pads are for those axes only (3 before and 1 cropped
    after along S)."""
    model = from_proto(onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[B, S, 4] x) => (float[B, ?, 4] y)
        <int64[2] pads = {3, -1}, int64[1] a1 = {1}>
        { r = Pad(x, pads, , a1)  y = Relu(r) }"""))
    assert symdims.name_lost_dims(model)
    assert _dims(model, "r") == ["B", "S + 2", 4]


def test_a_concat_keeps_only_the_dims_all_its_inputs_agree_on() -> None:
    """onnxruntime skips an empty input (an empty past of another batch): B and C along a
    kept axis name neither, while the concatenated axis is still the sum."""
    model = from_proto(onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B, S] a, float[C, S] b) => (float[?, ?] y)
        { r = Concat<axis=1>(a, b)  y = Relu(r) }"""))
    (concat,) = [n for n in model.graph if n.op_type == "Concat"]
    assert symdims._concat_dims(concat) == [None, "2*S"]
    # a dim one input leaves unknown does not hide the other's (GPT-J's rotary half)
    model = from_proto(onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B, S, 4] a, float[B, S, 4] b) => (float[?, ?, ?] y)
        { r = Concat<axis=1>(a, b)  y = Relu(r) }"""))
    model.graph.inputs[0].shape = ir.Shape(["B", "S", None])
    (concat,) = [n for n in model.graph if n.op_type == "Concat"]
    assert symdims._concat_dims(concat) == ["B", "2*S", 4]


@pytest.mark.parametrize(("key", "expected"), [("seq", "seq"), ("past", None)])
def test_a_causal_window_from_a_named_dim_less_itself(key: str, expected: str | None) -> None:
    """GPT-Neo's mask buffer[:, :, L - S : L, :L]: with the key as long as the query (both
    ``seq``) the window starts at 0 and is ``seq`` long; a key of another length names
    nothing."""
    model = from_proto(onnx.parser.parse_model(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch,seq,8] q, float[batch,{key},8] k) => (int64[4] y)
        <float[1,1,16,16] buf, int64[1] a1 = {{1}}, int64[1] a2 = {{2}}, int64[1] z = {{0}},
         int64[1] a3 = {{3}}>
        {{
          sq = Shape(q)  sk = Shape(k)  lq = Slice(sq, a1, a2)  lk = Slice(sk, a1, a2)
          st = Sub(lk, lq)  w = Slice(buf, st, lk, a2)  r = Slice(w, z, lk, a3)  y = Shape(r)
        }}"""))
    symdims.name_lost_dims(model)
    dims = _dims(model, "r")
    if expected is None:
        assert dims[2] is None or is_minted(dims[2])
    else:
        assert dims == [1, 1, expected, expected]


# ------------------------------------------- run-time repeats, sizes, x[-n:] and Conv


@pytest.mark.parametrize("nodes", [
    # a repeat read from a tensor's values, not from a shape
    "c = Cast<to=7>(v)  n = Slice(c, a0, a1)  t = Concat<axis=0>(n, a1, a1)  r = Tile(cls, t)",
    "n = Neg(s)  u = Unsqueeze(n, a0)  r = Slice(positions, u, m1, a1)",  # x[-S:-1]
    "n = Neg(b)  u = Unsqueeze(n, a0)  r = Slice(x, u, big, a1)",  # x[:, -B:] of S: min(B, S)
    "n = Neg(s)  u = Unsqueeze(n, a0)  r = Slice(x, u, big, a1, p2)",  # every second one
    # table[:, 63 - S:] of a 64-long axis: S + 1 long
    "c = Constant<value = int64 {63}>()  t = Sub(c, s)  u = Unsqueeze(t, a0)"
    "  r = Slice(positions, u, big, a1)",
    "t = Sub(s, b)  u = Unsqueeze(t, a0)  r = Slice(positions, u, big, a1)",  # from S - B
    "r = Slice(x, a0, ub, a1)",  # x[:, :B] of S: min(B, S)
])
def test_tails_and_repeats_that_name_nothing_stay_unknown(nodes: str) -> None:
    model = _case(nodes)
    symdims.name_lost_dims(model)
    dims = _dims(model, "r")
    axis = 0 if "Tile" in nodes else 1
    assert dims is None or dims[axis] is None or is_minted(dims[axis])


@pytest.mark.parametrize(("size", "length", "expected"), [
    ("S", "S", True),
    ("S + 2", "S", True),  # a causal Conv's padded output
    ("past + seq", "seq", True),
    ("S - 2", "S", False),
    ("2*S", "S", False),  # at least S, but spelled as no sum: not read
    ("S + 2", "T", False),
    (64, "S", False),  # a static axis may be shorter than S
    ("S", None, False),
])
def test_an_axis_known_to_hold_a_named_length(size, length, expected) -> None:
    assert symdims._at_least(size, length) is expected


CONV = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[B, 4, S] x, float[B, 4, H, W] image) => (float[B, 4, S] y)
    <float[4, 1, 3] w, float[4, 4, 3, 3] w2, int64 i2 = {{2}}, int64[1] a0 = {{0}},
     int64[1] a2 = {{2}}>
    {{
      r = Conv<group=4, {line}>(x, w)
      sh = Shape(x)  s = Gather<axis=0>(sh, i2)  us = Unsqueeze(s, a0)
      c = Slice(r, a0, us, a2)  y = Relu(c)
      r2 = Conv<{image}>(image, w2)  q = Relu(r2)
    }}
"""

# (attributes of the 1-D Conv over S, of the 2-D Conv over H and W, whether S is named
# after the 1-D Conv: at stride 1 only)
CONVS = [
    ("pads = [2, 2]", "pads = [2, 2, 2, 2]", True),
    ("pads = [2, 0]", "pads = [2, 2, 0, 0]", True),
    ("pads = [1, 1]", "pads = [1, 1, 1, 1]", True),
    ("pads = [0, 0]", "pads = [0, 0, 0, 0]", True),
    ("pads = [4, 4], dilations = [2]", "pads = [4, 4, 4, 4], dilations = [2, 2]", True),
    ("pads = [1, 3], strides = [2]", "pads = [1, 1, 3, 3], strides = [2, 2]", False),
    ('auto_pad = "SAME_UPPER"', 'auto_pad = "SAME_UPPER"', True),
    ('auto_pad = "VALID"', 'auto_pad = "VALID"', True),
    ('auto_pad = "SAME_LOWER", strides = [3]', 'auto_pad = "SAME_LOWER", strides = [3, 3]', False),
]


@pytest.mark.parametrize(("line", "image", "named"), CONVS)
def test_conv_dims_agree_with_onnxruntime(line: str, image: str, named: bool) -> None:
    """LFM2's causal depthwise Conv over a named sequence, cut back to it: the Conv's dims
    are named at stride 1 (left unknown at another stride), and every name is what
    onnxruntime computes once S, H and W are known."""
    import onnxruntime as ort
    proto = parse_with_weights(CONV.format(line=line, image=image))
    model = from_proto(proto)
    symdims.name_lost_dims(model)
    names = ["r", "r2", "c"]
    proto.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": np.ones((2, 4, 11), np.float32), "image": np.ones((2, 4, 7, 9), np.float32)}
    actual = dict(zip(names, session.run(names, feeds), strict=True))
    sizes = {"B": 2, "S": 11, "H": 7, "W": 9}
    axis = _dims(model, "r")[2]
    assert (axis is not None and not is_minted(axis)) is named
    for name in names:
        dims = _dims(model, name)
        for dim, size in zip(dims, actual[name].shape, strict=True):
            if isinstance(dim, int):
                assert dim == size, (name, dims)
            elif dim is not None and not is_minted(dim):
                value = eval(dim, {}, dict(sizes))  # noqa: S307 - sums of the test's names
                assert value == size, (name, dim)


def test_a_causal_conv_over_a_named_sequence_cut_back_to_it_is_named() -> None:
    model = from_proto(parse_with_weights(
        CONV.format(line="pads = [2, 2]", image="pads = [1, 1, 1, 1]")))
    assert _dims(model, "c")[2] != "S"
    assert symdims.name_lost_dims(model)
    assert _dims(model, "r") == ["B", 4, "S + 2"]
    assert _dims(model, "c") == ["B", 4, "S"]
    assert _dims(model, "r2") == ["B", 4, "H", "W"]


RESIZE = """
    <ir_version: 8, opset_import: ["" : 18]>
    g (float[B, 1, H, W] mask, float[B, 8, h, w] features) => (float[B, 1, h, w] y)
    <int64[1] a0 = {{0}}, int64[1] a2 = {{2}}, int64[1] a4 = {{4}}>
    {{
      sm = Shape(mask)  bc = Slice(sm, a0, a2)  sf = Shape(features)  hw = Slice(sf, a2, a4)
      sizes = Concat<axis=0>(bc, hw)  r = Resize<{attributes}>(mask, , , sizes)  y = Relu(r)
    }}
"""


def test_a_resize_to_sizes_read_at_run_time_is_named() -> None:
    """DETR's ``interpolate(mask, size=features.shape[-2:])``."""
    model = from_proto(onnx.parser.parse_model(RESIZE.format(attributes='mode = "nearest"')))
    assert _dims(model, "r") != ["B", 1, "h", "w"]
    assert symdims.name_lost_dims(model)
    assert _dims(model, "r") == ["B", 1, "h", "w"]


@pytest.mark.parametrize("attributes", [
    'keep_aspect_ratio_policy = "not_larger"',  # the sizes are bounds, not the sizes
    "axes = [0, 0, 2, 3]",  # an axis twice: invalid, names nothing
])
def test_a_resize_whose_sizes_are_not_its_dims_stays_unknown(attributes: str) -> None:
    model = from_proto(onnx.parser.parse_model(RESIZE.format(attributes=attributes)))
    symdims.name_lost_dims(model)
    dims = _dims(model, "r")
    assert dims is None or dims[2:] != ["h", "w"]
