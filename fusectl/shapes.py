"""Shapes for the values rules create, so later rules and the traffic model see them.

Whole-model inference runs before rewriting (onnx's inference with data propagation);
after that only new nodes need shapes, and onnx infers one node at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import onnx
import onnx_ir as ir
from onnx_ir.passes.common import _c_api_utils

from .irdata import plain
from .shapeexpr import is_minted

DATA_LIMIT = 1024
"""Constant inputs up to this many elements are given to inference as data."""


SHAPE_OF_FIRST_INPUT = frozenset({
    ("com.microsoft", "Gelu"), ("com.microsoft", "FastGelu"), ("com.microsoft", "BiasGelu"),
    ("com.microsoft", "QuickGelu"), ("com.microsoft", "SkipLayerNormalization"),
    ("com.microsoft", "SkipSimplifiedLayerNormalization"), ("", "LayerNormalization"),
    ("", "SimplifiedLayerNormalization"), ("com.microsoft", "RotaryEmbedding"),
})
"""Fused kernels the onnxruntime target emits whose first output is shaped like their first
input. onnx has no schema for them (LayerNormalization none below opset 17), so without
this their outputs stay untyped and every later rule reading rank() or shape() says no."""

_BASE_OP = {("com.microsoft", "FusedConv"): "Conv", ("com.microsoft", "FusedGemm"): "Gemm"}
"""Fused kernels shaped like the standard op they extend (their extra attributes and the
FusedConv residual input are left out when inferring)."""


def infer_node(node: ir.Node, opsets: Mapping[str, int], *, refine: bool = False) -> bool:
    """Fill in missing output types and shapes of ``node`` from its inputs; best effort.

    ``refine``: also fix the dims an existing shape leaves open where inference knows them
    (a replacement's output inherits the old output's shape: a Reshape whose run-time target
    became ``[0, 0, -1, 16]`` has 4 heads where the old one had an unknown count). Graph
    outputs keep their declared shapes."""
    key = (node.domain, node.op_type)
    base = _BASE_OP.get(key)
    if base is not None:
        return _infer_as(node, base, opsets, refine)
    if key == ("com.microsoft", "FusedMatMul"):
        return _infer_fused_matmul(node, opsets, refine)
    if key == ("com.microsoft", "MultiHeadAttention"):
        return _infer_multihead_attention(node)
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get(node.domain, 1), node.domain)
    except onnx.defs.SchemaError:
        return _copy_first_input(node) if key in SHAPE_OF_FIRST_INPUT else False
    input_types = {}
    input_data = {}
    for index, value in enumerate(node.inputs):
        if value is None:
            continue
        if value.type is None:
            return False
        name = value.name or f"__in{index}"
        proto = onnx.TypeProto()
        ir.serde.serialize_type_into(proto, value.type)
        if value.shape is not None:
            ir.serde.serialize_shape_into(proto, value.shape)
        input_types[name] = proto
        constant = value.const_value
        if constant is not None and constant.size <= DATA_LIMIT:
            # A Reshape's target or a Slice's bounds decide the output shape.
            input_data[name] = ir.serde.serialize_tensor(constant)
    try:
        node_proto = _serialize_with_names(node)
        inferred = onnx.shape_inference.infer_node_outputs(
            schema, node_proto, input_types, input_data, opset_imports=[
                onnx.helper.make_opsetid(d, v) for d, v in opsets.items()
            ],
        )
    except Exception:  # noqa: BLE001 - inference is an optimisation, never fatal
        return False
    for index, value in enumerate(node.outputs):
        proto = inferred.get(node_proto.output[index])
        if proto is None or not proto.HasField("tensor_type"):
            continue
        if value.type is None:
            value.type = ir.TensorType(ir.DataType(proto.tensor_type.elem_type))
        if not proto.tensor_type.HasField("shape"):
            continue
        if value.shape is None:
            value.shape = ir.Shape(_dims(proto.tensor_type.shape))
        elif refine and not value.is_graph_output():
            value.shape = _refined(value.shape, _dims(proto.tensor_type.shape))
    return True


def _refined(shape: ir.Shape, inferred: list[int | str | None]) -> ir.Shape:
    """``shape`` with its open dims taken from ``inferred``: a number for a symbol or an
    unknown dim, a name for an unknown dim or a symbol onnx minted (``unk__3`` names
    nothing: the Reshape whose -1 it stood for may be gone); a known number is never
    changed."""
    if len(inferred) != len(shape):
        return shape
    dims: list[int | ir.SymbolicDim | str | None] = []
    changed = False
    for old, new in zip(shape, inferred, strict=True):
        if isinstance(old, int) or new is None or (
                isinstance(new, str) and not is_minted(old.value)):
            dims.append(old)
        else:
            dims.append(new)
            changed = True
    return ir.Shape(dims) if changed else shape


def _copy_first_input(node: ir.Node) -> bool:
    source, target = node.inputs[0] if node.inputs else None, node.outputs[0]
    if source is None or source.type is None:
        return False
    if target.type is None:
        target.type = _output_type(node, source)
    if target.shape is None and source.shape is not None:
        target.shape = ir.Shape(list(source.shape))
    return True


_NORMS_OF_SCALE_TYPE = frozenset({("", "LayerNormalization"),
                                  ("", "SimplifiedLayerNormalization")})
"""onnxruntime's norms in the default domain give their output the scale's type (a float32
input normalized with a float16 scale is float16), as onnx's LayerNormalization does not."""


