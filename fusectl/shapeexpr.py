"""Static evaluation of run-time shape arithmetic: the constant target of a Reshape whose
target is computed from ``Shape(x)``.

Exporters before opset 14 (TorchScript, Paddle2ONNX, tf2onnx) write ``x.view(b, c, h*w)`` as
Shape -> Gather/Slice -> Cast/Unsqueeze/Mul -> Concat -> Reshape. When a dim of x is dynamic,
constant folding cannot fold the chain, and onnx's shape inference (below opset 14, or when
strict inference fails) leaves the Reshape untyped, so every rule downstream is blind. Most of
these targets are still constants for the purposes of Reshape: the static dims are known, a
dynamic dim that lands at its own position is a copy (a 0 when allowzero is 0), and one other
unknown entry can be a -1. ``runtime_shape_target`` (the rule expression function of
``reshape-runtime-target``, rules/05-cleanup.yaml) computes that constant or refuses.

Soundness: the new Reshape has the same input and the same allowzero as the old one, so a
known entry is written as its exact run-time value (a 0 or -1 in the run-time target means
the same in the constant), a copy is written as 0, and the one unknown entry as -1, which
Reshape infers back to the same value from the element count, as long as the other entries
are known and non-zero (a -1 beside an empty dim is an error). Every op is evaluated as
onnxruntime does (integer Div truncates toward zero, Cast from float truncates); anything
else, any doubt and any graph larger than a small budget is a NoMatch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from .expr import (
    NoMatch,
    _const_tensor,
    _shape_of_known_rank,
    is_value,
    symbolic_product,
    symbolic_quotient,
)

MAX_SHAPE_NODES = 64
"""Nodes one target may be computed from: shape arithmetic is a handful of nodes per Reshape,
and a hostile graph must not make one match expensive."""

MAX_ENTRIES = 64
"""Elements of a tensor in the shape arithmetic (a Reshape target has one per output dim)."""


@dataclass(frozen=True)
class Dim:
    """The run-time size of dim ``axis`` of the Reshape's input, not known statically."""

    axis: int


@dataclass(frozen=True)
class Named:
    """The run-time size of a dim inference named (``batch_size``), of any value."""

    name: str


Entry = bool | int | float | Dim | Named | None
"""One element of a shape tensor: its value (a bool in a comparison's result), a dim of the
Reshape's input, a named dim, or None (unknown)."""

MINTED_SYMBOL = re.compile(r"unk__\d+")
"""onnx's inference names a dim it cannot compute so: a fresh symbol, not a known size."""


def is_minted(name: str | None) -> bool:
    """Whether a dim's name says nothing of its size: none, or a symbol onnx minted."""
    return name is None or MINTED_SYMBOL.fullmatch(name) is not None


STAND_IN_PREFIX = "anon__"
"""How symdims names a graph input's anonymous dim while optimizing: ``anon__<input>_<axis>``
by the input's position, a name of one axis of one input, unknown to the traffic model,
removed before saving. A model already using such names gets none."""

STAND_IN = re.compile(r"anon__\d+_\d+")


def is_stand_in(name: str | None) -> bool:
    """Whether a dim's name is symdims' stand-in for an anonymous input dim."""
    return name is not None and STAND_IN.fullmatch(name) is not None


def mentions_minted(name: str | None) -> bool:
    """Whether a dim's name holds (``unk__3*2``) a symbol onnx minted."""
    return name is not None and MINTED_SYMBOL.search(name) is not None


def mentions_stand_in(name: str | None) -> bool:
    """Whether a dim's name is or holds (``anon__0_1*4``) a stand-in."""
    return name is not None and STAND_IN.search(name) is not None


MAX_EXPRESSION = 64
"""Characters of a dim read as an expression at most (torch writes ``s16 + s62``)."""


OPAQUE_OPERATORS = ("/", "%", "**", "^")
"""Operators onnx-ir's parser reads in a dim name that a name does not mean: a dim declared
``h/2`` is no half of another named ``h`` (sympy would add two of them up to ``h``), so such
a name gets no arithmetic (symdims) and is checked against no other dims (validate)."""


