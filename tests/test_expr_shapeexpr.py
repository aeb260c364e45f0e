"""Tests for fusectl/shapeexpr.py: the constant Reshape target of run-time shape arithmetic
(``runtime_shape_target``, rule reshape-runtime-target in rules/05-cleanup.yaml).

Each model is ONNX text whose last Reshape reads the computed target; the expected targets
are worked out by hand in the comments."""

from __future__ import annotations

import time

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from fusectl import expr
from fusectl.expr import NoMatch
from fusectl.shapeexpr import (
    MAX_SHAPE_NODES,
    Named,
    dim_name,
    runtime_shape_target,
    shape_entries,
)


def _target(body: str, inputs: str = "float[N,3,4,5] x", consts: str = "", opset: int = 13,
            allowzero: int | None = 0) -> list[int]:
    """Parse a graph computing ``t``, end it with ``reshaped = Reshape(x, t)`` and evaluate."""
    text = f"""
        <ir_version: 8, opset_import: ["" : {opset}]>
        g ({inputs}) => (float[?] reshaped)
        <{consts}>
        {{ {body}  reshaped = Reshape(x, t) }}
    """ if consts else f"""
        <ir_version: 8, opset_import: ["" : {opset}]>
        g ({inputs}) => (float[?] reshaped)
        {{ {body}  reshaped = Reshape(x, t) }}
    """
    model = ir.from_proto(onnx.parser.parse_model(text))
    reshape = next(n for n in model.graph if n.op_type == "Reshape")
    target = runtime_shape_target(reshape.inputs[1], reshape.inputs[0], allowzero)
    assert target.dtype == np.int64
    return target.tolist()


def _gathers(*indices: int) -> str:
    return ", ".join(f"int64 i{k} = {{{v}}}" for k, v in enumerate(indices))


# ----------------------------------------------------------------------------- fires


def test_view_b_c_hw_opset11() -> None:
    # x: [N,3,4,5]; target [N, 3, 4*5]: N is x's dim 0 at position 0 -> a copy (0)
    body = """s = Shape(x)  d0 = Gather(s, i0)  d1 = Gather(s, i1)  d2 = Gather(s, i2)
              d3 = Gather(s, i3)  hw = Mul(d2, d3)  u0 = Unsqueeze<axes=[0]>(d0)
              u1 = Unsqueeze<axes=[0]>(d1)  u2 = Unsqueeze<axes=[0]>(hw)
              t = Concat<axis=0>(u0, u1, u2)"""
    assert _target(body, consts=_gathers(0, 1, 2, 3), opset=11) == [0, 3, 20]


def test_torch_expand_target_where_equal_minus_one() -> None:
    # torch's x.expand(n, -1, ...) target Where(Equal(s, -1), 1, s) with s = [N, -1, 20]:
    # N is never -1 (a dim), the -1 becomes 1, the 20 stays: [N, 1, 20] -> [0, 1, 20]
    body = """s = Shape(x)  d0 = Gather(s, i0)  u0 = Unsqueeze<axes=[0]>(d0)
              c = Concat<axis=0>(u0, m, k)  e = Equal(c, m3)  t = Where(e, one3, c)"""
    consts = ("int64 i0 = {0}, int64[1] m = {-1}, int64[1] k = {20}, "
              "int64[3] m3 = {-1, -1, -1}, int64[3] one3 = {1, 1, 1}")
    assert _target(body, "float[N,1,4,5] x", consts) == [0, 1, 20]


def test_where_on_an_undecidable_condition_is_unknown() -> None:
    # Equal(N, 4) cannot be told: the first entry is unknown, written -1 (the only one)
    body = """s = Shape(x)  d0 = Gather(s, i0)  u0 = Unsqueeze<axes=[0]>(d0)
              c = Concat<axis=0>(u0, k)  e = Equal(c, f2)  t = Where(e, one2, c)"""
    consts = "int64 i0 = {0}, int64[1] k = {60}, int64[2] f2 = {4, 4}, int64[2] one2 = {1, 1}"
    assert _target(body, consts=consts) == [-1, 60]


