"""Make a freshly loaded model ready for matching: constants folded, shapes known.

Rules test constness (``is_const``) and shapes (``rank``, ``shape``). Exported
models often build weights at run time from constant subgraphs (the onnx
wheel's light models use ConstantOfShape), and carry no intermediate shapes;
without this stage rules would silently not fire.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_ir as ir
from onnx_ir.passes.common import (
    CommonSubexpressionEliminationPass,
    LiftConstantsToInitializersPass,
)
from onnxscript.optimizer import fold_constants

from .deadcode import remove_unused
from .dedupe import merge_equal_initializers
from .shapereads import read_dims_from_inputs, shape_read
from .shapes import infer_model_shapes, infer_node
from .symdims import name_anonymous_input_dims, name_lost_dims
from .traffic import can_fold  # the traffic model's notion of a node folding removes

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
    if fold:
        # Weights held in Constant nodes (models built with onnxscript) become initializers
        # first: every inference serializes the model, and leaves out only initializers (a
        # 670 MB SmolLM spent 6 s of its 10 inferring shapes through its Constants).
        LiftConstantsToInitializersPass(
            lift_all_constants=True, size_limit=BIG_CONSTANT_ELEMENTS)(model)
    # Models loaded from a file were inferred on their proto already (modelio).
    shapes_inferred = _has_unknown_shapes(model.graph) and infer_model_shapes(model)
    shapes_inferred = name_anonymous_input_dims(model) or shapes_inferred
    if fold:
        shapes_inferred = _fold_everything(model) or shapes_inferred
    # After folding, which turns the shapes of static models into constants: only the
    # Ranges over dynamic dims are left to name.
    shapes_inferred = name_lost_dims(model) or shapes_inferred
    if read_dims_from_inputs(model):
        remove_unused(model)  # the Shapes read no more
    return PrepareResult(before - _count_nodes(model), shapes_inferred)


def _fold_everything(model: ir.Model) -> bool:
    """Fold what is constant, lift Constant nodes to initializers, merge duplicates; True
    when shapes were inferred again."""
    # Shapes first (with onnx's data propagation): Shape/Size of statically shaped
    # values (the runtime shape arithmetic exporters emit, e.g. attention's
    # sqrt(head_dim)) fold only when the folder can see them. The folder's own
    # node-by-node inference is off: it costs ten times the folding itself, and one
    # whole-model inference afterwards types what folding created.
    shapes_inferred = modified = retyped = False
    failed: set[ir.Node] = set()  # nodes onnx's reference could not compute either
    for _ in range(MAX_FOLD_ROUNDS):
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            # numpy's warnings while computing constants (log of 0 in a mask) are not
            # the user's business: -q prints errors only
            warnings.simplefilter("ignore", RuntimeWarning)
            changed = _fold(model)
            # typed constants: the folder folds what reads them on the next round
            evaluated = _fold_left_constants(model, failed)
        modified |= changed or evaluated
        retyped = False
        if evaluated:
            continue
        # A folded shape makes the next value static: Shape(Reshape(x, folded)) folds
        # only once that value is typed again. Refold only when a shape query can now go.
        if changed and _has_shape_queries(model.graph):
            shapes_inferred = infer_model_shapes(model) or shapes_inferred
            retyped = True
            if _has_static_shape_queries(model.graph):
                continue
        # Last, the static dims of shapes that stay partly dynamic: earlier, they would
        # fold pieces of a chain that becomes wholly static once retyped.
        if not _fold_static_shape_reads(model.graph):
            break
        modified, retyped = True, False
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
    remove_unused(model)  # what folding and merging left unread, dead nodes
    _drop_output_identities(model.graph)
    if modified and not retyped:
        shapes_inferred = infer_model_shapes(model) or shapes_inferred
    return shapes_inferred


MAX_FOLD_ROUNDS = 4
"""Fold, retype, fold again: enough for the shape chains exporters write (a Reshape to a
folded shape whose own Shape feeds the next Reshape), then the static dims of the shapes
that stay partly dynamic and what reads them."""
BIG_CONSTANT_ELEMENTS = 1 << 14
"""Constant nodes of this many elements or more become initializers before the first shape
inference (``prepare``); the small ones stay nodes until folding is done."""
SHAPE_QUERY_OPS = frozenset({"Shape", "Size"})


def _has_shape_queries(graph: ir.Graph) -> bool:
    return any(node.op_type in SHAPE_QUERY_OPS and node.domain == "" for node in graph)


def _has_static_shape_queries(graph: ir.Graph) -> bool:
    """A Shape/Size whose input now has a fully static shape: the folder will fold it."""
    for node in graph:
        if node.op_type in SHAPE_QUERY_OPS and node.domain == "" and node.inputs:
            shape = node.inputs[0].shape if node.inputs[0] is not None else None
            if shape is not None and shape.is_static():
                return True
    return False


KEPT_CONSTANT_OPS = frozenset({
    "Dropout", "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear",
})
"""Ops left as they are even on constant inputs, as onnxscript's folder leaves them: a
quantized weight stays quantized (its DequantizeLinear is part of the QDQ format)."""


HALF_ACCUMULATING_OPS = frozenset({
    "ReduceSum", "ReduceSumSquare", "ReduceMean", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceProd", "MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum",
    "CumSum", "Softmax", "LogSoftmax", "LayerNormalization", "GroupNormalization",
    "InstanceNormalization", "RMSNormalization", "LpNormalization",
    "MeanVarianceNormalization", "AveragePool", "GlobalAveragePool", "LpPool",
    "GlobalLpPool", "Attention", "Sum", "Mean", "NegativeLogLikelihoodLoss",
    "SoftmaxCrossEntropyLoss", "GridSample",
})
"""Ops whose result goes through many steps: onnx's reference implementation, which the
folders compute with, keeps float16 for the steps (a weight norm's ReduceL2 over 65k float16
weights came out 5% off, wav2vec2's and HuBERT's positional convolution exported in float16;
``Sum(40000, 40000, -40000)`` overflowed), where onnxruntime computes in float32 and rounds
once. On a float16 or bfloat16 tensor they are folded here in float32, the result rounded to
the declared type (``_fold_left_constants``), never by onnxscript's folder."""