def expression_symbols(dim: ir.SymbolicDim,
                       named: Callable[[str], bool]) -> frozenset[str] | None:
    """The symbols of a dim spelled as an expression of other dims (torch's ``s16 + s62``:
    new tokens + past ones), or None when the dim is a name of its own: an identifier, text
    onnx-ir cannot parse, or an expression with a symbol ``named`` refuses (``seq-len`` is
    seq - len only in a model that has dims called ``seq`` and ``len``)."""
    name = dim.value
    if name is None or name.isidentifier() or len(name) > MAX_EXPRESSION or "**" in name:
        return None  # a power or a long text is a name: onnx-ir would compute 9**9**9
    try:
        symbols = frozenset(str(s) for s in dim.free_symbols())
    except Exception:  # noqa: BLE001 - a name onnx-ir cannot parse is just a name
        return None
    return symbols if all(named(s) for s in symbols) else None  # none: a number ("2*3")


def input_dim_names(graph: ir.Graph) -> frozenset[str]:
    """The dims a graph's inputs name on their own: the symbols an expression dim elsewhere
    in the model may be made of."""
    return frozenset(
        d.value for v in graph.inputs if v.shape is not None for d in v.shape
        if isinstance(d, ir.SymbolicDim) and d.value is not None and d.value.isidentifier())

_INT_RANGES = {ir.DataType.INT64: (-(2**63), 2**63 - 1), ir.DataType.INT32: (-(2**31), 2**31 - 1)}
_FLOAT_TYPES = {ir.DataType.FLOAT: np.float32, ir.DataType.DOUBLE: np.float64}
_BOOL = ir.DataType.BOOL
_ONNX_DOMAINS = ("", "ai.onnx")


@dataclass(frozen=True)
class ShapeTensor:
    """A 0-D or 1-D int32/int64/float/double tensor of the shape arithmetic, entry by entry."""

    entries: tuple[Entry, ...]
    rank: int
    dtype: ir.DataType


def runtime_shape_target(shape: Any, data: Any, allowzero: Any = 0) -> np.ndarray:
    """The constant target equal to the run-time target ``shape`` of ``Reshape(data, shape)``
    with that ``allowzero``: known entries as their values, ``data``'s own dynamic dim at its
    own position as 0 (a copy; allowzero 0 only), one other unknown entry as -1.

    No match for a second unknown entry (a -1 in the run-time target counts as one), an
    unknown entry beside a 0 or a copy, a value below -1, a shape computed by anything but
    constants, Shape and the ops below, or a computation larger than ``MAX_SHAPE_NODES``
    nodes."""
    copies = allowzero is None or int(allowzero) == 0
    result = _Evaluator(data).evaluate(shape)
    if result.rank != 1 or result.dtype != ir.DataType.INT64:
        raise NoMatch("the run-time target is not a 1-D int64 tensor")
    target: list[int] = []
    inferred = False  # an unknown entry written as -1
    for position, entry in enumerate(result.entries):
        if isinstance(entry, int):
            if entry < -1:
                raise NoMatch(f"the run-time target holds {entry}")
            target.append(entry)
        elif isinstance(entry, Dim) and entry.axis == position and copies:
            target.append(0)
        else:
            target.append(-1)
            inferred = True
    if target.count(-1) > 1:
        raise NoMatch("more than one entry of the run-time target is unknown")
    if inferred and any(d <= 0 for d in target if d != -1):
        # Reshape cannot infer a -1 when the other dims multiply to 0, so an empty input
        # that the run-time target reshaped would fail
        raise NoMatch("an unknown entry beside a 0 or a copied dim (which may be empty)")
    if not copies and 0 in target and -1 in target:
        raise NoMatch("allowzero=1 with both a 0 and a -1 (an invalid Reshape)")
    return np.asarray(target, dtype=np.int64)