def test_static_dims_are_written_as_literals() -> None:
    body = "s = Shape(x)  d = Gather(s, i0)  u = Unsqueeze<axes=[0]>(d)  t = Concat<axis=0>(u, m)"
    consts = "int64 i0 = {0}, int64[1] m = {-1}"
    assert _target(body, "float[2,3,4,5] x", consts, opset=11) == [2, -1]


def test_literal_minus_one_with_a_copy_opset13_axes_input() -> None:
    # x.view(x.size(0), -1): [N, -1] -> [0, -1]
    body = "s = Shape(x)  d = Gather(s, i0)  u = Unsqueeze(d, ax)  t = Concat<axis=0>(u, m)"
    consts = "int64 i0 = {0}, int64[1] ax = {0}, int64[1] m = {-1}"
    assert _target(body, "float[N,3,4] x", consts) == [0, -1]


def test_named_dims_of_another_value_are_copies() -> None:
    # The exporters' x.view(b, s, heads, d) with b, s taken from the block's input h, not
    # from x itself: h's dims B and S are x's dims 0 and 1 by name -> copies (0)
    body = """s = Shape(h)  b = Gather(s, i0)  l = Gather(s, i1)  ub = Unsqueeze<axes=[0]>(b)
              ul = Unsqueeze<axes=[0]>(l)  t = Concat<axis=0>(ub, ul, c)"""
    inputs = "float[B,S,64] x, float[B,S,64] h"
    consts = "int64 i0 = {0}, int64 i1 = {1}, int64[2] c = {4, 16}"
    assert _target(body, inputs, consts, opset=11) == [0, 0, 4, 16]
    # S at another position of the target: a known size, but not a copy -> -1
    body = "s = Shape(h)  l = Gather(s, i1)  ul = Unsqueeze<axes=[0]>(l)  t = Concat<axis=0>(c, ul)"
    assert _target(body, "float[S,8] x, float[B,S] h", "int64 i1 = {1}, int64[1] c = {8}",
                   opset=11) == [8, -1]


def test_a_dim_named_nowhere_in_the_input_is_unknown() -> None:
    # h's T is not a dim of x: unknown, and an unknown entry beside a copy is refused
    body = """s = Shape(h)  b = Gather(s, i0)  l = Gather(s, i1)  ub = Unsqueeze<axes=[0]>(b)
              ul = Unsqueeze<axes=[0]>(l)  t = Concat<axis=0>(ub, ul, c)"""
    consts = "int64 i0 = {0}, int64 i1 = {1}, int64[2] c = {4, 16}"
    with pytest.raises(NoMatch, match="beside"):
        _target(body, "float[B,S,64] x, float[B,T,64] h", consts, opset=11)


def test_negative_gather_indices() -> None:
    # x: [2,N]; Gather -2 -> 2 (static), Gather -1 -> N at position 1 (its own) -> 0
    body = "s = Shape(x)  a = Gather(s, i0)  b = Gather(s, i1)  t = Concat<axis=0>(a, b)"
    consts = "int64[1] i0 = {-2}, int64[1] i1 = {-1}"
    assert _target(body, "float[2,N] x", consts) == [2, 0]


def test_dynamic_dim_at_another_position_is_minus_one() -> None:
    # x: [N,6] -> [3, 2, N]: N moved from position 0 to 2 -> -1
    body = "s = Shape(x)  n = Gather(s, i0)  t = Concat<axis=0>(c, n)"
    consts = "int64[1] i0 = {0}, int64[2] c = {3, 2}"
    assert _target(body, "float[N,6] x", consts) == [3, 2, -1]


def test_allowzero_1_writes_a_copy_as_minus_one() -> None:
    # with allowzero=1 a 0 is a literal empty dim, so the copied N must be -1
    body = "s = Shape(x)  p = Slice(s, b0, e1)  t = Concat<axis=0>(p, c)"
    consts = "int64[1] b0 = {0}, int64[1] e1 = {1}, int64[1] c = {12}"
    assert _target(body, "float[N,3,4] x", consts, opset=14, allowzero=1) == [-1, 12]
    assert _target(body, "float[N,3,4] x", consts, opset=14, allowzero=0) == [0, 12]
    assert _target(body, "float[N,3,4] x", consts, opset=14, allowzero=None) == [0, 12]


