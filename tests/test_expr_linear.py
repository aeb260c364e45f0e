"""Tests for the expression functions the fully-connected rules (rules/20-linear.yaml) add:
broadcasts_into, producer_op and einsum_matmul."""

from __future__ import annotations

import contextlib

import numpy as np
import onnx_ir as ir
import pytest
from values import const as _const
from values import dynamic as _activation

from fusectl import expr
from fusectl.expr import NoMatch, parse

rank = expr.FUNCTIONS["rank"]
broadcasts_into = expr.FUNCTIONS["broadcasts_into"]
producer_op = expr.FUNCTIONS["producer_op"]
reader_op = expr.FUNCTIONS["reader_op"]
einsum_matmul = expr.FUNCTIONS["einsum_matmul"]






# ------------------------------------------------------------------------------ rank


def test_rank_counts_unknown_dims_that_shape_refuses() -> None:
    y = _activation("y", [None, None, 8])
    assert rank(y) == 3
    with pytest.raises(NoMatch):
        expr.FUNCTIONS["shape"](y)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (_activation("y", ["N", 5, 8]), 3),
        (_activation("y", []), 0),
        (_const("w", np.zeros((16, 8), np.float32)), 2),
        (_const("s", np.float32(2.0)), 0),
        (np.zeros((2, 3, 4)), 3),
        (1.5, 0),
    ],
)
def test_rank_of_known_ranks(value: object, expected: int) -> None:
    assert rank(value) == expected


@pytest.mark.parametrize("value", [None, _activation("y", None)])
def test_rank_without_a_shape_is_no_match(value: object) -> None:
    with pytest.raises(NoMatch):
        rank(value)


# ------------------------------------------------------------------- broadcasts_into


@pytest.mark.parametrize(
    ("small", "big"),
    [
        ((8,), [None, None, 8]),
        ((1, 8), [None, 8]),
        ((), [None, 8]),
        ((1,), [None, None]),
        ((1, 1, 8), ["B", "T", 8]),
        ((5, 1), ["B", 5, 8]),
        ((4, 8), [4, 8]),
    ],
)
def test_broadcasts_into_accepts_what_keeps_the_shape(small: tuple, big: list) -> None:
    bias = _const("b", np.ones(small, np.float32))
    assert broadcasts_into(bias, _activation("y", big)) is True


@pytest.mark.parametrize(
    ("small", "big"),
    [
        ((3, 1, 8), [4, 8]),  # adds a leading axis
        ((8,), [4, 1]),  # widens a single column
        ((4, 1), [None, 8]),  # rows against unknown rows: cannot be proven equal
        ((5, 8), ["N", 8]),  # rows against a symbolic dim
        ((7,), [None, 8]),  # mismatch
    ],
)
def test_broadcasts_into_refuses_growth_or_doubt(small: tuple, big: list) -> None:
    bias = _const("b", np.ones(small, np.float32))
    assert broadcasts_into(bias, _activation("y", big)) is False


def test_broadcasts_into_matches_equal_symbolic_dims() -> None:
    assert broadcasts_into(_activation("r", ["N", 8]), _activation("y", ["N", 8])) is True
    assert broadcasts_into(_activation("r", ["M", 8]), _activation("y", ["N", 8])) is False


def test_broadcasts_into_refuses_a_small_side_with_unknown_dims() -> None:
    assert broadcasts_into(_activation("r", [None, 8]), _activation("y", [None, 8])) is False


def test_broadcasts_into_without_a_shape_is_no_match() -> None:
    with pytest.raises(NoMatch):
        broadcasts_into(_const("b", np.ones(8, np.float32)), _activation("y", None))


# ----------------------------------------------------------------------- producer_op


def _output_of(domain: str, op_type: str) -> ir.Value:
    x = _activation("x", [2, 8])
    return ir.Node(domain, op_type, [x], num_outputs=1).outputs[0]