def dim_name(value: Any) -> str | None:
    """The name of the dim a scalar or one-element vector computed from Shape is (the
    ``Gather(Shape(input_ids), 1)`` of input_ids ``[batch_size, sequence_length]`` is
    ``sequence_length``); None when it is anything else or cannot be told."""
    try:
        result = _Evaluator(None, names=True).evaluate(value)
    except NoMatch:
        return None
    if len(result.entries) != 1 or not isinstance(result.entries[0], Named):
        return None
    return result.entries[0].name


def shape_entries(shape: Any, data: Any = None) -> tuple[Entry, ...] | None:
    """The entries of a run-time 1-D int64 shape vector (a Reshape's or Expand's target):
    constants as ints, dims of ``data`` as ``Dim``, other named dims as ``Named``, anything
    else None; None when the vector cannot be read at all."""
    try:
        result = _Evaluator(data, names=True).evaluate(shape)
    except NoMatch:
        return None
    if result.rank != 1 or result.dtype != ir.DataType.INT64:
        return None
    return result.entries


class _Evaluator:
    """Evaluates the producers of one shape tensor, each node once, within the budget.
    ``names``: a named dim of any value is a ``Named`` entry (else only the Reshape input's
    are known, by position), symbols onnx's inference minted excepted."""

    def __init__(self, data: Any, *, names: bool = False) -> None:
        self.data = data
        self.names = names
        self.budget = MAX_SHAPE_NODES
        self.done: dict[int, ShapeTensor] = {}
        # A named dynamic dim of another value is the same run-time size as the input's dim
        # of that name (what the rules' shape comparisons assume too): exporters take the
        # batch and sequence dims from the block's input, not from the Reshape's own input.
        self.axis_of_name: dict[str, int] = {}
        shape = data.shape if is_value(data) else None
        for axis, dim in enumerate(shape or ()):
            if not isinstance(dim, int) and dim.value is not None:
                self.axis_of_name.setdefault(dim.value, axis)

    def evaluate(self, value: Any) -> ShapeTensor:
        if not is_value(value):
            raise NoMatch("the target shape is not a value of the graph")
        known = self.done.get(id(value))
        if known is not None:
            return known
        tensor = _const_tensor(value)
        if tensor is not None:
            result = _constant(tensor)
        else:
            node = value.producer()
            if node is None:
                raise NoMatch(f"{value.name or 'the shape'} is a graph input")
            self.budget -= 1
            if self.budget < 0:
                raise NoMatch(f"the shape is computed by more than {MAX_SHAPE_NODES} nodes")
            result = self._node(node)
        self.done[id(value)] = result
        return result

    def _node(self, node: ir.Node) -> ShapeTensor:
        if node.domain not in _ONNX_DOMAINS or len(node.outputs) != 1:
            raise NoMatch(f"{node.op_type} in the shape computation")
        op = node.op_type
        if op == "Shape":
            return self._shape(node)
        if op == "Constant":
            return _constant_attribute(node)
        if op == "Concat":
            return _concat(node, [self._input(node, i) for i in range(len(node.inputs))])
        if op in _ELEMENTWISE:
            a, b = self._input(node, 0), self._input(node, 1)
            result = _elementwise(op, a, b)
            return self._named_arithmetic(op, a, b, result) if self.names else result
        if op == "Equal":
            return _equal(self._input(node, 0), self._input(node, 1))
        if op == "Where":
            return _where(*(self._input(node, i) for i in range(3)))
        handler = _UNARY.get(op)
        if handler is None:
            raise NoMatch(f"{op} in the shape computation")
        return handler(node, self._input(node, 0))

    def _named_arithmetic(self, op: str, a: ShapeTensor, b: ShapeTensor,
                          result: ShapeTensor) -> ShapeTensor:
        """``result`` (``op`` of ``a`` and ``b``) with the entries it left unknown named where
        they are 0 (a named dim less itself), a sum of named dims and a number (a mask over
        past + new tokens: ``past_sequence_length + sequence_length``; ``S + 8``) or such a
        sum less some of its terms (``(S + 8) - 8`` is ``S``), a product of named dims and positive
        integers (BLOOM's ``batch_size * num_heads``: ``4*batch_size``), or such a product
        divided exactly (``4*batch_size / 4`` is ``batch_size``)."""
        if a.dtype not in _INT_RANGES:
            return result
        entries = list(result.entries)
        for index, (x, y) in enumerate(_broadcast_pairs(a, b)):
            if entries[index] is not None:
                continue
            first, second = self._factor(x), self._factor(y)
            if op == "Sub" and isinstance(first, str) and first == second:
                entries[index] = 0  # a named dim less itself (GPT-Neo's key minus query length)
                continue
            name = _combine(op, first, second)
            if isinstance(name, int):
                entries[index] = name
            elif name is not None:
                axis = self.axis_of_name.get(name)
                entries[index] = Dim(axis) if axis is not None else Named(name)
        return ShapeTensor(tuple(entries), result.rank, result.dtype)

    def _factor(self, entry: Entry) -> str | int | None:
        """A named dim's name, a positive integer, else None."""
        if isinstance(entry, int) and not isinstance(entry, bool):
            return entry if entry >= 1 else None
        return self._name(entry)

    def _name(self, entry: Entry) -> str | None:
        """The name of a named dim entry (one of the input's, by its axis), or None."""
        if isinstance(entry, Named):
            return entry.name
        shape = self.data.shape if isinstance(entry, Dim) and is_value(self.data) else None
        dim = shape[entry.axis] if shape is not None and entry.axis < len(shape) else None
        if dim is None or isinstance(dim, int) or is_minted(dim.value):
            return None
        return dim.value

    def _input(self, node: ir.Node, index: int) -> ShapeTensor:
        if index >= len(node.inputs) or node.inputs[index] is None:
            raise NoMatch(f"{node.op_type} lacks input {index}")
        return self.evaluate(node.inputs[index])

    def _shape(self, node: ir.Node) -> ShapeTensor:
        source = node.inputs[0]
        dims = _shape_of_known_rank(source)
        # A graph output's dims may be only declared by the exporter, never checked by
        # inference: they say nothing about its run-time shape (prepare does not fold them),
        # except what its producer tells (a KV cache's present, Concat(past, new)).
        if source is not self.data and source.is_graph_output():
            dims = _concat_kept_dims(source, len(dims))
        entries: list[Entry] = []
        for axis, dim in enumerate(dims):
            if dim is None:
                entries.append(None)
            elif isinstance(dim, int):
                entries.append(dim)
            elif source is self.data:
                entries.append(Dim(axis))
            elif dim is not None and dim in self.axis_of_name:
                entries.append(Dim(self.axis_of_name[dim]))
            elif self.names and not is_minted(dim):
                entries.append(Named(dim))
            else:
                entries.append(None)
        start, end = _int_attr(node, "start", 0), _int_attr(node, "end", len(entries))
        return ShapeTensor(tuple(entries[start:end]), 1, ir.DataType.INT64)


