"""Tests for the expression functions of the layout rules (rules/50-layout.yaml).

Each function is checked against numpy doing the same thing the hard way: a reduction
moved above a Transpose, merged Squeezes/Unsqueezes, a Transpose that is a Reshape.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import onnx_ir as ir
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from values import const as _const
from values import dynamic as _dynamic
from values import evaluate as ev

from fusectl import expr
from fusectl.expr import NoMatch

LAYOUT_FUNCTIONS = [
    "norm_axes", "permute_axes", "reduced_perm", "fill_reshape_zeros", "moves_unit_dims_only",
    "transposed_shape", "is_noop_reshape", "squeezed_axes", "merge_unsqueeze_axes",
    "axes_before_unsqueeze",
    "merge_squeeze_axes", "itemsize", "lift_rank", "slice_range", "tiling_sizes", "num_uses",
    "transpose_ahead", "unmerged_perm", "unit_reshape_moved", "as_target",
]


def fn(name: str) -> Any:
    return expr.FUNCTIONS[name]


def test_functions_are_registered() -> None:
    assert set(LAYOUT_FUNCTIONS) <= set(expr.FUNCTIONS)


# ------------------------------------------------------------------------------ axes


def test_norm_axes() -> None:
    assert fn("norm_axes")([-1, 0], 3) == [0, 2]
    assert fn("norm_axes")(_const("a", np.array([2, -3], np.int64)), 4) == [1, 2]
    assert fn("norm_axes")([], 2) == []
    assert fn("norm_axes")([1], _dynamic("x", ["N", None, 3])) == [1]  # unknown dim is fine
    for bad in ([3], [-4], [0, -3]):
        with pytest.raises(NoMatch):
            fn("norm_axes")(bad, 3)
    with pytest.raises(NoMatch):
        fn("norm_axes")(None, 3)
    with pytest.raises(NoMatch):
        fn("norm_axes")(_dynamic("a", [1], ir.DataType.INT64), 3)  # not a constant
    with pytest.raises(NoMatch):
        fn("norm_axes")([0.5], 3)


def _reduce_cases() -> list[tuple[list[int], list[int] | None, int]]:
    cases = []
    for rank in (1, 2, 3, 4):
        for perm in itertools.permutations(range(rank)):
            for count in range(rank + 1):
                for axes in itertools.combinations(range(rank), count):
                    for keepdims in (0, 1):
                        cases.append((list(perm), list(axes) or None, keepdims))
    return cases


@pytest.mark.parametrize("case", _reduce_cases()[::7])
def test_reduction_moved_above_a_transpose(case: tuple[list[int], Any, int]) -> None:
    """sum(transpose(x, p), axes) == transpose(sum(x, permute_axes(p, axes)), reduced_perm)."""
    perm, axes, keepdims = case
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4, 5)[: len(perm)])
    expected = np.sum(np.transpose(x, perm), axis=None if axes is None else tuple(axes),
                      keepdims=bool(keepdims))
    inner = None if axes is None else tuple(fn("permute_axes")(perm, axes))
    moved = np.transpose(np.sum(x, axis=inner, keepdims=bool(keepdims)),
                         fn("reduced_perm")(perm, axes, keepdims))
    assert moved.shape == expected.shape
    np.testing.assert_allclose(moved, expected, rtol=1e-12)


def test_reduced_perm_examples() -> None:
    assert fn("reduced_perm")([0, 2, 3, 1], [1, 2], 1) == [0, 2, 3, 1]
    assert fn("reduced_perm")([0, 3, 1, 2], [-1], 0) == [0, 2, 1]
    assert fn("reduced_perm")([2, 0, 1], None, 1) == [0, 1, 2]  # all ones: no reorder
    assert fn("reduced_perm")([2, 0, 1], [], 0) == []  # empty axes: every axis
    assert fn("reduced_perm")([1, 0], _const("a", np.array([0], np.int64)), 0) == [0]
    assert fn("permute_axes")([0, 2, 3, 1], _const("a", np.array([-1], np.int64))) == [1]
    with pytest.raises(NoMatch):
        fn("reduced_perm")([0, 0, 1], [0], 1)
    with pytest.raises(NoMatch):
        fn("permute_axes")([1, 0], [2])


# --------------------------------------------------------------------- squeeze merges


def test_squeezed_axes() -> None:
    assert fn("squeezed_axes")([-1], _dynamic("x", ["N", 3, 1])) == [2]
    assert fn("squeezed_axes")(None, _dynamic("x", [1, 3, 1])) == [0, 2]
    with pytest.raises(NoMatch):  # a symbolic dim may be 1 at run time
        fn("squeezed_axes")(None, _dynamic("x", [1, "N"]))


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_merge_unsqueeze_axes_matches_numpy(rank: int) -> None:
    x = np.zeros((2, 3, 4)[:rank])
    for first_count, second_count in [(1, 1), (2, 1), (1, 2)]:
        mid_rank = rank + first_count
        for first in itertools.combinations(range(-mid_rank, mid_rank), first_count):
            if len({a % mid_rank for a in first}) != first_count:
                continue
            end_rank = mid_rank + second_count
            for second in itertools.combinations(range(end_rank), second_count):
                y = np.expand_dims(np.expand_dims(x, first), second)
                merged = fn("merge_unsqueeze_axes")(list(first), list(second), rank)
                assert np.expand_dims(x, merged).shape == y.shape


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_axes_before_unsqueeze_matches_numpy(rank: int) -> None:
    """Slicing the unsqueezed tensor equals unsqueezing the slice of x on the mapped axes."""
    x = np.arange(24.0)[:(2, 6, 24)[rank - 1]].reshape((2, 3, 4)[:rank])
    for count in (1, 2):
        out_rank = rank + count
        for inserted in itertools.combinations(range(-out_rank, out_rank), count):
            if len({a % out_rank for a in inserted}) != count:
                continue
            added = {a % out_rank for a in inserted}
            u = np.expand_dims(x, inserted)
            for axes in itertools.permutations(range(-out_rank, out_rank), 1 + (rank > 1)):
                if len({a % out_rank for a in axes}) != len(axes):
                    continue
                starts = [1] * len(axes)
                if added & {a % out_rank for a in axes}:
                    with pytest.raises(NoMatch):
                        fn("axes_before_unsqueeze")(list(axes), starts, list(inserted), rank)
                    continue
                moved = fn("axes_before_unsqueeze")(list(axes), starts, list(inserted), rank)
                cut_u, cut_x = [slice(None)] * out_rank, [slice(None)] * rank
                for step, (axis, at) in enumerate(zip(axes, moved, strict=True)):
                    cut_u[axis] = cut_x[at] = slice(1, None, step + 1)
                assert np.array_equal(u[tuple(cut_u)],
                                      np.expand_dims(x[tuple(cut_x)], inserted))
    with pytest.raises(NoMatch):
        fn("axes_before_unsqueeze")([5], [0], [0], 2)
    # without axes, one per start from the first: [0, 1] of a [2, 1, 3] Unsqueeze(x, 1) is
    # an inserted axis; [0] alone is x's axis 0
    assert fn("axes_before_unsqueeze")(None, [0], [1], 2) == [0]
    with pytest.raises(NoMatch):
        fn("axes_before_unsqueeze")(None, [0, 0], [1], 2)


def test_merge_squeeze_axes_matches_numpy() -> None:
    x = np.zeros((1, 2, 1, 3, 1))
    ones = [0, 2, 4]
    for count in (1, 2):
        for first in itertools.combinations(ones, count):
            y = np.squeeze(x, first)
            y_ones = [i for i, d in enumerate(y.shape) if d == 1]
            for second in itertools.chain.from_iterable(
                itertools.combinations(y_ones, n) for n in range(1, len(y_ones) + 1)
            ):
                merged = fn("merge_squeeze_axes")(list(first), list(second),
                                                  _dynamic("x", list(x.shape)))
                assert np.squeeze(x, tuple(merged)).shape == np.squeeze(y, second).shape
    assert fn("merge_squeeze_axes")([0], [-1], 5) == [0, 4]


# ------------------------------------------------------------------------- reshapes


def test_fill_reshape_zeros() -> None:
    shape = _const("s", np.array([0, 2, -1], np.int64))
    out = fn("fill_reshape_zeros")(shape, _dynamic("y", [6, 4]), 0)
    assert out.dtype == np.int64 and out.tolist() == [6, 2, -1]
    assert fn("fill_reshape_zeros")(shape, _dynamic("y", [6, 4]), 1) is shape  # literal zeros
    plain = _const("s", np.array([4, -1], np.int64))
    assert fn("fill_reshape_zeros")(plain, _dynamic("y", ["N", 4]), None) is plain
    runtime = _dynamic("s", [2], ir.DataType.INT64)
    assert fn("fill_reshape_zeros")(runtime, _dynamic("y", [6, 4]), 1) is runtime
    with pytest.raises(NoMatch):  # the copied dim is symbolic
        fn("fill_reshape_zeros")(shape, _dynamic("y", ["N", 4]), 0)
    with pytest.raises(NoMatch):  # a copied 0-size dim would read as "copy" again
        fn("fill_reshape_zeros")(shape, _dynamic("y", [0, 4]), 0)
    with pytest.raises(NoMatch):
        fn("fill_reshape_zeros")(runtime, _dynamic("y", [6, 4]), 0)
    # a symbolic dim stays a 0 when the new Reshape's input has it at the same position
    fill = fn("fill_reshape_zeros")
    assert fill(shape, _dynamic("y", ["N", 4]), 0, _dynamic("x", ["N", 2, 2])).tolist() \
        == [0, 2, -1]
    with pytest.raises(NoMatch):  # x has N elsewhere: a 0 would copy M
        fill(shape, _dynamic("y", ["N", 4]), 0, _dynamic("x", ["M", "N"]))
    with pytest.raises(NoMatch):  # x is shorter than the 0's position
        fill(_const("s", np.array([2, 0], np.int64)), _dynamic("y", [8, "N"]), 0,
             _dynamic("x", [16]))
    # static zeros are filled whatever x's shape (unknown dims, unknown rank)
    assert fill(shape, _dynamic("y", [6, 4]), 0, _dynamic("x", [None, 4])).tolist() == [6, 2, -1]
    unranked = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT))
    assert fill(shape, _dynamic("y", [6, 4]), 0, unranked).tolist() == [6, 2, -1]


def _unit_moving(dims: tuple[int, ...]) -> list[list[int]]:
    return [list(p) for p in itertools.permutations(range(len(dims)))
            if fn("moves_unit_dims_only")(list(p), _dynamic("x", list(dims)))]


@pytest.mark.parametrize("dims", [(2, 1, 3), (1, 4, 1, 5), (1, 1, 2), (3, 4)])
def test_unit_dim_transposes_are_reshapes(dims: tuple[int, ...]) -> None:
    x = np.arange(int(np.prod(dims))).reshape(dims)
    for perm in itertools.permutations(range(len(dims))):
        moves_units = fn("moves_unit_dims_only")(list(perm), _dynamic("x", list(dims)))
        target = fn("transposed_shape")(list(perm), _dynamic("x", list(dims)))
        same = np.array_equal(np.transpose(x, perm), x.reshape(target))
        assert moves_units == same, perm


def test_transposed_shape_symbolic() -> None:
    value = _dynamic("y", ["N", 1, 6])
    assert fn("moves_unit_dims_only")([1, 0, 2], value)
    assert not fn("moves_unit_dims_only")([2, 1, 0], value)
    assert fn("transposed_shape")([1, 0, 2], value).tolist() == [1, -1, 6]
    with pytest.raises(NoMatch):
        fn("transposed_shape")([1, 0, 2], _dynamic("y", ["N", 1, "M"]))
    with pytest.raises(NoMatch):
        fn("transposed_shape")([1, 0, 2], _dynamic("y", [0, 1, 6]))
    with pytest.raises(NoMatch):
        fn("moves_unit_dims_only")([1, 0], value)


def test_as_target_spells_dims_one_after_another() -> None:
    """BLOOM's [B*H,1,L] bias unfolded to x's leading dims: static dims, one symbolic as -1."""
    assert fn("as_target")((2, 4), (1, 16)).tolist() == [2, 4, 1, 16]
    assert fn("as_target")(("B", 4), (1, 16)).tolist() == [-1, 4, 1, 16]
    with pytest.raises(NoMatch, match="more than one"):
        fn("as_target")(("B", 4), (1, "L"))
    with pytest.raises(NoMatch, match="size 0"):
        fn("as_target")((2, 0), (1, 16))


@pytest.mark.parametrize(("dims", "lead", "perm"), [
    ((2, 3, 4, 5), 2, (0, 2, 1)), ((2, 3, 4, 5, 6), 3, (0, 2, 1)),
    ((2, 3, 4, 5), 1, (0, 3, 1, 2)), ((2, 3, 4, 5), 2, (0, 1, 2)),
    ((2, 3, 4, 5, 6), 2, (0, 3, 1, 2)),
])
def test_unmerged_perm_is_the_three_ops(dims: tuple[int, ...], lead: int,
                                        perm: tuple[int, ...]) -> None:
    """Reshape (fold the leading axes) -> Transpose -> Reshape (split them back), done by
    numpy, equals one Transpose of x by the perm the function gives."""
    x = np.arange(int(np.prod(dims))).reshape(dims)
    folded = x.reshape((-1, *dims[lead:]))
    moved = np.transpose(folded, perm)
    z = moved.reshape((*dims[:lead], *moved.shape[1:]))
    q = fn("unmerged_perm")(list(perm), _dynamic("x", list(dims)),
                            _dynamic("y", list(folded.shape)), _dynamic("z", list(z.shape)))
    np.testing.assert_array_equal(np.transpose(x, q), z)


def test_unmerged_perm_symbolic_and_refusals() -> None:
    x = _dynamic("x", ["B", 4, "L", 16])
    assert fn("unmerged_perm")([0, 2, 1], x, _dynamic("y", [None, "L", 16]),
                               _dynamic("z", ["B", 4, 16, "L"])) == [0, 1, 3, 2]
    refused = [
        ([1, 0, 2], _dynamic("y", [None, "L", 16]), ["B", 4, 16, "L"]),  # merged axis moves
        ([0, 2, 1], _dynamic("y", [None, "M", 16]), ["B", 4, 16, "M"]),  # other length
        ([0, 2, 1], _dynamic("y", [None, "L", 16]), [4, "B", 16, "L"]),  # split otherwise
        ([0, 2, 1], _dynamic("y", [None, "L", 16]), ["B", 4, 16, None]),  # unknown dim
        ([0, 2, 1], _dynamic("y", [None, 8, 32]), ["B", 4, 32, 8]),  # regrouped trailing
        ([0, 1], _dynamic("y", [None, "L", 16]), ["B", 4, "L", 16]),  # perm of wrong rank
    ]
    for perm, y, z in refused:
        with pytest.raises(NoMatch):
            fn("unmerged_perm")(perm, x, y, _dynamic("z", z))


def test_is_noop_reshape() -> None:
    s = lambda *dims: _const("s", np.array(dims, np.int64))  # noqa: E731
    assert fn("is_noop_reshape")(_dynamic("x", [2, 3, 4]), s(2, 3, 4), 0)
    assert fn("is_noop_reshape")(_dynamic("x", ["N", 3, 4]), s(0, 3, -1), 0)
    assert fn("is_noop_reshape")(_dynamic("x", ["N", 3, 4]), s(-1, 3, 4), 0)
    assert not fn("is_noop_reshape")(_dynamic("x", ["N", 3, 4]), s(0, 3, -1), 1)
    assert not fn("is_noop_reshape")(_dynamic("x", ["N", "M"]), s(-1, 12), 0)
    assert not fn("is_noop_reshape")(_dynamic("x", [2, 3, 4]), s(3, 2, 4), 0)
    assert not fn("is_noop_reshape")(_dynamic("x", [2, 3, 4]), s(-1, -1, 4), 0)
    assert not fn("is_noop_reshape")(_dynamic("x", [2, 12]), s(2, 3, 4), 0)
    assert not fn("is_noop_reshape")(_dynamic("x", [0, 3]), s(0, -1), 0)
    assert fn("is_noop_reshape")(_dynamic("x", ["N", None]), s(0, 0), None)
    with pytest.raises(NoMatch):
        fn("is_noop_reshape")(_dynamic("x", [2]), _dynamic("s", [1], ir.DataType.INT64))


# ---------------------------------------------------------------------------- others


def test_itemsize() -> None:
    assert fn("itemsize")(10) == 2.0  # FLOAT16
    assert fn("itemsize")(1) == 4.0
    assert fn("itemsize")(_dynamic("x", [2], ir.DataType.DOUBLE)) == 8.0
    assert fn("itemsize")(_const("c", np.zeros(2, np.int8))) == 1.0
    assert ev("itemsize(to) <= itemsize(x)", to=10, x=_dynamic("x", [2]))
    with pytest.raises(NoMatch):
        ev("itemsize(to)", to=12345)
    with pytest.raises(NoMatch):
        fn("itemsize")("float")
    with pytest.raises(NoMatch):
        fn("itemsize")(_dynamic("s", [2], ir.DataType.STRING))


def test_lift_rank_then_transpose_is_the_broadcast_constant() -> None:
    c = _const("c", np.arange(3, dtype=np.float16))
    lifted = fn("lift_rank")(c, 4)
    assert lifted.shape == (1, 1, 1, 3)
    perm = [0, 2, 3, 1]
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)
    c2 = ev("transpose(lift_rank(c, len(p)), inverse_perm(p))", c=c, p=perm)
    np.testing.assert_array_equal(np.transpose(x + c2, perm),
                                  np.transpose(x, perm) + np.arange(3, dtype=np.float32))
    assert fn("lift_rank")(2.0, 2).shape == (1, 1)
    with pytest.raises(NoMatch):
        fn("lift_rank")(_const("c", np.zeros((1, 2, 3), np.float32)), 2)


# ------------------------------------------------ sibling slices (rules/25-siblings.yaml)


def test_slice_range_and_tiling_sizes() -> None:
    x = _dynamic("x", [2, "N", 10])
    i64 = np.int64
    assert ev("slice_range(x, s, e, a)", x=x, s=_const("s", np.array([-4], i64)),
              e=_const("e", np.array([2**63 - 1], i64)), a=_const("a", np.array([2], i64))
              ) == [2, 6, 10]
    assert fn("slice_range")(_const("x", np.zeros((6, 3), np.float32)), [1], [4]
                                    ) == [0, 1, 4]
    for bad in ([1, 0], [0, 1]):  # the symbolic axis; two axes
        with pytest.raises(NoMatch):
            fn("slice_range")(x, bad[:1] * (1 + bad[1]), [3] * (1 + bad[1]),
                                     [bad[0]] * (1 + bad[1]))
    with pytest.raises(NoMatch, match="step"):
        fn("slice_range")(x, [0], [4], [2], [2])
    assert fn("tiling_sizes")([[2, 0, 4], [2, 4, 10]], x).tolist() == [4, 6]
    for ranges in ([[2, 0, 4], [2, 5, 10]], [[2, 0, 6], [2, 4, 10]], [[2, 0, 4], [2, 4, 9]],
                   [[2, 0, 0], [2, 0, 10]]):
        with pytest.raises(NoMatch):
            fn("tiling_sizes")(ranges, x)


def test_num_uses_counts_readers_and_graph_outputs() -> None:
    a, b = _dynamic("a", [4]), _dynamic("b", [4])
    add = ir.Node("", "Add", [a, b], outputs=[ir.Value(name="s")])
    mul = ir.Node("", "Mul", [add.outputs[0], add.outputs[0]], outputs=[ir.Value(name="m")])
    neg = ir.Node("", "Neg", [mul.outputs[0]], outputs=[ir.Value(name="z")])
    relu = ir.Node("", "Relu", [add.outputs[0]], outputs=[ir.Value(name="extra")])
    ir.Graph([a, b], [neg.outputs[0], relu.outputs[0]], nodes=[add, mul, neg, relu])
    values = {v.name: v for n in (add, mul, neg, relu) for v in n.outputs}
    assert fn("num_uses")(values["s"]) == 3  # Mul reads it twice, Relu once
    assert fn("num_uses")(values["z"]) == 1  # a graph output
    with pytest.raises(NoMatch):
        fn("num_uses")(np.ones(2))


def test_transpose_ahead_looks_three_hops_through_elementwise_ops() -> None:
    x = _dynamic("x", [2, 4])
    squeeze = ir.Node("", "Squeeze", [x], outputs=[ir.Value(name="s")])
    scale = ir.Node("", "Mul", [squeeze.outputs[0], squeeze.outputs[0]],
                    outputs=[ir.Value(name="m")])
    ahead = ir.Node("", "Transpose", [scale.outputs[0]], outputs=[ir.Value(name="t")])
    assert fn("transpose_ahead")(x)
    reshape = ir.Node("", "Reshape", [ahead.inputs[0]], outputs=[ir.Value(name="r")])
    ir.Node("", "Transpose", [reshape.outputs[0]], outputs=[ir.Value(name="t2")])
    y = _dynamic("y", [2, 4])
    ir.Node("", "Reshape", [y], outputs=[ir.Value(name="r2")])
    assert not fn("transpose_ahead")(y)  # a Reshape is not looked through
    z = _dynamic("z", [2, 4])
    chain = z
    for _ in range(3):
        chain = ir.Node("", "Relu", [chain], outputs=[ir.Value()]).outputs[0]
    ir.Node("", "Transpose", [chain], outputs=[ir.Value()])
    assert not fn("transpose_ahead")(z)  # four hops away
    assert fn("transpose_ahead")(y, x)


# ------------------------------------------------------------------ unit_reshape_moved


@st.composite
def _unit_reshapes(draw: st.DrawFn) -> tuple[list[int], list[int], list[int]]:
    """dims of x, a perm, and z: Transpose(x, perm) with its unit dims dropped and others
    inserted anywhere."""
    dims = draw(st.lists(st.sampled_from([1, 1, 2, 3, 4]), min_size=1, max_size=5))
    perm = draw(st.permutations(range(len(dims))))
    out = [dims[axis] for axis in perm if dims[axis] != 1]
    for _ in range(draw(st.integers(0, 3))):
        out.insert(draw(st.integers(0, len(out))), 1)
    return dims, list(perm), out or [1]


@settings(max_examples=200, deadline=None)
@given(_unit_reshapes())
def test_unit_reshape_moved_equals_reshape_after_transpose(case: tuple) -> None:
    dims, perm, out = case
    data = np.arange(int(np.prod(dims))).reshape(dims)
    try:
        target, order = fn("unit_reshape_moved")(perm, _dynamic("x", dims), _dynamic("z", out))
    except NoMatch:
        # only when the Transpose moves no dim larger than 1 (it is a view already)
        larger = [axis for axis in perm if dims[axis] != 1]
        assert larger == sorted(larger)
        return
    np.testing.assert_array_equal(data.reshape(target).transpose(order),
                                  data.transpose(perm).reshape(out))


def test_unit_reshape_moved_single_head_key_and_refusals() -> None:
    moved = fn("unit_reshape_moved")
    assert moved([0, 2, 1], _dynamic("x", [1, 64, 16]), _dynamic("z", [1, 1, 16, 64])) == [
        [1, 1, 64, 16], [0, 1, 3, 2]]
    assert moved([1, 0], _dynamic("x", ["N", 3]), _dynamic("z", [3, 1, "N"])) == [
        [-1, 1, 3], [2, 1, 0]]
    for perm, dims, out in [
        ([0, 2, 1], [2, 3, 4], [2, 12]),  # merges dims
        ([1, 0, 2], [1, 3, 4], [3, 1, 4]),  # moves only a unit dim
        ([1, 0], ["N", "M"], ["M", 1, "N"]),  # two symbolic dims
        ([1, 0], [2, 0], [0, 1, 2]),  # an empty dim
        ([0, 1], [2, 3, 4], [2, 3, 4]),  # perm of another rank
    ]:
        with pytest.raises(NoMatch):
            moved(perm, _dynamic("x", dims), _dynamic("z", out))


def test_read_by_shapes_besides_tells_a_product_only_shapes_read() -> None:
    """The 3-D product a dynamic export reshapes back is also read by the Shape computing
    that target (fine: it dies with the match); a Sigmoid or a graph output is a real reader."""
    import onnx.parser

    model = ir.from_proto(onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[8,5,6] a, float[8,6,3] b) => (float[8,5,3] z, float[8,5,3] e)
        { m = MatMul(a, b)  s = Shape(m)  t = Shape(a)  z = Reshape(m, s)  u = MatMul(a, b)
          e = Sigmoid(u)  n = Shape(u)  y = Reshape(u, n) }"""))
    values = {out.name: out for node in model.graph for out in node.outputs}
    check = fn("read_by_shapes_besides")
    assert check(values["m"], values["z"])
    assert not check(values["u"], values["y"])  # the Sigmoid reads it too
    assert not check(values["e"], values["e"])  # a graph output


