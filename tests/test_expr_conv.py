"""Tests for the conv-family expression functions of fusectl.expr.

Each function is checked against a brute-force reference: a direct numpy convolution
(grouped, strided, padded) and average pooling, so a fold computed with these functions
must give the same numbers as running the original ops.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir
import pytest
from values import const as _const

from fusectl import expr
from fusectl.expr import NoMatch, parse, symbolic_quotient

F = expr.FUNCTIONS
RNG = np.random.default_rng(7)


def conv(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None, *, group: int = 1,
         stride: int = 1, pad: int = 0) -> np.ndarray:
    """Direct N-d convolution of one image x [C_in, *S] with w [C_out, C_in/group, *K]."""
    c_in, spatial = x.shape[0], x.shape[1:]
    if pad:
        x = np.pad(x, [(0, 0)] + [(pad, pad)] * len(spatial))
    c_out, per_group, kernel = w.shape[0], w.shape[1], w.shape[2:]
    assert c_in == per_group * group
    out_shape = [(s + 2 * pad - k) // stride + 1 for s, k in zip(spatial, kernel, strict=True)]
    out = np.zeros([c_out, *out_shape])
    outs_per_group = c_out // group
    for o in range(c_out):
        first = (o // outs_per_group) * per_group
        for pos in itertools.product(*[range(n) for n in out_shape]):
            window = tuple(slice(p * stride, p * stride + k) for p, k in zip(pos, kernel,
                                                                             strict=True))
            out[(o, *pos)] = np.sum(x[(slice(first, first + per_group), *window)] * w[o])
    if b is not None:
        out += np.asarray(b).reshape([-1] + [1] * len(out_shape))
    return out


def avgpool(x: np.ndarray, k: list[int]) -> np.ndarray:
    """Average pool with kernel = stride k, no padding, floor mode."""
    out_shape = [s // kk for s, kk in zip(x.shape[1:], k, strict=True)]
    out = np.zeros([x.shape[0], *out_shape])
    for pos in itertools.product(*[range(n) for n in out_shape]):
        window = tuple(slice(p * kk, (p + 1) * kk) for p, kk in zip(pos, k, strict=True))
        out[(slice(None), *pos)] = x[(slice(None), *window)].mean(axis=tuple(range(1, x.ndim)))
    return out




# ---------------------------------------------------------------------- group_channels


@pytest.mark.parametrize("group", [1, 2, 3, 6])
def test_group_channels_conv_scales_input_channels(group: int) -> None:
    """W * group_channels(a, W, g) is the Conv of x * a (a per input channel)."""
    c_in, c_out = 6, 6
    w = RNG.normal(size=(c_out, c_in // group, 3, 3))
    x = RNG.normal(size=(c_in, 5, 5))
    a = RNG.uniform(0.5, 2.0, c_in)
    folded = w * F["group_channels"](a, w, group)
    expected = conv(x * a[:, None, None], w, group=group, pad=1)
    np.testing.assert_allclose(conv(x, folded, group=group, pad=1), expected, rtol=1e-10)


def test_group_channels_convtranspose_layout() -> None:
    """ConvTranspose weight [C_in, C_out/g]: entry [i, j] reaches output channel
    (i // (C_in/g)) * (C_out/g) + j."""
    c_in, per_group_out, group = 4, 3, 2
    w = np.zeros((c_in, per_group_out, 1, 1))
    s = np.arange(per_group_out * group, dtype=float) + 10
    laid = F["group_channels"](s, w, group)
    assert laid.shape == (4, 3, 1, 1)
    for i, j in itertools.product(range(c_in), range(per_group_out)):
        assert laid[i, j, 0, 0] == s[(i // (c_in // group)) * per_group_out + j]


def test_group_channels_refuses_mismatches() -> None:
    w = np.zeros((6, 2, 3, 3))
    with pytest.raises(NoMatch):
        F["group_channels"](np.ones(5), w, 3)  # 6 channels expected
    with pytest.raises(NoMatch):
        F["group_channels"](np.ones(8), w, 4)  # 6 rows do not split into 4 groups
    with pytest.raises(NoMatch):
        F["group_channels"](np.ones(2), np.zeros((2, 2)), 1)  # not a conv weight
    with pytest.raises(NoMatch):
        F["group_channels"](np.ones(2), np.zeros((2, 1, 3)), 0)


# --------------------------------------------------------------------- conv_shift_bias


@pytest.mark.parametrize(("group", "rank"), [(1, 2), (2, 2), (4, 2), (1, 1), (2, 3)])
def test_conv_shift_bias_is_the_shift_of_an_unpadded_conv(group: int, rank: int) -> None:
    c_in, c_out = 4, 8
    kernel = (3, 2, 2)[:rank]
    w = RNG.normal(size=(c_out, c_in // group, *kernel))
    x = RNG.normal(size=(c_in, *(5,) * rank))
    a = RNG.normal(size=c_in)
    shifted = conv(x + a.reshape([-1] + [1] * rank), w, group=group, stride=2)
    bias = F["conv_shift_bias"](w, a, group)
    np.testing.assert_allclose(conv(x, w, bias, group=group, stride=2), shifted, rtol=1e-10)


def test_conv_shift_bias_refuses_a_wrong_vector() -> None:
    with pytest.raises(NoMatch):
        F["conv_shift_bias"](np.zeros((4, 2, 1, 1)), np.ones(3), 1)


# ------------------------------------------------------------------------ dense_weight


@pytest.mark.parametrize("group", [1, 2, 4])
def test_dense_weight_computes_the_grouped_conv(group: int) -> None:
    w = RNG.normal(size=(8, 4 // group, 3, 3))
    x = RNG.normal(size=(4, 5, 5))
    dense = F["dense_weight"](w, group)
    assert dense.shape == (8, 4, 3, 3)
    np.testing.assert_allclose(conv(x, dense), conv(x, w, group=group), rtol=1e-10)


def test_dense_weight_refuses_a_bad_group() -> None:
    with pytest.raises(NoMatch):
        F["dense_weight"](np.zeros((6, 1, 1, 1)), 4)


# ------------------------------------------------------------------------ conv_compose


@pytest.mark.parametrize("group", [1, 2])
def test_conv_compose_is_a_1x1_conv_after_a_conv(group: int) -> None:
    w1 = RNG.normal(size=(6, 4 // group, 3, 3))
    w2 = RNG.normal(size=(5, 6, 1, 1))
    x = RNG.normal(size=(4, 6, 6))
    merged = F["conv_compose"](w2, w1, group)
    assert merged.shape == (5, 4, 3, 3)
    expected = conv(conv(x, w1, group=group, pad=1, stride=2), w2)
    np.testing.assert_allclose(conv(x, merged, pad=1, stride=2), expected, rtol=1e-10)


def test_conv_compose_refuses_non_1x1_or_mismatched_channels() -> None:
    with pytest.raises(NoMatch):
        F["conv_compose"](np.zeros((5, 6, 3, 3)), np.zeros((6, 4, 3, 3)), 1)
    with pytest.raises(NoMatch):
        F["conv_compose"](np.zeros((5, 7, 1, 1)), np.zeros((6, 4, 3, 3)), 1)
    with pytest.raises(NoMatch):
        F["conv_compose"](np.zeros((5, 6, 1)), np.zeros((6, 4, 3, 3)), 1)


# -------------------------------------------------------------------------- box_filter


@pytest.mark.parametrize(("kernel", "pool", "pad"), [((3, 3), [2, 2], 1), ((1, 1), [2, 2], 0),
                                                      ((3, 2), [3, 2], 0), ((2,), [3], 0)])
def test_box_filter_is_conv_then_tiling_average_pool(kernel: tuple[int, ...], pool: list[int],
                                                    pad: int) -> None:
    w = RNG.normal(size=(3, 2, *kernel))
    x = RNG.normal(size=(2, *(9,) * len(kernel)))
    merged = F["box_filter"](w, pool)
    assert merged.shape[2:] == tuple(k + p - 1 for k, p in zip(kernel, pool, strict=True))
    expected = avgpool(conv(x, w, pad=pad), pool)
    if len(set(pool)) == 1:
        got = conv(x, merged, stride=pool[0], pad=pad)
        np.testing.assert_allclose(got, expected, rtol=1e-10)
    # per-axis strides: check one output pixel by hand (the reference conv takes one stride)
    origin = tuple(slice(0, k) for k in merged.shape[2:])
    padded = np.pad(x, [(0, 0)] + [(pad, pad)] * len(kernel))
    first = np.array([np.sum(padded[(slice(None), *origin)] * merged[o]) for o in range(3)])
    np.testing.assert_allclose(first, expected[(slice(None), *(0,) * len(kernel))], rtol=1e-10)


def test_box_filter_refuses_a_rank_mismatch_and_huge_windows() -> None:
    with pytest.raises(NoMatch):
        F["box_filter"](np.zeros((1, 1, 3, 3)), [2])
    with pytest.raises(NoMatch):
        F["box_filter"](np.zeros((1, 1, 3, 3)), [0, 2])
    with pytest.raises(NoMatch):
        F["box_filter"](np.zeros((1, 1, 3, 3)), [100, 100])


# ------------------------------------------------------------------------ spatial_pads


def test_spatial_pads_from_pad_inputs() -> None:
    assert F["spatial_pads"]([0, 0, 1, 2, 0, 0, 3, 4], 4) == [1, 2, 3, 4]
    assert F["spatial_pads"](np.array([2, 0, 1, 1]), 4, np.array([-2, 3])) == [2, 0, 1, 1]
    assert F["spatial_pads"]([5, 6], 3, [2]) == [5, 6]
    assert F["spatial_pads"]([0, 0, 0, 0, 0, 0], 3, None) == [0, 0]


@pytest.mark.parametrize(("pads", "rank", "axes"), [
    ([0, 1, 0, 0, 0, 0, 0, 0], 4, None),  # channel axis
    ([1, 0, 0, 0, 0, 0, 0, 0], 4, None),  # batch axis
    ([0, 0, -1, 0, 0, 0, 0, 0], 4, None),  # crop
    ([0, 0, 1, 1], 4, None),  # wrong length
    ([1, 1], 4, [1]),  # channel axis through axes
    ([1, 1, 1, 1], 4, [2, 2]),  # repeated axis
    ([1, 1], 4, [4]),  # out of range
    ([1, 1], 2, [1]),  # no spatial axis at all
])
def test_spatial_pads_refuses(pads: list[int], rank: int, axes: list[int] | None) -> None:
    with pytest.raises(NoMatch):
        F["spatial_pads"](pads, rank, axes)


# -------------------------------------------------------------------------------- prod


def test_prod() -> None:
    assert F["prod"]([2, 3, 4]) == 24
    assert F["prod"]([]) == 1
    assert F["prod"](np.array([5])) == 5
    with pytest.raises(NoMatch):
        F["prod"](list(range(1, 100)))


def test_prod_of_symbolic_dims_is_spelled_as_shape_spells_a_product_dim() -> None:
    """torch names a product dim by its factors ("batch*seq", sympy's order); prod() of
    symbolic dims and shape() of such a dim give one spelling, so equal products compare
    equal and different ones do not."""
    from values import dynamic

    assert F["prod"](["seq", "batch"]) == "batch*seq"
    assert F["prod"](("batch", 4, "seq", 2)) == "8*batch*seq"
    assert F["prod"](["seq", 0]) == 0
    merged = dynamic("z", ["seq*batch", "2*s0", "Min(64, s50)", "((a*b)//c)"])
    assert F["shape"](merged) == ("batch*seq", "2*s0", "Min(64, s50)", "((a*b)//c)")
    assert F["prod"](["batch", "seq"]) == F["shape"](merged)[0]
    assert F["prod"](["batch", "len"]) != F["shape"](merged)[0]
    assert F["prod"](["s0", 2]) == F["shape"](merged)[1]
    assert F["prod"](["((a*b)//c)", 2]) == "2*((a*b)//c)"  # opaque, never split


def test_a_factor_with_an_operator_is_parenthesized() -> None:
    """dynamo names a dim ``s0 + s1`` (new tokens + past ones): twice it is 2*(s0 + s1),
    not 2*s0 + s1; a call or a parenthesized name is one factor as it is."""
    assert F["prod"]([2, "s0 + s1"]) == "2*(s0 + s1)"
    assert F["prod"](["s0 - 1", "b"]) == "b*(s0 - 1)"
    assert F["prod"](["seq-len", 4]) == "4*(seq-len)"
    assert F["prod"](["a//b", "c"]) == "(a//b)*c"
    assert F["prod"](["s0 + s1"]) == "s0 + s1"  # alone, the name as it is
    assert F["prod"](["Min(64, s50)", 2]) == "2*Min(64, s50)"
    assert symbolic_quotient([4, "s0 + s1", "b"], [2, "b"]) == "2*(s0 + s1)"


def test_a_spelled_product_reads_back_as_its_factors() -> None:
    """One spelling per product: ``2*(s0 + s1)`` is 2 times the name ``s0 + s1`` again, so a
    product of it and 3 is the product of 6 and that name, and dividing by 2 gives it back;
    a power, an unbalanced or a merely bracketed sum is one name."""
    assert F["prod"](["2*(s0 + s1)", 3]) == F["prod"]([6, "s0 + s1"]) == "6*(s0 + s1)"
    assert symbolic_quotient(["2*(s0 + s1)"], [2]) == "s0 + s1"
    assert F["prod"](["a**2", 2]) == "2*(a**2)"
    assert F["prod"](["(a)+(b)", 2]) == "2*((a)+(b))"
    assert F["prod"](["a)*(b", 2]) == "2*(a)*(b)"


# ---------------------------------------------------------- through the expression language


def test_functions_run_in_rule_expressions_on_graph_constants() -> None:
    w = RNG.normal(size=(4, 1, 3, 3)).astype(np.float32)
    a = RNG.normal(size=4).astype(np.float32)
    env = {"W": _const("W", w), "a": _const("a", a), "g": 4}
    got = parse("conv_shift_bias(W, a, g)", env).evaluate(env)
    np.testing.assert_allclose(got, (w * a.reshape(4, 1, 1, 1)).sum(axis=(1, 2, 3)), rtol=1e-5)
    scaled = parse("W * group_channels(a, W, g)", env).evaluate(env)
    np.testing.assert_allclose(scaled, w * a.reshape(4, 1, 1, 1), rtol=1e-6)
    kernel = parse("shape(box_filter(W, [2, 2]))[2:]", env).evaluate(env)
    assert tuple(kernel) == (4, 4)


def test_functions_refuse_non_constant_weights() -> None:
    dynamic = ir.Value(name="W", type=ir.TensorType(ir.DataType.FLOAT),
                       shape=ir.Shape([4, 1, 3, 3]))
    env = {"W": dynamic, "a": np.ones(4), "g": 4}
    for source in ("conv_shift_bias(W, a, g)", "dense_weight(W, g)", "box_filter(W, [2, 2])"):
        with pytest.raises(NoMatch):
            parse(source, env).evaluate(env)
    # only the shape is needed to lay out a vector
    assert parse("group_channels(a, W, g)", env).evaluate(env).shape == (4, 1, 1, 1)