# ----------------------------------------------------------------------------- reading


def _concat_kept_dims(value: ir.Value, rank: int) -> tuple[int | str | None, ...]:
    """The dims of a Concat's output along the axes it does not concatenate, where all its
    inputs agree on them (onnxruntime skips an empty input, an empty past of another batch,
    so one input alone tells nothing); None elsewhere, for an input whose shape is unknown
    or only declared (a graph output's), and for any other producer."""
    unknown: tuple[int | str | None, ...] = (None,) * rank
    node = value.producer()
    if node is None or node.op_type != "Concat" or node.domain not in _ONNX_DOMAINS:
        return unknown
    axis = node.attributes.get("axis")
    if axis is None or not isinstance(axis.value, int) or not -rank <= axis.value < rank:
        return unknown
    shapes = []
    for source in node.inputs:
        if source is None or source.shape is None or source.is_graph_output() \
                or len(source.shape) != rank:
            return unknown
        shapes.append(_shape_of_known_rank(source))
    return tuple(None if i == axis.value % rank or len({s[i] for s in shapes}) != 1
                 else shapes[0][i] for i in range(rank))


def _constant(tensor: ir.TensorProtocol) -> ShapeTensor:
    if len(tensor.shape) > 1 or tensor.size > MAX_ENTRIES:
        raise NoMatch("a constant in the shape computation is not a short vector")
    dtype = tensor.dtype
    if dtype in _INT_RANGES:
        entries: tuple[Entry, ...] = tuple(int(v) for v in tensor.numpy().reshape(-1))
    elif dtype in _FLOAT_TYPES:
        entries = tuple(float(v) for v in tensor.numpy().reshape(-1))
    elif dtype == _BOOL:
        entries = tuple(bool(v) for v in tensor.numpy().reshape(-1))
    else:
        raise NoMatch(f"a {dtype} constant in the shape computation")
    return ShapeTensor(entries, len(tensor.shape), dtype)


