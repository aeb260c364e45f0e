"""Make a freshly loaded model ready for matching: constants folded, shapes known.

Rules test constness (``is_const``) and shapes (``rank``, ``shape``). Exported
models often build weights at run time from constant subgraphs (the onnx
wheel's light models use ConstantOfShape), and carry no intermediate shapes;
without this stage rules would silently not fire.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import onnx_ir as ir
from onnx_ir.passes.common import (
    CommonSubexpressionEliminationPass,
    LiftConstantsToInitializersPass,
    RemoveUnusedNodesPass,
)
from onnxscript.optimizer import fold_constants

from .dedupe import merge_equal_initializers
from .shapes import infer_model_shapes

FOLD_INPUT_LIMIT = 1 << 22
FOLD_OUTPUT_LIMIT = 1 << 27
TIDY_CONSTANT_LIMIT = 1024
"""Elements up to which tidy() merges equal constants by content."""


@dataclass(frozen=True)
class PrepareResult:
    """What preparation changed: nodes folded into constants, whether shapes were inferred."""

    folded_nodes: int
    """Nodes gone before matching: folded constants, lifted Constant nodes, duplicates."""
    shapes_inferred: bool


LEGACY_IR_VERSION = 4


def detach_legacy_initializer_inputs(model: ir.Model) -> int:
    """Before IR version 4 every initializer had to be listed as a graph input, yet
    onnxruntime treats such initializers as constants. Drop them from the inputs so
    that they are constants here too; ``reattach_legacy_initializer_inputs`` puts
    the (possibly new) initializers back before saving."""
    if model.ir_version >= LEGACY_IR_VERSION:
        return 0
    inputs = model.graph.inputs
    legacy = [v for v in inputs if v.is_initializer()]
    for value in legacy:
        inputs.remove(value)
    return len(legacy)


def reattach_legacy_initializer_inputs(model: ir.Model) -> None:
    """List every initializer as a graph input again, as IR version < 4 requires."""
    if model.ir_version >= LEGACY_IR_VERSION:
        return
    listed = set(model.graph.inputs)
    for value in model.graph.initializers.values():
        if value not in listed:
            model.graph.inputs.append(value)


def prepare(model: ir.Model, *, fold: bool = True) -> PrepareResult:
    """Fold constant subgraphs (onnxscript's folder) and infer shapes (onnx's inference).

    Call ``detach_legacy_initializer_inputs`` first (before taking the signature).
    """
    before = _count_nodes(model)
    # Models loaded from a file were inferred on their proto already (modelio).
    shapes_inferred = _has_unknown_shapes(model.graph) and infer_model_shapes(model)
    if fold:
        # Shapes first (with onnx's data propagation): Shape/Size of statically shaped
        # values (the runtime shape arithmetic exporters emit, e.g. attention's
        # sqrt(head_dim)) fold only when the folder can see them. The folder's own
        # node-by-node inference is off: it costs ten times the folding itself, and one
        # whole-model inference afterwards types what folding created.
        modified = _fold(model)
        if modified:
            _retype_folded_strings(model.graph)
        # Constant nodes become initializers (what every peer does), equal weights one
        # initializer, and identical nodes computing the same value are merged (onnxruntime's
        # basic level and onnx-simplifier do). Safe below IR 4 too: the caller detached the
        # initializers from the inputs (detach_legacy_initializer_inputs) and lists the
        # remaining ones again before saving; a dropped one left listed would become a
        # required input on onnxruntime.
        LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
        merge_equal_initializers(model.graph)
        CommonSubexpressionEliminationPass()(model)
        RemoveUnusedNodesPass()(model)  # what folding and merging left unread, dead nodes
        if modified:
            shapes_inferred = infer_model_shapes(model) or shapes_inferred
    return PrepareResult(before - _count_nodes(model), shapes_inferred)


SEQUENCE_REWRITE_OPS = frozenset({"ConcatFromSequence", "SplitToSequence"})
"""Ops onnxscript's folder rewrites into opset-13 forms (Unsqueeze/Split with an axes or
split input) whatever the model's opset."""
SEQUENCE_REWRITE_OPSET = 13


