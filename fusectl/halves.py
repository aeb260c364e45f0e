"""Is a tensor's last axis two equal halves? The cos/sin tables of a rotary embedding.

Rotary embeddings written out in ops compute ``x * cos + rotate_half(x) * sin`` with tables
``cos = Cos(Concat(freqs, freqs))``: the same angles twice along the last axis. A fused
RotaryEmbedding takes only the first half, so a fusion is right only when the second half
equals the first. This module proves that from the graph: the table is built by a Concat of
one value with itself, or is a constant with equal halves, and everything between it and the
multiplication acts on every element alone (Cos, Sin, Cast, a scale) or moves whole rows
(Unsqueeze, Gather of positions, a Reshape keeping the last dim). Anything else is "not
proven", never a guess.

Interleaved rotary embeddings (GPT-J, CodeGen, Cohere) rotate adjacent pairs instead, with
tables ``repeat_interleave(cos(freqs), 2)``: every angle twice in a row, ``t[..., 2i] ==
t[..., 2i + 1]``. ``repeats_pairs`` proves that the same way; it is a property of the flat
(row-major) order whenever the last dim is even, so a Reshape between even last dims keeps
it, and ``Tile``/``Expand``/``Concat`` of a last dim of 1 to an even one (the exporters'
spelling of ``repeat_interleave``) creates it.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .expr import NoMatch, _const_tensor, _shape_of_known_rank
from .shapeexpr import _ints

MAX_NODES = 32
"""Producers visited per question: the tables are built by a handful of ops; a hostile graph
cannot make the walk expensive."""

_ELEMENTWISE_UNARY = frozenset({
    "Cos", "Sin", "Cast", "Neg", "Identity", "Exp", "Sqrt", "Reciprocal", "Abs", "Relu",
    "Tanh", "Sigmoid", "Erf", "Floor", "Ceil", "Round", "Sign",
})
_ELEMENTWISE_BINARY = frozenset({"Mul", "Div", "Add", "Sub", "Pow", "Max", "Min"})


def repeats_halves(value: ir.Value) -> bool:
    """Whether ``value``'s last axis has an even, static length and its second half always
    equals its first, whatever the graph inputs are."""
    return _even_last(value) and _proven(value, [MAX_NODES], pairs=False)


def repeats_pairs(value: ir.Value) -> bool:
    """Whether ``value``'s last axis has an even, static length and each element at an even
    index always equals the next one (``t[..., 2i] == t[..., 2i + 1]``)."""
    return _even_last(value) and _proven(value, [MAX_NODES], pairs=True)


def _even_last(value: ir.Value) -> bool:
    rank = _rank(value)
    if rank is None or rank == 0:
        return False
    last = _dim(value, -1)
    return isinstance(last, int) and last % 2 == 0


def _proven(value: ir.Value, budget: list[int], *, pairs: bool) -> bool:
    budget[0] -= 1
    if budget[0] < 0:
        return False
    tensor = _const_tensor(value)
    if tensor is not None:
        return _constant_repeats(tensor.numpy(), pairs)
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return False
    op = node.op_type
    if op in _ELEMENTWISE_UNARY:
        return _same_last_dim(node.inputs[0], value) and _proven(node.inputs[0], budget,
                                                                  pairs=pairs)
    if op in _ELEMENTWISE_BINARY:
        return all(_operand_proven(operand, value, budget, pairs) for operand in node.inputs)
    if op in ("Concat", "Tile", "Expand") and _repeats_last_axis(node, value, pairs):
        return True
    if _keeps_last_axis(node, value):
        return _proven(node.inputs[0], budget, pairs=pairs)
    if pairs and op in ("Reshape", "Flatten") \
            and _even_width(_built_last(node.inputs[0], [MAX_NODES])):
        # The pairs are pairs of the flat order; both last dims even keeps them aligned. The
        # input's width is read from the ops that build it, never from a declared shape.
        return _proven(node.inputs[0], budget, pairs=True)
    if pairs and op == "Gather":
        return _gathers_pairs(node)
    return False


def _constant_repeats(array: np.ndarray, pairs: bool) -> bool:
    if array.ndim == 0 or array.shape[-1] % 2:
        return False
    if pairs:
        return bool(np.array_equal(array[..., 0::2], array[..., 1::2], equal_nan=True))
    half = array.shape[-1] // 2
    return bool(np.array_equal(array[..., :half], array[..., half:], equal_nan=True))


def _operand_proven(operand: ir.Value | None, result: ir.Value, budget: list[int],
                    pairs: bool) -> bool:
    """An operand of an elementwise op keeps the repeats when it has them itself or is
    the same along the result's last axis (a scalar scale, a last dim of 1)."""
    if operand is None:
        return False
    rank = _rank(operand)
    if rank is None:
        return False
    if rank == 0 or _dim(operand, -1) == 1:
        return True
    return _same_last_dim(operand, result) and _proven(operand, budget, pairs=pairs)


def _repeats_last_axis(node: ir.Node, value: ir.Value, pairs: bool) -> bool:
    """The op itself writes the repeats along the last axis. Halves: ``Concat(a, a)`` or a
    Tile by 2. Pairs: a last dim of 1 stacked, tiled or broadcast to an even one (the
    exporters' ``repeat_interleave``, whose Reshape then merges that axis)."""
    data = node.inputs[0] if node.inputs else None
    rank = _rank(value)
    if data is None or rank is None or _rank(data) != rank:
        return False
    if pairs and (_built_last(data, [MAX_NODES]) != 1
                  or not _even_width(_built_last(value, [MAX_NODES]))):
        return False  # a last dim of 1 made even, both read from the ops, not declarations
    op = node.op_type
    if op == "Concat":
        axis = node.attributes.get_int("axis", 0)
        return axis in (-1, rank - 1) and len(node.inputs) == 2 and node.inputs[1] is data
    if op == "Tile":
        repeats = _constant_list(node, "")
        if repeats is None or len(repeats) != rank:
            return False
        return repeats[-1] % 2 == 0 if pairs else repeats[-1] == 2
    return op == "Expand" and pairs  # 1 broadcast to the value's even last dim