@pytest.mark.parametrize(
    ("domain", "op", "expected"),
    [("", "Div", "Div"), ("ai.onnx", "Mul", "Mul"),
     ("com.microsoft", "FusedMatMul", "com.microsoft.FusedMatMul")],
)
def test_producer_op_names_the_producing_node(domain: str, op: str, expected: str) -> None:
    assert producer_op(_output_of(domain, op)) == expected


def test_producer_op_of_inputs_and_initializers_is_empty() -> None:
    assert producer_op(_activation("x", [2, 8])) == ""
    assert producer_op(_const("w", np.ones(3, np.float32))) == ""


@pytest.mark.parametrize("value", [None, 1.0, "Div", np.zeros(2)])
def test_producer_op_of_a_non_value_is_no_match(value: object) -> None:
    with pytest.raises(NoMatch):
        producer_op(value)


def test_producer_op_climbs_first_inputs_by_depth() -> None:
    x = _activation("x", [2, 8])
    reshaped = ir.Node("", "Reshape", [x, _const("s", np.array([2, 2, 4]))], num_outputs=1)
    transposed = ir.Node("", "Transpose", [reshaped.outputs[0]], num_outputs=1)
    k = transposed.outputs[0]
    assert [producer_op(k, d) for d in (0, 1, 2)] == ["Transpose", "Reshape", ""]


@pytest.mark.parametrize("depth", [-1, 9, 1.5, True])
def test_producer_op_refuses_a_depth_out_of_range(depth: object) -> None:
    with pytest.raises(NoMatch):
        producer_op(_output_of("", "Relu"), depth)


# ------------------------------------------------------------------------- reader_op


def test_reader_op_names_the_one_reading_node() -> None:
    x = _activation("x", [2, 8])
    ir.Node("com.microsoft", "QuickGelu", [x], num_outputs=1)
    assert reader_op(x) == "com.microsoft.QuickGelu"
    y = _activation("y", [2, 8])
    ir.Node("", "Reshape", [y, _const("s", np.array([4, 4]))], num_outputs=1)
    assert reader_op(y) == "Reshape"


def test_reader_op_is_empty_for_none_several_or_a_graph_output() -> None:
    unread = _activation("u", [2, 8])
    assert reader_op(unread) == ""
    twice = _activation("t", [2, 8])
    ir.Node("", "Relu", [twice], num_outputs=1)
    ir.Node("", "Relu", [twice], num_outputs=1)
    assert reader_op(twice) == ""
    out = ir.Node("", "Relu", [_activation("x", [2, 8])], num_outputs=1).outputs[0]
    ir.Node("", "Reshape", [out, _const("s", np.array([4, 4]))], num_outputs=1)
    ir.Graph([], [out], nodes=[out.producer()], name="g")
    assert reader_op(out) == ""


@pytest.mark.parametrize("value", [None, 1.0, "Reshape"])
def test_reader_op_of_a_non_value_is_no_match(value: object) -> None:
    with pytest.raises(NoMatch):
        reader_op(value)


def test_functions_are_usable_in_rule_expressions() -> None:
    condition = parse(
        'producer_op(x) not in ["Mul", "Div"] and rank(y) == 3 and broadcasts_into(b, y)',
        ["x", "y", "b"],
    )
    env = {
        "x": _activation("x", [2, 5, 16]),
        "y": _activation("y", [None, 5, 8]),
        "b": _const("b", np.ones(8, np.float32)),
    }
    assert condition.evaluate(env) is True
    env["x"] = _output_of("", "Div")
    assert condition.evaluate(env) is False


# ------------------------------------------------------------------------------ einsum