REFERENCE_WRONG_OPS = frozenset({"LRN"})
"""Ops onnx's reference implementation (1.23) gets wrong, left for onnxruntime to compute:
LRN loops over the batch instead of the channels, so channels from the batch size on are
not normalized."""

_HALF_TYPES = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


def _sums_in_half(node: ir.Node) -> bool:
    """A standard op of ``HALF_ACCUMULATING_OPS`` reading a float16 or bfloat16 tensor."""
    return (node.op_type in HALF_ACCUMULATING_OPS and node.domain in ("", "ai.onnx")
            and any(v is not None and v.dtype in _HALF_TYPES for v in node.inputs))


def _fold_left_constants(model: ir.Model, failed: set[ir.Node]) -> bool:
    """Compute the standard nodes onnxscript's folder leaves although every input is a
    constant: every node with several outputs (a packed attention weight Split at run time,
    as the dynamo exporter writes nn.MultiheadAttention) and the ops its evaluator fails on
    (the GatherElements with which ALBERT and ELECTRA exports slice their token_type_ids
    buffer). onnx's reference implementation computes them; each read output becomes an
    initializer, so the folder folds their readers on its next round. Outputs are computed
    only when their inferred static size is within FOLD_OUTPUT_LIMIT, so a node the folder
    left for its size is not computed again; nor is one in ``failed`` (adds those it could
    not compute)."""
    graph = model.graph
    opset = model.opset_imports.get("", 1)
    folded = False
    for node in list(graph):  # graph order: a computed node makes its readers candidates
        # Cheapest tests first: few nodes have only constant inputs.
        if node.domain != "" or not node.inputs \
                or not all(_small_constant(v) for v in node.inputs) \
                or node.op_type in KEPT_CONSTANT_OPS or node.op_type in REFERENCE_WRONG_OPS \
                or node in failed or not can_fold(node):
            continue
        shapes = _static_output_shapes(node)
        if shapes is None or _elements(shapes) > FOLD_OUTPUT_LIMIT:
            continue
        arrays = _evaluate(node, opset, widen=_sums_in_half(node))
        if arrays is None or not _as_declared(node, shapes, arrays):
            failed.add(node)
            continue
        for value, array in zip(node.outputs, arrays, strict=True):
            if value.uses() or value.is_graph_output():
                _become_constant(graph, value, array)
        graph.remove(node, safe=True)
        folded = True
    return folded