def _output_type(node: ir.Node, source: ir.Value) -> ir.TypeProtocol | None:
    if (node.domain, node.op_type) in _NORMS_OF_SCALE_TYPE and len(node.inputs) > 1:
        scale = node.inputs[1]
        return scale.type if scale is not None else None
    return source.type


def _infer_as(node: ir.Node, op_type: str, opsets: Mapping[str, int],
              refine: bool = False) -> bool:
    """Infer ``node`` as the standard ``op_type`` it extends, then copy the result back."""
    schema = onnx.defs.get_schema(op_type, opsets.get("", 1), "")
    inputs = list(node.inputs[: schema.max_input])
    attributes = [a for name, a in node.attributes.items() if name in schema.attributes]
    return _infer_twin(node, ir.Node("", op_type, inputs, attributes=attributes,
                                     num_outputs=1), opsets, refine)


def _infer_fused_matmul(node: ir.Node, opsets: Mapping[str, int], refine: bool) -> bool:
    """com.microsoft.FusedMatMul is ``MatMul(op(A), op(B)) * alpha``, op transposing the last
    two dims where transA / transB say so: inferred as a MatMul of operands shaped that way.
    Batch transposes (transBatchA / transBatchB) are left untyped."""
    attributes = node.attributes
    if attributes.get_int("transBatchA", 0) or attributes.get_int("transBatchB", 0):
        return False
    operands: list[ir.Value | None] = []
    for value, flag in zip(node.inputs[:2], ("transA", "transB"), strict=False):
        if value is not None and attributes.get_int(flag, 0):
            if value.shape is None or len(value.shape) < 2:
                return False
            dims = list(value.shape)
            dims[-2], dims[-1] = dims[-1], dims[-2]
            value = ir.Value(name=value.name, type=value.type, shape=ir.Shape(dims))
        operands.append(value)
    return _infer_twin(node, ir.Node("", "MatMul", operands, num_outputs=1), opsets, refine)


def _infer_multihead_attention(node: ir.Node) -> bool:
    """com.microsoft.MultiHeadAttention's first output is [B, S, H*Dv]: the query's [B, S]
    and the value's hidden size, from a [B, L, H*Dv] value or [B, H, L, Dv] heads. Only the
    query-key-value form the onnxruntime target emits (3-D query, separate K and V)."""
    query = node.inputs[0] if node.inputs else None
    value = node.inputs[2] if len(node.inputs) > 2 else None
    target = node.outputs[0]
    if query is None or value is None or query.type is None:
        return False
    if query.shape is None or value.shape is None or len(query.shape) != 3:
        return False
    value_dims = list(value.shape)
    if len(value_dims) == 3:
        hidden = value_dims[2]
    elif len(value_dims) == 4 and isinstance(value_dims[1], int) and isinstance(
            value_dims[3], int):
        hidden = value_dims[1] * value_dims[3]
    else:
        return False
    if target.type is None:
        target.type = query.type
    if target.shape is None:
        target.shape = ir.Shape([query.shape[0], query.shape[1], hidden])
    return True