def test_a_computed_zero_keeps_its_value() -> None:
    # 4 - 4 = 0: Reshape reads the same 0 at run time, whatever allowzero says
    body = "s = Shape(x)  d = Gather(s, i1)  z0 = Sub(d, c4)  t = Concat<axis=0>(z0, c7)"
    consts = "int64[1] i1 = {1}, int64[1] c4 = {4}, int64[1] c7 = {7}"
    assert _target(body, "float[N,4] x", consts, allowzero=0) == [0, 7]
    assert _target(body, "float[N,4] x", consts, allowzero=1) == [0, 7]


def test_integer_division_truncates_toward_zero() -> None:
    # x: [N,6]; (6 - 13) / 2 = -7 / 2 = -3 in onnxruntime (floor division would give -4);
    # times -1 -> 3
    body = """s = Shape(x)  n = Gather(s, i0)  c = Gather(s, i1)  d = Sub(c, c13)
              h = Div(d, two)  p = Mul(h, m1)  t = Concat<axis=0>(n, p, two)"""
    consts = ("int64[1] i0 = {0}, int64[1] i1 = {1}, int64[1] c13 = {13}, int64[1] two = {2}, "
              "int64[1] m1 = {-1}")
    assert _target(body, "float[N,6] x", consts) == [0, 3, 2]


def test_cast_to_float_and_back_truncates() -> None:
    # x: [N,7]; float(7) / 2 = 3.5, Cast to int64 truncates -> 3; Ceil(3.5) = 4;
    # float(7) / -2 = -3.5 -> -3 (floor would give -4); times -1 -> 3
    cast_back = """s = Shape(x)  n = Gather(s, i0)  c = Gather(s, i1)  f = Cast<to=1>(c)
                   h = Div(f, two)  up = Ceil(h)  neg = Div(f, mtwo)
                   a = Cast<to=7>(h)  b = Cast<to=7>(up)  nb = Cast<to=7>(neg)
                   p = Mul(nb, m1)  t = Concat<axis=0>(n, a, b, p)"""
    consts = ("int64[1] i0 = {0}, int64[1] i1 = {1}, float[1] two = {2.0}, "
              "float[1] mtwo = {-2.0}, int64[1] m1 = {-1}")
    assert _target(cast_back, "float[N,7] x", consts) == [0, 3, 4, 3]


def test_floor_and_int32_round_trip() -> None:
    # Paddle2ONNX: Cast(Shape, int32) ... Cast(int64); Floor(7 / 2) = 3
    body = """s = Shape(x)  a = Cast<to=6>(s)  p = Slice(a, b0, e1)  q = Cast<to=7>(p)
              c = Gather(s, i1)  f = Cast<to=11>(c)  h = Div(f, two)  fl = Floor(h)
              r = Cast<to=7>(fl)  t = Concat<axis=0>(q, r)"""
    consts = "int64[1] b0 = {0}, int64[1] e1 = {1}, int64[1] i1 = {1}, double[1] two = {2.0}"
    assert _target(body, "float[N,7] x", consts) == [0, 3]


def test_a_dynamic_dim_through_float_is_unknown() -> None:
    # N cast to float and back is no longer known to be x's dim 0: -1, not 0
    body = """s = Shape(x)  n = Gather(s, i0)  f = Cast<to=1>(n)  b = Cast<to=7>(f)
              t = Concat<axis=0>(b, c)"""
    consts = "int64[1] i0 = {0}, int64[1] c = {12}"
    assert _target(body, "float[N,3,4] x", consts) == [-1, 12]


def test_slice_negative_start_and_step() -> None:
    # Shape [N,3,4,5] reversed from the last entry: [5, 4, 3, N]; N lands at position 3
    body = "s = Shape(x)  t = Slice(s, b, e, a, st)"
    consts = ("int64[1] b = {-1}, int64[1] e = {-9223372036854775807}, int64[1] a = {0}, "
              "int64[1] st = {-1}")
    assert _target(body, consts=consts) == [5, 4, 3, -1]


def test_slice_clamps_like_onnx() -> None:
    # starts -3 on 4 entries -> 1; ends 100 -> 4: [3, 4, 5], then N in front
    body = """s = Shape(x)  n = Slice(s, z, one)  p = Slice(s, b, e)
              t = Concat<axis=0>(n, p)"""
    consts = "int64[1] z = {0}, int64[1] one = {1}, int64[1] b = {-3}, int64[1] e = {100}"
    assert _target(body, consts=consts) == [0, 3, 4, 5]