def test_is_minted_dim_tells_onnx_symbols_from_names() -> None:
    check = fn("is_minted_dim")
    assert check("unk__21")
    assert not check("batch_size") and not check(16) and not check("4*unk__3")


def _values_of(text: str) -> dict[str, ir.Value]:
    import onnx

    proto = onnx.shape_inference.infer_shapes(onnx.parser.parse_model(text))
    model = ir.serde.deserialize_model(proto)
    return {v.name: v for node in model.graph for v in node.outputs}


_HEADS = """<ir_version: 10, opset_import: ["" : 23]>
g (float[2,6,{h},24] x, float[2,6,2] c, float[2,6,2] s, float[2,{h},6,8] K)
  => (float[2,6,{w}] z{extra_out})
<int64[3] so = {{2, 6, {w}}}>
{{
  t = Transpose<perm=[0, 2, 1, 3]>(x)  q, k, v = Split<axis=3, num_outputs=3>(t)
  qr = RotaryEmbedding<rotary_embedding_dim=4>(q, c, s)
  o = Attention({args})  {extra}
  ot = Transpose<perm=[0, 2, 1, 3]>(o)  z = Reshape(ot, so)
}}"""

_PUSHED = """<ir_version: 10, opset_import: ["" : 23]>
g (float[2,6,4,24] x, float[2,6,2] c, float[2,6,2] s, float[2,4,6,8] K)
  => (float[2,6,32] z{outputs})
<int64[3] so = {{2, 6, 32}}>
{{
  a, b, e = Split<axis=3, num_outputs=3>(x)
  q = Transpose<perm=[0, 2, 1, 3]>(a)  k = Transpose<perm=[0, 2, 1, 3]>(b)
  v = Transpose<perm=[0, 2, 1, 3]>(e)
  qr = RotaryEmbedding<rotary_embedding_dim=4>(q, c, s)
  kr = RotaryEmbedding<rotary_embedding_dim=4>(k, c, s)
  o = Attention(qr, kr, v)  {extra}
  ot = Transpose<perm=[0, 2, 1, 3]>({merged})  z = Reshape(ot, so)
}}"""