def _infer_twin(node: ir.Node, twin: ir.Node, opsets: Mapping[str, int], refine: bool) -> bool:
    """Infer ``twin`` (a standard node reading ``node``'s inputs) and give ``node``'s first
    output what it got."""
    try:
        if not infer_node(twin, opsets):
            return False
        source, target = twin.outputs[0], node.outputs[0]
        if target.type is None:
            target.type = source.type
        if source.shape is not None:
            if target.shape is None:
                target.shape = source.shape
            elif refine and not target.is_graph_output():
                target.shape = _refined(target.shape, [_plain_dim(d) for d in source.shape])
        return True
    finally:
        for index in range(len(twin.inputs)):
            twin.replace_input_with(index, None)


def _serialize_with_names(node: ir.Node) -> onnx.NodeProto:
    """serialize_node needs named values; detached new nodes may have none yet."""
    renamed = []
    for prefix, values in (("__in", node.inputs), ("__out", node.outputs)):
        for index, value in enumerate(values):
            if value is not None and not value.name:
                value.name = f"{prefix}{index}"
                renamed.append(value)
    try:
        return ir.serde.serialize_node(node)
    finally:
        for value in renamed:
            value.name = None


def infer_model_shapes(model: ir.Model) -> bool:
    """onnx's shape inference (with data propagation) over the whole model; True when it
    changed a type or shape. If onnx's inference fails, the model is left unchanged.

    Why not onnx-ir's ShapeInferencePass: in onnx-ir 1.1 it lists every initializer as a
    graph input with a membership test on the growing input list (quadratic: 577 s of a
    100k-node graph's 743 s), and it deserializes the whole inferred model again only to
    copy shapes back (two thirds of its remaining time). Here the initializers are listed
    with a set and the inferred types are read straight from the proto's value_info.
    """
    return bool(try_infer_model_shapes(model))


def try_infer_model_shapes(model: ir.Model) -> bool | None:
    """:func:`infer_model_shapes`, telling a failure (None, the model unchanged) from an
    inference that changed nothing (False)."""
    inferred = _infer_whole(model)
    if inferred is None:
        return None
    changed = merge_inferred_shapes(model.graph, inferred.graph)
    if _type_past_unschemed_ops(model):
        changed = True
        # the ops typed, the whole-model pass now reaches past them with data propagation
        # (if it fails, the node-by-node types stay)
        retyped = _infer_whole(model)
        if retyped is not None:
            merge_inferred_shapes(model.graph, retyped.graph)
    return changed


def _infer_whole(model: ir.Model) -> onnx.ModelProto | None:
    """onnx's inference over the model, None when it fails; the graph inputs as they were."""
    graph = model.graph
    inputs = list(graph.inputs)
    try:
        return _call_onnx_api_linear(infer_proto_shapes, model)
    except Exception:  # noqa: BLE001 - inference is an optimisation, never fatal
        return None
    finally:
        if list(graph.inputs) != inputs:
            graph.inputs.clear()
            graph.inputs.extend(inputs)


def _type_past_unschemed_ops(model: ir.Model) -> bool:
    """Type, node by node in graph order, what onnx's inference left untyped behind an
    onnxruntime kernel it has no schema for (a LayerNormalization below opset 17 in
    onnxruntime's test models, SimplifiedLayerNormalization): onnx stops at such a node, and
    everything after it would stay untyped, so no rule reading dtype() or rank() fires
    there. True when something was typed; nothing is walked in models without such a node."""
    opsets = dict(model.opset_imports)
    graph = model.graph
    if not any((node.domain, node.op_type) in SHAPE_OF_FIRST_INPUT
               and not _has_schema(node, opsets) and node.outputs[0].type is None
               for node in graph):
        return False
    typed = False
    for node in graph:
        if all(v.type is not None and v.shape is not None for v in node.outputs) \
                or any(v is not None and v.type is None for v in node.inputs):
            continue
        typed = infer_node(node, opsets) or typed
    return typed


def _has_schema(node: ir.Node, opsets: Mapping[str, int]) -> bool:
    return onnx.defs.has(node.op_type, opsets.get(node.domain, 1), node.domain)