def _constant_attribute(node: ir.Node) -> ShapeTensor:
    """A Constant given as ``value_int(s)``/``value_float(s)`` (a ``value`` tensor is read
    by expr's constant lookup)."""
    for name, dtype, rank in (("value_int", ir.DataType.INT64, 0),
                              ("value_ints", ir.DataType.INT64, 1),
                              ("value_float", ir.DataType.FLOAT, 0),
                              ("value_floats", ir.DataType.FLOAT, 1)):
        attr = node.attributes.get(name)
        if attr is not None:
            values = np.asarray(attr.value, dtype=_FLOAT_TYPES.get(dtype, np.int64))
            if values.size > MAX_ENTRIES:
                break
            return _constant(ir.tensor(values.reshape((-1,) if rank else ()), dtype=dtype))
    raise NoMatch("a Constant that is not a short int or float vector")


def _int_attr(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.value)


def _ints(node: ir.Node, attribute: str, index: int) -> list[int] | None:
    """A list operand that moved from an attribute to an input (Unsqueeze/Squeeze axes at
    opset 13, Slice bounds at opset 10): the constant ints, or None when absent."""
    attr = node.attributes.get(attribute)
    if attr is not None:
        return [int(v) for v in attr.value]
    if index >= len(node.inputs) or node.inputs[index] is None:
        return None
    return list(_const_ints(node, index).entries)  # type: ignore[arg-type]


def _const_ints(node: ir.Node, index: int) -> ShapeTensor:
    """Input ``index`` of ``node``, which must be an integer constant (Gather indices...)."""
    value = node.inputs[index] if index < len(node.inputs) else None
    tensor = None if value is None else _const_tensor(value)
    if tensor is None:
        raise NoMatch(f"input {index} of {node.op_type} is not a constant")
    values = _constant(tensor)
    if values.dtype not in _INT_RANGES:
        raise NoMatch(f"input {index} of {node.op_type} is not an integer")
    return values


def _first_axis(axes: list[int] | None) -> None:
    """Shape tensors are vectors: an axes operand must name their only axis."""
    if axes is not None and axes not in ([0], [-1]):
        raise NoMatch(f"axes {axes} on a shape vector")


# ----------------------------------------------------------------------------- ops


def _identity(node: ir.Node, x: ShapeTensor) -> ShapeTensor:
    return x


def _concat(node: ir.Node, parts: list[ShapeTensor]) -> ShapeTensor:
    if _int_attr(node, "axis", 0) not in (0, -1) or not parts:
        raise NoMatch("Concat of shape vectors along another axis")
    if any(p.rank != 1 or p.dtype != parts[0].dtype for p in parts):
        raise NoMatch("Concat of something else than vectors of one dtype")
    entries = tuple(e for p in parts for e in p.entries)
    if len(entries) > MAX_ENTRIES:
        raise NoMatch(f"a shape vector longer than {MAX_ENTRIES}")
    return ShapeTensor(entries, 1, parts[0].dtype)