def _fold(model: ir.Model) -> bool:
    """onnxscript's constant folding; True when it changed the model.

    Skipped for models below opset 13 holding the sequence ops the folder would turn into
    nodes their opset does not have. A folder crash on one node (onnxscript 0.7 raises on a
    SplitToSequence with a run-time split) keeps what was folded before it: every
    replacement the folder made is complete, so the graph is valid as it stands.
    """
    version = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))
    if version < SEQUENCE_REWRITE_OPSET and any(
            node.op_type in SEQUENCE_REWRITE_OPS and node.domain in ("", "ai.onnx")
            for node in ir.traversal.RecursiveGraphIterator(model.graph)):
        return False
    try:
        return fold_constants(
            model,
            onnx_shape_inference=False,
            input_size_limit=FOLD_INPUT_LIMIT,
            output_size_limit=FOLD_OUTPUT_LIMIT,
            should_fold=_fold_constant_of_shape,
        ).modified
    except RuntimeError:
        return True  # maybe modified: shapes are inferred again


def tidy(model: ir.Model, created: Collection[str] = ()) -> None:
    """Merge the duplicates rewrites create: three projections of one LayerNorm output
    each get their own Reshape to 2-D (and their own shape constant) when they become
    Gemms; one is enough. Only the small constants named in ``created`` are compared by
    content (the model's own were merged by ``prepare``). Below IR 4 too, as in
    ``prepare``: legacy initializer inputs are listed again only after this. Then shapes
    are inferred again, for the traffic model."""
    _merge_equal_constants(model.graph, created)
    CommonSubexpressionEliminationPass()(model)
    RemoveUnusedNodesPass()(model)
    # New nodes were typed one by one; where that left a dtype or a dimension unknown
    # (a shape computed at run time), the whole model sees more.
    if _has_unknown_shapes(model.graph):
        infer_model_shapes(model)


def _has_unknown_shapes(graph: ir.Graph) -> bool:
    for node in graph:
        for value in node.outputs:
            if value.type is None or value.shape is None:
                return True
            if any(not isinstance(d, int) and d.value is None for d in value.shape.dims):
                return True
    return False


def _merge_equal_constants(graph: ir.Graph, names: Collection[str]) -> None:
    first: dict[tuple[object, ...], ir.Value] = {}
    for name in names:
        value = graph.initializers.get(name)
        if value is None or value.const_value is None or value.is_graph_input() \
                or value.is_graph_output() or value.const_value.size > TIDY_CONSTANT_LIMIT:
            continue
        array = value.const_value.numpy()
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in first:
            first[key] = value
            continue
        value.replace_all_uses_with(first[key])
        del graph.initializers[name]


def _retype_folded_strings(graph: ir.Graph) -> None:
    """onnxscript 0.7's folder stores a folded string constant as a plain ir.Tensor, which
    onnx-ir cannot serialize (no bit width for STRING); give it a StringTensor."""
    for value in graph.initializers.values():
        tensor = value.const_value
        if tensor is not None and tensor.dtype == ir.DataType.STRING \
                and not isinstance(tensor, ir.StringTensor):
            value.const_value = ir.StringTensor(tensor.numpy().reshape(-1),
                                                shape=tensor.shape, name=tensor.name)


def _fold_constant_of_shape(node: ir.Node) -> bool | None:
    """onnxscript keeps ConstantOfShape (it is compact), but weights built with it
    must become real constants for rules to see them."""
    if node.op_type != "ConstantOfShape" or node.domain != "" or not node.inputs:
        return None
    shape = node.inputs[0].const_value if node.inputs[0] is not None else None
    if shape is None:
        return None
    size = 1
    for dim in shape.numpy().tolist():
        size *= int(dim)
    return size <= FOLD_OUTPUT_LIMIT


def _count_nodes(model: ir.Model) -> int:
    return sum(1 for _ in model.graph)
