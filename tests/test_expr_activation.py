"""Tests for the expression functions of the activation rules (rules/40-activation.yaml):
near, is_scalar_const, same_rank and single_axis; and for the forms that only the rules of
that file together turn into one op (each rule alone is covered by its embedded tests)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from values import const
from values import dynamic as _dynamic
from values import evaluate as ev

import fusectl
from fusectl import expr
from fusectl.expr import NoMatch

F = expr.FUNCTIONS
RULES = Path(__file__).resolve().parent.parent / "rules" / "40-activation.yaml"


def _const(name: str, array: Any, dtype: Any = np.float32) -> ir.Value:
    return const(name, np.asarray(array, dtype=dtype))








# ------------------------------------------------------------------------------ near


def test_near_float32_constant_within_1e_5() -> None:
    assert F["near"](_const("c", 1.4142135), 1.4142135623730951) is True
    assert F["near"](_const("c", [0.044715]), 0.044715) is True
    assert F["near"](_const("c", 1.41421), 1.4142135623730951) is True  # 2.5e-6 off
    assert F["near"](_const("c", 1.4141), 1.4142135623730951) is False  # 8e-5 off
    assert F["near"](_const("c", 0.6), 0.5) is False


def test_near_allows_the_rounding_of_float16_constants() -> None:
    # float16 stores sqrt(2) as 1.4140625 (1.1e-4 off) and 0.044715 1.5e-4 off.
    sqrt2 = _const("c", 1.4142135623730951, np.float16)
    assert float(sqrt2.const_value.numpy()) == 1.4140625
    assert F["near"](sqrt2, 1.4142135623730951) is True
    assert F["near"](_const("k", 0.044715, np.float16), 0.044715) is True
    assert F["near"](_const("h", 1 / 6, np.float16), 1 / 6) is True
    # ... but not a different constant: 0.5 vs 0.6, 0.2 vs 1/6, 0.05 vs 0.044715.
    assert F["near"](_const("h", 0.6, np.float16), 0.5) is False
    assert F["near"](_const("a", 0.2, np.float16), 1 / 6) is False
    assert F["near"](_const("k", 0.05, np.float16), 0.044715) is False


def test_near_bfloat16_uses_its_own_precision() -> None:
    k = _const("k", 0.044715, ml_dtypes.bfloat16)
    assert F["near"](k, 0.044715) is True
    assert F["near"](_const("h", 0.6, ml_dtypes.bfloat16), 0.5) is False


def test_near_plain_numbers_use_the_float32_tolerance() -> None:
    # Attribute values (HardSigmoid alpha) come as Python floats.
    assert F["near"](0.1666666716, 1 / 6) is True
    assert F["near"](np.float16(1.4140625), 1.4142135623730951) is False
    assert F["near"](0.0, 0.0) is True
    assert F["near"](1e-9, 0.0) is False


def test_near_needs_one_constant_value() -> None:
    with pytest.raises(NoMatch, match="2 values"):
        F["near"](_const("c", [0.5, 0.5]), 0.5)
    with pytest.raises(NoMatch, match="not a constant"):
        F["near"](_dynamic("x", [2]), 0.5)
    with pytest.raises(NoMatch):
        F["near"](None, 0.5)


def test_near_in_an_expression() -> None:
    c, r = _const("c", 1.4142135), None
    source = "(c is None or near(c, 1.4142135623730951)) and (r is None or near(r, 0.7071))"
    assert ev(source, c=c, r=r) is True
    assert ev(source, c=None, r=_const("r", 0.7071)) is True
    assert ev(source, c=None, r=_const("r", 1.4142135)) is False


# ---------------------------------------------------------------- is_scalar_const


def test_is_scalar_const() -> None:
    assert F["is_scalar_const"](_const("a", 0.5), _const("b", [3.0]), _const("c", [[2.0]]))
    assert F["is_scalar_const"]() is True
    assert F["is_scalar_const"](None, _const("b", 1.0), None) is True  # absent optional inputs
    assert F["is_scalar_const"](_const("a", [0.5, 0.5])) is False
    assert F["is_scalar_const"](_const("a", 0.5), _dynamic("x", [1])) is False
    assert F["is_scalar_const"](_const("n", 3, np.int64)) is True


def test_is_scalar_const_does_not_trust_overridable_initializers() -> None:
    value = _const("a", 0.5)
    graph = ir.Graph(inputs=[value], outputs=[value], nodes=[], name="g")
    assert graph.inputs[0] is value and value.is_graph_input()
    assert F["is_scalar_const"](value) is False


# ----------------------------------------------------------------------- same_rank


def test_same_rank_accepts_unknown_and_symbolic_dims() -> None:
    x = _dynamic("x", ["N", None, 8])
    z = _dynamic("z", [None, None, None])
    assert F["same_rank"](z, x) is True
    assert F["same_rank"](_dynamic("y", [1, "N", None, 8]), x) is False
    assert F["same_rank"](_const("c", [[1.0]]), _dynamic("w", [3, 4])) is True
    assert F["same_rank"](np.zeros((2, 3)), _dynamic("w", [3, 4])) is True


def test_same_rank_of_an_unknown_rank_is_no_match() -> None:
    with pytest.raises(NoMatch, match="shape of x is unknown"):
        F["same_rank"](_dynamic("x", None), _dynamic("z", [2]))
    with pytest.raises(NoMatch):
        F["same_rank"](None, _dynamic("z", [2]))


# --------------------------------------------------------------------- single_axis


@pytest.mark.parametrize(("axes", "axis"), [(_const("a", [-1], np.int64), 2),
                                            (_const("a", [1], np.int64), 1),
                                            (_const("a", 0, np.int64), 0),
                                            ([-3], 0), ([2], 2), (-2, 1)])
def test_single_axis_normalizes(axes: Any, axis: int) -> None:
    assert F["single_axis"](axes, _dynamic("x", ["N", None, 8])) == axis


@pytest.mark.parametrize("axes", [None, [], [1, 2], _const("a", [0, 1], np.int64), [3], [-4],
                                  _const("f", [1.0])])
def test_single_axis_rejects_other_reductions(axes: Any) -> None:
    with pytest.raises(NoMatch):
        F["single_axis"](axes, _dynamic("x", [2, 3, 4]))


def test_single_axis_needs_a_known_rank_and_constant_axes() -> None:
    with pytest.raises(NoMatch, match="unknown"):
        F["single_axis"]([0], _dynamic("x", None))
    with pytest.raises(NoMatch, match="not a constant"):
        F["single_axis"](_dynamic("axes", [1]), _dynamic("x", [2, 3]))


def test_single_axis_in_an_expression() -> None:
    x = _dynamic("x", [2, 4, 8])
    source = "max_axes is None or single_axis(max_axes, x) == single_axis(axes, x)"
    axes = _const("axes", [-1], np.int64)
    assert ev(source, max_axes=[2], axes=axes, x=x) is True
    assert ev(source, max_axes=None, axes=axes, x=x) is True
    assert ev(source, max_axes=[1], axes=axes, x=x) is False


# ------------------------------------------------ forms only the rules together fuse


def _optimize(text: str) -> tuple[Counter[str], fusectl.OptimizeResult]:
    rules = fusectl.load_rule_set([RULES], builtin=False)
    model = ir.from_proto(onnx.parser.parse_model(text))
    result = fusectl.optimize(model, rules=rules)
    assert result.validation is not None and result.validation.passed
    ops = Counter(n.op_type for n in result.model.graph)
    return ops, result


def test_torchscript_tanh_gelu_via_cube_to_pow() -> None:
    ops, result = _optimize("""
        <ir_version: 9, opset_import: ["" : 20]>
        g (float[2,16] x) => (float[2,16] z)
        <float k = {0.044715}, float s = {0.7978845608028654}, float one = {1.0},
         float half = {0.5}>
        {
          sq = Mul(x, x)  cube = Mul(x, sq)  m = Mul(k, cube)  inner = Add(x, m)
          u = Mul(s, inner)  t = Tanh(u)  h = Add(one, t)  a = Mul(x, h)  z = Mul(half, a)
        }""")
    assert ops == Counter({"Gelu": 1})
    assert result.rewrite.counts() == {"cube-to-pow": 1, "gelu-tanh": 1}


def test_fast_gelu_via_unfactor() -> None:
    ops, result = _optimize("""
        <ir_version: 9, opset_import: ["" : 20]>
        g (float[2,16] x) => (float[2,16] z)
        <float k = {0.044715}, float s = {0.7978845608}, float one = {1.0}, float half = {0.5}>
        {
          xs = Mul(x, s)  kx = Mul(x, k)  kxx = Mul(kx, x)  p = Add(kxx, one)  u = Mul(xs, p)
          t = Tanh(u)  h = Add(t, one)  a = Mul(x, half)  z = Mul(a, h)
        }""")
    assert ops == Counter({"Gelu": 1})
    assert result.rewrite.counts() == {"gelu-tanh-unfactor": 1, "gelu-tanh": 1}


def test_hardswish_from_min_max_relu6() -> None:
    ops, _ = _optimize("""
        <ir_version: 8, opset_import: ["" : 14]>
        g (float[2,16] x0) => (float[2,16] z)
        <float sc = {8.0}, float three = {3.0}, float zero = {0.0}, float six = {6.0}>
        {
          x = Mul(x0, sc)  a = Add(x, three)  lo = Max(a, zero)  r = Min(lo, six)
          p = Mul(x, r)  z = Div(p, six)
        }""")
    assert ops == Counter({"Mul": 1, "HardSwish": 1})


def test_hardswish_from_x_times_hard_sigmoid() -> None:
    ops, result = _optimize("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,16] x0) => (float[2,16] z)
        <float sc = {8.0}, float three = {3.0}, float zero = {0.0}, float six = {6.0}>
        {
          x = Mul(x0, sc)  a = Add(three, x)  r = Clip(a, zero, six)  hs = Div(r, six)
          z = Mul(hs, x)
        }""")
    assert ops == Counter({"Mul": 1, "HardSwish": 1})
    assert result.rewrite.counts() == {"hardsigmoid-relu6": 1, "hardswish-from-hardsigmoid": 1}


