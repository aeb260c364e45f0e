"""Read named dims from the graph input that names them, not from the value at hand.

Exports with dynamic axes read the batch and sequence lengths from whatever value is near:
``Shape(k)[2]`` of an attention's keys (T5's relative position bias), ``Shape(h)[1]`` of a
hidden state, dynamo's ``Shape<start=0, end=2>(x)``. Each such read is one more reader of
the value, and a fusion whose pattern runs through the value (the keys' Transpose into
MultiHeadAttention) cannot remove it: the pattern does not match. Once the dims are named
(onnx's inference, then symdims), the same sizes can be read from the graph input that
declares the names, and the value is left to its real readers. Equal names are equal sizes,
as everywhere in the rules.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .expr import NoMatch
from .names import FreshNames
from .shapeexpr import _ints, is_minted

_ONNX_DOMAINS = ("", "ai.onnx")


def read_dims_from_inputs(model: ir.Model) -> int:
    """Point the main graph's reads of named dims at the graph inputs that name them:
    ``Gather(Shape(x), i)`` and ``Shape(x)`` whose dims are all named by one input. Returns
    the reads moved; the Shapes left unread are dead code for the caller to remove."""
    return len(ShapeReadMover(model).move(list(model.graph)))


class ShapeReadMover:
    """Moves reads of named dims to the graph inputs naming them, for ``read_dims_from_inputs``
    and for the rewrite loop, whose rules write such reads of the values they leave (the
    key's run-time length of GroupQueryAttention): there a read of a rotated key keeps a
    later fusion through it from removing it. One Shape per graph input serves every move."""

    def __init__(self, model: ir.Model, names: FreshNames | None = None) -> None:
        """``names``: the caller's fresh names, when it makes names of its own too."""
        self.graph = model.graph
        self.sources = _named_input_dims(self.graph)
        self.fresh = _Fresh(self.graph, names or FreshNames(model)) if self.sources else None

    def move(self, nodes: list[ir.Node]) -> list[ir.Value]:
        """Move the reads among ``nodes`` (of the main graph) that can be; return the Shape
        outputs that lost a reader (the Shapes may be dead now)."""
        if self.fresh is None:
            return []
        graph, fresh, sources = self.graph, self.fresh, self.sources
        lost: list[ir.Value] = []
        # the Gathers first: a Shape some of whose reads moved may be left whole
        ordered = [n for n in nodes if n.op_type == "Gather"] \
            + [n for n in nodes if n.op_type == "Shape"]
        for node in ordered:
            if node.domain not in _ONNX_DOMAINS or node.graph is not graph:
                continue
            read = _gathered_read(node) if node.op_type == "Gather" else _whole_read(node)
            if read is None:
                continue
            origin = _one_origin(read, sources)
            if origin is None:
                continue
            source, axes = origin
            shape = fresh.shape_of(source)
            if node.op_type == "Gather":
                lost.append(node.inputs[0])  # type: ignore[arg-type]
                index = node.inputs[1].const_value.numpy()  # type: ignore[union-attr]
                node.replace_input_with(0, shape)
                if index.reshape(-1).tolist() != axes:
                    node.replace_input_with(
                        1, fresh.constant(np.asarray(axes).reshape(index.shape)))
            else:
                gather = ir.node("Gather", [shape, fresh.constant(np.asarray(axes))],
                                 attributes={"axis": 0}, name=fresh.name(f"{node.name}_named"))
                graph.insert_before(node, gather)
                gather.outputs[0].name = fresh.name(f"{node.outputs[0].name}_named")
                gather.outputs[0].type = node.outputs[0].type
                gather.outputs[0].shape = node.outputs[0].shape
                ir.convenience.replace_all_uses_with(node.outputs[0], gather.outputs[0])
                lost.append(node.outputs[0])
        return lost


def _named_input_dims(graph: ir.Graph) -> dict[str, tuple[ir.Value, int]]:
    """Each name a graph input declares as a dim, with the first input and axis naming it."""
    sources: dict[str, tuple[ir.Value, int]] = {}
    for value in graph.inputs:
        if value.shape is None or value.is_initializer():
            continue
        for axis, dim in enumerate(value.shape):
            if _is_name(dim):
                sources.setdefault(dim.value, (value, axis))  # type: ignore[union-attr]
    return sources


def shape_read(node: ir.Node) -> tuple[ir.Value, list[ir.SymbolicDim | int]] | None:
    """``(x, dims)`` when ``node`` reads dims of x from ``Shape(x)`` at constant positions:
    ``Gather(Shape(x), i)`` (the dims in the indices' order; reshape to the indices' shape
    for the value) or ``Slice(Shape(x), start, end)`` with step 1 (the exporters' ``x.shape[-1:]``
    of an attention's head size); else None."""
    if node.domain not in _ONNX_DOMAINS or not node.inputs or node.inputs[0] is None:
        return None
    query = node.inputs[0].producer()
    if query is None or query.op_type != "Shape" or query.domain not in _ONNX_DOMAINS:
        return None
    read = _queried_dims(query)
    if read is None:
        return None
    if node.op_type == "Slice":
        bounds = _slice_bounds(node)
        return None if bounds is None else (read[0], read[1][bounds[0]:bounds[1]])
    if node.op_type != "Gather" or len(node.inputs) != 2 or node.inputs[1] is None \
            or node.attributes.get_int("axis", 0) != 0:
        return None
    indices = node.inputs[1].const_value
    if indices is None or node.inputs[1].is_graph_input():
        return None
    index = indices.numpy()
    if index.ndim > 1 or index.dtype.kind not in "iu" \
            or any(not -len(read[1]) <= int(i) < len(read[1]) for i in index.reshape(-1)):
        return None
    return read[0], [read[1][int(i)] for i in index.reshape(-1)]


def _slice_bounds(node: ir.Node) -> tuple[int, int] | None:
    """(start, end) of a 1-D Slice with constant bounds, axis 0 and step 1 (inputs from
    opset 10, attributes before); Python's slicing clamps them as Slice does."""
    try:
        starts, ends = _ints(node, "starts", 1), _ints(node, "ends", 2)
        axes, steps = _ints(node, "axes", 3), _ints(node, "steps", 4)
    except NoMatch:  # a bound computed at run time
        return None
    if starts is None or ends is None or len(starts) != 1 or len(ends) != 1:
        return None
    if axes not in (None, [0], [-1]) or steps not in (None, [1]):
        return None
    return starts[0], ends[0]


def _gathered_read(node: ir.Node) -> list[ir.SymbolicDim | int] | None:
    """The dims ``Gather(Shape(x), i)`` reads, when x is not a graph input itself (nor a
    graph output, whose dims may be only declared)."""
    read = shape_read(node)
    if read is None or read[0].is_graph_input() or read[0].is_graph_output():
        return None
    return read[1]


def _whole_read(node: ir.Node) -> list[ir.SymbolicDim | int] | None:
    """The dims ``Shape(x)`` reads, when x is not a graph input itself (nor a graph output,
    whose dims may be only declared)."""
    read = _queried_dims(node)
    if node.outputs[0].is_graph_output() or read is None or read[0].is_graph_input() \
            or read[0].is_graph_output():
        return None
    return read[1]


def _queried_dims(query: ir.Node) -> tuple[ir.Value, list[ir.SymbolicDim | int]] | None:
    source = query.inputs[0] if query.inputs else None
    if source is None or source.shape is None:
        return None
    # Shape-15's start/end clamp and count from the end as Python's slices do
    return source, list(source.shape.dims[query.attributes.get_int("start", 0):
                                          query.attributes.get_int("end", None)])


def _one_origin(dims: list[ir.SymbolicDim | int],
                sources: dict[str, tuple[ir.Value, int]]) -> tuple[ir.Value, list[int]] | None:
    """The one graph input naming every dim read, and the axes it names them at."""
    if not dims or not all(_is_name(d) and d.value in sources for d in dims):  # type: ignore[union-attr]
        return None
    origins = [sources[d.value] for d in dims]  # type: ignore[union-attr]
    if any(value is not origins[0][0] for value, _ in origins):
        return None
    return origins[0][0], [axis for _, axis in origins]


def _is_name(dim: ir.SymbolicDim | int) -> bool:
    return not isinstance(dim, int) and not is_minted(dim.value)


class _Fresh:
    """New values for the moved reads: one Shape per graph input, int64 index constants."""

    def __init__(self, graph: ir.Graph, names: FreshNames) -> None:
        self.graph = graph
        self.name = names.fresh
        self.shapes: dict[int, ir.Value] = {}

    def shape_of(self, source: ir.Value) -> ir.Value:
        known = self.shapes.get(id(source))
        if known is None:
            node = ir.node("Shape", [source], name=self.name(f"{source.name}_shape"))
            first = next(iter(self.graph), None)
            if first is None:
                self.graph.append(node)
            else:
                self.graph.insert_before(first, node)
            known = node.outputs[0]
            known.name = self.name(f"{source.name}_shape")
            known.type = ir.TensorType(ir.DataType.INT64)
            known.shape = ir.Shape([len(source.shape or ())])
            self.shapes[id(source)] = known
        return known

    def constant(self, array: np.ndarray) -> ir.Value:
        array = array.astype(np.int64)
        value = ir.Value(name=self.name("named_dim_axes"), type=ir.TensorType(ir.DataType.INT64),
                         shape=ir.Shape(array.shape), const_value=ir.Tensor(array))
        self.graph.register_initializer(value)
        return value