def test_slice_with_attributes_opset9() -> None:
    body = """s = Shape(x)  n = Slice<starts=[0], ends=[1], axes=[0]>(s)
              p = Slice<starts=[2], ends=[4]>(s)  t = Concat<axis=0>(n, p)"""
    assert _target(body, opset=9) == [0, 4, 5]


def test_shape_start_attribute_opset15() -> None:
    # Shape<start=-2> of [2,N,4] = [N, 4]: N (dim 1) lands at position 0 -> -1
    body = "t = Shape<start=-2>(x)"
    assert _target(body, "float[2,N,4] x", opset=15) == [-1, 4]


def test_squeeze_and_unsqueeze_axes_inputs_opset13() -> None:
    body = """s = Shape(x)  p = Slice(s, z, one)  q = Squeeze(p, z)  u = Unsqueeze(q, z)
              t = Concat<axis=0>(u, c)"""
    consts = "int64[1] z = {0}, int64[1] one = {1}, int64[1] c = {60}"
    assert _target(body, consts=consts) == [0, 60]


def test_squeeze_attribute_opset11() -> None:
    body = """s = Shape(x)  p = Slice(s, z, one)  q = Squeeze<axes=[0]>(p)
              u = Unsqueeze<axes=[-1]>(q)  t = Concat<axis=0>(u, c)"""
    consts = "int64[1] z = {0}, int64[1] one = {1}, int64[1] c = {60}"
    assert _target(body, consts=consts, opset=11) == [0, 60]


def test_constant_nodes_with_value_ints() -> None:
    body = """s = Shape(x)  n = Slice(s, z, one)  c = Constant<value_ints=[3, 20]>()
              t = Concat<axis=0>(n, c)"""
    consts = "int64[1] z = {0}, int64[1] one = {1}"
    assert _target(body, consts=consts) == [0, 3, 20]


def test_broadcast_arithmetic_on_a_vector() -> None:
    # Shape [N,3,4,5] sliced to [3,4,5] times 2 -> [6, 8, 10]; N in front
    body = """s = Shape(x)  n = Slice(s, z, one)  p = Slice(s, one, e)  d = Mul(p, two)
              t = Concat<axis=0>(n, d)"""
    consts = "int64[1] z = {0}, int64[1] one = {1}, int64[1] e = {4}, int64 two = {2}"
    assert _target(body, consts=consts) == [0, 6, 8, 10]


def test_each_node_is_evaluated_once() -> None:
    # v doubles 40 times from 4 through a DAG of 40 Adds (2^40 paths without memoisation)
    lines = ["s = Shape(x)  n = Gather(s, i0)  v0 = Gather(s, i1)"]
    lines += [f"v{k + 1} = Add(v{k}, v{k})" for k in range(40)]
    lines.append("t = Concat<axis=0>(n, v40)")
    started = time.perf_counter()
    target = _target("  ".join(lines), "float[N,4] x", "int64[1] i0 = {0}, int64[1] i1 = {1}")
    assert target == [0, 4 * 2**40]
    assert time.perf_counter() - started < 5


def test_registered_as_an_expression_function() -> None:
    text = """
        <ir_version: 8, opset_import: ["" : 12]>
        g (float[N,6] x) => (float[?] z)
        <int64[1] i0 = {0}, int64[2] c = {2, 3}>
        { s = Shape(x)  n = Gather(s, i0)  t = Concat<axis=0>(n, c)  z = Reshape(x, t) }
    """
    model = ir.from_proto(onnx.parser.parse_model(text))
    reshape = next(n for n in model.graph if n.op_type == "Reshape")
    env = {"s": reshape.inputs[1], "x": reshape.inputs[0], "az": 0}
    value = expr.parse("runtime_shape_target(s, x, az)", env).evaluate(env)
    assert value.tolist() == [0, 2, 3]


# ----------------------------------------------------------------------------- refuses