def test_mish_from_log_exp_via_softplus() -> None:
    ops, result = _optimize("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[2,16] x) => (float[2,16] z)
        <float one = {1.0}>
        { e = Exp(x)  s = Add(e, one)  sp = Log(s)  t = Tanh(sp)  z = Mul(x, t) }""")
    assert ops == Counter({"Mish": 1})
    assert sum(result.rewrite.counts().values()) in (1, 2)


def test_stable_softmax_is_taken_whole() -> None:
    ops, result = _optimize("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[2,4,8] x) => (float[2,4,8] z)
        <int64[1] axes = {-1}>
        {
          m = ReduceMax(x, axes)  d = Sub(x, m)  e = Exp(d)  s = ReduceSum(e, axes)
          z = Div(e, s)
        }""")
    assert ops == Counter({"Softmax": 1})
    assert result.rewrite.counts() == {"softmax-stable": 1}


def test_relu_then_relu6_written_with_max_min() -> None:
    ops, _ = _optimize("""
        <ir_version: 8, opset_import: ["" : 13]>
        g (float[2,16] x0) => (float[2,16] z)
        <float sc = {8.0}, float zero = {0.0}, float six = {6.0}>
        { x = Mul(x0, sc)  r = Relu(x)  lo = Max(r, zero)  z = Min(lo, six) }""")
    assert ops == Counter({"Mul": 1, "Clip": 1})