def _heads(h: int = 4, args: str = "qr, k, v", extra: str = "", extra_out: str = "") -> dict:
    return _values_of(_HEADS.format(h=h, w=h * 8, args=args, extra=extra, extra_out=extra_out))


def _pushed(extra: str = "", merged: str = "o", outputs: str = "") -> dict:
    return _values_of(_PUSHED.format(extra=extra, merged=merged, outputs=outputs))


def test_feeds_heads_needs_every_head_of_the_attention_transposed() -> None:
    feeds = fn("feeds_heads")
    ok = _heads()
    assert feeds(ok["q"], ok["k"], ok["v"])  # through the rotary, and directly
    assert not feeds(ok["qr"])  # key and value are Split parts, not head Transposes yet
    pushed = _pushed()
    assert feeds(pushed["qr"]) and feeds(pushed["kr"])
    other = _heads(args="qr, K, v")
    assert not feeds(other["q"], other["k"], other["v"])  # the key is no head Transpose
    read = _heads(extra="w = Relu(v)", extra_out=", float[2,4,6,8] w")
    assert not feeds(read["q"], read["k"], read["v"])  # v also read by a Relu
    out = _heads(extra_out=", float[2,4,6,8] qr")
    assert not feeds(out["qr"])  # a graph output keeps its layout
    one = _heads(h=1)
    assert not feeds(one["q"], one["k"], one["v"])  # one head: its Transpose becomes a Reshape
    assert not feeds(np.ones(2))