def infer_proto_shapes(proto: onnx.ModelProto | bytes) -> onnx.ModelProto:
    """onnx's inference with data propagation, strict first; when strict mode gives up on
    the whole model (an exporter declared an output with the wrong rank, which onnxruntime
    ignores), the non-strict pass still types every node it can."""
    try:
        return onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True,
                                                 data_prop=True)
    except onnx.shape_inference.InferenceError:
        return onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=False,
                                                 data_prop=True)


def merge_inferred_shapes(graph: ir.Graph, proto: onnx.GraphProto, *,
                          keep_signature: bool = False) -> bool:
    """Copy inferred types and shapes onto the values of ``graph`` (and its subgraphs, which
    the proto lists in the same node order); True when something changed.
    ``keep_signature`` leaves the main graph's inputs and outputs as declared."""
    return _merge_graph(graph, proto, keep_signature, {})


def _merge_graph(graph: ir.Graph, proto: onnx.GraphProto, keep_signature: bool,
                 seen: dict[bytes, _TensorFacts | None]) -> bool:
    """merge_inferred_shapes; ``seen`` holds the facts of each distinct inferred type met so
    far (a 100k-node graph has a handful: reading each once halves the merge)."""
    types = {info.name: info.type for part in (proto.input, proto.value_info, proto.output)
             for info in part}
    modified = False
    values = [*graph.inputs,
              *plain(graph.initializers).values(),
              *(out for node in graph for out in node.outputs)]
    if keep_signature:
        declared = {id(v) for v in (*graph.inputs, *graph.outputs)}
        values = [v for v in values if id(v) not in declared]
    for value in values:
        inferred = types.get(value.name) if value.name else None
        if inferred is not None:
            modified |= _set_type(value, inferred, seen)
    for index, node in enumerate(graph):
        subgraphs = [attr for attr in plain(node.attributes).values()
                     if attr.type in _SUBGRAPH_ATTRIBUTES and not attr.is_ref()]
        if not subgraphs or index >= len(proto.node):
            continue
        node_proto = proto.node[index]
        for attr in subgraphs:
            attr_proto = next((a for a in node_proto.attribute if a.name == attr.name), None)
            if attr_proto is None:
                continue
            if attr.type == ir.AttributeType.GRAPH:
                modified |= _merge_graph(attr.value, attr_proto.g, False, seen)
            else:
                for sub, sub_proto in zip(attr.value, attr_proto.graphs, strict=False):
                    modified |= _merge_graph(sub, sub_proto, False, seen)
    return modified


_SUBGRAPH_ATTRIBUTES = frozenset({ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS})


def prefer_computed_dims(graph: ir.Graph, computed: onnx.GraphProto) -> int:
    """Where the model's own arithmetic (``computed``: onnx's inference run without the
    declared value_info of intermediates) gives a dim that the declared one contradicts,
    take the computed one; returns how many values changed.

    A declared dim is a claim nobody checks (onnxruntime ignores it, onnx's inference keeps a
    declared name over one it computes): ``value_info`` left at batch 1 after an input was made
    dynamic would let rules bake ``1`` into a Reshape. A computed dim is a number or a name
    carried from the inputs; where inference could not tell (none, or a symbol it minted)
    the declared dim stays. The graph's outputs (never in ``value_info``) keep their
    declarations."""
    types = {info.name: info.type for info in computed.value_info}
    seen: dict[bytes, _TensorFacts | None] = {}  # a handful of distinct types, read once each
    changed = 0
    for node in graph:
        for value in node.outputs:
            inferred = types.get(value.name) if value.name else None
            if inferred is None:
                continue
            facts = _cached_facts(inferred, seen)
            if facts is None or facts.dims is None or value.shape is None:
                continue
            current = tuple(_plain_dim(d) for d in value.shape.dims)
            if len(current) != len(facts.dims):
                dims = facts.dims  # a declared rank the arithmetic contradicts says nothing
            else:
                dims = tuple(c if isinstance(c, int) or not is_minted(c) else d
                             for c, d in zip(facts.dims, current, strict=True))
            if dims != current:
                value.shape = ir.Shape(dims)
                changed += 1
    return changed


