"""Graph values for expression-function tests, shared by tests/test_expr*.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from fusectl.expr import parse


def const(name: str, array: np.ndarray) -> ir.Value:
    """An initializer-like value: constant data, not a graph input."""
    return ir.Value(
        name=name,
        const_value=ir.tensor(array),
        type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
        shape=ir.Shape(array.shape),
    )


def dynamic(name: str, dims: list[int | str | None] | None,
            dtype: ir.DataType = ir.DataType.FLOAT) -> ir.Value:
    """A value with a type and (maybe) a shape only, like an activation."""
    return ir.Value(name=name, type=ir.TensorType(dtype),
                    shape=None if dims is None else ir.Shape(dims))


def evaluate(source: str, **env: Any) -> Any:
    """Parse ``source`` knowing the names of ``env`` and evaluate it there."""
    return parse(source, list(env)).evaluate(env)


def parse_with_weights(text: str, fixed: dict[str, np.ndarray] | None = None,
                       scale: float = 0.2) -> Any:
    """An onnx ModelProto from onnx's text format whose initializers declared without data
    (``<float[64,64] w>``) get normal random weights of that ``scale``, or the arrays in
    ``fixed`` (position buffers, -inf)."""
    import onnx.parser
    from onnx import numpy_helper

    from fusectl.ruletest import strip_dataless_initializers

    text, declared = strip_dataless_initializers(text)
    model = onnx.parser.parse_model(text)
    rng = np.random.default_rng(0)
    fixed = fixed or {}
    model.graph.initializer.extend(
        numpy_helper.from_array(fixed[name] if name in fixed
                                else rng.normal(0, scale, dims).astype(np.float32), name)
        for name, _, dims in declared)
    return model


def rename_dim(model: Any, old: str, new: str) -> Any:
    """``model`` (a ModelProto) with the dim ``old`` of its inputs and outputs renamed
    ``new``: onnx's text format spells dims as identifiers, exporters also as sums
    (optimum's ``past_sequence_length + sequence_length``)."""
    for value in [*model.graph.input, *model.graph.output]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param == old:
                dim.dim_param = new
    return model
