"""Static shapes to measure a model with, once its symbolic input dims are bound (``--dim``).

Why: onnx's shape inference names a dim it cannot write as a formula of the inputs' symbols
``unk__N`` (a Conv's ``(W + 2p - k) / s + 1``), and a Reshape to a target computed at run
time gets no shape at all; so a bound input dim never reaches the values behind the first
Conv, and their traffic would be unknown (every OCR model has a dynamic width). Here a copy
of the model gets its input dims bound and is prepared again (inference, then the shape
arithmetic folded, as :func:`fusectl.prepare.prepare` does at any opset), and the static
shapes of the copy's values are read by name. For measuring only: the model itself keeps
its symbolic shapes, and rules never see these.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx_ir as ir

from .prepare import prepare
from .traffic import unbound_dim

__all__ = ["bound_shapes"]


def bound_shapes(model: ir.Model, dims: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
    """Value name -> static shape in the main graph of ``model`` with its inputs' symbolic
    dims bound (``dims``; an unbound named dim as 1, as the traffic model counts it; an
    unnamed one stays unknown). Empty when no value has a dim inference could not name, or
    when preparing the copy fails."""
    if not _has_unnamed_dims(model.graph):
        return {}
    if not any(_bind(d, dims) is not d for v in model.graph.inputs if v.shape is not None
               for d in v.shape):
        return {}  # nothing to bind (stand-in names of anonymous dims): the copy would be it
    try:
        copy = model.clone()
        for value in copy.graph.inputs:
            if value.shape is not None:
                value.shape = ir.Shape([_bind(d, dims) for d in value.shape])
        for node in copy.graph:
            for value in node.outputs:
                value.shape = None  # inferred again from the bound inputs (by prepare)
        prepare(copy)
    except Exception:  # noqa: BLE001 - measuring falls back to the symbolic shapes
        return {}
    static: dict[str, tuple[int, ...]] = {}
    # what the copy folded (a Shape read, an LSTM's initial state) is an initializer there
    values = [*copy.graph.initializers.values(), *(v for n in copy.graph for v in n.outputs)]
    for value in values:
        shape = value.shape
        if value.name and shape is not None and shape.is_static():
            static[value.name] = tuple(shape.dims)  # type: ignore[arg-type]
    return static


def _bind(dim: int | ir.SymbolicDim, dims: Mapping[str, int]) -> int | ir.SymbolicDim:
    if isinstance(dim, int) or dim.value is None:
        return dim
    name = str(dim.value)
    size = dims[name] if name in dims else unbound_dim(name)
    return dim if size is None else int(size)


def _has_unnamed_dims(graph: ir.Graph) -> bool:
    """Whether a graph input has a symbolic dim and some node output a dim inference could
    not name after the inputs' symbols (``unk__N``, unnamed) or no shape at all."""
    if not any(isinstance(d, ir.SymbolicDim) for v in graph.inputs if v.shape is not None
               for d in v.shape):
        return False
    for node in graph:
        for value in node.outputs:
            shape = value.shape
            if shape is None:
                if value.uses():
                    return True
                continue
            for dim in shape:
                if not isinstance(dim, int) and (dim.value is None or _unnamed(dim.value)):
                    return True
    return False


def _unnamed(name: str) -> bool:
    """A dim the traffic model cannot count: not a name nor a product of names and numbers
    (torch's ``batch_size*sequence_length`` is counted as its factors are)."""
    return any(unbound_dim(part) is None and not part.isdigit() for part in name.split("*"))