def _become_constant(graph: ir.Graph, value: ir.Value, array: np.ndarray) -> None:
    """Replace ``value`` everywhere by an initializer holding ``array`` (under its name)."""
    name, value.name = value.name, None
    constant = ir.Value(name=name, type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                        shape=ir.Shape(array.shape), const_value=ir.Tensor(array))
    graph.register_initializer(constant)
    ir.convenience.replace_all_uses_with(value, constant, replace_graph_outputs=True)


def _has_static_shape_reads(graph: ir.Graph) -> bool:
    """A Gather that ``_fold_static_shape_reads`` would turn into a constant."""
    return any(_static_shape_read(node) is not None for node in graph)


def _static_shape_read(node: ir.Node) -> np.ndarray | None:
    """What ``Gather(Shape(x), i)`` or ``Slice(Shape(x), a, b)`` computes when the dims it
    reads are static, else None.
    Not when x is a graph output: its dims may be only declared."""
    read = shape_read(node)
    if read is None or read[0].is_graph_output() \
            or not all(isinstance(d, int) and d >= 0 for d in read[1]):
        return None
    picked = np.asarray(read[1], dtype=np.int64)
    if node.op_type == "Gather":  # the indices' shape (a scalar index reads a scalar)
        return picked.reshape(tuple(node.inputs[1].const_value.shape))  # type: ignore[union-attr]
    return picked


def _fold_static_shape_reads(graph: ir.Graph) -> bool:
    """``Gather(Shape(x), i)`` at constant indices whose dims of ``x`` are static becomes a
    constant, however dynamic x's other dims are: TorchScript reads one dim with a scalar
    index (``x.size(1)``; an LSTM's ``h0 = zeros(2, b, H)`` under a dynamic image width),
    which onnxscript 0.7's folder leaves (it folds 1-D indices only). The Unsqueeze, Concat
    and ConstantOfShape reading it fold on the next round. Not when x is a graph output:
    its dims may be only declared (an OCR model declares [1, seqlen] for a 3-D output)."""
    folded = False
    for node in list(graph):
        picked = _static_shape_read(node)
        if picked is not None:
            _become_constant(graph, node.outputs[0], picked)
            graph.remove(node, safe=True)
            folded = True
    return folded


def _small_constant(value: ir.Value | None) -> bool:
    """A constant known at load time (an initializer no input overrides, or a Constant
    node's output) of at most FOLD_INPUT_LIMIT elements."""
    if value is None:
        return True  # an omitted optional input
    tensor = value.const_value
    if tensor is None or value.is_graph_input() or tensor.size > FOLD_INPUT_LIMIT:
        return False
    producer = value.producer()
    return value.is_initializer() or (
        producer is not None and producer.op_type == "Constant" and producer.domain == "")


def _static_output_shapes(node: ir.Node) -> list[tuple[int, ...] | None] | None:
    """The inferred shape of every output of ``node`` (None for an omitted optional output
    nobody reads), or None when a read output is not a tensor of static shape (a sequence,
    an unknown dimension)."""
    shapes: list[tuple[int, ...] | None] = []
    for value in node.outputs:
        if value.type is None and not value.uses() and not value.is_graph_output():
            shapes.append(None)
            continue
        if not isinstance(value.type, ir.TensorType) or value.shape is None:
            return None
        dims = value.shape.dims
        if not all(isinstance(d, int) for d in dims):
            return None
        shapes.append(tuple(dims))
    return shapes


def _elements(shapes: list[tuple[int, ...] | None]) -> int:
    return sum(math.prod(shape) for shape in shapes if shape is not None)


def _as_declared(node: ir.Node, shapes: list[tuple[int, ...] | None],
                 arrays: list[np.ndarray]) -> bool:
    """Whether the computed outputs are numeric tensors of the inferred shapes and dtypes:
    a reference implementation that got an op wrong must not become a constant."""
    for value, shape, array in zip(node.outputs, shapes, arrays, strict=True):
        if shape is None:
            continue  # not read: dropped
        if array.dtype.kind in "OSU" or array.shape != shape:
            return False  # strings are left to the folder (onnx-ir stores them apart)
        try:
            dtype = ir.DataType.from_numpy(array.dtype)
        except TypeError:
            return False
        if value.dtype is not None and value.dtype != dtype:
            return False
    return True