def _even_width(width: int | None) -> bool:
    return isinstance(width, int) and width > 0 and width % 2 == 0


def _built_last(value: ir.Value | None, budget: list[int]) -> int | None:
    """The last dim of ``value`` as the ops that build it set it (a constant's shape, an
    Unsqueeze of the last axis, constant Tile repeats and Expand targets, Concat, ops that
    keep the shape), or None. A declared dim that inference could not recompute is a claim
    nobody checks: a stale [8, M, 2] on a tensor that is [8, 16, 1] at run time would prove
    pairs that are not there."""
    budget[0] -= 1
    if value is None or budget[0] < 0:
        return None
    tensor = _const_tensor(value)
    if tensor is not None:
        return int(tensor.shape[-1]) if len(tensor.shape) else None
    node = value.producer()
    rank = _rank(value)
    if node is None or rank is None or rank == 0 or node.domain not in ("", "ai.onnx"):
        return None
    op, data = node.op_type, node.inputs[0] if node.inputs else None
    if op in _ELEMENTWISE_UNARY:
        return _built_last(data, budget)
    if op == "Unsqueeze":
        axes = _constant_list(node, "axes")
        if axes is None:
            return None
        return 1 if rank - 1 in {a % rank for a in axes} else _built_last(data, budget)
    entries = _constant_list(node, "") if op in ("Tile", "Expand") \
        and len(node.inputs) == 2 else None
    if op == "Tile" and entries:
        width = _built_last(data, budget)
        return None if width is None else width * entries[-1]
    if op == "Expand" and entries and entries[-1] >= 0:
        return entries[-1] if entries[-1] != 1 else _built_last(data, budget)
    if op == "Concat" and node.attributes.get_int("axis", 0) in (-1, rank - 1):
        widths = [_built_last(v, budget) for v in node.inputs]
        return None if None in widths else sum(widths)  # type: ignore[arg-type]
    return None


def _constant_list(node: ir.Node, attribute: str) -> list[int] | None:
    """The constant ints of ``node``'s attribute, or else of its second input (Unsqueeze's
    axes, Tile's repeats, Expand's target), or None."""
    try:
        return _ints(node, attribute, 1)
    except NoMatch:
        return None


def _gathers_pairs(node: ir.Node) -> bool:
    """A Gather along the last axis by constant indices that come in equal pairs."""
    data, indices = (node.inputs[0], node.inputs[1]) if len(node.inputs) == 2 else (None, None)
    rank = _rank(data) if data is not None else None
    table = _const_tensor(indices) if indices is not None else None
    if rank is None or table is None:
        return False
    if node.attributes.get_int("axis", 0) not in (-1, rank - 1):
        return False
    last = _dim(data, -1)
    ids = table.numpy()
    if not isinstance(last, int) or ids.ndim == 0 or ids.shape[-1] % 2:
        return False
    ids = np.where(ids < 0, ids + last, ids)
    return bool(np.array_equal(ids[..., 0::2], ids[..., 1::2]))


def _keeps_last_axis(node: ir.Node, value: ir.Value) -> bool:
    """Ops that move or repeat whole rows: the output's last axis is the data input's last
    axis, element for element."""
    data = node.inputs[0] if node.inputs else None
    if data is None or not _same_last_dim(data, value):
        return False
    in_rank, out_rank = _rank(data), _rank(value)
    if in_rank is None or out_rank is None:
        return False
    op = node.op_type
    if op in ("Unsqueeze", "Squeeze", "Reshape", "Expand", "Flatten"):
        # With the last dim equal on both sides, row-major order keeps each row whole.
        return op != "Flatten" or node.attributes.get_int("axis", 1) < in_rank
    if op == "Transpose":
        perm = node.attributes.get_ints("perm", None)
        return perm is not None and list(perm)[-1] == in_rank - 1
    if op == "Gather":
        axis = node.attributes.get_int("axis", 0)
        return axis not in (-1, in_rank - 1)
    if op == "Slice":
        axes = node.inputs[3] if len(node.inputs) > 3 else None
        if axes is None:
            return False  # slices from axis 0 on, maybe the last one
        tensor = _const_tensor(axes)
        return tensor is not None and all(
            int(a) not in (-1, in_rank - 1) for a in tensor.numpy().reshape(-1))
    return False


def _same_last_dim(a: ir.Value | None, b: ir.Value) -> bool:
    if a is None:
        return False
    dim = _dim(a, -1)
    return isinstance(dim, int) and dim == _dim(b, -1)


def _shape(value: ir.Value) -> tuple[int | str | None, ...] | None:
    """Dims of a value (None for an unknown dim), or None when its rank is unknown."""
    try:
        return _shape_of_known_rank(value)
    except NoMatch:
        return None


def _rank(value: ir.Value) -> int | None:
    shape = _shape(value)
    return None if shape is None else len(shape)


def _dim(value: ir.Value, axis: int) -> int | str | None:
    shape = _shape(value)
    return shape[axis] if shape else None
