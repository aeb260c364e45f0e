"""Shapes for the values rules create, so later rules and the traffic model see them.

Whole-model inference runs once before rewriting (onnx-ir's ShapeInferencePass);
after that only new nodes need shapes, and onnx infers one node at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import onnx
import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass, _c_api_utils

DATA_LIMIT = 1024
"""Constant inputs up to this many elements are given to inference as data."""


def infer_node(node: ir.Node, opsets: Mapping[str, int]) -> bool:
    """Fill in missing output types and shapes of ``node`` from its inputs; best effort."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get(node.domain, 1), node.domain)
    except onnx.defs.SchemaError:
        return False
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
        if value.shape is None and proto.tensor_type.HasField("shape"):
            dims = []
            for dim in proto.tensor_type.shape.dim:
                if dim.HasField("dim_value"):
                    dims.append(dim.dim_value)
                elif dim.HasField("dim_param"):
                    dims.append(dim.dim_param)
                else:
                    dims.append(None)
            value.shape = ir.Shape(dims)
    return True


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
    """onnx-ir's ShapeInferencePass over the whole model; True when it changed something.

    onnx-ir 1.1 lists every initializer as a graph input around the onnx call with a
    membership test on the growing input list: quadratic, 577 s of a 100k-node graph's
    743 s. The pass runs with a linear copy of that helper. When onnx's inference fails,
    the pass says "model left unchanged" but may already have listed initializers as
    graph inputs; the signature is put back as it was.
    """
    graph = model.graph
    inputs = list(graph.inputs)
    original = _c_api_utils.call_onnx_api
    _c_api_utils.call_onnx_api = _call_onnx_api_linear
    try:
        result = ShapeInferencePass()(model)
    finally:
        _c_api_utils.call_onnx_api = original
    if list(graph.inputs) != inputs:
        graph.inputs.clear()
        graph.inputs.extend(inputs)
    return result.modified


def _call_onnx_api_linear(func: Callable[[onnx.ModelProto], Any], model: ir.Model) -> Any:
    """onnx-ir's ``_c_api_utils.call_onnx_api`` with a set for "already an input"."""
    graph = model.graph
    initializers = tuple(graph.initializers.values())
    tensors = {v.name: v.const_value for v in initializers}
    original_count = len(graph.inputs)
    listed = {id(v) for v in graph.inputs}
    for value in initializers:
        if value.const_value is not None:
            if value.shape is None:
                value.shape = value.const_value.shape  # type: ignore[assignment]
            if value.dtype is None:
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
