"""The reference run in float64: how far the reference's own float32 (or float16) result is
from exact.

A fusion reorders float32 arithmetic, so its result differs from the reference's by rounding.
On a deep model (random weights, LayerNorm of small variances) that rounding can exceed the
fp32 tolerance of SPEC §5: the one-layer Whisper encoder of onnxscript's test models is
6e-4 away from its float64 value at the reference, against a tolerance near 1e-4, and an
equally accurate candidate then "fails". Validation asks this module for the float64 outputs
only when float32 outputs disagree, and does not hold against the candidate what stays within
the reference's own rounding error (``validate.py`` decides how).

The same holds in float16, where a fused kernel that computes in float32 inside (onnxruntime's
RotaryEmbedding) is *more* accurate than the float16 chain it replaces.

The reference is widened (every float32 and float16 tensor, type, cast, constant and float
output type becomes float64) and run by onnx's reference evaluator, which computes the
standard ops in numpy at the dtype it is given (onnxruntime's CPU provider has no float64
Conv). Models with ops of other domains or quantized ops give no float64 run, nor do models
the evaluator cannot load or run: then the float32 (or float16) verdict stands, and the
output's reason says why (``Unavailable``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import TopologicalSortPass

from .errors import first_line_of

FLOAT, DOUBLE = ir.DataType.FLOAT, ir.DataType.DOUBLE
WIDENED = frozenset({FLOAT, ir.DataType.FLOAT16})
"""The element types computed in float64 instead."""

# Inputs whose type the standard fixes to float32 (index per op): they stay float32.
# Resize-10 takes its scales second, later versions third (after roi).
_FLOAT_ONLY_INPUTS: dict[str, tuple[int, ...]] = {"Resize": (2,), "Upsample": (1,)}
_QUANTIZED_OPS = frozenset({
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv",
    "QLinearMatMul", "MatMulInteger", "ConvInteger",
})  # fmt: skip
# The attribute naming an op's output element type, and whether float is its default.
_DTYPE_ATTRIBUTES: dict[str, tuple[str, bool]] = {
    "Cast": ("to", False),
    "EyeLike": ("dtype", False),
    "Bernoulli": ("dtype", False),
    "RandomNormal": ("dtype", True),
    "RandomUniform": ("dtype", True),
    "RandomNormalLike": ("dtype", False),
    "RandomUniformLike": ("dtype", False),
    "HannWindow": ("output_datatype", True),
    "HammingWindow": ("output_datatype", True),
    "BlackmanWindow": ("output_datatype", True),
    "MelWeightMatrix": ("output_datatype", True),
}


class Unavailable(Exception):
    """Why a model has no float64 run, in one line: validation reports it, and the float32
    (or float16) verdict stands."""


class Float64Run:
    """The model widened to float64 and its evaluator, built on the first sample that needs
    them and kept for the next ones (a model is widened and loaded once per validation)."""

    def __init__(self, model: ir.Model | str | Path) -> None:
        self._model: ir.Model | str | Path | None = model
        self._evaluator: Any = None
        self._failure: str | None = None
        self._outputs: list[str] = []
        self._inputs: set[str] = set()

    def _build(self) -> None:
        source, self._model = self._model, None  # the evaluator holds what it needs
        # A model loaded for this run alone is widened in place: no second copy of the weights.
        copy = isinstance(source, ir.Model)
        model = source if isinstance(source, ir.Model) else _load(source)
        why = unsupported(model)
        if why is not None:
            raise Unavailable(why)
        wide = _widen(model, copy=copy)
        from onnx.reference import ReferenceEvaluator  # imported when a comparison needs it

        try:
            self._evaluator = ReferenceEvaluator(ir.to_proto(wide))
        except Exception as e:  # noqa: BLE001 - an op the evaluator lacks, a bad conversion
            raise Unavailable(f"onnx's reference evaluator cannot load it: {_first_line(e)}"
                              ) from None
        self._outputs = [v.name for v in wide.graph.outputs]
        self._inputs = {v.name for v in wide.graph.inputs}

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """The outputs on ``feeds`` (float feeds widened) by output name, sequences as lists.
        Raises :class:`Unavailable` saying why the model cannot be run so."""
        if self._evaluator is None and self._failure is None:
            try:
                self._build()
            except Unavailable as e:
                self._failure = str(e)
            except Exception as e:  # noqa: BLE001 - e.g. an external data file gone missing
                self._failure = f"cannot widen the model: {_first_line(e)}"
        if self._failure is not None:
            raise Unavailable(self._failure)
        wide_feeds = {k: _widen_array(v) for k, v in feeds.items() if k in self._inputs}
        try:
            results = self._evaluator.run(None, wide_feeds)
        except Exception as e:  # noqa: BLE001 - an op the evaluator computes differently
            raise Unavailable(f"onnx's reference evaluator failed: {_first_line(e)}") from None
        return dict(zip(self._outputs, results, strict=False))

    def outputs(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """The tensor outputs on ``feeds`` (float feeds widened), or None when the model
        cannot be run that way (other domains, quantized ops, an evaluator error)."""
        try:
            results = self.run(feeds)
        except Unavailable:
            return None
        return {name: np.asarray(r) for name, r in results.items()
                if not isinstance(r, (list, tuple, dict))}


def float64_outputs(
    model: ir.Model | str | Path, feeds: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray] | None:
    """The model's outputs computed in float64 on ``feeds``: one :class:`Float64Run`."""
    return Float64Run(model).outputs(feeds)