@dataclass(frozen=True)
class _TensorFacts:
    """An inferred tensor type as plain values: its dtype (None: not inferred) and its dims
    (None: no shape; a dim is an int, a symbol or None when unknown)."""

    dtype: ir.DataType | None
    dims: tuple[int | str | None, ...] | None


def _cached_facts(inferred: onnx.TypeProto, seen: dict[bytes, _TensorFacts | None]
                  ) -> _TensorFacts | None:
    """``_tensor_facts``, read once per distinct type (equal types, equal bytes: a 100k-node
    graph has a handful)."""
    key = inferred.SerializeToString()
    if key not in seen:
        seen[key] = _tensor_facts(inferred)
    return seen[key]


def _tensor_facts(inferred: onnx.TypeProto) -> _TensorFacts | None:
    """The facts of a tensor type, or None for any other type (sequences, optionals)."""
    if not inferred.HasField("tensor_type"):
        return None
    tensor = inferred.tensor_type
    return _TensorFacts(ir.DataType(tensor.elem_type) if tensor.elem_type else None,
                        tuple(_dims(tensor.shape)) if tensor.HasField("shape") else None)


def _set_type(value: ir.Value, inferred: onnx.TypeProto,
              seen: dict[bytes, _TensorFacts | None]) -> bool:
    """Take the inferred dtype and shape when they differ from the value's (onnx's inference
    starts from the value's own, so the inferred one is at least as precise)."""
    facts = _cached_facts(inferred, seen)
    if facts is None:  # sequences, optionals: rare, the slow path
        if inferred.WhichOneof("value") is None:
            return False
        new_type = ir.serde.deserialize_type_proto_for_type(inferred)
        new_shape = ir.serde.deserialize_type_proto_for_shape(inferred)
        modified = False
        if new_type is not None and value.type != new_type:
            value.type = new_type
            modified = True
        if new_shape is not None and value.shape != new_shape:
            value.shape = new_shape
            modified = True
        return modified
    modified = False
    dtype = facts.dtype
    if dtype is not None and (value.type is None or value.dtype != dtype):
        value.dtype = dtype
        modified = True
    dims = facts.dims
    if dims is not None:
        current = value.shape
        if current is None or tuple(_plain_dim(d) for d in current.dims) != dims:
            value.shape = ir.Shape(dims)
            modified = True
    return modified


def _dims(shape: onnx.TensorShapeProto) -> list[int | str | None]:
    dims: list[int | str | None] = []
    for dim in shape.dim:
        if dim.HasField("dim_value"):
            dims.append(dim.dim_value)
        elif dim.HasField("dim_param"):
            dims.append(dim.dim_param)
        else:
            dims.append(None)
    return dims


def _plain_dim(dim: int | ir.SymbolicDim) -> int | str | None:
    return dim if isinstance(dim, int) else dim.value


def _call_onnx_api_linear(func: Callable[[onnx.ModelProto], Any], model: ir.Model) -> Any:
    """onnx-ir's ``_c_api_utils.call_onnx_api`` with a set for "already an input"."""
    graph = model.graph
    initializers = tuple(graph.initializers.values())
    tensors = {v.name: v.const_value for v in initializers}
    original_count = len(graph.inputs)
    listed = {id(v) for v in graph.inputs}
    for value in initializers:
        if value.const_value is not None:
            # The tensor is the truth: a folded value may still carry the symbolic shape
            # inferred before it was folded.
            if value.shape is None or value.shape != value.const_value.shape:
                value.shape = ir.Shape(value.const_value.shape.dims)
            if value.dtype != value.const_value.dtype:
                value.dtype = value.const_value.dtype
        if id(value) not in listed:
            graph.inputs.append(value)
            listed.add(id(value))
        if value.const_value is None:
            graph.initializers.pop(value.name)
        elif value.const_value.nbytes > _c_api_utils._BIG_TENSOR_SIZE_LIMIT:
            value.const_value = None
            graph.initializers.pop(value.name)
    proto = ir.serde.serialize_model(model)
    try:
        return func(proto)
    finally:
        for value in initializers:
            value.const_value = tensors[value.name]
            if value.const_value is not None:
                graph.register_initializer(value)
            else:
                graph.initializers.add(value)
        kept = graph.inputs[:original_count]
        graph.inputs.clear()
        graph.inputs.extend(kept)