def _gather(node: ir.Node, x: ShapeTensor) -> ShapeTensor:
    if _int_attr(node, "axis", 0) not in (0, -1) or x.rank != 1:
        raise NoMatch("Gather from something else than a vector")
    indices = _const_ints(node, 1)
    size = len(x.entries)
    if not all(-size <= i < size for i in indices.entries):  # type: ignore[operator]
        raise NoMatch("a Gather index is out of range")
    entries = tuple(x.entries[i] for i in indices.entries)  # type: ignore[index]
    return ShapeTensor(entries, indices.rank, x.dtype)


def _slice(node: ir.Node, x: ShapeTensor) -> ShapeTensor:
    starts, ends = _ints(node, "starts", 1), _ints(node, "ends", 2)
    axes, steps = _ints(node, "axes", 3), _ints(node, "steps", 4)
    if x.rank != 1 or starts is None or ends is None or len(starts) != 1 or len(ends) != 1:
        raise NoMatch("Slice of something else than a vector")
    _first_axis(axes)
    step = 1 if steps is None else steps[0]
    if (steps is not None and len(steps) != 1) or step == 0:
        raise NoMatch("Slice with a step of 0 or several steps")
    # Python slices clamp and count from the end exactly as ONNX Slice does
    return ShapeTensor(x.entries[starts[0]:ends[0]:step], 1, x.dtype)


def _unsqueeze(node: ir.Node, x: ShapeTensor) -> ShapeTensor:
    axes = _ints(node, "axes", 1)
    if x.rank != 0 or axes is None:
        raise NoMatch("Unsqueeze of something else than a scalar")
    _first_axis(axes)
    return ShapeTensor(x.entries, 1, x.dtype)


def _squeeze(node: ir.Node, x: ShapeTensor) -> ShapeTensor:
    _first_axis(_ints(node, "axes", 1))
    if x.rank != 1 or len(x.entries) != 1:
        raise NoMatch("Squeeze of something else than a one-element vector")
    return ShapeTensor(x.entries, 0, x.dtype)


def _reshape(node: ir.Node, x: ShapeTensor) -> ShapeTensor:
    target = list(_const_ints(node, 1).entries)
    if target == [] and len(x.entries) == 1:
        return ShapeTensor(x.entries, 0, x.dtype)
    if target in ([-1], [len(x.entries)]) and len(x.entries) > 0:
        return ShapeTensor(x.entries, 1, x.dtype)
    raise NoMatch(f"Reshape of a shape vector to {target}")


def _cast(node: ir.Node, x: ShapeTensor) -> ShapeTensor:
    try:
        to = ir.DataType(_int_attr(node, "to", 0))
    except ValueError:  # not a data type: onnxruntime refuses the model, not this evaluator
        raise NoMatch("Cast to an unknown data type") from None
    if to in _INT_RANGES:
        low, high = _INT_RANGES[to]
        entries = [_to_int(e, low, high) for e in x.entries]
    elif to in _FLOAT_TYPES:
        entries = [_to_float(e, to) for e in x.entries]
    else:
        raise NoMatch(f"Cast to {to} in the shape computation")
    return ShapeTensor(tuple(entries), x.rank, to)


def _to_int(entry: Entry, low: int, high: int) -> Entry:
    if isinstance(entry, bool):
        return int(entry)
    if isinstance(entry, float):
        if not math.isfinite(entry):
            raise NoMatch("Cast of a non-finite float to an integer")
        entry = math.trunc(entry)  # onnxruntime casts with static_cast: toward zero
    if isinstance(entry, int) and not low <= entry <= high:
        raise NoMatch(f"Cast of {entry} out of the integer range")
    return entry  # a Dim keeps its meaning: tensor dims fit in int32


def _to_float(entry: Entry, to: ir.DataType) -> Entry:
    if isinstance(entry, (bool, int, float)):
        return float(_FLOAT_TYPES[to](entry))
    return None