def _evaluate(node: ir.Node, opset: int, widen: bool = False) -> list[np.ndarray] | None:
    """The outputs of ``node`` on its constant inputs, or None when onnx's reference
    implementation cannot compute them. ``widen`` computes float16 and bfloat16 inputs in
    float32 and rounds each output to its declared type, as onnxruntime does."""
    if node.op_type == "GatherElements":
        data, indices = (v.const_value.numpy() for v in node.inputs)
        result = _gather_elements(data, indices, node.attributes.get_int("axis", 0))
        return None if result is None else [result]
    from onnx.reference import ReferenceEvaluator  # imported on first use: it is slow

    # Positional names: two inputs may be one value, or unnamed.
    inputs = [f"input{i}" if v is not None else "" for i, v in enumerate(node.inputs)]
    proto = ir.serde.serialize_node(node)
    del proto.input[:]
    proto.input.extend(inputs)
    del proto.output[:]
    proto.output.extend(f"output{i}" for i in range(len(node.outputs)))
    constants = [onnx.numpy_helper.from_array(_widened(v) if widen else v.const_value.numpy(),
                                              name)
                 for name, v in zip(inputs, node.inputs, strict=True) if v is not None]
    outputs = [onnx.helper.make_empty_tensor_value_info(name) for name in proto.output]
    try:
        evaluator = ReferenceEvaluator(onnx.helper.make_model(
            onnx.helper.make_graph([proto], "fold", [], outputs, constants),
            opset_imports=[onnx.helper.make_opsetid("", opset)]))
        results = evaluator.run(None, {})
    except Exception:  # noqa: BLE001 - an op the reference cannot run simply stays
        return None
    if not all(isinstance(a, (np.ndarray, np.generic)) for a in results):
        return None  # a sequence or an optional
    arrays = [np.asarray(a) for a in results]
    if widen:
        arrays = [a.astype(v.dtype.numpy()) if v.dtype in _HALF_TYPES else a
                  for a, v in zip(arrays, node.outputs, strict=True)]
    return arrays


def _widened(value: ir.Value) -> np.ndarray:
    """A constant input as computed in float32 when it is float16 or bfloat16."""
    array = value.const_value.numpy()
    return array.astype(np.float32) if value.dtype in _HALF_TYPES else array


def _gather_elements(data: np.ndarray, indices: np.ndarray, axis: int) -> np.ndarray | None:
    """GatherElements in numpy: onnx's reference implementation (1.23) fails when the axis
    holds 64 values or more (numpy.choose's limit) and its fallback gathers wrong values.
    As onnxruntime does, the indices may be shorter than the data on the other axes (they
    read its leading part) and negative; None where onnxruntime would raise."""
    rank = data.ndim
    if rank == 0 or indices.ndim != rank or not -rank <= axis < rank:
        return None
    axis %= rank
    size = data.shape[axis]
    if indices.size and (indices.min() < -size or indices.max() >= size):
        return None
    if any(n > d for k, (n, d) in enumerate(zip(indices.shape, data.shape, strict=True))
           if k != axis):
        return None
    window = data[tuple(slice(None) if k == axis else slice(0, n)
                        for k, n in enumerate(indices.shape))]
    return np.take_along_axis(window, np.where(indices < 0, indices + size, indices), axis)


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
    # The folder warns about every multi-output node it skips and every evaluation that
    # fails (_fold_left_constants computes the constant ones); -q prints errors only.
    folder_log = logging.getLogger("onnxscript.optimizer._constant_folding")
    level = folder_log.level
    folder_log.setLevel(logging.ERROR)
    # The folder turns Shape/Size of a statically shaped value into a constant; a graph
    # output's dims may be only declared (an exporter may declare them wrongly, onnxruntime
    # never checks), so the folder sees what its producer gives it instead.
    hidden = [(value, value.shape) for value in model.graph.outputs
              if value.shape is not None and any(
                  use.node.op_type in ("Shape", "Size") for use in value.uses())]
    for value, _ in hidden:
        value.shape = _shape_from_producer(value, model.opset_imports)
    try:
        return fold_constants(
            model,
            onnx_shape_inference=False,
            input_size_limit=FOLD_INPUT_LIMIT,
            output_size_limit=FOLD_OUTPUT_LIMIT,
            should_fold=_should_fold,
        ).modified
    except (RuntimeError, ValueError):  # ValueError: a malformed If the checker let through
        return True  # maybe modified: shapes are inferred again
    finally:
        folder_log.setLevel(level)
        for value, shape in hidden:
            value.shape = shape


