"""Tests for the expression functions of the cleanup and elementwise rules
(rules/05-cleanup.yaml, rules/45-elementwise.yaml): is_graph_output, casts_exactly,
broadcast_shape, slice_is_full, fits_dtype, values_fit_exactly, cast_like and num_outputs."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest
from values import const as _const
from values import dynamic as _dynamic
from values import evaluate as ev

from fusectl import expr
from fusectl.expr import NoMatch, parse

F = expr.FUNCTIONS








# ------------------------------------------------------------------- is_graph_output


def test_is_graph_output() -> None:
    x = _dynamic("x", [2])
    node = ir.Node("", "Relu", [x], num_outputs=1)
    inner = node.outputs[0]
    last = ir.Node("", "Neg", [inner], num_outputs=1)
    ir.Graph(inputs=[x], outputs=[last.outputs[0]], nodes=[node, last], name="g")
    assert F["is_graph_output"](last.outputs[0]) is True
    assert F["is_graph_output"](inner) is False
    assert F["is_graph_output"](x) is False
    with pytest.raises(NoMatch):
        F["is_graph_output"](None)
    assert ev("not is_graph_output(y)", y=inner) is True


# ---------------------------------------------------------------------- casts_exactly

EXACT = [
    ("float32", "float64"),
    ("float16", "float32"),
    ("float16", "float64"),
    ("bfloat16", "float32"),
    ("int8", "float16"),
    ("uint8", "float16"),
    ("uint8", "bfloat16"),
    ("int8", "int16"),
    ("uint8", "int16"),
    ("uint16", "int32"),
    ("int16", "float32"),
    ("int32", "int64"),
    ("int32", "float64"),
    ("uint32", "int64"),
    ("bool", "int8"),
    ("bool", "float16"),
    ("float32", "float32"),
]
LOSSY = [
    ("float32", "float16"),
    ("float32", "bfloat16"),
    ("float64", "float32"),
    ("float16", "bfloat16"),
    ("bfloat16", "float16"),
    ("int16", "float16"),
    ("int32", "float32"),
    ("int64", "float64"),
    ("uint64", "int64"),
    ("int8", "uint8"),
    ("int8", "uint64"),
    ("int64", "int32"),
    ("float32", "int64"),
    ("float16", "bool"),
    ("int8", "bool"),
    ("float32", "float8_e4m3fn"),
    ("string", "float32"),
]


@pytest.mark.parametrize(("src", "dst"), EXACT)
def test_casts_exactly_true(src: str, dst: str) -> None:
    assert F["casts_exactly"](src, dst) is True


@pytest.mark.parametrize(("src", "dst"), LOSSY)
def test_casts_exactly_false(src: str, dst: str) -> None:
    assert F["casts_exactly"](src, dst) is False


def _dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _every_value(name: str) -> np.ndarray:
    """Every value of an 8- or 16-bit dtype (floats through their bit patterns)."""
    dtype = _dtype(name)
    if dtype.kind == "b":
        return np.array([False, True])
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.arange(int(info.min), int(info.max) + 1).astype(dtype)
    bits = np.arange(2 ** (8 * dtype.itemsize), dtype=np.uint64).astype(f"uint{8 * dtype.itemsize}")
    values = bits.view(dtype)
    with np.errstate(invalid="ignore"):
        return values[~np.isnan(values.astype(np.float64))]


SMALL = ["bool", "int8", "uint8", "int16", "uint16", "float16", "bfloat16"]
TARGETS = ["int8", "uint8", "int16", "uint16", "int32", "int64", "float16", "bfloat16",
           "float32", "float64"]


@pytest.mark.parametrize("src", SMALL)
def test_casts_exactly_agrees_with_numpy_round_trips(src: str) -> None:
    """For every small dtype: the answer is True exactly when every value survives
    src -> dst -> src in numpy (ints compared as ints, floats bit for bit)."""
    values = _every_value(src)
    for dst in TARGETS:
        if dst == src:
            continue
        with np.errstate(all="ignore"):
            there = values.astype(_dtype(dst))
            back = there.astype(_dtype(src))
            exact = bool(np.all(there.astype(np.float64) == values.astype(np.float64)))
            exact = exact and bool(np.array_equal(back, values))
        assert F["casts_exactly"](src, dst) is exact, (src, dst)


def test_casts_exactly_takes_codes_and_values() -> None:
    assert F["casts_exactly"](1, 11) is True  # FLOAT -> DOUBLE
    assert F["casts_exactly"](1, 10) is False  # FLOAT -> FLOAT16
    assert F["casts_exactly"](16, 1) is True  # BFLOAT16 -> FLOAT
    x16 = _dynamic("x", [2], ir.DataType.FLOAT16)
    assert F["casts_exactly"](x16, "float32") is True
    assert ev("casts_exactly(dtype(x), 'float64')", x=x16) is True
    with pytest.raises(NoMatch):
        F["casts_exactly"](12345, 1)
    with pytest.raises(NoMatch):
        F["casts_exactly"](None, "float32")


# -------------------------------------------------------------------- broadcast_shape


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ((2, 3), [2, 3], (2, 3)),
        ((2, 3), [3], (2, 3)),
        ((2, 3), [1], (2, 3)),
        ((2, 1), [3], (2, 3)),
        ((3,), [2, 1], (2, 3)),
        (("N", 3), [1, 3], ("N", 3)),
        (("N", 3), ["N", 1], ("N", 3)),
        ((), [4], (4,)),
        ((2, 3), [], (2, 3)),
        ((1, 3), np.array([2, 3], np.int64), (2, 3)),
    ],
)
def test_broadcast_shape(a: Any, b: Any, expected: tuple) -> None:
    assert F["broadcast_shape"](a, b) == expected


@pytest.mark.parametrize(
    ("a", "b"),
    [((2, 3), [4, 3]), (("N", 3), [4, 3]), (("N",), ["M"]), ((2,), [-1]), ((2,), [[1, 2]])],
)
def test_broadcast_shape_no_match(a: Any, b: Any) -> None:
    with pytest.raises(NoMatch):
        F["broadcast_shape"](a, b)


def test_expand_is_a_no_op_expression() -> None:
    source = "broadcast_shape(shape(x), s) == shape(x)"
    x = _dynamic("x", ["N", 3])
    assert ev(source, x=x, s=_const("s", np.array([1, 3], np.int64))) is True
    assert ev(source, x=x, s=_const("s", np.array([3], np.int64))) is True
    assert ev(source, x=x, s=_const("s", np.array([1, 1, 3], np.int64))) is False
    with pytest.raises(NoMatch):
        ev(source, x=x, s=_const("s", np.array([5, 3], np.int64)))


# ---------------------------------------------------------------------- slice_is_full

BIG = 2**63 - 1


@pytest.mark.parametrize(
    ("dims", "starts", "ends", "axes", "steps", "full"),
    [
        ([2, 5], [0], [BIG], [1], None, True),
        ([2, 5], [0, 0], [2, 5], None, None, True),
        ([2, 5], [-5], [100], [-1], [1], True),
        ([2, 5], [-100], [5], [1], [1], True),
        ([2, 5], [1], [BIG], [1], None, False),
        ([2, 5], [0], [4], [1], None, False),
        ([2, 5], [0], [-1], [1], None, False),
        ([2, 5], [0], [BIG], [1], [2], False),
        ([2, 5], [-1], [-BIG], [1], [-1], False),
        (["N", 5], [0], [BIG], [0], None, True),
        (["N", 5], [0], [2**31 - 1], [0], None, True),
        (["N", 5], [0], [1000], [0], None, False),
        (["N", 5], [1], [BIG], [0], None, False),
        ([0, 5], [0], [BIG], [0], None, True),
    ],
)
def test_slice_is_full(dims: list, starts: list, ends: list, axes: list | None,
                       steps: list | None, full: bool) -> None:
    x = _dynamic("x", dims)
    assert F["slice_is_full"](x, starts, ends, axes, steps) is full


@pytest.mark.parametrize(
    ("dims", "starts", "ends", "axes"),
    [
        ([2, 5], [0], [5], [2]),  # axis out of range
        ([2, 5], [0, 0], [5, 5], [1, -1]),  # repeated axis
        ([2, 5], [0, 0], [5], [1]),  # lengths differ
        ([None, 5], [0], [BIG], [0]),  # unknown dim
    ],
)
def test_slice_is_full_no_match(dims: list, starts: list, ends: list, axes: list) -> None:
    with pytest.raises(NoMatch):
        F["slice_is_full"](_dynamic("x", dims), starts, ends, axes)


def test_slice_is_full_on_constant_inputs() -> None:
    x = _dynamic("x", [3, 4])
    starts = _const("st", np.array([0], np.int64))
    ends = _const("en", np.array([BIG], np.int64))
    axes = _const("ax", np.array([-2], np.int64))
    assert ev("slice_is_full(x, st, en, ax, None)", x=x, st=starts, en=ends, ax=axes) is True
    with pytest.raises(NoMatch):  # float "starts" are not a slice
        F["slice_is_full"](x, _const("st", np.array([0.0], np.float32)), ends, axes)


# ------------------------------------------------------------------------- fits_dtype


def test_fits_dtype() -> None:
    x16 = _dynamic("x", [2], ir.DataType.FLOAT16)
    x32 = _dynamic("x", [2], ir.DataType.FLOAT)
    assert F["fits_dtype"](np.array([300.0 * 200.0]), x16) is True
    assert F["fits_dtype"](np.array([300.0 * 300.0]), x16) is False
    assert F["fits_dtype"](np.array([300.0 * 300.0]), x32) is True
    assert F["fits_dtype"](np.array([1.0, np.inf]), x32) is False
    assert F["fits_dtype"](np.array([np.nan]), "float64") is False
    assert F["fits_dtype"](np.array([1e39]), "bfloat16") is False
    assert F["fits_dtype"](2.5, "float32") is True
    assert F["fits_dtype"](np.array([127, -128]), "int8") is True
    assert F["fits_dtype"](np.array([128]), "int8") is False
    assert F["fits_dtype"](np.array([1.5]), "int32") is False
    assert F["fits_dtype"](np.array([1.0]), "string") is False
    a = _const("a", np.array([400.0], np.float16))
    b = _const("b", np.array([300.0], np.float16))
    assert ev("fits_dtype(a * b, x)", a=a, b=b, x=x16) is False
    assert ev("fits_dtype(a / b, x)", a=a, b=b, x=x16) is True


# --------------------------------------------------------- values_fit_exactly, cast_like


def test_values_fit_exactly() -> None:
    x16 = _dynamic("x", [2], ir.DataType.FLOAT16)
    assert F["values_fit_exactly"](np.array([1.0, 0.5, 3.0, -2048.0], np.float32), x16) is True
    assert F["values_fit_exactly"](np.array([1.0, 0.1], np.float32), x16) is False  # rounds
    assert F["values_fit_exactly"](np.array([1e6], np.float32), x16) is False  # overflows
    assert F["values_fit_exactly"](np.array([1e-8], np.float32), x16) is False  # flushes
    assert F["values_fit_exactly"](np.array([2049.0], np.float32), "float16") is False
    assert F["values_fit_exactly"](np.array([0.1], np.float32), "float64") is True
    assert F["values_fit_exactly"](np.array([127, -128]), "int8") is True
    assert F["values_fit_exactly"](np.array([128]), "int8") is False
    assert F["values_fit_exactly"](np.array([1.5]), "int32") is False
    s = _const("s", np.array([0.75, 1.25], np.float32))
    assert ev("values_fit_exactly(s, x)", s=s, x=x16) is True


def test_cast_like_fixes_the_dtype_of_a_let_array() -> None:
    x16 = _dynamic("x", [2], ir.DataType.FLOAT16)
    s = _const("s", np.array([0.75, 1.25], np.float32))
    out = F["cast_like"](s, x16)
    assert out.dtype == np.float16 and out.tolist() == [0.75, 1.25]
    assert F["cast_like"](np.array([2.5]), 7).dtype == np.int64  # an ONNX dtype code
    # a let reading the float32 scale first would be typed float32 (compile._typed): the
    # explicit cast, also inside a conditional, keeps float16
    assert parse("cast_like(s, x)", {"s", "x"}).explicit_dtype
    assert parse("None if s is None else cast_like(s, x)", {"s", "x"}).explicit_dtype
    assert not parse("None if s is None else s", {"s"}).explicit_dtype
    assert not parse("cast_like(s, x) * 2", {"s", "x"}).explicit_dtype


# ------------------------------------------------------------------------ num_outputs


def test_num_outputs_counts_present_outputs() -> None:
    x = _dynamic("x", [2, 4, 3])
    stats = [_const(n, np.ones(4, np.float32)) for n in ("s", "b", "m", "v")]
    node = ir.Node("", "BatchNormalization", [x, *stats], num_outputs=3)
    node.outputs[0].name, node.outputs[1].name, node.outputs[2].name = "y", "", "rv"
    assert F["num_outputs"](node.outputs[0]) == 2
    single = ir.Node("", "BatchNormalization", [x, *stats], num_outputs=1)
    assert ev("num_outputs(y) == 1", y=single.outputs[0]) is True
    with pytest.raises(NoMatch):
        F["num_outputs"](x)  # a graph input has no producer
    with pytest.raises(NoMatch):
        F["num_outputs"](3)


def test_functions_are_registered() -> None:
    for name in ("is_graph_output", "casts_exactly", "broadcast_shape", "slice_is_full",
                 "fits_dtype", "num_outputs"):
        assert name in expr.FUNCTIONS
        parse(f"{name}(a, b)", ["a", "b"])