def widened(model: ir.Model, *, copy: bool = True) -> ir.Model | None:
    """``model`` (a copy of it unless ``copy=False``) computing in float64 where it computed
    in float32 or float16; None if :func:`unsupported` says why it cannot."""
    return None if unsupported(model) is not None else _widen(model, copy=copy)


def _widen(model: ir.Model, *, copy: bool) -> ir.Model:
    wide = model.clone() if copy else model
    for graph in wide.graphs():
        for value in (*graph.inputs, *graph.initializers.values()):
            _widen_value(value)
        for node in list(graph):
            _widen_node(node)
            for value in node.outputs:
                _widen_value(value)
        for node in list(graph):
            _keep_float_inputs(graph, node)
    return wide


def unsupported(model: ir.Model) -> str | None:
    """Why ``model`` cannot be widened, in a few words; None if it can."""
    if model.functions:  # a function body's types would need the same care; rare in references
        return "the model has local functions"
    for graph in model.graphs():
        for node in graph:
            if node.domain not in ("", "ai.onnx"):
                return f"{node.domain}.{node.op_type} is not a standard ONNX op"
            if node.op_type in _QUANTIZED_OPS:
                return f"quantized op {node.op_type}"
    return None


def _load(path: str | Path) -> ir.Model:
    try:
        model = ir.load(os.fspath(path))
    except Exception as e:  # noqa: BLE001 - any loading error is the reason
        raise Unavailable(f"cannot load the model: {_first_line(e)}") from None
    TopologicalSortPass()(model)  # an input out of order (fusectl.repair forgives it)
    return model


def _first_line(error: BaseException) -> str:
    return first_line_of(error, 160)


def _widen_array(array: np.ndarray) -> np.ndarray:
    return array.astype(np.float64) if array.dtype in (np.float32, np.float16) else array


def _widen_value(value: ir.Value) -> None:
    if value.type is not None and value.type.dtype in WIDENED:
        value.type = ir.TensorType(DOUBLE)
    tensor = value.const_value
    if tensor is not None and tensor.dtype in WIDENED:
        value.const_value = ir.tensor(tensor.numpy().astype(np.float64), name=tensor.name)
    elif isinstance(tensor, ir.ExternalTensor):  # the evaluator gets one self-contained proto
        value.const_value = ir.tensor(tensor.numpy(), name=tensor.name)


def _widen_node(node: ir.Node) -> None:
    if node.op_type in _DTYPE_ATTRIBUTES:
        name, float_default = _DTYPE_ATTRIBUTES[node.op_type]
        attr = node.attributes.get(name)
        if (attr is None and float_default) or (
                attr is not None and attr.type == ir.AttributeType.INT
                and attr.value in WIDENED):
            node.attributes[name] = ir.AttrInt64(name, int(DOUBLE))
    if node.op_type == "ConstantOfShape" and "value" not in node.attributes:
        node.attributes["value"] = ir.AttrTensor("value", ir.tensor(np.zeros(1, np.float64)))
    for name, attr in list(node.attributes.items()):
        if attr.type == ir.AttributeType.TENSOR and attr.value.dtype in WIDENED:
            node.attributes[name] = ir.AttrTensor(
                name, ir.tensor(attr.value.numpy().astype(np.float64)))
    if node.op_type == "Constant":
        for name in ("value_float", "value_floats"):
            attr = node.attributes.pop(name, None)
            if attr is not None:
                node.attributes["value"] = ir.AttrTensor(
                    "value", ir.tensor(np.asarray(attr.value, dtype=np.float64)))


def _keep_float_inputs(graph: ir.Graph, node: ir.Node) -> None:
    """Cast back to float32 the inputs the standard allows only as float32."""
    indices = _FLOAT_ONLY_INPUTS.get(node.op_type, ())
    if node.op_type == "Resize" and len(node.inputs) == 2:
        indices = (1,)
    for index in indices:
        if index >= len(node.inputs) or node.inputs[index] is None:
            continue
        value = node.inputs[index]
        if value.type is None or value.type.dtype != DOUBLE:
            continue
        cast = ir.node("Cast", [value], attributes={"to": int(FLOAT)})
        cast.outputs[0].type = ir.TensorType(FLOAT)
        graph.insert_before(node, cast)
        node.replace_input_with(index, cast.outputs[0])