def _rounding(op: str) -> Callable[[ir.Node, ShapeTensor], ShapeTensor]:
    def rounded(node: ir.Node, x: ShapeTensor) -> ShapeTensor:
        if x.dtype not in _FLOAT_TYPES:
            raise NoMatch(f"{op} of an integer tensor")
        function = math.floor if op == "Floor" else math.ceil
        entries = [float(function(e)) if isinstance(e, float) and math.isfinite(e) else None
                   for e in x.entries]
        return ShapeTensor(tuple(entries), x.rank, x.dtype)
    return rounded


def _neg(node: ir.Node, x: ShapeTensor) -> ShapeTensor:
    """Neg: known numbers negated (the lowest integer wraps to itself, as in onnxruntime);
    a dim's negation is unknown here (symdims reads ``x[-n:]`` from the Neg itself)."""
    low = _INT_RANGES.get(x.dtype, (None,))[0]
    entries: list[Entry] = []
    for entry in x.entries:
        if isinstance(entry, bool) or not isinstance(entry, int | float):
            entries.append(None)
        else:
            entries.append(entry if entry == low else -entry)
    return ShapeTensor(tuple(entries), x.rank, x.dtype)


_UNARY: dict[str, Callable[[ir.Node, ShapeTensor], ShapeTensor]] = {
    "Identity": _identity,
    "Gather": _gather,
    "Slice": _slice,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Reshape": _reshape,
    "Cast": _cast,
    "Neg": _neg,
    "Floor": _rounding("Floor"),
    "Ceil": _rounding("Ceil"),
}
"""Ops evaluated from their first input (further inputs must be constants)."""

_ELEMENTWISE = ("Add", "Sub", "Mul", "Div")


def _elementwise(op: str, a: ShapeTensor, b: ShapeTensor) -> ShapeTensor:
    if a.dtype != b.dtype or a.dtype == _BOOL:
        raise NoMatch(f"{op} of {a.dtype} and {b.dtype}")
    n, m = len(a.entries), len(b.entries)
    if n != m and 1 not in (n, m):
        raise NoMatch(f"{op} of vectors of lengths {n} and {m}")
    size = max(n, m) if min(n, m) > 0 else 0
    entries = tuple(_arithmetic(op, a.entries[i % n], b.entries[i % m], a.dtype)
                    for i in range(size))
    return ShapeTensor(entries, max(a.rank, b.rank), a.dtype)


def _arithmetic(op: str, a: Entry, b: Entry, dtype: ir.DataType) -> Entry:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return None  # a dim of unknown size, or unknown
    if dtype in _FLOAT_TYPES:
        ftype = _FLOAT_TYPES[dtype]
        with np.errstate(all="ignore"):  # inf and nan are refused where they matter
            value = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply,
                     "Div": np.divide}[op](ftype(a), ftype(b))
        return float(value)
    a, b = int(a), int(b)
    if op == "Div":
        if b == 0:
            raise NoMatch("an integer division by zero in the shape computation")
        quotient = abs(a) // abs(b)  # onnxruntime's integer Div truncates toward zero
        value = quotient if (a < 0) == (b < 0) else -quotient
    else:
        value = {"Add": a + b, "Sub": a - b, "Mul": a * b}[op]
    low, high = _INT_RANGES[dtype]
    if not low <= value <= high:
        raise NoMatch(f"{op} overflows {dtype}")
    return value


SUM_TERMS = 8
"""Terms of a named sum at most (a mask over past + new tokens has two)."""


def _combine(op: str, a: str | int | None, b: str | int | None) -> str | int | None:
    """The name of ``a op b`` for named dims and positive integers (``_named_arithmetic``);
    a difference of sums may be a number (``(S + 8) - S`` is 8)."""
    if a is None or b is None or (isinstance(a, int) and isinstance(b, int)):
        return None
    if op in ("Add", "Sub"):
        return _sum_of(a, b, 1 if op == "Add" else -1)
    if op == "Mul":
        product = symbolic_product([a, b])
        return product if isinstance(product, str) else None
    if op == "Div":
        quotient = symbolic_quotient([a], [b])
        return quotient if isinstance(quotient, str) else None
    return None