@pytest.mark.parametrize(("inputs", "body", "consts", "allowzero", "why"), [
    # [M, N, 4] from x [N,M,4]: both dynamic dims move, two unknown entries
    ("float[N,M,4] x", "s = Shape(x)  m = Gather(s, i1)  n = Gather(s, i0)  "
     "t = Concat<axis=0>(m, n, c)", "int64[1] i0 = {0}, int64[1] i1 = {1}, int64[1] c = {4}",
     0, "more than one"),
    # allowzero=1: the copy of N becomes -1, and there is a literal -1 already
    ("float[N,3,4] x", "s = Shape(x)  p = Slice(s, b0, e1)  t = Concat<axis=0>(p, m)",
     "int64[1] b0 = {0}, int64[1] e1 = {1}, int64[1] m = {-1}", 1, "more than one"),
    # allowzero=1 with a literal 0 and a literal -1 is an invalid Reshape
    ("float[N,3] x", "s = Shape(x)  p = Slice(s, b0, e1)  t = Concat<axis=0>(zero, p, m)",
     "int64[1] b0 = {1}, int64[1] e1 = {2}, int64[1] zero = {0}, int64[1] m = {-1}", 1,
     "allowzero=1"),
    # [N, M*4] from x [N,M,4]: M*4 would be a -1 beside the copy of N, which fails when N is 0
    ("float[N,M,4] x", "s = Shape(x)  n = Slice(s, b0, e1)  m = Gather(s, e1)  f = Mul(m, c) "
     " t = Concat<axis=0>(n, f)", "int64[1] b0 = {0}, int64[1] e1 = {1}, int64[1] c = {4}", 0,
     "beside a 0 or a copied dim"),
    # the same beside a literal 0 (allowzero=1: an empty dim)
    ("float[N,3] x", "s = Shape(x)  p = Slice(s, b0, e1)  t = Concat<axis=0>(zero, p)",
     "int64[1] b0 = {0}, int64[1] e1 = {1}, int64[1] zero = {0}", 1, "beside a 0"),
    # the shape of another tensor with two dynamic dims
    ("float[N,M] x, float[M,N] y", "t = Shape(y)", "", 0, "more than one"),
    # a value below -1
    ("float[N,3] x", "s = Shape(x)  p = Slice(s, b0, e1)  t = Concat<axis=0>(p, m)",
     "int64[1] b0 = {0}, int64[1] e1 = {1}, int64[1] m = {-2}", 0, "-2"),
    # an op the evaluator does not know
    ("float[N,3] x", "s = Shape(x)  p = Slice(s, b0, e1)  q = Max(p, b0)  "
     "t = Concat<axis=0>(q, e1)", "int64[1] b0 = {0}, int64[1] e1 = {1}", 0, "Max"),
    # an op of another domain
    ("float[N,3] x", "s = Shape(x)  t = com.example.Id(s)", "", 0, "Id"),
    # the target itself is a graph input
    ("float[N,3] x, int64[2] t", "", "", 0, "graph input"),
    # Gather index out of range
    ("float[N,3] x", "s = Shape(x)  t = Gather(s, i)", "int64[1] i = {2}", 0, "out of range"),
    # Gather from a 2-D constant
    ("float[N,3] x", "t = Gather(c, i)", "int64[2,2] c = {1, 2, 3, 4}, int64[1] i = {0}", 0,
     "vector"),
    # Gather indices computed at run time
    ("float[N,3] x, int64[1] i", "s = Shape(x)  t = Gather(s, i)", "", 0, "not a constant"),
    # integer division by zero
    ("float[N,3] x", "s = Shape(x)  d = Gather(s, i)  t = Div(d, z)",
     "int64[1] i = {1}, int64[1] z = {0}", 0, "division by zero"),
    # int64 overflow
    ("float[N,3] x", "s = Shape(x)  d = Gather(s, i)  t = Mul(d, big)",
     "int64[1] i = {1}, int64[1] big = {4611686018427387904}", 0, "overflows"),
    # Cast of an infinite float (3 / 0.0) back to int64
    ("float[N,3] x", "s = Shape(x)  d = Gather(s, i)  f = Cast<to=1>(d)  q = Div(f, z)  "
     "t = Cast<to=7>(q)", "int64[1] i = {1}, float[1] z = {0.0}", 0, "non-finite"),
    # a Cast to no data type (a corrupt model: refused here, by onnxruntime later)
    ("float[N,3] x", "s = Shape(x)  t = Cast<to=999>(s)", "", 0, "unknown data type"),
    # an int32 target (Reshape wants int64)
    ("float[N,3] x", "s = Shape(x)  t = Cast<to=6>(s)", "", 0, "int64"),
    # Unsqueeze of a vector makes a matrix
    ("float[N,3] x", "s = Shape(x)  t = Unsqueeze(s, z)", "int64[1] z = {0}", 0, "scalar"),
    # Slice with step 0
    ("float[N,3] x", "s = Shape(x)  t = Slice(s, b, e, a, st)",
     "int64[1] b = {0}, int64[1] e = {2}, int64[1] a = {0}, int64[1] st = {0}", 0, "step"),
    # Add of int64 and int32
    ("float[N,3] x", "s = Shape(x)  a = Cast<to=6>(s)  t = Add(s, a)", "", 0, "INT32"),
])
def test_refuses(inputs: str, body: str, consts: str, allowzero: int, why: str) -> None:
    with pytest.raises(NoMatch, match=why):
        _target(body, inputs, consts, allowzero=allowzero)


