"""Bounds on a tensor's values, proven from the graph: is an attention mask finite?

Exporters guard attention with ``Where(IsNaN(p), 0, p)`` after the Softmax, because a row
masked entirely with -inf gives NaN. The guard only matters when the mask can hold -inf; the
masks Hugging Face models build (``Where(keep, 0, finfo.min)``, ``(1 - m) * -10000``) are
finite, and then the guard is the identity and the attention fusions may drop it. This
module proves such bounds by interval arithmetic over the few ops masks are built from;
anything else is "unknown", so the answer is None, never a guess.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from .expr import NoMatch, _const_tensor, is_value

MAX_NODES = 48
"""Producers visited per question: masks are built by a handful of ops; a hostile graph
cannot make the walk expensive."""

Bounds = tuple[float, float]

_PASS_THROUGH = frozenset({
    "Identity", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Transpose", "Flatten", "Tile",
    "Slice", "Gather", "GatherND", "GatherElements", "Concat", "Pad",
})
"""Ops whose output values are a selection of their first (data) input's values; Concat
selects from every input, and Pad adds its constant (its pad value)."""


def value_bounds(value: ir.Value, budget: list[int] | None = None) -> Bounds | None:
    """Lowest and highest value ``value`` can hold whatever the graph inputs are, or None.

    Integer and bool values bound by their dtype (a Cast of a bool is in [0, 1]); float
    graph inputs are unbounded (they may carry -inf themselves)."""
    budget = [MAX_NODES] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0:
        return None
    dtype = value.dtype
    tensor = _const_tensor(value)
    if tensor is not None:
        array = tensor.numpy()
        if array.size == 0 or array.dtype.kind not in "biuf":
            return None
        low, high = float(array.min()), float(array.max())
        return (low, high) if not (math.isnan(low) or math.isnan(high)) else None
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return _dtype_bounds(dtype)
    rule = _RULES.get(node.op_type)
    if rule is not None:
        bounds = rule(node, budget)
        if bounds is not None:
            return bounds
    return _dtype_bounds(dtype)


def _dtype_bounds(dtype: ir.DataType | None) -> Bounds | None:
    """What any value of an integer or bool dtype can hold; None for floats."""
    if dtype is None:
        return None
    if dtype == ir.DataType.BOOL:
        return (0.0, 1.0)
    numpy_dtype = dtype.numpy()
    if numpy_dtype.kind in "iu":
        info = np.iinfo(numpy_dtype)
        return (float(info.min), float(info.max))
    return None


def _inputs_bounds(inputs: list[ir.Value | None], budget: list[int]) -> list[Bounds] | None:
    result = []
    for value in inputs:
        if value is None:
            return None
        bounds = value_bounds(value, budget)
        if bounds is None:
            return None
        result.append(bounds)
    return result


def _union(bounds: list[Bounds]) -> Bounds:
    return (min(b[0] for b in bounds), max(b[1] for b in bounds))


def _pass_through(node: ir.Node, budget: list[int]) -> Bounds | None:
    data = list(node.inputs) if node.op_type == "Concat" else [node.inputs[0]]
    extra: list[Bounds] = []
    if node.op_type == "Pad":  # constant mode adds its value (input 2, or attribute < 11)
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            data.append(node.inputs[2])
        else:
            extra.append((node.attributes.get_float("value", 0.0),) * 2)
    bounds = _inputs_bounds(data, budget)
    return None if bounds is None else _union(bounds + extra)


def _where(node: ir.Node, budget: list[int]) -> Bounds | None:
    bounds = _inputs_bounds(list(node.inputs[1:3]), budget)
    return None if bounds is None else _union(bounds)


def _cast(node: ir.Node, budget: list[int]) -> Bounds | None:
    """A Cast keeps its input's bounds unless they do not fit the target type (a float
    cast to float16 overflows to inf; an out-of-range float cast to int is undefined)."""
    bounds = _inputs_bounds([node.inputs[0]], budget)
    target = node.outputs[0].dtype
    fits = _dtype_bounds(target) or _float_limit(target)
    if bounds is None or fits is None:
        return None
    (low, high), (lowest, highest) = bounds[0], fits
    return (low, high) if lowest <= low and high <= highest else None


def _float_limit(dtype: ir.DataType | None) -> Bounds | None:
    if dtype is None or dtype.numpy().kind != "f":
        return None
    largest = float(np.finfo(dtype.numpy()).max)
    return (-largest, largest)


def _arithmetic(node: ir.Node, budget: list[int]) -> Bounds | None:
    bounds = _inputs_bounds(list(node.inputs), budget)
    if bounds is None or len(bounds) != 2:
        return None
    (a, b), (c, d) = bounds
    if not all(map(math.isfinite, (a, b, c, d))):  # -inf + inf, 0 * inf: NaN is possible
        return None
    if node.op_type == "Add":
        corners = [a + c, b + d]
    elif node.op_type == "Sub":
        corners = [a - d, b - c]
    else:
        corners = [a * c, a * d, b * c, b * d]
    return (min(corners), max(corners))


def _neg(node: ir.Node, budget: list[int]) -> Bounds | None:
    bounds = _inputs_bounds([node.inputs[0]], budget)
    return None if bounds is None else (-bounds[0][1], -bounds[0][0])


def _min_max(node: ir.Node, budget: list[int]) -> Bounds | None:
    bounds = _inputs_bounds(list(node.inputs), budget)
    if not bounds:
        return None
    pick = min if node.op_type == "Min" else max
    return (pick(b[0] for b in bounds), pick(b[1] for b in bounds))


_RULES: dict[str, Callable[[ir.Node, list[int]], Bounds | None]] = {
    **dict.fromkeys(_PASS_THROUGH, _pass_through),
    "Where": _where,
    "Cast": _cast,
    "Add": _arithmetic,
    "Sub": _arithmetic,
    "Mul": _arithmetic,
    "Neg": _neg,
    "Min": _min_max,
    "Max": _min_max,
}


def is_finite_mask(mask: object) -> bool:
    """True when an additive attention mask provably holds only finite values, small enough
    that adding a score cannot overflow to -inf: any finite value for float32/float64 (a
    score would have to be below -1e31), at most half the largest float16 for float16
    (HF's ``finfo(float16).min`` mask overflows with a score of -16, so it is refused)."""
    if not is_value(mask):
        raise NoMatch("is_finite_mask() needs a value of the match")
    bounds = value_bounds(mask)
    if bounds is None:
        return False
    dtype = mask.dtype
    limits = _float_limit(dtype)
    if limits is None:
        return False
    limit = limits[1] if dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE) else limits[1] / 2
    return max(abs(bounds[0]), abs(bounds[1])) <= limit