def test_feeds_heads_needs_an_attention_that_goes_3d() -> None:
    """Moving the Transposes pays only when attention-heads-from-views then converts the
    Attention: no named head counts, no present outputs, its output merged back."""
    feeds = fn("feeds_heads")
    kept = _pushed(extra="r = Relu(o)", outputs=", float[2,4,6,8] r")
    assert not feeds(kept["qr"])  # the 4-D output is read elsewhere
    assert not feeds(_pushed(merged="kr", outputs=", float[2,4,6,8] o")["qr"])  # not merged
    named = _PUSHED.format(extra="", merged="o", outputs="").replace(
        "Attention(qr, kr, v)", "Attention<q_num_heads=4, kv_num_heads=4>(qr, kr, v)")
    assert not feeds(_values_of(named)["qr"])
    present = _PUSHED.format(extra="", merged="o", outputs=", float[2,4,6,8] pk").replace(
        "o = Attention(qr, kr, v)", "o, pk = Attention(qr, kr, v)")
    assert not feeds(_values_of(present)["qr"])


def test_feeds_heads_follows_the_nan_guard() -> None:
    """torch's Where(IsNaN(o), 0, o) between the Attention and the merge: converted too,
    with a one-value fill only (a rank-4 fill would widen the 3-D output)."""
    feeds = fn("feeds_heads")
    for fill, expected in (("float zero = {0.0}", True), ("float[1,1,1,1] zero = {0.0}", False)):
        text = _PUSHED.format(extra="n = IsNaN(o)  g = Where(n, zero, o)", merged="g",
                              outputs="").replace("<int64[3] so = {2, 6, 32}>",
                                                  f"<int64[3] so = {{2, 6, 32}}, {fill}>")
        assert feeds(_values_of(text)["qr"]) is expected