def tidy(model: ir.Model, created: Collection[str] = ()) -> None:
    """Merge the duplicates rewrites create: three projections of one LayerNorm output
    each get their own Reshape to 2-D (and their own shape constant) when they become
    Gemms; one is enough. Only the small constants named in ``created`` are compared by
    content (the model's own were merged by ``prepare``). Below IR 4 too, as in
    ``prepare``: legacy initializer inputs are listed again only after this. Then shapes
    are inferred again, for the traffic model."""
    _merge_equal_constants(model.graph, created)
    CommonSubexpressionEliminationPass()(model)
    remove_unused(model)
    _drop_output_identities(model.graph)
    # New nodes were typed one by one; where that left a dtype or a dimension unknown
    # (a shape computed at run time), the whole model sees more.
    if _has_unknown_shapes(model.graph):
        infer_model_shapes(model)
    # A dim the rewrite made static (a Reshape to a materialized target) that a Shape
    # reads: what reads it folds now, as in prepare (an LSTM's h0 sized by that dim).
    if _has_static_shape_reads(model.graph):
        _fold_everything(model)


def _drop_output_identities(graph: ir.Graph) -> None:
    """``y = Identity(t)`` where ``y`` is a graph output and the Identity is ``t``'s only
    reader: the producer of ``t`` writes ``y`` directly (a rule or the folder made ``y`` a
    copy, e.g. a Reshape to the shape it already has, and an output keeps its name)."""
    for out in list(graph.outputs):
        node = out.producer()
        if node is None or node.op_type != "Identity" or node.domain != "" \
                or len(node.inputs) != 1 or node.inputs[0] is None:
            continue
        source = node.inputs[0]
        if source.producer() is None or source.is_graph_output() or len(source.uses()) != 1:
            continue
        name = out.name
        ir.convenience.replace_all_uses_with(out, source, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        out.name = None
        source.name = name


def _has_unknown_shapes(graph: ir.Graph) -> bool:
    """Whether a node output lacks a type, a shape or a dimension (a symbol is known)."""
    for node in graph:
        for value in node.outputs:
            shape = value.shape
            if value.type is None or shape is None:
                return True
            for dim in shape:  # iterating the shape itself: no tuple of dims per value
                if not isinstance(dim, int) and dim.value is None:
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


def _shape_from_producer(value: ir.Value, opsets: dict[str, int]) -> ir.Shape | None:
    """The shape a graph output's producer gives it from its inputs (None when inference
    cannot tell); a graph input listed as an output keeps its own, which onnxruntime checks."""
    node = value.producer()
    if node is None:
        return value.shape
    saved = [(out, out.shape) for out in node.outputs]
    for out, _ in saved:
        out.shape = None
    try:
        infer_node(node, opsets)
        return value.shape
    finally:
        for out, shape in saved:
            out.shape = shape


def _should_fold(node: ir.Node) -> bool | None:
    """What the folder may fold, beyond its own choice (None): never a node the traffic
    model does not fold (onnxscript's list of random ops misses Bernoulli, which it would
    freeze into one draw) nor one that sums in half precision (``HALF_ACCUMULATING_OPS``);
    and ConstantOfShape, which onnxscript keeps (it is compact), when
    small: weights built with it must become real constants for rules to see them."""
    if not can_fold(node) or _sums_in_half(node) or (
            node.op_type in REFERENCE_WRONG_OPS and node.domain in ("", "ai.onnx")):
        return False
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
    return len(model.graph)  # the main graph's nodes (the linked list keeps its length)