@pytest.mark.parametrize("equation, a_shape, b_shape", [
    ("bhid,bhjd->bhij", (2, 3, 5, 4), (2, 3, 7, 4)),
    ("bhij,bhjd->bhid", (2, 3, 5, 7), (2, 3, 7, 4)),
    ("ibh,jbh->bij", (5, 2, 4), (7, 2, 4)),
    ("ibh,jbh->bji", (5, 2, 4), (7, 2, 4)),
    ("ij,ki->kj", (3, 4), (5, 3)),
    ("Ab,bC->AC", (3, 4), (4, 5)),
    ("hbi, hjb -> hji", (2, 3, 4), (2, 5, 3)),
    ("bsh,hd->bsd", (2, 3, 4), (4, 5)),      # a linear layer: b is a plain matrix
    ("hd,bsh->bsd", (4, 5), (2, 3, 4)),      # the same, operands swapped
    ("ij,bjk->bik", (3, 4), (2, 4, 5)),      # a plain matrix first
    ("sbh,dh->bsd", (3, 2, 4), (5, 4)),
    ("bhij,bjhd->bihd", (2, 3, 5, 7), (2, 7, 3, 4)),  # attention output as [B,S,H,D]
    ("ij,jk->ki", (3, 4), (4, 5)),                    # one Transpose after, not two before
    ("bij,bjk->ibk", (2, 3, 4), (2, 4, 5)),
    ("bsh,hd->sbd", (2, 3, 4), (4, 5)),  # b is the free letter here: [s,b,h] @ [h,d]
])
def test_einsum_matmul_plans_what_numpy_computes(equation, a_shape, b_shape) -> None:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(a_shape), rng.standard_normal(b_shape)
    plans = []
    for transposed in (False, True):  # exactly one of the two rules takes it
        with contextlib.suppress(NoMatch):
            plans.append(einsum_matmul(equation, a, b, transposed))
    assert len(plans) == 1
    perm_first, perm_second, swap, perm_out = plans[0]
    first, second = (b, a) if swap else (a, b)
    first = first if perm_first is None else first.transpose(perm_first)
    second = second if perm_second is None else second.transpose(perm_second)
    product = first @ second
    product = product if perm_out is None else product.transpose(perm_out)
    np.testing.assert_allclose(product, np.einsum(equation.replace(" ", ""), a, b),
                               rtol=1e-12)


@pytest.mark.parametrize("equation, ranks", [
    ("ii,ij->ij", (2, 2)),            # diagonal
    ("ij,jk", (2, 2)),                # implicit output
    ("...ij,...jk->...ik", (3, 3)),   # ellipsis
    ("ij,jk->k", (2, 2)),             # a free letter summed away
    ("ijk,jkl->il", (3, 3)),          # two summed letters
    ("ij,j->i", (2, 1)),              # matrix times vector
    ("i,j->ij", (1, 1)),              # outer product
    ("ij,jk,kl->il", (2, 2)),         # three operands
    ("ij,jk->ik", (3, 2)),            # ranks that are not the terms'
    ("i1,1k->ik", (2, 2)),            # not letters
    ("bij,jk->ik", (3, 2)),           # b summed over one operand only
    ("bij,cjk->bcik", (3, 3)),        # batch letters of each operand alone
    ("bij,bjk->bikz", (3, 3)),        # an output letter of no operand
])
def test_einsum_matmul_refuses_what_is_not_one_product(equation, ranks) -> None:
    operands = [np.ones((3,) * rank) for rank in ranks]
    for transposed in (False, True):
        with pytest.raises(NoMatch):
            einsum_matmul(equation, *operands, transposed)


def test_einsum_matmul_needs_summed_dims_known_equal() -> None:
    """Einsum broadcasts a summed dim of 1 (or of an unrelated symbol) against N, MatMul
    does not; the same symbol on both sides is equal."""
    with pytest.raises(NoMatch):
        einsum_matmul("ij,jk->ik", np.ones((3, 1)), np.ones((4, 5)))
    with pytest.raises(NoMatch):
        einsum_matmul("ij,jk->ik", _activation("a", [3, "J"]), _activation("b", ["K", 5]))
    assert einsum_matmul("ij,jk->ik", _activation("a", [3, "J"]),
                         _activation("b", ["J", 5])) == [None, None, False, None]