def test_feeds_heads_takes_one_key_and_value_head_as_it_comes() -> None:
    """Multi-query attention: a one-head key or value is read squeezed to [B,L,D], whatever
    produced it (its head Transpose became a Reshape); two untransposed heads are not."""
    feeds = fn("feeds_heads")
    text = """<ir_version: 10, opset_import: ["" : 23]>
g (float[2,6,4,8] x, float[2,6,4] c, float[2,6,4] s, float[2,{h},6,8] K, float[2,{h},6,8] V)
  => (float[2,6,32] z)
<int64[3] so = {{2, 6, 32}}>
{{
  q = Transpose<perm=[0, 2, 1, 3]>(x)  qr = RotaryEmbedding(q, c, s)  o = Attention(qr, K, V)
  ot = Transpose<perm=[0, 2, 1, 3]>(o)  z = Reshape(ot, so)
}}"""
    assert feeds(_values_of(text.format(h=1))["qr"])
    assert not feeds(_values_of(text.format(h=2))["qr"])


def test_feeds_heads_needs_each_head_read_once() -> None:
    """Query heads two Attentions read keep their Transpose for the second one: moving it
    would add nodes and remove none."""
    feeds = fn("feeds_heads")
    text = """<ir_version: 10, opset_import: ["" : 23]>
g (float[2,6,4,8] Q, float[2,1,6,8] K, float[2,1,6,8] V, float[2,1,6,8] K2, float[2,6,4] c,
   float[2,6,4] s) => (float[2,6,32] z, float[2,6,32] z2)
<int64[3] so = {2, 6, 32}>
{
  q = Transpose<perm=[0, 2, 1, 3]>(Q)  qr = RotaryEmbedding(q, c, s)
  o = Attention<is_causal=1>(qr, K, V)  ot = Transpose<perm=[0, 2, 1, 3]>(o)  z = Reshape(ot, so)
  o2 = Attention(qr, K2, V)  ot2 = Transpose<perm=[0, 2, 1, 3]>(o2)  z2 = Reshape(ot2, so)
}"""
    assert not feeds(_values_of(text)["qr"])
    split = """<ir_version: 10, opset_import: ["" : 23]>
g (float[2,6,6,8] x, float[2,1,6,8] K2, float[2,1,6,8] V2) => (float[2,6,32] z, float[2,6,32] z2)
<int64[3] so = {2, 6, 32}, int64[3] sz = {4, 1, 1}>
{
  t = Transpose<perm=[0, 2, 1, 3]>(x)  q, k, v = Split<axis=1>(t, sz)
  o = Attention<is_causal=1>(q, k, v)  ot = Transpose<perm=[0, 2, 1, 3]>(o)  z = Reshape(ot, so)
  o2 = Attention(q, K2, V2)  ot2 = Transpose<perm=[0, 2, 1, 3]>(o2)  z2 = Reshape(ot2, so)
}"""
    parts = _values_of(split)
    assert not feeds(parts["q"], parts["k"], parts["v"])


def test_feeds_heads_needs_the_other_rotated_heads_transposed_once() -> None:
    feeds = fn("feeds_heads")
    text = """<ir_version: 10, opset_import: ["" : 23]>
g (float[2,6,4,8] Q, float[2,6,4,8] K, float[2,6,4,8] V, float[2,6,4] c, float[2,6,4] s)
  => (float[2,6,32] z{extra_out})
<int64[3] so = {{2, 6, 32}}>
{{
  q = Transpose<perm=[0, 2, 1, 3]>(Q)  qr = RotaryEmbedding(q, c, s)
  k = Transpose<perm=[0, 2, 1, 3]>(K)  kr = RotaryEmbedding(k, c, s)
  v = Transpose<perm=[0, 2, 1, 3]>(V)  {extra}
  o = Attention(qr, kr, v)  ot = Transpose<perm=[0, 2, 1, 3]>(o)  z = Reshape(ot, so)
}}"""
    assert feeds(_values_of(text.format(extra="", extra_out=""))["qr"])
    shared = text.format(extra="w = Relu(k)", extra_out=", float[2,4,6,8] w")
    assert not feeds(_values_of(shared)["qr"])  # k's Transpose stays for the Relu