def _sum_of(a: str | int, b: str | int, sign: int) -> str | int | None:
    """``a + b`` or ``a - b`` of sums of named dims and a number, spelled as exporters declare
    sums (optimum's ``past_sequence_length + sequence_length``, torch's ``s16 + s62``) and
    onnx-ir spells a dim plus a number: identifiers in sorted order, the number last, joined
    by `` + `` (``S + 8``), so the same sum computed either way round has one name.
    ``(S + 8) - 8`` is ``S`` again, as nn.Unfold's block count reads it. None for a
    difference that would leave a name less something (no size is known to be that large)
    and for terms that are no identifiers (products, minted symbols' expressions)."""
    first, second = sum_parts(a), sum_parts(b)
    if first is None or second is None:
        return None
    names, number = list(first[0]), first[1] + sign * second[1]
    if sign > 0:
        names += second[0]
    else:
        for name in second[0]:
            if name not in names:
                return None
            names.remove(name)
    if not names:
        return number
    if number < 0 or len(names) + (number > 0) > SUM_TERMS:
        return None
    return " + ".join(sorted(names) + ([str(number)] if number else []))


def sum_parts(entry: str | int) -> tuple[list[str], int] | None:
    """A sum's identifiers and its number (0 for none): ``S + 8`` is (["S"], 8)."""
    if isinstance(entry, int):
        return [], entry
    terms = entry.split(" + ")
    number = 0
    if terms[-1].isdigit():
        number = int(terms.pop())
    return (terms, number) if terms and all(t.isidentifier() for t in terms) else None


def sum_terms(name: str) -> list[str] | None:
    """The terms of a dim named as a sum (``_named_sum``'s spelling; a plain name is one
    term), or None when a term is not an identifier."""
    terms = name.split(" + ")
    return terms if all(t.isidentifier() for t in terms) else None


def _broadcast_pairs(*tensors: ShapeTensor) -> list[tuple[Entry, ...]]:
    """The entries of equally long (or one-entry) vectors, paired up as broadcasting does."""
    lengths = {len(t.entries) for t in tensors} - {1}
    if len(lengths) > 1:
        raise NoMatch(f"vectors of lengths {sorted(lengths)} do not broadcast")
    size = lengths.pop() if lengths else 1
    return [tuple(t.entries[i % len(t.entries)] for t in tensors) for i in range(size)]


def _equal(a: ShapeTensor, b: ShapeTensor) -> ShapeTensor:
    """``Equal``, as torch writes ``expand(batch, -1, -1)``: ``Where(Equal(s, -1), 1, s)``."""
    if a.dtype != b.dtype:
        raise NoMatch(f"Equal of {a.dtype} and {b.dtype}")
    entries = tuple(_same(x, y) for x, y in _broadcast_pairs(a, b))
    return ShapeTensor(entries, max(a.rank, b.rank), _BOOL)


def _same(a: Entry, b: Entry) -> bool | None:
    if a is None or b is None:
        return None
    numbers = [e for e in (a, b) if isinstance(e, (int, float))]
    if len(numbers) == 2:
        return a == b
    if a == b:
        return True  # one dim, or one name
    if numbers and numbers[0] < 0:
        return False  # a dim is never negative
    return None


def _where(condition: ShapeTensor, x: ShapeTensor, y: ShapeTensor) -> ShapeTensor:
    if condition.dtype != _BOOL or x.dtype != y.dtype:
        raise NoMatch("Where of something else than a bool condition and one dtype")
    entries = tuple(a if c is True else b if c is False else (a if a == b else None)
                    for c, a, b in _broadcast_pairs(condition, x, y))
    return ShapeTensor(entries, max(condition.rank, x.rank, y.rank), x.dtype)
