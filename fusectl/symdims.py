"""Name the dims onnx's shape inference loses where the model's own shape arithmetic tells
them: exports with dynamic axes compute the targets of Reshape, Expand, ConstantOfShape,
Slice and Range from ``Shape(x)`` at run time.

onnx's inference, even with data propagation, gives a fresh symbol (``unk__N``) to the
``-1`` of ``Reshape(x, [b, s, -1, 16])`` beside a symbolic dim, to torch's
``expand(batch, -1, -1)`` (written ``Expand(t, Where(Equal(s, -1), 1, s))``), to a
``Flatten`` of symbolic dims, to ``position_ids[:, :seq_len]`` and to the length of
``arange(input_ids.size(1))``. From there on nothing can be shown to have the input's batch
or sequence length, or 4 heads: the attention rules refuse.

Each such output's dims are read with shapeexpr's evaluator (each op evaluated as
onnxruntime does; a ``-1`` is the quotient of the products of the dims), the symbols onnx
minted downstream of it are forgotten, and onnx's inference runs again; it keeps a declared
dim it cannot compute itself, so the names flow on. A name reaching a ``Shape`` downstream
lets the next target be read, so rounds repeat while one names something new. Equal names
are equal sizes, a name spelled ``a*b`` is the product of ``a`` and ``b``, as everywhere in
the rules, and a slice from 0 to a named length has that length (a run with a shorter
buffer fails where the slice meets the sequence). A slice dropping a fixed number of
elements from a named axis (clamped: ``Max(0, S - k)``), a Pad with constant pads and a
Concat along a named axis are named by onnx-ir's symbolic arithmetic (``sequence_length - 1``,
``past + 2*seq``), which takes a named dim to be at least 1.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import onnx_ir as ir

from .expr import SLICE_TO_END, NoMatch, symbolic_product, symbolic_quotient
from .shapeexpr import (
    OPAQUE_OPERATORS,
    STAND_IN_PREFIX,
    Dim,
    Entry,
    Named,
    _const_ints,
    _ints,
    dim_name,
    is_minted,
    mentions_stand_in,
    shape_entries,
    sum_parts,
    sum_terms,
)
from .shapes import _plain_dim, try_infer_model_shapes

MAX_CONCAT_INPUTS = 32
"""Concats with more inputs get no summed name (``_concat_dims``)."""

MAX_ROUNDS = 24
"""Rounds of naming and re-inference: a name computed in one round is read by the next
shape computation downstream (the batch dim of an Expand, then the heads' Reshape)."""

_ONNX_DOMAINS = ("", "ai.onnx")

Dims = list[int | str | None]
"""A shape as plain dims: ints, names, None for a dim not known; a symbol onnx minted is
kept as its name but counts as unknown (``_unknown``)."""

_INFERRED = object()
"""The ``-1`` entry of a Reshape target, while its size is computed."""


def name_lost_dims(model: ir.Model) -> bool:
    """Name the dims of the main graph's shape-computing ops that onnx left unknown, then
    infer shapes again, round after round; True when a shape changed. Nothing changes when
    nothing needs a name, and a round whose inference fails is undone."""
    graph = model.graph
    changed = False
    for _ in range(MAX_ROUNDS):
        found = _computable_shapes(graph)
        if not found:
            break
        if not _infer_with(model, {value: ir.Shape(dims) for value, dims in found.items()}):
            break
        changed = True
    return changed


def name_anonymous_input_dims(model: ir.Model) -> bool:
    """Give each anonymous dim of the main graph's inputs a name of its own
    (``anon__0_1``: axis 1 of the first input) and infer shapes again; True when one was named.

    onnx's inference mints a fresh symbol for such a dim at every value it reaches (the
    hidden states of a ``[1, ?]`` input_ids are ``[unk__5, unk__6, 16]``), so no two values
    can be shown to be as long, and the shape arithmetic reading it cannot be named: the
    attention rules refuse. A name of one axis of one input equals only itself, which is
    true. ``forget_stand_ins`` removes the names before the model is saved."""
    graph = model.graph
    if any(mentions_stand_in(name) for name in _dim_names(model)):
        return False  # the model's own names look like stand-ins: they could not be told apart
    named: dict[ir.Value, ir.Shape] = {}
    for index, value in enumerate(graph.inputs):
        shape = value.shape
        if value.is_initializer() or shape is None \
                or not any(isinstance(d, ir.SymbolicDim) and d.value is None for d in shape):
            continue
        named[value] = ir.Shape([
            f"{STAND_IN_PREFIX}{index}_{axis}"
            if isinstance(d, ir.SymbolicDim) and d.value is None else d
            for axis, d in enumerate(shape)])
    return bool(named) and _infer_with(model, named)


def _infer_with(model: ir.Model, fixed: dict[ir.Value, ir.Shape]) -> bool:
    """Give the ``fixed`` values their shapes and infer again; False (and everything as it
    was) when onnx's inference fails. Only what depends on them is inferred afresh: elsewhere
    the symbols onnx minted stay, and with them what they tell (two values with one symbol
    are as long)."""
    downstream = _downstream(model.graph, list(fixed))
    saved = {value: value.shape for value in [*fixed, *downstream]}
    for value in downstream:
        shape = value.shape
        if shape is not None and any(_minted(d) for d in shape):
            value.shape = ir.Shape([None if _minted(d) else d for d in shape])
    for value, shape in fixed.items():
        value.shape = shape
    if try_infer_model_shapes(model) is None:
        for value, shape in saved.items():
            value.shape = shape
        return False
    return True


def _dim_names(model: ir.Model) -> set[str]:
    """Every dim name of every value of every graph."""
    return {d.value for graph in model.graphs()
            for v in (*graph.inputs, *graph.outputs, *(o for n in graph for o in n.outputs))
            if v.shape is not None
            for d in v.shape if isinstance(d, ir.SymbolicDim) and d.value is not None}


def forget_stand_ins(model: ir.Model) -> None:
    """Anonymous again: the dims ``name_anonymous_input_dims`` named, in every value of every
    graph (inference carries them into subgraphs too; the saved model declares what the
    user's did)."""
    values = [v for graph in model.graphs()
              for v in (*graph.inputs, *graph.outputs,
                        *(out for node in graph for out in node.outputs))]
    for value in values:
        shape = value.shape
        if shape is not None and any(
                isinstance(d, ir.SymbolicDim) and mentions_stand_in(d.value) for d in shape):
            value.shape = ir.Shape([
                None if isinstance(d, ir.SymbolicDim) and mentions_stand_in(d.value) else d
                for d in shape])


def _computable_shapes(graph: ir.Graph) -> dict[ir.Value, Dims]:
    """The outputs whose shapes the evaluator knows better than onnx did, with those shapes."""
    outputs = {id(v) for v in graph.outputs}
    found: dict[ir.Value, Dims] = {}
    for node in graph:
        compute = _COMPUTED.get(node.op_type)
        if compute is None or node.domain not in _ONNX_DOMAINS or not node.outputs:
            continue
        out = node.outputs[0]
        if out.type is None or id(out) in outputs:
            continue  # a graph output keeps its declared shape
        current = _dims(out.shape)
        if current is not None and not any(_unknown(d) for d in current):
            continue
        computed = compute(node)
        merged = None if computed is None else _better(current, computed)
        if merged is not None:
            found[out] = merged
    return found


def _better(current: Dims | None, computed: Dims) -> Dims | None:
    """``current`` with the dims it lacks (unknown, or a symbol onnx minted) taken from
    ``computed``; None when that tells nothing new or the two disagree (onnx's own sizes
    and names are kept)."""
    if current is None:
        # an untyped value is typed when the shape is whole or names a dim: a dim left
        # unknown gets a fresh symbol, which nothing downstream can be matched with once a
        # rule gives the value its real dim (a Reshape's run-time target made constant)
        named = any(isinstance(d, str) and not _unknown(d) for d in computed)
        return computed if None not in computed or named else None
    if len(current) != len(computed):
        return None
    merged: Dims = []
    for known, new in zip(current, computed, strict=True):
        if _unknown(new):  # a minted symbol tells something only where nothing is known
            merged.append(new if known is None else known)
        elif _unknown(known) or known == new:
            merged.append(new)
        else:
            return None
    return merged if merged != current else None


def _downstream(graph: ir.Graph, values: list[ir.Value]) -> list[ir.Value]:
    """The values computed from ``values``, but the graph's outputs (declared shapes)."""
    outputs = {id(v) for v in graph.outputs}
    seen = {id(v) for v in values}
    queue, found = list(values), []
    while queue:
        for use in queue.pop().uses():
            for out in use.node.outputs:
                if id(out) not in seen:
                    seen.add(id(out))
                    queue.append(out)
                    if id(out) not in outputs:
                        found.append(out)
    return found


# ----------------------------------------------------------------------------- ops


def _range_dims(node: ir.Node) -> Dims | None:
    """``Range(0, n, 1)`` with ``n`` a named dim has that length."""
    if len(node.inputs) != 3 or any(v is None for v in node.inputs):
        return None
    try:
        if _const_ints(node, 0).entries != (0,) or _const_ints(node, 2).entries != (1,):
            return None
    except NoMatch:  # a start or step computed at run time
        return None
    name = dim_name(node.inputs[1])
    return None if name is None else [name]


def _reshape_dims(node: ir.Node) -> Dims | None:
    """Reshape's output: a 0 copies the input's dim (allowzero 0), a -1 is what is left."""
    if len(node.inputs) < 2 or node.inputs[0] is None or node.inputs[1] is None:
        return None
    data, target = node.inputs[0], node.inputs[1]
    data_dims = _dims(data.shape)
    entries = shape_entries(target, data)
    if entries is None:
        return None
    allowzero = node.attributes.get("allowzero")
    copies = allowzero is None or int(allowzero.value) == 0
    dims: list = []
    for position, entry in enumerate(entries):
        if _is_int(entry, 0) and copies:
            dims.append(data_dims[position]
                        if data_dims is not None and position < len(data_dims) else None)
        elif _is_int(entry, -1):
            dims.append(_INFERRED)
        else:
            dims.append(_entry_dim(entry, data_dims))
    inferred = [i for i, d in enumerate(dims) if d is _INFERRED]
    if len(inferred) > 1:
        return None
    if inferred:
        others = [d for d in dims if d is not _INFERRED]
        known = data_dims is not None and None not in data_dims and None not in others
        dims[inferred[0]] = _product(symbolic_quotient(data_dims, others)) if known else None
    return dims


def _expand_dims(node: ir.Node) -> Dims | None:
    """Expand's output: the input and the target broadcast together."""
    read = _data_and_vector(node, 1) if len(node.inputs) == 2 else None
    if read is None:
        return None
    data_dims, entries = read
    return _broadcast(data_dims, [_entry_dim(e, data_dims) for e in entries])


def _data_and_vector(node: ir.Node, index: int) -> tuple[Dims, tuple[Entry, ...]] | None:
    """The dims of ``node``'s data (input 0) and the entries of the shape vector at input
    ``index`` (an Expand's target, a Tile's repeats, a Resize's sizes), read with the
    data's dims; None when either is unknown."""
    if len(node.inputs) <= index or node.inputs[0] is None or node.inputs[index] is None:
        return None
    data_dims = _dims(node.inputs[0].shape)
    entries = shape_entries(node.inputs[index], node.inputs[0])
    return None if data_dims is None or entries is None else (data_dims, entries)


def _constant_of_shape_dims(node: ir.Node) -> Dims | None:
    if not node.inputs or node.inputs[0] is None:
        return None
    entries = shape_entries(node.inputs[0])
    return None if entries is None else [_entry_dim(e, None) for e in entries]


def _slice_dims(node: ir.Node) -> Dims | None:
    """``Slice(x, 0, n)`` with unit steps: the axes sliced are ``n`` long. A named ``n`` is
    taken as the length only along an axis of static size, as exporters slice a fixed
    buffer to the sequence length (``position_ids[:, :seq_len]``; a longer sequence than
    the buffer fails where the slice meets it). Along a dynamic axis the slice may be
    shorter than ``n`` and stays unnamed: reads of its shape would be moved to ``n``.
    ``Slice(x, p, end)`` of an axis named as a sum ``p + s`` is ``s`` long (``_sum_after``)."""
    if len(node.inputs) < 3 or any(v is None for v in node.inputs[:3]):
        return None
    data_dims = _dims(node.inputs[0].shape)
    try:
        axes, steps = _ints(node, "axes", 3), _ints(node, "steps", 4)
    except NoMatch:  # a bound computed at run time
        return None
    starts = shape_entries(node.inputs[1], node.inputs[0])
    ends = shape_entries(node.inputs[2], node.inputs[0])
    axes = list(range(len(starts or ()))) if axes is None else axes
    steps = [1] * len(starts or ()) if steps is None else steps
    if (data_dims is None or starts is None or ends is None
            or not len(starts) == len(ends) == len(axes) == len(steps)
            or any(s != 1 for s in steps)):
        return None
    dims = list(data_dims)
    for axis, start, end in zip(axes, starts, ends, strict=True):
        if not -len(dims) <= axis < len(dims):
            return None
        size = dims[axis]
        last = _tail_name(node.inputs[1], axes.index(axis), size) if start is None else None
        if _is_plain_int(start) and _is_plain_int(end) and isinstance(size, int):
            dims[axis] = len(range(size)[start:end])  # onnxruntime clamps as Python does
        elif last is not None:
            dims[axis] = _last(size, last, end)
            if dims[axis] is None:
                return None
        elif isinstance(size, str) and _is_offset(start, end):
            dims[axis] = _dropped(size, start - (end if end < 0 else 0))
            if dims[axis] is None:
                return None
        elif not _is_int(start, 0):
            dims[axis] = _sum_after(size, _entry_dim(start, data_dims), end)
            if dims[axis] is None:
                return None
        elif isinstance(end, int) and not isinstance(end, bool):
            if isinstance(size, int):
                dims[axis] = max(0, min(end + size if end < 0 else end, size))
            else:
                dims[axis] = size if end >= SLICE_TO_END else None
        elif isinstance(size, int):
            dims[axis] = _entry_dim(end, data_dims)
        else:
            length = _entry_dim(end, data_dims)
            dims[axis] = length if _at_least(size, length) else None
    return dims


def _at_least(size: int | str | None, length: int | str | None) -> bool:
    """Whether an axis of ``size`` is known to hold ``length``: the same name, or a sum of
    it and more (names or numbers, none below 0): a causal Conv's ``sequence_length + 2``
    cut back to ``sequence_length``, a mask over past + new tokens cut to the new ones."""
    if not isinstance(size, str) or not isinstance(length, str):
        return False
    parts = sum_parts(size)
    return size == length or parts is not None and length in parts[0]


def _is_offset(start: Entry, end: Entry) -> bool:
    """``x[k:]``, ``x[:-k]`` or ``x[k:-j]`` in integers: a fixed number of elements dropped
    from the ends of the axis (``_dropped`` names the rest)."""
    ints = all(isinstance(e, int) and not isinstance(e, bool) for e in (start, end))
    return ints and 0 <= start < SLICE_TO_END and (end >= SLICE_TO_END or -SLICE_TO_END < end < 0) \
        and not (start == 0 and end >= SLICE_TO_END)


def _dropped(size: str, count: int) -> str | None:
    """The length of a named axis less ``count`` elements dropped from its ends, as onnxruntime
    clamps a slice: ``max(0, S - count)``. onnx-ir's arithmetic takes a named dim to be at
    least 1, so one element dropped is ``S - 1`` (MobileBERT's ``x[:, 1:]``, which a Pad of one
    row makes ``S`` again) and more keep the ``Max`` (``x[:, 2:-2]`` padded back by 2 each side
    is not ``S``: at S = 3 it is 4 long)."""
    if not _arithmetic_name(size):
        return None
    return _spelled(f"max(0, {size} - {count})")


def _shifted(size: int | str | None, delta: int) -> int | str | None:
    """A dim plus an integer: a size, or a name in onnx-ir's (sympy's) spelling
    (``Max(0, S - 4) + 4``, ``S - 1 + 1`` is ``S``); None for an unknown dim, a size below 0
    and a name that gets no arithmetic (``_arithmetic_name``)."""
    if isinstance(size, int):
        return size + delta if size + delta >= 0 else None
    if size is None or not _arithmetic_name(size):
        return None
    return size if delta == 0 else _spelled(f"{size} + ({delta})")


def _sum(sizes: Sequence[int | str | None]) -> int | str | None:
    """The sum of dims (a Concat's axis): an int for sizes, else one name in onnx-ir's
    spelling (``past + 2*seq``); None when a dim is unknown or gets no arithmetic."""
    if any(isinstance(d, str) and not _arithmetic_name(d) or d is None for d in sizes):
        return None
    if all(isinstance(d, int) for d in sizes):
        return sum(sizes)  # type: ignore[arg-type]
    return _spelled(" + ".join(f"({d})" for d in sizes))


@functools.lru_cache(maxsize=4096)
def _arithmetic_name(name: str) -> bool:
    """Whether ``name`` gets symbolic arithmetic: not minted by onnx, no division or power,
    parsed by onnx-ir and spelled back as written (``seq-len`` would be ``-len + seq``,
    ``seq + past`` reordered: each would come back as another name)."""
    if _unknown(name) or any(op in name for op in OPAQUE_OPERATORS):
        return False
    return _spelled(name) == name


@functools.lru_cache(maxsize=4096)
def _spelled(expression: str) -> int | str | None:
    """onnx-ir's simplified spelling of a dim expression: an int when it is a number, None
    when onnx-ir cannot parse it (``seq len``, ``batch[0]``) or it is negative."""
    try:
        value = (ir.SymbolicDim(expression) + 0).value
    except Exception:  # noqa: BLE001 - onnx-ir's parser refuses names it cannot read
        return None
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        return value
    return number if number >= 0 else None


def _sum_after(size: int | str | None, start: int | str | None, end: Entry) -> str | None:
    """The length of ``x[p:]`` along an axis named as a sum of ``p`` and more (torch's
    ``position_ids[:, past:]`` of a mask over past + new tokens is as long as the new tokens:
    a dim is never negative, so ``p`` is within the axis); None for anything else."""
    to_end = isinstance(end, int) and not isinstance(end, bool) and end >= SLICE_TO_END
    if not isinstance(size, str) or not isinstance(start, str) or not to_end:
        return None
    terms, skipped = sum_terms(size), sum_terms(start)
    if terms is None or skipped is None:
        return None
    for term in skipped:
        if term not in terms:
            return None
        terms.remove(term)
    return " + ".join(terms) or None


def _tail_name(starts: ir.Value, position: int, size: int | str | None) -> str | None:
    """The named dim ``n`` that entry ``position`` of a Slice's ``starts`` counts back from
    the end of an axis of ``size``: torch's ``x[:, -n:]`` (``Unsqueeze(Neg(Gather(Shape(ids),
    1)))``) or, along an axis of static size ``L``, ``x[:, L - n:]`` (MPT's ALiBi table cut to
    the sequence); else None."""
    node = starts.producer()
    while node is not None and node.domain in ("", "ai.onnx") and position == 0 \
            and node.op_type in ("Unsqueeze", "Reshape") and node.inputs and node.inputs[0]:
        node = node.inputs[0].producer()
    if node is None or node.domain not in ("", "ai.onnx") or position != 0 \
            or len(node.inputs) not in (1, 2) or any(v is None for v in node.inputs):
        return None
    if node.op_type == "Neg" and len(node.inputs) == 1:
        return dim_name(node.inputs[0])
    if node.op_type == "Sub" and len(node.inputs) == 2 and isinstance(size, int):
        try:
            total = _const_ints(node, 0).entries
        except NoMatch:
            return None
        return dim_name(node.inputs[1]) if total == (size,) else None
    return None


def _last(size: int | str | None, length: str, end: Entry) -> int | str | None:
    """The length of ``x[-n:]`` along an axis of ``size``: ``n`` where the axis is at least
    ``n`` long, as it is when named ``n`` or a sum holding ``n`` (a mask over past + new
    tokens sliced to the new ones), or of static size (a buffer sliced to the sequence, as
    ``x[:n]`` is read); None for anything else."""
    to_end = isinstance(end, int) and not isinstance(end, bool) and end >= SLICE_TO_END
    if not to_end or size is None:
        return None
    return length if isinstance(size, int) or _at_least(size, length) else None


def _flatten_dims(node: ir.Node) -> Dims | None:
    """Flatten's two dims: the products of the dims before and from ``axis``."""
    data_dims = _dims(node.inputs[0].shape) if node.inputs and node.inputs[0] else None
    if data_dims is None or None in data_dims:
        return None
    attr = node.attributes.get("axis")
    axis = 1 if attr is None else int(attr.value)
    if not -len(data_dims) <= axis <= len(data_dims):
        return None
    if axis < 0:
        axis += len(data_dims)
    return [_product(symbolic_product(data_dims[:axis])),
            _product(symbolic_product(data_dims[axis:]))]


def _pad_dims(node: ir.Node) -> Dims | None:
    """Pad's output: each axis grows by its two constant pads (negative ones crop)."""
    if len(node.inputs) < 2 or node.inputs[0] is None or node.inputs[1] is None:
        return None
    data_dims = _dims(node.inputs[0].shape)
    pads = shape_entries(node.inputs[1])
    if data_dims is None or pads is None or not all(_is_plain_int(p) for p in pads):
        return None
    axes: list[int] = list(range(len(data_dims)))
    if len(node.inputs) > 3 and node.inputs[3] is not None:
        try:
            axes = _const_ints(node, 3).entries
        except NoMatch:
            return None
    if len(pads) != 2 * len(axes):
        return None
    dims = list(data_dims)
    for i, axis in enumerate(axes):
        if not -len(dims) <= axis < len(dims):
            return None
        delta = pads[i] + pads[i + len(axes)]
        if delta:
            dims[axis] = _shifted(dims[axis], delta)
    return dims


def _concat_dims(node: ir.Node) -> Dims | None:
    """Concat's output: the sizes along the axis added up (``past_sequence_length +
    sequence_length`` for a cache that is not a graph output); each other dim where the
    inputs that know it agree (onnxruntime skips an empty input, so an empty past of another
    batch does not fail: two different names name neither; an input whose dim is unknown,
    or only declared as a graph output's, tells nothing). Not for more than
    ``MAX_CONCAT_INPUTS`` inputs (a sum of hundreds of names is costly and names nothing an
    attention reads)."""
    if not 0 < len(node.inputs) <= MAX_CONCAT_INPUTS:
        return None
    shapes = [_dims(v.shape) if v is not None else None for v in node.inputs]
    if any(d is None for d in shapes) or len({len(d) for d in shapes}) != 1:
        return None
    rank = len(shapes[0])
    attr = node.attributes.get("axis")
    axis = int(attr.value) if attr is not None else 0
    if not -rank <= axis < rank:
        return None
    axis %= rank
    total = _sum([dims[axis] for dims in shapes])
    if total is None:
        return None
    told = [dims for value, dims in zip(node.inputs, shapes, strict=True)
            if not value.is_graph_output()]
    out: Dims = []
    for position in range(rank):
        known = {d[position] for d in told if not _unknown(d[position])}
        out.append(total if position == axis else (known.pop() if len(known) == 1 else None))
    return out


def _tile_dims(node: ir.Node) -> Dims | None:
    """Tile's output: each dim times its repeat (onnx's inference forgets named dims even
    where the repeat is 1: ``repeat_interleave`` exported as Unsqueeze + Tile). A repeat
    read at run time from a named dim names the axis it tiles from 1 (torch's
    ``weight.unsqueeze(0).repeat(batch_size, 1, 1)``, DETR's object queries)."""
    read = _data_and_vector(node, 1) if len(node.inputs) == 2 else None
    if read is None or len(read[1]) != len(read[0]):
        return None
    data_dims, repeats = read
    dims: Dims = []
    for dim, entry in zip(data_dims, repeats, strict=True):
        count = _entry_dim(entry, data_dims)
        if count is None or (_is_plain_int(entry) and entry < 0):
            return None
        if count == 1 or dim == 1:
            dims.append(dim if count == 1 else None if _unknown(count) else count)
        else:
            dims.append(None if _unknown(dim) or _unknown(count)
                        else _product(symbolic_product([dim, count])))
    return dims


def _resize_dims(node: ir.Node) -> Dims | None:
    """Resize to ``sizes`` read at run time (TorchScript's ``interpolate(mask, size=...)``
    writes ``Concat(Shape(x)[:2], [h, w])``): the output has those sizes, on the axes the
    ``axes`` attribute names (all by default); the other axes keep the input's dims. Not
    with an aspect-ratio policy other than ``stretch`` (the sizes are then bounds)."""
    if node.attributes.get_string("keep_aspect_ratio_policy", "stretch") != "stretch":
        return None
    read = _data_and_vector(node, 3)
    if read is None:
        return None
    data_dims, entries = read
    attr = node.attributes.get("axes")
    axes = list(attr.value) if attr is not None else list(range(len(data_dims)))
    if len(axes) != len(entries) or len({a % len(data_dims) for a in axes}) != len(axes) \
            or any(not -len(data_dims) <= a < len(data_dims) for a in axes):
        return None
    dims = list(data_dims)
    for axis, entry in zip(axes, entries, strict=True):
        dims[axis] = _entry_dim(entry, data_dims)
    return dims


def _conv_dims(node: ir.Node) -> Dims | None:
    """Conv's output: the batch, the weight's output channels, and each spatial dim
    ``d + pad_begin + pad_end - dilation * (k - 1)`` at stride 1 (a causal depthwise Conv
    over a named sequence, as LFM2's short convolutions, which onnx's inference leaves
    unknown); a named dim at another stride is unknown."""
    if len(node.inputs) < 2 or node.inputs[0] is None or node.inputs[1] is None:
        return None
    data_dims = _dims(node.inputs[0].shape)
    weight_dims = _dims(node.inputs[1].shape)
    if data_dims is None or weight_dims is None or len(data_dims) != len(weight_dims) \
            or len(data_dims) < 3:
        return None
    spatial = len(data_dims) - 2
    attributes_only = len(node.inputs)  # _ints reads an attribute, no input, here
    kernel = _ints(node, "kernel_shape", attributes_only) or weight_dims[2:]
    strides = _ints(node, "strides", attributes_only) or [1] * spatial
    dilations = _ints(node, "dilations", attributes_only) or [1] * spatial
    pads = _ints(node, "pads", attributes_only) or [0] * 2 * spatial
    mode = node.attributes.get_string("auto_pad", "NOTSET")
    if len(kernel) != spatial \
            or len(strides) != spatial or len(dilations) != spatial or len(pads) != 2 * spatial \
            or mode not in ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"):
        return None
    dims: Dims = [data_dims[0], weight_dims[0]]
    for axis, size in enumerate(data_dims[2:]):
        if not isinstance(kernel[axis], int) or strides[axis] < 1 or dilations[axis] < 1:
            return None
        reach = dilations[axis] * (kernel[axis] - 1)
        if mode.startswith("SAME"):
            padded, reach = size, 0
        elif mode == "VALID":
            padded = size
        else:
            padded = _shifted(size, pads[axis] + pads[axis + spatial])
        if isinstance(padded, int):
            dims.append((padded - reach - 1) // strides[axis] + 1 if padded > reach else None)
        elif mode.startswith("SAME") and strides[axis] == 1:
            dims.append(size)
        else:
            dims.append(_shifted(padded, -reach) if strides[axis] == 1 else None)
    return dims


def _is_plain_int(entry: Entry) -> bool:
    return isinstance(entry, int) and not isinstance(entry, bool)


_COMPUTED: dict[str, Callable[[ir.Node], Dims | None]] = {
    "Range": _range_dims,
    "Reshape": _reshape_dims,
    "Expand": _expand_dims,
    "ConstantOfShape": _constant_of_shape_dims,
    "Slice": _slice_dims,
    "Flatten": _flatten_dims,
    "Pad": _pad_dims,
    "Concat": _concat_dims,
    "Tile": _tile_dims,
    "Resize": _resize_dims,
    "Conv": _conv_dims,
}


def _broadcast(first: Dims, second: Dims) -> Dims:
    """Multidirectional broadcasting of two shapes: a dim against 1 is that dim, a known
    size other than 1 against an unknown or named one is that size (the op fails on any
    other), two different names or unknowns are unknown."""
    out: Dims = []
    for i in range(1, max(len(first), len(second)) + 1):
        a = first[-i] if i <= len(first) else 1
        b = second[-i] if i <= len(second) else 1
        if a == 1 or a == b:
            out.append(b)
        elif b == 1:
            out.append(a)
        elif isinstance(a, int):
            out.append(a if not isinstance(b, int) else None)
        elif isinstance(b, int):
            out.append(b)
        else:
            out.append(None)
    return list(reversed(out))


# ----------------------------------------------------------------------------- reading


def _entry_dim(entry: Entry, data_dims: Sequence[int | str | None] | None) -> int | str | None:
    """The dim one entry of a shape vector sets: a size, a name, a dim of the input."""
    if isinstance(entry, bool):
        return None
    if isinstance(entry, int):
        return entry if entry >= 0 else None
    if isinstance(entry, Named):
        return entry.name
    if isinstance(entry, Dim) and data_dims is not None and entry.axis < len(data_dims):
        return data_dims[entry.axis]
    return None


def _is_int(entry: Entry, number: int) -> bool:
    return isinstance(entry, int) and not isinstance(entry, bool) and entry == number


def _dims(shape: ir.Shape | None) -> Dims | None:
    """Plain dims; a symbol onnx minted is kept (equal symbols are equal sizes in one
    inference) but counts as unknown (``_unknown``) and never enters a product."""
    if shape is None:
        return None
    return [_plain_dim(d) for d in shape]


def _unknown(dim: int | str | None) -> bool:
    return dim is None or (isinstance(dim, str) and is_minted(dim))


def _product(result: int | str | None) -> int | str | None:
    """A computed product, unless it is built from a symbol onnx minted (such a name would
    outlive the inference that minted it)."""
    if isinstance(result, str) and "*" in result \
            and any(is_minted(part) for part in result.split("*")):
        return None
    return result


def _minted(dim: int | ir.SymbolicDim) -> bool:
    return not isinstance(dim, int) and is_minted(dim.value)