def test_budget_bounds_a_long_chain() -> None:
    chain = [f"v{k + 1} = Add(v{k}, zero)" for k in range(MAX_SHAPE_NODES + 5)]
    body = "s = Shape(x)  n = Gather(s, i0)  v0 = Gather(s, i1)  " + "  ".join(chain) + \
        f"  t = Concat<axis=0>(n, v{MAX_SHAPE_NODES + 5})"
    consts = "int64[1] i0 = {0}, int64[1] i1 = {1}, int64[1] zero = {0}"
    with pytest.raises(NoMatch, match="more than 64 nodes"):
        _target(body, "float[N,4] x", consts)
    short = "s = Shape(x)  n = Gather(s, i0)  v0 = Gather(s, i1)  " + "  ".join(chain[:10]) + \
        "  t = Concat<axis=0>(n, v10)"
    assert _target(short, "float[N,4] x", consts) == [0, 4]


# ------------------------------------------------------------ same output on onnxruntime


@pytest.mark.parametrize(("opset", "inputs", "body", "consts"), [
    (11, "float[N,3,4,5] x", """s = Shape(x)  d0 = Gather(s, i0)  d2 = Gather(s, i2)
     d3 = Gather(s, i3)  hw = Mul(d2, d3)  u0 = Unsqueeze<axes=[0]>(d0)
     u1 = Unsqueeze<axes=[0]>(hw)  t = Concat<axis=0>(u0, c3, u1)""",
     "int64 i0 = {0}, int64 i2 = {2}, int64 i3 = {3}, int64[1] c3 = {3}"),
    # [2N, 3] -> [-1, 3]
    (13, "float[N,6] x", "s = Shape(x)  n = Gather(s, i0)  d = Mul(n, c2)  "
     "t = Concat<axis=0>(d, c3)", "int64[1] i0 = {0}, int64[1] c2 = {2}, int64[1] c3 = {3}"),
    (13, "float[2,N,4] x", "s = Shape(x)  p = Slice(s, b, e, a, st)  t = Concat<axis=0>(p, c)",
     "int64[1] b = {-1}, int64[1] e = {-9223372036854775807}, int64[1] a = {0}, "
     "int64[1] st = {-2}, int64[1] c = {-1}"),
    (14, "float[N,3,4] x", "s = Shape(x)  p = Slice(s, b0, e1)  t = Concat<axis=0>(p, c)",
     "int64[1] b0 = {0}, int64[1] e1 = {1}, int64[1] c = {12}"),
])
@pytest.mark.parametrize("batch", [0, 1, 3])
def test_same_output_on_onnxruntime(opset: int, inputs: str, body: str, consts: str,
                                    batch: int) -> None:
    """The constant target reshapes like the run-time one, for batch sizes 0 (an empty
    tensor: a -1 beside it could not be inferred), 1 and 3."""
    ort = pytest.importorskip("onnxruntime")
    allowzero = "<allowzero=1>" if opset >= 14 else ""
    text = f"""
        <ir_version: 7, opset_import: ["" : {opset}]>
        g ({inputs}) => (float[?] reshaped)
        <{consts}>
        {{ {body}  reshaped = Reshape{allowzero}(x, t) }}
    """
    proto = onnx.parser.parse_model(text)
    model = ir.from_proto(proto)
    reshape = next(n for n in model.graph if n.op_type == "Reshape")
    target = runtime_shape_target(reshape.inputs[1], reshape.inputs[0], 1 if allowzero else 0)
    folded = onnx.parser.parse_model(text)
    folded.graph.initializer.append(onnx.numpy_helper.from_array(target, "fixed_target"))
    folded.graph.node[-1].input[1] = "fixed_target"
    dims = [batch if d.dim_param else d.dim_value
            for d in proto.graph.input[0].type.tensor_type.shape.dim]
    x = np.arange(np.prod(dims), dtype=np.float32).reshape(dims)
    options = ort.SessionOptions()  # onnxruntime's own shape folding would hide the original
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    outputs = [ort.InferenceSession(m.SerializeToString(), options,
                                    providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
               for m in (proto, folded)]
    assert outputs[0].shape == outputs[1].shape
    np.testing.assert_array_equal(outputs[0], outputs[1])


# ------------------------------------------------------------ dims that say nothing


def _reshape_of(text: str) -> ir.Node:
    model = ir.from_proto(onnx.parser.parse_model(text))
    return next(n for n in model.graph if n.op_type == "Reshape")


DECLARED_OUTPUT = """
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[N,6] x) => (float[{dims}] y, float[?] z)
    {{ y = Relu(x)  t = Shape(y)  z = Reshape(x, t) }}
"""


@pytest.mark.parametrize("dims", ["2,6", "B,6"])
def test_a_graph_outputs_declared_dims_are_not_read(dims: str) -> None:
    """y = Relu(x) is [N,6] at run time whatever its declaration says (onnxruntime does not
    check it): read as [2,6], the target would be a constant that fails for any N but 2;
    read as [B,6], B would pass for a name of y's first dim."""
    reshape = _reshape_of(DECLARED_OUTPUT.format(dims=dims))
    assert shape_entries(reshape.inputs[1]) == (None, None)
    assert shape_entries(reshape.inputs[1], reshape.inputs[0]) == (None, None)
    with pytest.raises(NoMatch, match="more than one"):
        runtime_shape_target(reshape.inputs[1], reshape.inputs[0], 0)


PRESENT = """
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[B,4,P,8] past, float[B,4,S,8] new, float[C,4,S,8] other, float[N,6] x)
      => (float[B,4,T,8] present,
      float[?] z)
    {{ present = {producer}  t = Shape(present)  z = Reshape(x, t) }}
"""


@pytest.mark.parametrize(("producer", "entries"), [
    # a KV cache's present: its producer, not its declaration, tells all but the cache axis
    ("Concat<axis=2>(past, new)", (Named("B"), 4, None, 8)),
    ("Concat<axis=-2>(past, new)", (Named("B"), 4, None, 8)),
    ("Concat<axis=0>(past, past)", (None, 4, Named("P"), 8)),
    ("Relu(past)", (None, None, None, None)),  # any other producer: nothing
    # inputs that disagree: onnxruntime skips an empty past of another batch
    ("Concat<axis=2>(past, other)", (None, 4, None, 8)),
])
def test_a_graph_output_tells_what_its_concat_keeps(producer: str, entries: tuple) -> None:
    reshape = _reshape_of(PRESENT.format(producer=producer))
    assert shape_entries(reshape.inputs[1]) == entries


MINTED = """
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[N,6] x, float[M,6] h) => (float[?] z)
    <int64[1] i0 = {0}, int64[1] c = {6}>
    { v = Relu(h)  s = Shape(v)  d = Gather(s, i0)  t = Concat<axis=0>(d, c)
       z = Reshape(x, t) }
"""


def test_a_minted_symbol_is_no_named_dim() -> None:
    """onnx's inference mints ``unk__3`` for a dim it cannot compute: a fresh symbol, which
    another inference (another pass, another model) may give to a dim of another size, so
    it names nothing; ``M``, a name the model gave, does."""
    reshape = _reshape_of(MINTED)
    values = {out.name: out for node in reshape.graph for out in node.outputs}
    for dim, entry in (("unk__3", None), ("M", Named("M"))):
        values["v"].shape = ir.Shape([dim, 6])
        assert shape_entries(values["t"]) == (entry, 6)
        assert dim_name(values["d"]) == (None if entry is None else "M")
