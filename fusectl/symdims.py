"""Name the dims onnx's shape inference loses: the length of ``Range(0, n, 1)`` when ``n`` is a
named dim read through ``Shape`` (TorchScript's position ids, ``arange(input_ids.size(1))``).

onnx's inference gives such a Range a fresh symbol (``unk__N``); the position embeddings added
to the token embeddings then give the sum another fresh one, and from there on nothing can be
shown to have the input's sequence length: the attention mask's key length is
``sequence_length``, the keys' is ``unk__1``, and the attention rules refuse. The length is
read with shapeexpr's evaluator (Gather/Slice/Squeeze/Cast of Shape, each node evaluated as
onnxruntime does), the Range is given it, the symbols onnx minted are forgotten, and onnx's
inference runs again; it keeps a declared dim it cannot compute itself, so the name flows
on. Equal names are equal sizes, as everywhere in the rules.
"""

from __future__ import annotations

import onnx_ir as ir

from .expr import _const_tensor
from .shapeexpr import MINTED_SYMBOL, dim_name
from .shapes import _plain_dim, infer_model_shapes

_ONNX_DOMAINS = ("", "ai.onnx")


def name_lost_dims(model: ir.Model) -> bool:
    """Name the lengths of the main graph's ``Range(0, n, 1)`` nodes whose ``n`` is a named
    dim, then infer shapes again; True when a shape changed. Nothing changes when no Range
    needs a name or onnx's inference fails."""
    graph = model.graph
    lengths = {}
    for node in graph:
        if node.op_type == "Range" and node.domain in _ONNX_DOMAINS:
            name = _range_length(node)
            out = node.outputs[0]
            if name is not None and not _has_dims(out, [name]):
                lengths[out] = name
    if not lengths:
        return False
    saved = {value: value.shape for value in _inferred_values(graph)}
    for value, shape in saved.items():
        if shape is not None and any(_minted(d) for d in shape):
            value.shape = ir.Shape([None if _minted(d) else d for d in shape])
    for value, name in lengths.items():
        value.shape = ir.Shape([name])
    if infer_model_shapes(model):
        return True
    for value, shape in saved.items():  # onnx's inference failed: as it was
        value.shape = shape
    return False


def _range_length(node: ir.Node) -> str | None:
    """The name of the length of ``Range(0, n, 1)`` with ``n`` a named dim, else None."""
    if len(node.inputs) != 3 or any(v is None for v in node.inputs):
        return None
    start, limit, delta = node.inputs
    if _scalar(start) != 0 or _scalar(delta) != 1:
        return None
    return dim_name(limit)


def _scalar(value: ir.Value) -> int | None:
    tensor = _const_tensor(value)
    if tensor is None or tensor.size != 1 or not tensor.dtype.is_integer():
        return None
    return int(tensor.numpy().reshape(()))


def _has_dims(value: ir.Value, dims: list[int | str]) -> bool:
    shape = value.shape
    return shape is not None and [_plain_dim(d) for d in shape] == dims


def _minted(dim: int | ir.SymbolicDim) -> bool:
    return (not isinstance(dim, int) and dim.value is not None
            and MINTED_SYMBOL.fullmatch(dim.value) is not None)


def _inferred_values(graph: ir.Graph) -> list[ir.Value]:
    """The values whose shapes inference gave (the graph's outputs keep their declared ones)."""
    outputs = {id(v) for v in graph.outputs}
    return [out for node in graph for out in node.outputs if id(out) not in outputs]