_PRODUCTS = frozenset({("", "MatMul"), ("", "Gemm"), ("com.microsoft", "FusedMatMul")})


def _is_product(value: ir.Value) -> bool:
    """A matrix product, maybe scaled by a finite constant: finite for finite operands."""
    node = value.producer()
    if node is None:
        return False
    if node.op_type in ("Mul", "Div") and node.domain == "" and len(node.inputs) == 2:
        first, second = node.inputs
        for product, scale in ((first, second), (second, first)):
            if node.op_type == "Div" and product is second:
                continue
            bounds = value_bounds(scale) if scale is not None else None
            if (product is not None and bounds is not None and all(map(math.isfinite, bounds))
                    and _is_product(product) and (node.op_type == "Mul" or bounds[0] > 0)):
                return True
        return False
    return (node.domain, node.op_type) in _PRODUCTS


def is_finite_scores(scores: object) -> bool:
    """True when the input of an attention Softmax is finite for finite model inputs and
    weights: a (scaled) matrix product, plus at most a provably finite mask. Its Softmax
    then never yields NaN, and torch's ``Where(IsNaN(p), 0, p)`` guard is the identity."""
    if not is_value(scores):
        raise NoMatch("is_finite_scores() needs a value of the match")
    if _is_product(scores):
        return True
    node = scores.producer()
    if node is None or node.op_type != "Add" or node.domain != "" or len(node.inputs) != 2:
        return False
    first, second = node.inputs
    return any(a is not None and b is not None and _is_product(a) and is_finite_mask(b)
               for a, b in ((first, second), (second, first)))
