"""The rule expression language: Python syntax, parsed with ``ast``, run by a whitelist.

Rules are data that anyone may hand us, so expressions are never given to
``eval``/``exec``. Only a small set of node types is accepted at load time;
names must be known at load time; functions come from one table. Evaluation
works on numpy arrays and plain Python values; captured graph values are
turned into arrays only when an expression needs their data.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

MAX_SOURCE_CHARS = 2000
MAX_DEPTH = 40
MAX_EXPONENT = 64
MAX_SEQUENCE = 1 << 16
MAX_RANK = 64
MAX_ELEMENTS = 1 << 28


class ExprError(Exception):
    """An expression is not acceptable (found at load time)."""


class NoMatch(Exception):  # noqa: N818 - a control-flow signal, not an error
    """The expression cannot hold for this match (e.g. a value is not a constant)."""


# --------------------------------------------------------------------------- values


_NOT_VALUES = (int, float, bool, str, list, tuple, dict, np.ndarray, np.generic, type(None))


def is_value(obj: Any) -> bool:
    """``isinstance(obj, ir.Value)``, fast: ir.Value is a typing Protocol class, and a
    protocol isinstance check that fails costs a microsecond in Python code (a million
    such checks in a 100k-node run)."""
    return type(obj) is ir.Value or (not isinstance(obj, _NOT_VALUES)
                                     and isinstance(obj, ir.Value))


def _const_tensor(value: ir.Value) -> ir.TensorProtocol | None:
    """The constant tensor behind a value, or None: initializers that are also
    graph inputs can be overridden at run time, so they are not constants."""
    if value.is_graph_input():
        return None
    tensor = value.const_value
    if tensor is not None:
        return tensor
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and producer.domain == "":
        attr = producer.attributes.get("value")
        if attr is not None and attr.type == ir.AttributeType.TENSOR:
            return attr.as_tensor()
    return None


def is_constant(value: Any) -> bool:
    """True when ``value`` is a graph value whose data is known at rewrite time."""
    if is_value(value):
        return _const_tensor(value) is not None
    return value is not None


def to_array(value: Any, name: str = "value") -> Any:
    """Numeric view of a value: arrays for graph constants, scalars stay scalars."""
    if is_value(value):
        tensor = _const_tensor(value)
        if tensor is None:
            raise NoMatch(f"{value.name or name} is not a constant")
        array = tensor.numpy()
        if array.dtype not in _FULL_PRECISION and _low_precision(array.dtype):
            array = array.astype(np.float32)  # compute folds in fp32, cast back later
        return array
    if value is None:
        raise NoMatch(f"{name} is absent")
    if isinstance(value, (list, tuple)):
        return np.asarray(value)
    return value


_FULL_PRECISION = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int64, np.int32,
                                                  np.int8, np.uint8, np.bool_))
"""Common dtypes, answered without numpy's slow dtype naming."""


def _low_precision(dtype: np.dtype) -> bool:
    return dtype == np.float16 or dtype.kind == "V" or \
        str(dtype).startswith(("bfloat16", "float8", "float4"))


_DTYPE_NAMES: dict[ir.DataType, str] = {}


def _onnx_dtype_name(dtype: ir.DataType) -> str:
    """The numpy name of an ONNX dtype, cached (numpy computes dtype names in Python)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        try:
            name = np.dtype(dtype.numpy()).name if dtype != ir.DataType.BFLOAT16 else "bfloat16"
        except TypeError:
            raise NoMatch(f"dtype {dtype.name} has no numpy equivalent") from None
        _DTYPE_NAMES[dtype] = name
    return name


def _shape_of(value: Any) -> tuple[int | str, ...]:
    if is_value(value):
        tensor = _const_tensor(value)
        if tensor is not None:
            return tuple(int(d) for d in tensor.shape)
        if value.shape is None:
            raise NoMatch(f"shape of {value.name} is unknown")
        dims: list[int | str] = []
        for dim in value.shape:
            if isinstance(dim, int):
                dims.append(dim)
            elif dim.value is None:
                raise NoMatch(f"shape of {value.name} has an unknown dimension")
            else:
                name = str(dim.value)
                dims.append(symbolic_product([name]) if "*" in name else name)  # type: ignore[misc]
        return tuple(dims)
    if value is None:
        raise NoMatch("shape of an absent value")
    return tuple(np.shape(value))


def _dtype_of(value: Any) -> str:
    if is_value(value):
        tensor = _const_tensor(value)
        dtype = tensor.dtype if tensor is not None else value.dtype
        if dtype is None:
            raise NoMatch(f"dtype of {value.name} is unknown")
        return _onnx_dtype_name(dtype)
    return np.asarray(value).dtype.name


def value_dtype(value: Any) -> np.dtype | None:
    """The numpy dtype a captured value has in the model (before any upcast)."""
    if not is_value(value):
        return None
    tensor = _const_tensor(value)
    dtype = tensor.dtype if tensor is not None else value.dtype
    if dtype is None:
        return None
    try:
        return np.dtype(dtype.numpy())
    except TypeError:
        return None


# ------------------------------------------------------------------------- functions


def _fn_is_const(*values: Any) -> bool:
    return all(is_constant(v) for v in values)


def _fn_rank(value: Any) -> int:
    """The rank; known even when some dims are not (exporters leave batch dims unnamed)."""
    return len(_shape_of_known_rank(value))


def _fn_shape(value: Any) -> tuple[int | str, ...]:
    return _shape_of(value)


def _fn_size(value: Any) -> int:
    dims = _shape_of(value)
    if not all(isinstance(d, int) for d in dims):
        raise NoMatch("size of a tensor with symbolic dimensions")
    return int(math.prod(dims))  # type: ignore[arg-type]


def _fn_value(value: Any) -> Any:
    return to_array(value)


def _fn_item(value: Any) -> Any:
    array = np.asarray(to_array(value))
    if array.size != 1:
        raise NoMatch(f"item() of a tensor with {array.size} elements")
    return array.reshape(()).item()


def _fn_along(vector: Any, axis: int, like: Any) -> np.ndarray:
    """Reshape a 1-D vector so it broadcasts along ``axis`` of a tensor like ``like``."""
    rank = like if isinstance(like, int) else _fn_rank(like)
    _check_rank(rank)
    array = np.asarray(to_array(vector))
    if array.ndim > 1:
        raise NoMatch("along() needs a vector")
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank:
        raise NoMatch(f"along(): axis {axis} out of range for rank {rank}")
    shape = [1] * rank
    shape[axis] = -1
    return array.reshape(shape)


def _fn_per_channel(value: Any, length: int, axis: int, rank: int) -> np.ndarray:
    """A constant that broadcasts only along ``axis`` of a rank-``rank`` tensor, as a vector.

    Scalars and size-1 tensors broadcast to ``length``; anything that would change
    the other tensor's shape (higher rank, other non-1 axes) is not per-channel.
    """
    _check_rank(rank)
    if not 0 < int(length) <= MAX_ELEMENTS:
        raise NoMatch(f"channel count {length} out of range")
    array = np.asarray(to_array(value))
    if array.ndim > rank:
        raise NoMatch("constant has a higher rank than the tensor it applies to")
    axis = axis + rank if axis < 0 else axis
    padded = (1,) * (rank - array.ndim) + array.shape
    for i, dim in enumerate(padded):
        if i != axis and dim != 1:
            raise NoMatch("constant varies along a non-channel axis")
    if padded[axis] not in (1, length):
        raise NoMatch("constant does not match the channel count")
    return np.broadcast_to(array.reshape(-1), (length,)).copy()


def _fn_is_per_channel(value: Any, length: int, axis: int, rank: int) -> bool:
    try:
        _fn_per_channel(value, length, axis, rank)
    except NoMatch:
        return False
    return True


def _fn_concat(arrays: Iterable[Any], axis: int = 0) -> np.ndarray:
    return np.concatenate([np.asarray(to_array(a)) for a in arrays], axis=axis)


def _fn_default(value: Any, fallback: Any) -> Any:
    return fallback if value is None else value


def _fn_compose_perm(first: Any, second: Any) -> list[int]:
    """Transpose(Transpose(x, first), second) == Transpose(x, compose_perm(first, second))."""
    first, second = [int(i) for i in first], [int(i) for i in second]
    if sorted(first) != list(range(len(first))) or sorted(second) != sorted(first):
        raise NoMatch("not permutations of the same rank")
    return [first[i] for i in second]


def _fn_inverse_perm(perm: Any) -> list[int]:
    perm = [int(i) for i in perm]
    if sorted(perm) != list(range(len(perm))):
        raise NoMatch("not a permutation")
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return inverse


def _fn_is_identity_perm(perm: Any) -> bool:
    return [int(i) for i in perm] == list(range(len(perm)))


def _fn_allclose(a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    a, b = np.asarray(to_array(a)), np.asarray(to_array(b))
    try:
        return bool(np.allclose(a, b, rtol=rtol, atol=atol))
    except ValueError:
        return False


def _fn_all(value: Any) -> bool:
    return bool(np.all(to_array(value)))


def _fn_any(value: Any) -> bool:
    return bool(np.any(to_array(value)))


def _check_rank(rank: Any) -> None:
    if not isinstance(rank, (int, np.integer)) or not 0 <= int(rank) <= MAX_RANK:
        raise NoMatch(f"rank {rank} out of range")


def _fn_broadcasts_to(small: Any, big: Any) -> bool:
    """Whether ``small`` broadcasts to ``big``'s shape without changing that shape."""
    a, b = _shape_of(small), _shape_of(big)
    if len(a) > len(b):
        return False
    return all(x == 1 or x == y for x, y in zip(reversed(a), reversed(b), strict=False))


def _fn_trailing_axis(axes: Any, rank: int) -> int:
    """The first axis of a contiguous run of trailing axes (``[-2, -1]`` of rank 3 -> 1)."""
    if axes is None:
        raise NoMatch("reduction over all axes")
    _check_rank(rank)
    if is_value(axes):
        axes = to_array(axes)
    normalized = sorted(int(a) + rank if int(a) < 0 else int(a) for a in np.ravel(axes))
    if not normalized or normalized != list(range(normalized[0], rank)):
        raise NoMatch(f"axes {list(np.ravel(axes))} are not the trailing axes of rank {rank}")
    return normalized[0]


def _fn_expand_to(value: Any, shape: Any) -> np.ndarray:
    dims = [int(d) for d in shape]
    if len(dims) > MAX_RANK or math.prod(dims) > MAX_ELEMENTS:
        raise NoMatch("expand_to() result too large")
    return np.broadcast_to(np.asarray(to_array(value)), tuple(int(d) for d in shape)).copy()


def _cast(dtype: str) -> Callable[[Any], np.ndarray]:
    def cast(value: Any) -> np.ndarray:
        return np.asarray(to_array(value)).astype(dtype)

    cast.__name__ = dtype
    return cast


MAX_CONV_MACS = 1 << 32
MAX_BOX_WINDOW = 4096


def _conv_weight(weight: Any) -> np.ndarray:
    """A constant Conv/ConvTranspose weight: [rows, cols, k...] with at least one kernel axis."""
    array = np.asarray(to_array(weight, "weight"))
    if not 3 <= array.ndim <= MAX_RANK:
        raise NoMatch(f"a conv weight has rank >= 3, got {array.ndim}")
    return array


def _fn_group_channels(vector: Any, weight: Any, group: Any) -> np.ndarray:
    """A per-channel vector laid out against a grouped conv weight, for folds that scale or
    shift the channel on the other side of the weight than axis 0.

    ``weight`` is [rows, cols, k...] in ``group`` groups; entry [r, c] connects channel
    ``(r // (rows / group)) * cols + c`` of the other side: the input channel for a Conv
    weight [C_out, C_in/group, k...], the output channel for a ConvTranspose weight
    [C_in, C_out/group, k...]. The result [rows, cols, 1...] holds ``vector`` at that
    channel and broadcasts against the weight.
    """
    dims = _shape_of(weight)
    if not 3 <= len(dims) <= MAX_RANK or not all(isinstance(d, int) for d in dims):
        raise NoMatch("group_channels() needs a conv weight of known shape")
    rows, cols = int(dims[0]), int(dims[1])
    group = int(group)
    if group < 1 or rows % group:
        raise NoMatch(f"{rows} weight rows do not split into {group} groups")
    array = np.asarray(to_array(vector)).reshape(-1)
    if array.size != group * cols:
        raise NoMatch(f"{array.size} channel values for {group * cols} channels")
    channel = (np.arange(rows) // (rows // group))[:, None] * cols + np.arange(cols)[None, :]
    return array[channel].reshape((rows, cols) + (1,) * (len(dims) - 2))


def _fn_conv_shift_bias(weight: Any, shift: Any, group: Any) -> np.ndarray:
    """What an unpadded Conv adds to each output channel when its input is shifted by a
    per-input-channel constant: ``sum over c, k of W[o, c, k] * shift[channel(o, c)]``."""
    array = _conv_weight(weight)
    laid_out = _fn_group_channels(shift, array, group)
    return np.sum(array.astype(np.float64) * laid_out, axis=tuple(range(1, array.ndim)))


def _fn_dense_weight(weight: Any, group: Any) -> np.ndarray:
    """A grouped Conv weight [C_out, C_in/group, k...] as the equivalent dense (group 1)
    weight [C_out, C_in, k...] with zero blocks, for merges that end up fully connected."""
    array = _conv_weight(weight)
    group = int(group)
    rows, cols = array.shape[0], array.shape[1]
    if group < 1 or rows % group:
        raise NoMatch(f"{rows} output channels do not split into {group} groups")
    if array.size * group > MAX_ELEMENTS:
        raise NoMatch("dense_weight() result too large")
    dense = np.zeros((rows, cols * group) + array.shape[2:], dtype=array.dtype)
    per_group = rows // group
    for g in range(group):
        block = slice(g * per_group, (g + 1) * per_group)
        dense[block, g * cols:(g + 1) * cols] = array[block]
    return dense


def _fn_conv_compose(outer: Any, inner: Any, group: Any) -> np.ndarray:
    """The weight of one Conv equal to a 1x1 Conv ``outer`` [C2, C1, 1...] (group 1) applied
    after a Conv ``inner`` [C1, C0/group, k...]: [C2, C0, k...] (a dense, group-1 weight)."""
    second, first = _conv_weight(outer), _conv_weight(inner)
    if any(d != 1 for d in second.shape[2:]) or second.ndim != first.ndim:
        raise NoMatch("the outer conv must be 1x1 with the inner conv's rank")
    if second.shape[1] != first.shape[0]:
        raise NoMatch("the outer conv's input channels are not the inner conv's outputs")
    group = int(group)
    macs = second.shape[0] * first.size * max(group, 1)
    if macs > MAX_CONV_MACS:
        raise NoMatch("conv_compose() needs too much work")
    dense = _fn_dense_weight(first, group)
    matrix = second.reshape(second.shape[0], second.shape[1]).astype(np.float64)
    return np.tensordot(matrix, dense, axes=([1], [0]))


def _fn_box_filter(weight: Any, kernel: Any) -> np.ndarray:
    """Conv weights followed by an average pool whose windows tile (kernel = stride): each
    spatial kernel convolved with a ``kernel``-sized box of 1/prod(kernel), giving kernel
    size K + k - 1, so Conv then AveragePool is one strided Conv."""
    array = _conv_weight(weight)
    box = [int(k) for k in np.ravel(kernel)]
    if len(box) != array.ndim - 2 or any(k < 1 for k in box):
        raise NoMatch("the pool kernel does not match the conv's spatial rank")
    window = math.prod(box)
    out_shape = array.shape[:2] + tuple(s + k - 1 for s, k in zip(array.shape[2:], box,
                                                                     strict=True))
    if window > MAX_BOX_WINDOW or math.prod(out_shape) > MAX_ELEMENTS:
        raise NoMatch("box_filter() result too large")
    out = np.zeros(out_shape, dtype=np.float64)
    for offset in np.ndindex(*box):
        index = (slice(None), slice(None)) + tuple(
            slice(o, o + s) for o, s in zip(offset, array.shape[2:], strict=True)
        )
        out[index] += array
    return out / window


def _fn_spatial_pads(pads: Any, rank: Any, axes: Any = None) -> list[int]:
    """The pads of a constant Pad as Conv/pool ``pads`` ([begins..., ends...] of the spatial
    axes 2.. of a rank-``rank`` tensor); no match when the Pad pads the batch or channel
    axis or crops (negative pads). ``axes`` is the Pad's optional axes input (opset 18)."""
    _check_rank(rank)
    rank = int(rank)
    values = [int(p) for p in np.ravel(to_array(pads, "pads"))]
    if axes is None:
        listed = list(range(rank))
    else:
        listed = [int(a) + rank if int(a) < 0 else int(a) for a in np.ravel(to_array(axes))]
        if len(set(listed)) != len(listed) or not all(0 <= a < rank for a in listed):
            raise NoMatch(f"bad Pad axes {listed} for rank {rank}")
    if len(values) != 2 * len(listed):
        raise NoMatch(f"{len(values)} pads for {len(listed)} axes")
    begins, ends = [0] * rank, [0] * rank
    for i, axis in enumerate(listed):
        begins[axis], ends[axis] = values[i], values[i + len(listed)]
    if min(begins + ends) < 0:
        raise NoMatch("negative pads crop the tensor")
    if rank < 3 or any(begins[:2]) or any(ends[:2]):
        raise NoMatch("the Pad pads the batch or channel axis")
    return begins[2:] + ends[2:]


def _fn_prod(values: Any) -> int | str:
    """The product of a list of integers (e.g. the pixels of a pool window or stride), to
    compare sizes that scale with it. With symbolic dims, the product's name as
    ``shape()`` spells a product dim (see ``symbolic_product``): ``prod(shape(q)[:2]) ==
    shape(z)[0]`` holds for q ``[batch, seq, ...]`` and z ``["batch*seq", ...]``."""
    if isinstance(values, (list, tuple)) and any(isinstance(v, str) for v in values):
        if len(values) > MAX_RANK:
            raise NoMatch("prod() of a long list")
        return symbolic_product(values)
    items = [int(v) for v in np.ravel(to_array(values, "values"))]
    if len(items) > MAX_RANK:
        raise NoMatch("prod() of a long list")
    result = math.prod(items)
    if abs(result).bit_length() > MAX_INT_BITS:
        raise NoMatch(f"integer larger than {MAX_INT_BITS} bits")
    return result


_PRODUCT_NAME = re.compile(r"[A-Za-z_][\w.]*|\d+")


def symbolic_product(factors: Iterable[int | str]) -> int | str:
    """A product of dims in one spelling: its integer factor first (when not 1), then the
    symbols sorted by name, joined by ``*``. torch's exporter names a product dim so
    (sympy's ``batch*seq``, ``2*s0``); a name that is not a plain product (``Min(64, s)``,
    ``(a*b)//c``) is one opaque symbol. Equal spellings are equal sizes, as for any two
    dims of one name."""
    number, names = _product_factors(factors)
    return _spell_product(number, names)


def symbolic_quotient(dividend: Iterable[int | str], divisor: Iterable[int | str]
                      ) -> int | str | None:
    """The product of ``dividend`` divided by that of ``divisor`` when it divides exactly,
    symbol by symbol and in integers (the ``-1`` of ``Reshape([B,S,64], [B,S,4,-1])`` is 16),
    spelled as :func:`symbolic_product`; None when it does not or the divisor may be 0."""
    number, names = _product_factors(dividend)
    over, over_names = _product_factors(divisor)
    if over == 0 or number % over:
        return None
    left = list(names)
    for name in over_names:
        if name not in left:
            return None
        left.remove(name)
    return _spell_product(number // over, left)


def _product_factors(factors: Iterable[int | str]) -> tuple[int, list[str]]:
    """The integer factor and the symbols of a product of dims (``2*a*b`` is 2, [a, b])."""
    number, names = 1, []
    for factor in factors:
        if isinstance(factor, str):
            parts = _split_product(factor)
            for part in parts if parts and len(parts) > 1 else [factor]:
                if part.isdigit():
                    number *= int(part)
                else:
                    names.append(part)
        else:
            number *= int(factor)
    return number, names


def _split_product(text: str) -> list[str] | None:
    """The factors of ``2*a*(s0 + s1)`` (a parenthesized factor without its parentheses, as
    ``_spell_product`` writes it); None when ``text`` is not such a product."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0:
            return None
        if char == "*" and depth == 0:
            if "*" in (text[index - 1:index], text[index + 1:index + 2]):
                return None  # a power
            parts.append(text[start:index].strip())
            start = index + 1
    parts.append(text[start:].strip())
    factors = []
    for part in parts:
        if part.startswith("(") and part.endswith(")") and _balanced(part[1:-1]):
            factors.append(part[1:-1].strip())
        elif _PRODUCT_NAME.fullmatch(part):
            factors.append(part)
        else:
            return None
    return factors if depth == 0 else None


def _spell_product(number: int, names: list[str]) -> int | str:
    if not names:
        return number
    if number == 0:
        return 0
    factors = ([str(number)] if number != 1 else []) + sorted(names)
    if len(factors) == 1:
        return factors[0]
    return "*".join(f"({f})" if _has_operator(f) else f for f in factors)


def _balanced(text: str) -> bool:
    """Whether every parenthesis of ``text`` closes in it (``(a)+(b)`` minus its outer pair
    does not)."""
    depth = 0
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0:
            return False
    return depth == 0


def _has_operator(name: str) -> bool:
    """Whether a dim's name needs parentheses as a factor: an operator outside any
    (``s0 + s1``: 2*s0 + s1 would be another size; ``Min(64, s)`` and ``(a//b)`` are one)."""
    depth = 0
    for char in name:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0 or (depth == 0 and char in "+-*/%"):
            return True
    return depth != 0


def _fn_is_static(dims: Any) -> bool:
    """Whether a dim, or every dim of a list of them (``shape(x)``), is a known integer, not
    a symbol: what a rule needs before writing the dim into a constant."""
    items = dims if isinstance(dims, (list, tuple)) else [dims]
    return all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in items)


def _fn_axis_dim(value: Any, axis: int) -> int | str:
    """One dim of a value (a size or a symbol), known even where others are not (``shape()``
    needs them all): the width of a table whose row count the inference lost."""
    if not is_value(value) or value.shape is None:
        raise NoMatch("axis_dim() needs a value of known rank")
    rank = len(value.shape)
    if isinstance(axis, bool) or not isinstance(axis, int) or not -rank <= axis < rank:
        raise NoMatch(f"axis {axis} out of range for rank {rank}")
    dim = value.shape[axis]
    if isinstance(dim, int):
        return dim
    if dim.value is None:
        raise NoMatch(f"dim {axis} of {value.name} is unknown")
    return str(dim.value)


def _fn_dims(values: Iterable[Any], axis: int) -> np.ndarray:
    """Sizes of several tensors along one axis, as the int64 ``split`` of a Split."""
    sizes = []
    for value in values:
        shape = _fn_shape(value)
        if not -len(shape) <= int(axis) < len(shape):
            raise NoMatch(f"axis {axis} out of range for rank {len(shape)}")
        dim = shape[int(axis)]
        if not isinstance(dim, (int, np.integer)):
            raise NoMatch("a size along the split axis is not known")
        sizes.append(int(dim))
    return np.asarray(sizes, dtype=np.int64)


def _fn_zeros(shape: Any, like: Any = None) -> np.ndarray:
    """A zero tensor (e.g. the missing bias of one sibling), in ``like``'s dtype."""
    dims = [int(d) for d in np.atleast_1d(np.asarray(shape))]
    if any(d < 0 for d in dims) or int(np.prod(dims, dtype=np.int64)) > MAX_ELEMENTS:
        raise NoMatch("zeros() shape is negative or too large")
    dtype = np.float32 if like is None else np.asarray(to_array(like)).dtype
    return np.zeros(dims, dtype=dtype)


def _fn_op_type(value: Any) -> str:
    """The op type of the node that produced a matched value (``domain.Op`` outside the
    ONNX domain), so that one rule with op alternatives (``z = Relu | Tanh (y)``) can
    name the op it matched, e.g. as a fused op's ``activation`` attribute."""
    if not is_value(value):
        raise NoMatch("op_type() needs a value of the match")
    node = value.producer()
    if node is None:
        raise NoMatch(f"{value.name or 'value'} is not produced by a node")
    if node.domain in ("", "ai.onnx"):
        return node.op_type
    return f"{node.domain}.{node.op_type}"


# ------------------------------------------------- layout (rules/50-layout.yaml)


def _rank_of(value: Any) -> int:
    """The rank of a value, also when some of its dims are unknown (``rank`` needs them all)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        rank = int(value)
    elif is_value(value) and _const_tensor(value) is None:
        if value.shape is None:
            raise NoMatch(f"rank of {value.name} is unknown")
        rank = len(value.shape)
    else:
        rank = len(_shape_of(value))
    _check_rank(rank)
    return rank


def _int_list(values: Any, what: str) -> list[int]:
    """Axes, perms and shapes (an attribute list, a constant tensor or an array) as ints."""
    if values is None:
        raise NoMatch(f"{what} absent")
    array = np.asarray(to_array(values, what))
    if array.ndim > 1 or array.size > MAX_RANK:
        raise NoMatch(f"{what} must be a short list")
    if array.size and array.dtype.kind not in "iu":
        raise NoMatch(f"{what} must be integers")
    return [int(v) for v in array.reshape(-1)]


def _perm(perm: Any) -> list[int]:
    values = _int_list(perm, "perm")
    if sorted(values) != list(range(len(values))):
        raise NoMatch(f"{values} is not a permutation")
    return values


def _fn_norm_axes(axes: Any, rank: Any) -> list[int]:
    """Axes made non-negative and sorted, for a tensor of ``rank`` (an int or a value), so
    that two ops' axes can be compared; out-of-range or repeated axes do not match (the
    op itself would fail)."""
    size = _rank_of(rank)
    normalized = []
    for axis in _int_list(axes, "axes"):
        axis = axis + size if axis < 0 else axis
        if not 0 <= axis < size:
            raise NoMatch(f"axis {axis} out of range for rank {size}")
        normalized.append(axis)
    if len(set(normalized)) != len(normalized):
        raise NoMatch("repeated axes")
    return sorted(normalized)


def _fn_permute_axes(perm: Any, axes: Any) -> list[int]:
    """Axes of ``Transpose(x, perm)`` as axes of x: reducing the transposed tensor over
    ``axes`` is reducing x over ``permute_axes(perm, axes)`` (then transposing)."""
    order = _perm(perm)
    return sorted(order[a] for a in _fn_norm_axes(axes, len(order)))


def _fn_reduced_perm(perm: Any, axes: Any, keepdims: Any) -> list[int]:
    """The perm of the Transpose that must follow a reduction moved above ``Transpose(perm)``.

    ``axes`` are the reduction's axes after the Transpose (None or empty: every axis).
    With keepdims the perm is unchanged, or the identity when every axis is reduced (all
    dims are then 1); without keepdims the reduced dims are gone and the others keep
    the order the Transpose gave them.
    """
    order = _perm(perm)
    rank = len(order)
    reduced = [] if axes is None else _fn_norm_axes(axes, rank)
    if not reduced:
        reduced = list(range(rank))
    if keepdims is None or int(keepdims) != 0:
        return list(range(rank)) if len(reduced) == rank else order
    gone = {order[k] for k in reduced}
    kept = [j for j in range(rank) if j not in gone]
    return [kept.index(order[k]) for k in range(rank) if k not in reduced]


def _fn_fill_reshape_zeros(shape: Any, like: Any, allowzero: Any = 0, source: Any = None) -> Any:
    """A Reshape target that no longer depends on the Reshape's input, so that a chain of
    reshapes can start from an earlier tensor.

    With ``allowzero`` 0 (the default) a 0 in the target copies the input's dim at that
    position; each 0 becomes the static dim of ``like`` (the Reshape's input), or stays a 0
    where ``like``'s dim is a symbol that ``source`` (the tensor the new Reshape reads) has
    at the same position: the 0 then copies the same size from it (``[B,S,32]`` viewed as
    ``[B,S,4,8]`` and back by ``[0,0,32]``). Returns ``shape`` itself when it has no 0 or
    when allowzero is 1 (zeros are then literal and a -1 depends on the element count
    only, which a chain of reshapes keeps).
    """
    if allowzero is not None and int(allowzero) != 0:
        return shape
    target = _int_list(shape, "Reshape shape")
    if 0 not in target:
        return shape
    dims = _shape_of(like)
    filled = []
    for i, dim in enumerate(target):
        if dim == 0 and i < len(dims) and isinstance(dims[i], str) and is_value(source) \
                and source.shape is not None and i < len(source.shape) \
                and _shape_of_known_rank(source)[i] == dims[i]:
            filled.append(0)
            continue
        if dim == 0:
            if i >= len(dims) or not isinstance(dims[i], int):
                raise NoMatch(f"the dim a 0 copies (axis {i}) is not known statically")
            if dims[i] == 0:
                raise NoMatch("a copied dim of size 0 cannot be written as a literal")
            dim = dims[i]
        filled.append(dim)
    return np.asarray(filled, dtype=np.int64)


def _fn_moves_unit_dims_only(perm: Any, value: Any) -> bool:
    """Whether ``Transpose(value, perm)`` only moves dims of size 1: the dims that may be
    larger (symbolic ones included) keep their order, so the data order is unchanged and
    the Transpose is a Reshape (a view, no copy)."""
    order = _perm(perm)
    dims = _shape_of(value)
    if len(dims) != len(order):
        raise NoMatch("perm and rank differ")
    moved = [axis for axis in order if dims[axis] != 1]
    return moved == sorted(moved)


def _fn_transposed_shape(perm: Any, value: Any) -> np.ndarray:
    """The dims of ``Transpose(value, perm)`` as a Reshape target valid for any input with
    as many elements: static dims as they are, one symbolic dim as -1. No match for a
    second symbolic dim or a dim of size 0 (a 0 in a Reshape target copies a dim)."""
    order = _perm(perm)
    dims = _shape_of(value)
    if len(dims) != len(order):
        raise NoMatch("perm and rank differ")
    return _fn_as_target([dims[axis] for axis in order])


def _fn_float32_scale(value: Any) -> float:
    """A scale attribute as float32 stores it, refused when it rounds to 0 or is not finite
    (a product of tiny scales underflows, a Div by inf gives 0): onnxruntime refuses to load
    Attention with scale 0, and MultiHeadAttention reads 0 as its default 1/sqrt(D)."""
    with np.errstate(over="ignore", under="ignore"):
        scale = float(np.float32(value))
    if scale == 0 or not math.isfinite(scale):
        raise NoMatch(f"the scale {value!r} is 0 or not finite in float32")
    return scale


def _fn_as_target(*parts: Any) -> np.ndarray:
    """The dims ``parts`` spell one after another as a Reshape target valid for any input
    with as many elements: static dims as they are, one symbolic dim as -1. No match for a
    second symbolic dim or a dim of size 0 (a 0 in a Reshape target copies a dim)."""
    out = [d for part in parts for d in part]
    if sum(1 for d in out if not isinstance(d, (int, np.integer))) > 1:
        raise NoMatch("more than one symbolic dim")
    if 0 in out:
        raise NoMatch("a dim of size 0")
    return np.asarray([d if isinstance(d, (int, np.integer)) else -1 for d in out],
                      dtype=np.int64)


def _fn_unit_reshape_moved(perm: Any, x: Any, z: Any) -> list[Any]:
    """``[target, order]`` with ``Transpose(Reshape(x, target), order)`` equal to
    ``z = Reshape(Transpose(x, perm))`` when that Reshape only inserts or drops dims of size
    1: x gets the same unit dims where z has them, then the transpose moves the larger dims
    as ``perm`` did. No match when the dims of size other than 1 change, when the Transpose
    moves only unit dims (it is a view: transpose-reshape-collapse), for two symbolic dims
    (the target spells one as -1) or a dim of size 0."""
    order = _perm(perm)
    dims = _shape_of_known_rank(x)
    out = _shape_of_known_rank(z)
    if len(order) != len(dims):
        raise NoMatch("perm and rank differ")
    if any(d is None or isinstance(d, int) and d <= 0 for d in (*dims, *out)):
        raise NoMatch("a dim is unknown, 0 or an older exporter's -1")
    kept = [axis for axis in order if dims[axis] != 1]  # x's axes as the Transpose lists them
    slots = [index for index, dim in enumerate(out) if dim != 1]  # where z has them
    if [dims[axis] for axis in kept] != [out[index] for index in slots]:
        raise NoMatch("the Reshape changes dims other than those of size 1")
    ascending = sorted(kept)
    if kept == ascending:
        raise NoMatch("the Transpose moves only dims of size 1")
    target: list[int | str] = [1] * len(out)
    for slot, axis in zip(slots, ascending, strict=True):
        target[slot] = dims[axis]
    if sum(1 for d in target if not isinstance(d, int)) > 1:
        raise NoMatch("more than one symbolic dim")
    moved = list(range(len(out)))
    for slot, axis in zip(slots, kept, strict=True):
        moved[slot] = slots[ascending.index(axis)]
    return [[d if isinstance(d, int) else -1 for d in target], moved]


def _fn_unmerged_perm(perm: Any, x: Any, merged: Any, z: Any) -> list[int]:
    """The perm of the one Transpose of ``x`` equal to ``z = Reshape(Transpose(merged,
    perm))`` with ``merged = Reshape(x)``: ``merged`` folds the leading axes of x into its
    axis 0 and keeps the others, ``perm`` leaves axis 0 first, and ``z`` splits it back
    into x's leading dims. Checked on the values' shapes (symbolic dims compare by name),
    so run-time Reshape targets (torch's SDPA export transposes K this way) qualify."""
    order = _perm(perm)
    dims = _shape_of_known_rank(x)
    folded = _shape_of_known_rank(merged)
    out = _shape_of_known_rank(z)
    lead = len(dims) - len(folded) + 1  # x's axes folded into axis 0
    if len(order) != len(folded) or lead < 1 or order[0] != 0:
        raise NoMatch("the Transpose moves the merged leading axis")
    if any(d is None for d in (*dims, *folded[1:], *out)):
        raise NoMatch("a dim is unknown")
    # With the trailing dims equal, axis 0 holds the product of x's leading dims (or the
    # tensors are empty, and any order of no elements is the same).
    if list(folded[1:]) != list(dims[lead:]):
        raise NoMatch("the first Reshape changes more than the leading axes")
    if list(out) != list(dims[:lead]) + [folded[axis] for axis in order[1:]]:
        raise NoMatch("the second Reshape does not split the leading axes back")
    return list(range(lead)) + [axis + lead - 1 for axis in order[1:]]


def _fn_is_noop_reshape(value: Any, shape: Any, allowzero: Any = 0) -> bool:
    """Whether ``Reshape(value, shape)`` returns value's own shape: every target entry is
    the same static dim or a copying 0 (allowzero 0), plus at most one -1 (which is then
    that dim); symbolic dims must be copied with 0 to count."""
    dims = _shape_of_known_rank(value)
    target = _int_list(shape, "Reshape shape")
    copies = allowzero is None or int(allowzero) == 0
    if len(target) != len(dims) or 0 in [d for d in dims if isinstance(d, int)]:
        return False
    inferred = 0
    for dim, wanted in zip(dims, target, strict=True):
        if wanted == 0 and copies:
            continue
        if wanted == -1:
            inferred += 1
        elif not isinstance(dim, int) or dim != wanted:
            return False
    return inferred <= 1


def _shape_of_known_rank(value: Any) -> tuple[int | str | None, ...]:
    """Dims of a value, None for an unknown dim (the rank must be known)."""
    if is_value(value) and _const_tensor(value) is None:
        if value.shape is None:
            raise NoMatch(f"shape of {value.name} is unknown")
        return tuple(d if isinstance(d, int) else d.value for d in value.shape)
    return _shape_of(value)


def _fn_squeezed_axes(axes: Any, value: Any) -> list[int]:
    """The axes ``Squeeze(value, axes)`` removes, sorted and non-negative. Without axes a
    Squeeze removes every dim of size 1, which is only known when no dim is symbolic."""
    if axes is not None:
        return _fn_norm_axes(axes, value)
    dims = _shape_of(value)
    if not all(isinstance(d, int) for d in dims):
        raise NoMatch("a Squeeze without axes on symbolic dims")
    return [i for i, d in enumerate(dims) if d == 1]


def _fn_merge_unsqueeze_axes(first: Any, second: Any, value: Any) -> list[int]:
    """The axes of one Unsqueeze equal to ``Unsqueeze(Unsqueeze(value, first), second)``."""
    rank = _rank_of(value)
    inner = _fn_norm_axes(first, rank + len(_int_list(first, "axes")))
    middle = rank + len(inner)
    outer = _fn_norm_axes(second, middle + len(_int_list(second, "axes")))
    kept = [i for i in range(middle + len(outer)) if i not in outer]
    return sorted(set(outer) | {kept[i] for i in inner})


def _fn_axes_before_unsqueeze(axes: Any, starts: Any, inserted: Any, value: Any
                              ) -> list[int]:
    """The axes a Slice cuts of ``Unsqueeze(value, inserted)`` (``axes``, or when None the
    first ones, one per start) as axes of ``value``, in their order: the Slice moves above
    the Unsqueeze. An axis the Unsqueeze inserts does not match (slicing a unit dim is not
    a slice of ``value``)."""
    rank = _rank_of(value)
    out_rank = rank + len(_int_list(inserted, "axes"))
    added = set(_fn_norm_axes(inserted, out_rank))
    kept = [i for i in range(out_rank) if i not in added]
    listed = (list(range(len(_int_list(starts, "starts")))) if axes is None
              else _int_list(axes, "axes"))
    moved = []
    for axis in listed:
        axis = axis + out_rank if axis < 0 else axis
        if axis in added:
            raise NoMatch(f"axis {axis} is one the Unsqueeze inserts")
        if not 0 <= axis < out_rank:
            raise NoMatch(f"axis {axis} out of range for rank {out_rank}")
        moved.append(kept.index(axis))
    if len(set(moved)) != len(moved):
        raise NoMatch("repeated axes")
    return moved


def _fn_merge_squeeze_axes(first: Any, second: Any, value: Any) -> list[int]:
    """The axes of one Squeeze equal to ``Squeeze(Squeeze(value, first), second)``;
    ``first`` are axes of value, ``second`` axes of the intermediate (see squeezed_axes)."""
    rank = _rank_of(value)
    inner = _fn_norm_axes(first, rank)
    outer = _fn_norm_axes(second, rank - len(inner))
    kept = [j for j in range(rank) if j not in inner]
    return sorted(set(inner) | {kept[j] for j in outer})


def _fn_itemsize(value: Any) -> float:
    """Bytes per element of a value's dtype or of an ONNX dtype code (a Cast's ``to``), to
    tell whether moving a Transpose across a Cast makes it move more bytes."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        dtype = ir.DataType(int(value))
    elif is_value(value):
        tensor = _const_tensor(value)
        dtype = tensor.dtype if tensor is not None else value.dtype
        if dtype is None:
            raise NoMatch(f"dtype of {value.name} is unknown")
    else:
        raise NoMatch("itemsize() needs a value or a dtype code")
    try:
        return float(dtype.itemsize)
    except TypeError:  # strings have no fixed size
        raise NoMatch(f"{dtype} has no fixed element size") from None


def _fn_lift_rank(value: Any, rank: Any) -> np.ndarray:
    """A constant with leading 1-dims added up to ``rank``: numpy broadcasting made
    explicit, so that the constant can be transposed along with the other operand."""
    _check_rank(rank)
    array = np.asarray(to_array(value))
    if array.ndim > int(rank):
        raise NoMatch(f"rank {array.ndim} is higher than {rank}")
    return array.reshape((1,) * (int(rank) - array.ndim) + array.shape)


# --------------------------------------------- activations (rules/40-activation.yaml)

_ROUNDING_RTOL = {"float16": 2.0**-10, "bfloat16": 2.0**-7}
"""Relative tolerance of ``near`` for constants stored in a low-precision float dtype
(one machine epsilon: twice the worst rounding error of a stored constant)."""
NEAR_RTOL = 1e-5


def _fn_near(value: Any, target: Any) -> bool:
    """Whether a constant holds exactly one value equal to ``target`` up to the rounding of
    its own dtype. Exporters store sqrt(2), 1/6 or 0.044715 in the model's dtype: in a
    float16 model they are off by up to 2^-11 (relative), far more than the 1e-5 a literal
    in a match statement allows, so activation rules capture such constants and test them
    here. Attribute values (plain numbers) compare with the float32 tolerance."""
    rtol = NEAR_RTOL
    if is_value(value):
        dtype = value_dtype(value)
        rtol = _ROUNDING_RTOL.get(dtype.name if dtype is not None else "", NEAR_RTOL)
    array = np.asarray(to_array(value), dtype=np.float64)
    if array.size != 1:
        raise NoMatch(f"a constant with {array.size} values, not one")
    wanted = float(np.asarray(to_array(target), dtype=np.float64).reshape(()))
    actual = float(array.reshape(()))
    return bool(abs(actual - wanted) <= rtol * abs(wanted) + 1e-12)


def _fn_is_scalar_const(*values: Any) -> bool:
    """Whether every given value that is present is a constant holding one element: the
    slopes, offsets and bounds of a decomposed activation become attributes or scalar
    inputs of one op. Absent optional inputs (None) are allowed."""
    return all(v is None or (is_constant(v) and _fn_size(v) == 1) for v in values)


def _fn_same_rank(a: Any, b: Any) -> bool:
    """Whether two values have the same known rank (their dims may be unknown).

    A chain of elementwise ops with one-element constants keeps its input's shape exactly
    when its output has the input's rank (a constant of higher rank would add dims), so
    ``same_rank(z, x)`` checks at once every literal of a pattern before it becomes a
    single op on x."""
    return _fn_rank(a) == _fn_rank(b)


def _fn_single_axis(axes: Any, like: Any) -> int:
    """The one axis a reduction runs over (a constant input, an attribute list or a number),
    made non-negative for a tensor like ``like``: Softmax(axis) equals a decomposed
    softmax only when its ReduceSum runs over exactly one axis."""
    if axes is None:
        raise NoMatch("the reduction runs over every axis")
    values = np.ravel(np.asarray(to_array(axes, "axes")))
    if values.size != 1 or values.dtype.kind not in "iu":
        raise NoMatch(f"the reduction runs over {values.size} axes, not one")
    rank = _fn_rank(like)
    axis = int(values[0])
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank:
        raise NoMatch(f"axis {int(values[0])} out of range for rank {rank}")
    return axis


# ------------------------------- elementwise and cleanup (rules/05-cleanup, 45-elementwise)


def _fn_is_graph_output(value: Any) -> bool:
    """Whether a matched value is an output of its graph. ``y = Identity(x)`` in a
    replacement keeps an Identity when y is a graph output (its name must survive), so a
    rule that removes Identity nodes must not match those: it would replace the node by
    an equal one on every pass."""
    if not is_value(value):
        raise NoMatch("is_graph_output() needs a value of the match")
    return value.is_graph_output()


def _fn_num_uses(value: Any) -> int:
    """How many node inputs read a matched value, plus one when it is a graph output: a
    rule that also writes an intermediate again (the residual sum of a skip norm) fires
    only when someone outside the match reads it."""
    if not is_value(value):
        raise NoMatch("num_uses() needs a value of the match")
    return len(value.uses()) + int(value.is_graph_output())


def _fn_is_minted_dim(dim: Any) -> bool:
    """Whether a dim from shape() is a symbol onnx's inference minted (``unk__3``), which
    names nothing: a Reshape to a -1 target gets one when its element count is unspelled."""
    from .shapeexpr import is_minted  # shapeexpr reads expr's value helpers

    return isinstance(dim, str) and is_minted(dim)


def _fn_read_by_shapes_besides(value: Any, reader_output: Any) -> bool:
    """Whether ``value`` is no graph output and every node reading it, but the one writing
    ``reader_output``, is a Shape or Size: a rule that writes ``value`` again for them (a
    dynamic export's Shape computing the Reshape target it replaces) then costs no second
    copy of the computation, which dies with that Shape arithmetic."""
    if not is_value(value) or not is_value(reader_output):
        raise NoMatch("read_by_shapes_besides() needs values of the match")
    reader = reader_output.producer()
    return not value.is_graph_output() and all(
        use.node is reader or (use.node.op_type in ("Shape", "Size") and use.node.domain == "")
        for use in value.uses())


_INT_RANGES = {
    "bool": (0, 1),
    "int8": (-(2**7), 2**7 - 1),
    "uint8": (0, 2**8 - 1),
    "int16": (-(2**15), 2**15 - 1),
    "uint16": (0, 2**16 - 1),
    "int32": (-(2**31), 2**31 - 1),
    "uint32": (0, 2**32 - 1),
    "int64": (-(2**63), 2**63 - 1),
    "uint64": (0, 2**64 - 1),
}
"""Value range of the integer dtypes (and bool, as 0/1)."""

_FLOAT_FORMATS = {
    "float16": (11, 15, -24, 65504.0),
    "bfloat16": (8, 127, -133, 3.3895313892515355e38),
    "float32": (24, 127, -149, 3.4028234663852886e38),
    "float64": (53, 1023, -1074, 1.7976931348623157e308),
}
"""Significand bits (with the implicit one), largest exponent, exponent of the smallest
subnormal and largest finite value of the float dtypes."""


def _dtype_name(value: Any) -> str:
    """A dtype as numpy names it (``dtype()``'s names): from a name, an ONNX dtype code
    (a Cast's ``to``) or a value."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        try:
            dtype = ir.DataType(int(value))
        except ValueError:
            raise NoMatch(f"{value} is not an ONNX dtype code") from None
        return _onnx_dtype_name(dtype)
    if is_value(value):
        return _dtype_of(value)
    raise NoMatch("expected a dtype name, an ONNX dtype code or a value")


def _fn_casts_exactly(src: Any, dst: Any) -> bool:
    """Whether every value of dtype ``src`` is exactly representable in dtype ``dst``, so
    that a Cast to dst and back is the identity: float32 -> float64 -> float32 is,
    float32 -> float16 -> float32 is not (it rounds, overflows to inf, flushes tiny values).

    Integers (and bool as 0/1) fit a wider integer range or a float whose significand
    holds them (int8 and uint8 in float16, int16 in float32, int32 in float64); a float
    fits a float with at least its significand bits and exponent range. Anything else
    (float -> int, int64 -> float64, float16 <-> bfloat16, float8, strings) is not exact.
    """
    source, target = _dtype_name(src), _dtype_name(dst)
    if source == target:
        return True
    if source in _INT_RANGES:
        low, high = _INT_RANGES[source]
        if target in _INT_RANGES:
            target_low, target_high = _INT_RANGES[target]
            return target_low <= low and high <= target_high
        if target in _FLOAT_FORMATS:
            return max(-low, high) <= 2 ** _FLOAT_FORMATS[target][0]
        return False
    if source in _FLOAT_FORMATS and target in _FLOAT_FORMATS:
        bits, high, tiny, _ = _FLOAT_FORMATS[source]
        target_bits, target_high, target_tiny, _ = _FLOAT_FORMATS[target]
        return target_bits >= bits and target_high >= high and target_tiny <= tiny
    return False


def _dims(value: Any, what: str) -> list[int | str]:
    """Dims of a shape given as a list (``shape(x)``: ints and symbolic names) or as a
    constant 1-D int tensor (e.g. Expand's shape input)."""
    if isinstance(value, (list, tuple)) and all(
        isinstance(d, str) or (isinstance(d, (int, np.integer)) and not isinstance(d, bool))
        for d in value
    ):
        if len(value) > MAX_RANK:
            raise NoMatch(f"{what} has more than {MAX_RANK} dims")
        dims = [d if isinstance(d, str) else int(d) for d in value]
    else:
        dims = list(_int_list(value, what))
    if any(isinstance(d, int) and d < 0 for d in dims):
        raise NoMatch(f"{what} has a negative dim")
    return dims


def _fn_broadcast_shape(a: Any, b: Any) -> tuple[int | str, ...]:
    """The shape two shapes broadcast to (numpy/ONNX multidirectional broadcasting).

    Shapes are lists of dims (``shape(x)``, symbolic dims as names) or constant 1-D int
    tensors: ``Expand(x, s)`` returns x unchanged exactly when
    ``broadcast_shape(shape(x), s) == shape(x)``. A symbolic dim against a static dim
    other than 1 could be either, so that does not match; incompatible static dims do
    not match either (the op would fail).
    """
    first, second = _dims(a, "first shape"), _dims(b, "second shape")
    out: list[int | str] = []
    for i in range(1, max(len(first), len(second)) + 1):
        x = first[-i] if i <= len(first) else 1
        y = second[-i] if i <= len(second) else 1
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        elif isinstance(x, int) and isinstance(y, int):
            raise NoMatch(f"dims {x} and {y} do not broadcast")
        else:
            raise NoMatch(f"dims {x} and {y}: the result depends on a symbolic dim")
    return tuple(reversed(out))


SLICE_TO_END = 2**31 - 1
"""An end at least this large takes a symbolic dim to its end (exporters write INT64_MAX
or INT32_MAX for "to the end")."""


def _fn_slice_is_full(value: Any, starts: Any, ends: Any, axes: Any = None,
                      steps: Any = None) -> bool:
    """Whether ``Slice(value, starts, ends, axes, steps)`` returns value unchanged: on every
    sliced axis the step is 1, the start clamps to 0 and the end clamps to the dim.

    Works for the input form (opset >= 10) and the attribute form (lists). A symbolic dim
    is taken whole only with start 0 and an end of at least 2^31-1; an unknown dim or
    rank does not match.
    """
    dims = _shape_of_known_rank(value)
    rank = len(dims)
    begin, end = _int_list(starts, "starts"), _int_list(ends, "ends")
    where = list(range(len(begin))) if axes is None else _int_list(axes, "axes")
    step = [1] * len(begin) if steps is None else _int_list(steps, "steps")
    if not len(begin) == len(end) == len(where) == len(step):
        raise NoMatch("starts, ends, axes and steps differ in length")
    seen: set[int] = set()
    for b, e, axis, s in zip(begin, end, where, step, strict=True):
        axis = axis + rank if axis < 0 else axis
        if not 0 <= axis < rank or axis in seen:
            raise NoMatch(f"bad or repeated slice axis {axis}")
        seen.add(axis)
        if s != 1:
            return False
        dim = dims[axis]
        if isinstance(dim, int):
            first = min(max(b + dim if b < 0 else b, 0), dim)
            last = min(max(e + dim if e < 0 else e, 0), dim)
            if first != 0 or last != dim:
                return False
        elif dim is None:
            raise NoMatch(f"dim {axis} is unknown")
        elif b != 0 or e < SLICE_TO_END:
            return False
    return True


def _fn_slice_range(value: Any, starts: Any, ends: Any, axes: Any = None,
                    steps: Any = None) -> list[int]:
    """``[axis, begin, end]`` of a unit-step Slice of one axis with a known dim, bounds
    clamped as Slice clamps them: sibling Slices that tile an axis become one Split."""
    dims = _shape_of_known_rank(value)
    begin, end = _int_list(starts, "starts"), _int_list(ends, "ends")
    where = [0] if axes is None else _int_list(axes, "axes")
    step = [1] if steps is None else _int_list(steps, "steps")
    if not len(begin) == len(end) == len(where) == len(step) == 1:
        raise NoMatch("the slice must cut exactly one axis")
    if step[0] != 1:
        raise NoMatch(f"the slice has step {step[0]}")
    axis = where[0] + len(dims) if where[0] < 0 else where[0]
    if not 0 <= axis < len(dims) or not isinstance(dims[axis], int):
        raise NoMatch(f"slice axis {where[0]} has no known dim")
    dim = dims[axis]
    first = min(max(begin[0] + dim if begin[0] < 0 else begin[0], 0), dim)
    last = min(max(end[0] + dim if end[0] < 0 else end[0], 0), dim)
    return [axis, first, last]


_PASS_THROUGH = frozenset({"Squeeze", "Unsqueeze", "Mul", "Div", "Add", "Sub", "Neg", "Relu",
                           "Sigmoid", "Tanh", "Exp", "Erf", "Cast", "Identity"})


def _fn_transpose_ahead(*values: Any) -> bool:
    """Whether a Transpose reads one of ``values`` within three hops of elementwise ops and
    Squeezes: pushing a Transpose below a Split multiplies it by the parts, which pays
    only when one of them meets another Transpose and composes with it."""
    frontier = [v for v in values if is_value(v)]
    for _ in range(3):
        following = []
        for value in frontier:
            for use in value.uses():
                node = use.node
                if node.domain not in ("", "ai.onnx"):
                    continue
                if node.op_type == "Transpose":
                    return True
                if node.op_type in _PASS_THROUGH:
                    following.extend(node.outputs)
        frontier = following
    return False


_HEAD_PERM = [0, 2, 1, 3]


def _is_head_transpose(value: ir.Value) -> bool:
    node = value.producer()
    if node is None or node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return False
    perm = node.attributes.get("perm")
    return perm is not None and list(perm.value) == _HEAD_PERM


def _one_head(value: ir.Value) -> bool:
    """Whether [B,H,S,D] heads are known to be one head."""
    shape = value.shape
    return shape is not None and len(shape) == 4 and shape[1] == 1


def _is_plain_rotary(node: ir.Node) -> bool:
    return (node.op_type == "RotaryEmbedding" and node.domain in ("", "ai.onnx")
            and "num_heads" not in node.attributes)


def _fn_feeds_heads(*values: Any) -> bool:
    """Whether ``values`` (about to be [B,H,S,D] heads transposed from [B,S,H,D]: Split parts
    once a Transpose is pushed below the Split, or a RotaryEmbedding whose Transpose moves
    below it) are read only by standard Attention nodes, directly or through a 4-D
    RotaryEmbedding, whose other query, key and value inputs are such heads too (or one
    key and value head, multi-query): each Transpose is then taken away by the 3-D
    Attention (attention-heads-from-views and its one-kv-head form), so moving it costs
    nothing in the end, where otherwise it would add nodes. Every head is read once: a
    Transpose that two Attentions read stays for the second one."""
    present = [v for v in values if is_value(v)]
    if not present:
        return False
    ours = {id(v) for v in present}
    attentions: dict[int, ir.Node] = {}
    for value in present:
        if value.is_graph_output() or not value.uses():
            return False
        for use in value.uses():
            node = use.node
            if _is_plain_rotary(node) and use.idx == 0:
                out = node.outputs[0]
                ours.add(id(out))
                readers = [u.node for u in out.uses()]
                if out.is_graph_output() or not readers:
                    return False
            elif node.domain in ("", "ai.onnx") and node.op_type == "Attention" and use.idx < 3:
                readers = [node]
            else:
                return False
            for reader in readers:
                if reader.domain not in ("", "ai.onnx") or reader.op_type != "Attention":
                    return False
                attentions[id(reader)] = reader

    def ready(value: ir.Value | None, position: int) -> bool:
        if value is None:
            return False
        if _one_head(value):  # a Transpose moving one head is rewritten as a Reshape first;
            return position > 0  # one key or value head is read squeezed, a query is not
        if len(value.uses()) != 1 or value.is_graph_output():
            return False  # the Transpose (or rotation) stays for its other reader
        if id(value) in ours or _is_head_transpose(value):
            return True
        node = value.producer()
        moved = node.inputs[0] if node is not None and node.inputs else None
        return node is not None and _is_plain_rotary(node) and moved is not None \
            and len(moved.uses()) == 1 \
            and (id(moved) in ours or _is_head_transpose(moved))

    return all(len(a.inputs) >= 3 and all(ready(v, i) for i, v in enumerate(a.inputs[:3]))
               and _goes_3d(a) for a in attentions.values())


def _static_heads(value: ir.Value | None) -> tuple[int, int] | None:
    """(heads, head size) of [B,H,S,D] heads when both are known and positive."""
    shape = value.shape if value is not None else None
    if shape is None or len(shape) != 4:
        return None
    heads, size = shape[1], shape[3]
    if isinstance(heads, int) and isinstance(size, int) and heads > 0 and size > 0:
        return heads, size
    return None


def _goes_3d(attention: ir.Node) -> bool:
    """What attention-heads-from-views needs of an Attention besides its heads: no head
    counts named, no past or present, known head counts and sizes, and the output merged
    back by Transpose<[0,2,1,3]> and a Reshape to [B,S,H*Dv] (through torch's NaN guard with
    a one-value fill, if any) and read by nothing else."""
    named = attention.attributes
    if "q_num_heads" in named or "kv_num_heads" in named or len(attention.inputs) > 4 \
            or len(attention.outputs) != 1:
        return False
    q, k, v = (_static_heads(x) for x in attention.inputs[:3])
    if q is None or k is None or v is None:
        return False
    out = attention.outputs[0]
    if out.is_graph_output():
        return False
    readers = [u.node for u in out.uses()]
    if {r.op_type for r in readers} == {"IsNaN", "Where"} and len(readers) == 2:
        guard = next(r for r in readers if r.op_type == "Where")
        fill = guard.inputs[1]
        if fill is None or fill.const_value is None or fill.const_value.size != 1 \
                or len(fill.const_value.shape) > 1 or guard.outputs[0].is_graph_output():
            return False
        readers = [u.node for u in guard.outputs[0].uses()]
    if len(readers) != 1 or not _is_head_transpose(readers[0].outputs[0]):
        return False
    merged = readers[0].outputs[0]
    if merged.is_graph_output() or [u.node.op_type for u in merged.uses()] != ["Reshape"]:
        return False
    reshape = merged.uses()[0].node
    z, heads = reshape.outputs[0], merged.shape
    width = q[0] * v[1]
    if z.shape is None or heads is None or len(heads) != 4 or z.shape[-1] != width:
        return False
    if len(z.shape) == 3:
        return list(z.shape[:2]) == list(heads[:2])
    target = reshape.inputs[1].const_value if len(reshape.inputs) > 1 and \
        reshape.inputs[1] is not None else None
    rows = [heads[0], heads[1]]
    return len(z.shape) == 2 and (
        target is not None and target.numpy().tolist() == [-1, width]
        or all(isinstance(d, int) for d in rows) and z.shape[0] == rows[0] * rows[1])


def _fn_tiling_sizes(ranges: Any, value: Any) -> np.ndarray:
    """The Split sizes of slices ``[axis, begin, end]`` (in member order) that cover one
    axis of ``value`` exactly, end to end, without gaps or overlaps."""
    dims = _shape_of_known_rank(value)
    axis = ranges[0][0]
    edge = 0
    sizes = []
    for _, first, last in ranges:
        if first != edge or last <= first:
            raise NoMatch("the slices do not tile the axis end to end")
        sizes.append(last - first)
        edge = last
    if edge != dims[axis]:
        raise NoMatch(f"the slices cover {edge} of {dims[axis]} along axis {axis}")
    return np.asarray(sizes, dtype=np.int64)


def _fn_einsum_matmul(equation: Any, a_value: Any, b_value: Any,
                      transposed_output: Any = False) -> list[Any]:
    """How a two-operand Einsum is one MatMul: ``[perm_first, perm_second, swap, perm_out]``.
    The product is ``MatMul(first, second)``, first and second being the operands in order,
    or swapped when ``swap``; each is transposed by its perm, None where it needs none, and
    the product by ``perm_out``.

    The equation must spell its output (``->``), repeat no letter within a term and use no
    ellipsis; one letter is summed (in both operands, not the output), each operand has one
    free letter in the output, and every other output letter is a batch letter: in both
    operands, or (output ending with the free letters) in one of them while the other is a
    plain matrix, which MatMul broadcasts (``bsh,hd->bsd``). ``bhid,bhjd->bhij``,
    ``ij,jk->ki`` (swapped operands) and ``bhij,bjhd->bihd`` (the product transposed to
    [B,S,H,D]) all qualify. Of the plans, the one with fewest Transposes is taken; the rule
    with ``transposed_output`` takes it when it transposes the product, the other when it
    does not (NoMatch otherwise). The summed dims must be known equal: Einsum broadcasts a
    summed dim of 1 against N, MatMul does not."""
    if not isinstance(equation, str):
        raise NoMatch("einsum_matmul() needs the equation and the two operands")
    dims_a, dims_b = _shape_of(a_value), _shape_of(b_value)
    spelled = equation.replace(" ", "")
    if spelled.count("->") != 1 or "." in spelled:
        raise NoMatch(f"einsum {equation!r}: no explicit output, or an ellipsis")
    inputs, out = spelled.split("->")
    terms = inputs.split(",")
    if len(terms) != 2:
        raise NoMatch(f"einsum {equation!r} has {len(terms)} operands, not 2")
    a, b = terms
    if (len(a), len(b)) != (len(dims_a), len(dims_b)):
        raise NoMatch(f"einsum {equation!r}: terms of ranks {len(a)}, {len(b)}, operands of "
                      f"ranks {len(dims_a)}, {len(dims_b)}")
    if not (a + b + out).isalpha() or any(len(set(s)) != len(s) for s in (a, b, out)):
        raise NoMatch(f"einsum {equation!r}: a letter repeats within a term (a diagonal)")
    summed = [c for c in a if c in b and c not in out]
    if len(summed) != 1 or len(out) < 2:
        raise NoMatch(f"einsum {equation!r} is not one matrix product")
    k = summed[0]
    if dims_a[a.index(k)] != dims_b[b.index(k)]:
        raise NoMatch(f"einsum {equation!r}: the summed dims {dims_a[a.index(k)]} and "
                      f"{dims_b[b.index(k)]} are not known equal (Einsum broadcasts a 1)")
    plans = [p for p in (_einsum_in_order(a, b, out, k), _einsum_transposed(a, b, out, k))
             if p is not None]
    if not plans:
        raise NoMatch(f"einsum {equation!r} is not one matrix product")
    best = min(plans, key=lambda p: sum(x is not None for x in (p[0], p[1], p[3])))
    if (best[3] is not None) != bool(transposed_output):
        raise NoMatch(f"einsum {equation!r}: the other form of the product is shorter")
    return best


def _identity_none(perm: list[int]) -> list[int] | None:
    return None if _fn_is_identity_perm(perm) else perm


def _einsum_in_order(a: str, b: str, out: str, k: str) -> list[Any] | None:
    """The plan whose product is the output (in order, or swapped operands): the output
    ends with the free letters; batch letters in both operands, or in one of them while
    the other is a plain matrix."""
    batch, ends = list(out[:-2]), out[-2:]
    m = next((c for c in ends if c in a and c not in b), None)
    n = next((c for c in ends if c in b and c not in a), None)
    if m is None or n is None or set(a) - set(batch) != {m, k} \
            or set(b) - set(batch) != {n, k} or not set(batch) <= set(a) | set(b):
        return None
    batch_a, batch_b = [c for c in batch if c in a], [c for c in batch if c in b]
    if batch_a and batch_a != batch or batch_b and batch_b != batch:
        return None  # a batch letter missing from an operand that has others
    swap = ends == n + m  # y = b' @ a': [.., n, k] @ [.., k, m]
    first = [b.index(c) for c in (*batch_b, n, k)] if swap else \
        [a.index(c) for c in (*batch_a, m, k)]
    second = [a.index(c) for c in (*batch_a, k, m)] if swap else \
        [b.index(c) for c in (*batch_b, k, n)]
    return [_identity_none(first), _identity_none(second), swap, None]


def _einsum_transposed(a: str, b: str, out: str, k: str) -> list[Any] | None:
    """The plan whose product is transposed to the output: batch letters in both operands,
    one free letter each."""
    free_a = [c for c in out if c in a and c not in b]
    free_b = [c for c in out if c in b and c not in a]
    batch = [c for c in out if c in a and c in b]
    if len(free_a) != 1 or len(free_b) != 1 or len(out) != len(batch) + 2 \
            or set(a) != {*batch, free_a[0], k} or set(b) != {*batch, free_b[0], k}:
        return None
    m, n = free_a[0], free_b[0]
    product = [*batch, m, n]
    perm_out = [product.index(c) for c in out]
    if _fn_is_identity_perm(perm_out):
        return None  # the in-order plan
    return [_identity_none([a.index(c) for c in (*batch, m, k)]),
            _identity_none([b.index(c) for c in (*batch, k, n)]), False, perm_out]


def _fn_fits_dtype(value: Any, like: Any) -> bool:
    """Whether a constant computed while folding (numpy works in float32 even for float16
    models) survives the cast to ``like``'s dtype (a value, a dtype name or an ONNX
    code): finite and within the float range, or within the integer range. Folding
    two constants into one must not create an inf (300 * 300 in float16) or a NaN that
    neither original had."""
    name = _dtype_name(like)
    array = np.asarray(to_array(value))
    if array.size > MAX_ELEMENTS:
        raise NoMatch("fits_dtype() of a huge constant")
    if name in _FLOAT_FORMATS:
        if array.dtype.kind not in "biuf":
            return False
        values = array.astype(np.float64)
        return bool(np.all(np.isfinite(values)) and
                    np.all(np.abs(values) <= _FLOAT_FORMATS[name][3]))
    if name in _INT_RANGES:
        if array.dtype.kind not in "biu":
            return False
        low, high = _INT_RANGES[name]
        return bool(array.size == 0 or (int(array.min()) >= low and int(array.max()) <= high))
    return False


def _fn_values_fit_exactly(value: Any, like: Any) -> bool:
    """Whether every element of a constant is exactly representable in ``like``'s dtype (a
    value, a dtype name or an ONNX code): a float32 norm scale of ones, or of weights cast up
    from float16, moves onto the float16 tensor without rounding. Float and integer dtypes
    numpy knows (bfloat16 through ml_dtypes)."""
    target = _numpy_dtype(_dtype_name(like))
    array = np.asarray(to_array(value))
    if array.size > MAX_ELEMENTS:
        raise NoMatch("values_fit_exactly() of a huge constant")
    if array.dtype.kind not in "biuf":
        return False
    with np.errstate(all="ignore"):
        return bool(np.array_equal(array.astype(target).astype(array.dtype), array))


def _fn_cast_like(value: Any, like: Any) -> np.ndarray:
    """A constant cast to ``like``'s dtype (a value, a dtype name or an ONNX code). The
    result keeps that dtype, whatever the expression reads first (see ``_typed``)."""
    array = np.asarray(to_array(value))
    if array.size > MAX_ELEMENTS:
        raise NoMatch("cast_like() of a huge constant")
    return array.astype(_numpy_dtype(_dtype_name(like)))


def _numpy_dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        raise NoMatch(f"dtype {name} has no numpy equivalent") from None


def _fn_num_outputs(value: Any) -> int:
    """How many outputs the node that produced a matched value has (an output with an
    empty name is absent). A pattern statement with one output also matches a node with
    more when they are unused, but some ops change meaning with their output count:
    BatchNormalization before opset 14 computes in training mode when it has its
    running-statistics outputs."""
    if not is_value(value):
        raise NoMatch("num_outputs() needs a value of the match")
    node = value.producer()
    if node is None:
        raise NoMatch(f"{value.name or 'value'} is not produced by a node")
    return sum(1 for out in node.outputs if out.name != "")


# --------------------------------------------- fully connected (rules/20-linear.yaml)


def _fn_broadcasts_into(small: Any, big: Any) -> bool:
    """Whether ``small`` broadcasts to ``big`` without enlarging it, when ``big`` may have
    unknown dims: each dim of ``small`` is 1 or equals ``big``'s dim, and an unknown dim of
    ``big`` only takes a 1 (so a bias can never silently grow the output)."""
    a, b = list(_shape_of_known_rank(small)), list(_shape_of_known_rank(big))
    if len(a) > len(b) or any(d is None for d in a):
        return False
    return all(x == 1 or (y is not None and x == y)
               for x, y in zip(reversed(a), reversed(b), strict=False))


def _fn_batch_source(value: Any) -> Any:
    """The value to read ``value``'s leading (batch) dim from: the input of the Splits
    along other axes that ``value`` comes from, else ``value`` itself. A rule that expands
    a table to the batch reads it there, so the part of a partial rotary (Split, rotate
    the first part, Concat) is read by the rotation alone and the partial rules can take
    the Split and Concat away."""
    if not is_value(value):
        raise NoMatch("batch_source() needs a value of the match")
    for _ in range(4):
        node = value.producer()
        if node is None or node.op_type != "Split" or node.domain not in ("", "ai.onnx") \
                or not node.inputs or node.inputs[0] is None:
            break
        rank = len(value.shape) if value.shape is not None else None
        axis = node.attributes.get_int("axis", 0)
        if rank is None or axis % rank == 0 or node.inputs[0].shape is None \
                or len(node.inputs[0].shape) != rank:
            break
        value = node.inputs[0]
    return value


def _fn_producer_op(value: Any, depth: int = 0) -> str:
    """The op type of the node producing a value, "" for graph inputs and initializers. Input
    side folds use it to leave the affine tail of a decomposed LayerNorm, RMSNorm or GELU
    (an input produced by Mul/Div) to the fusion that takes the whole pattern. ``depth``
    climbs that many producers up through first inputs: ``producer_op(k, 1)`` is "Reshape"
    for ``k = Transpose(Reshape(x))`` (the heads split from a projection)."""
    if not is_value(value):
        raise NoMatch("producer_op() needs a value of the match")
    if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= 8:
        raise NoMatch("producer_op() climbs 0 to 8 producers")
    node = value.producer()
    for _ in range(depth):
        if node is None or not node.inputs or node.inputs[0] is None:
            return ""
        node = node.inputs[0].producer()
    return "" if node is None else _op_name(node)


def _fn_reader_op(value: Any) -> str:
    """The op type of the one node reading a value, "" when none, several or a graph output
    read it. A rule variant that ends one node early (attention heads left as [B,S,H,D]
    for a Concat, ConvBERT's) leaves a value whose only reader is the node the longer
    variant takes (the merging Reshape) to that variant."""
    if not is_value(value):
        raise NoMatch("reader_op() needs a value of the match")
    uses = value.uses()
    if len(uses) != 1 or value.is_graph_output():
        return ""
    return _op_name(uses[0].node)


def _op_name(node: ir.Node) -> str:
    """An op as rules name it: ``Reshape``, ``com.microsoft.FusedMatMul``."""
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"


def _fn_is_finite_mask(mask: Any) -> bool:
    """Whether an additive attention mask provably holds only finite values (valuerange.py:
    the NaN guard after a Softmax is then the identity)."""
    from .valuerange import is_finite_mask  # valuerange reads expr's value helpers

    return is_finite_mask(mask)


def _fn_is_finite_value(value: Any) -> bool:
    """Whether a value provably holds no NaN and no infinity, whatever the graph inputs
    (valuerange.py: constants, and the few ops masks and clamp bounds are built from)."""
    from .valuerange import value_bounds  # valuerange reads expr's value helpers

    if not is_value(value):
        raise NoMatch("is_finite_value() needs a value of the match")
    bounds = value_bounds(value)
    return bounds is not None and all(map(math.isfinite, bounds))


def _fn_runtime_shape_target(shape: Any, data: Any, allowzero: Any = 0) -> np.ndarray:
    """The constant equal to a Reshape target computed from Shape at run time (shapeexpr.py)."""
    from .shapeexpr import runtime_shape_target  # shapeexpr reads expr's value helpers

    return runtime_shape_target(shape, data, allowzero)


def _fn_is_finite_scores(scores: Any) -> bool:
    """Whether a Softmax input is a (scaled) product plus at most a provably finite mask
    (valuerange.py: the Softmax then never yields NaN)."""
    from .valuerange import is_finite_scores

    return is_finite_scores(scores)


def _fn_repeats_halves(value: Any) -> bool:
    """Whether a rotary cos/sin table's last axis is provably two equal halves (halves.py):
    a fused RotaryEmbedding reads only the first."""
    from .halves import repeats_halves

    return is_value(value) and repeats_halves(value)


def _fn_repeats_pairs(value: Any) -> bool:
    """Whether an interleaved rotary table's last axis provably holds each angle twice in a
    row (halves.py): a fused RotaryEmbedding reads only the even elements."""
    from .halves import repeats_pairs

    return is_value(value) and repeats_pairs(value)


def _fn_half_table(table: Any, rank: int) -> np.ndarray:
    """The first half (last axis) of a constant rotary table broadcast as [B|1, 1, S, D],
    [1, S, D] or [S, D]: as [B|1, S, D/2] (``rank`` 3, onnx's RotaryEmbedding) or as rows
    [B*S, D/2] (``rank`` 2, onnxruntime's cache read by position)."""
    array = np.asarray(to_array(table))
    if array.ndim not in (2, 3, 4) or array.shape[-1] % 2:
        raise NoMatch("half_table() needs a [.., S, D] table with an even D")
    return _table_rows(array[..., : array.shape[-1] // 2], rank, 1 if array.ndim == 4 else None)


def _fn_pair_table(table: Any, rank: int, heads_axis: int | None) -> np.ndarray:
    """The even elements (last axis) of a constant interleaved rotary table with the heads'
    axis ``heads_axis`` of size 1 (None: no such axis), as :func:`_fn_half_table` gives them."""
    array = np.asarray(to_array(table))
    if array.ndim not in (2, 3, 4) or array.shape[-1] % 2:
        raise NoMatch("pair_table() needs a [.., S, D] table with an even D")
    if heads_axis is not None and (isinstance(heads_axis, bool) or not isinstance(
            heads_axis, int) or not -array.ndim <= heads_axis < array.ndim):
        raise NoMatch(f"pair_table(): heads axis {heads_axis!r} is no axis of rank {array.ndim}")
    if heads_axis is not None and array.shape[heads_axis] != 1:
        raise NoMatch("pair_table() needs the heads' axis to be 1")
    return _table_rows(array[..., 0::2], rank, heads_axis)


def _table_rows(table: np.ndarray, rank: int, heads_axis: int | None) -> np.ndarray:
    """A rotary table [B|1, S, D/2] (``rank`` 3) or [B*S, D/2] (``rank`` 2), its heads'
    axis (size 1) dropped."""
    if heads_axis is not None:
        table = np.squeeze(table, axis=heads_axis)
    batch = table.shape[0] if table.ndim == 3 else 1
    return table.reshape(batch, table.shape[-2], table.shape[-1]) if rank == 3 \
        else table.reshape(-1, table.shape[-1])


def _fn_positions(batch: Any, seq: Any) -> np.ndarray:
    """int64 [batch, seq] row numbers 0 .. batch*seq-1: the position ids that read a rotary
    table flattened to [batch*seq, D/2] row by row."""
    if not _fn_is_static([batch, seq]) or batch * seq > MAX_SEQUENCE:
        raise NoMatch("positions() needs small static dims")
    return np.arange(batch * seq, dtype=np.int64).reshape(batch, seq)


FAR_REACHING = frozenset({"transpose_ahead", "feeds_heads", "is_finite_mask", "is_finite_scores",
                          "is_finite_value", "runtime_shape_target", "repeats_halves",
                          "repeats_pairs"})
"""Functions that read the graph beyond a value's producer and its readers (several hops
down or up). Every other function reads only what a match and its inputs' producers and
readers hold, which lets the rewrite loop re-try a rule only near what changed
(rewrite.py); a rule calling one of these is re-tried everywhere on every pass."""

FUNCTIONS: dict[str, Callable[..., Any]] = {
    "runtime_shape_target": _fn_runtime_shape_target,
    "is_const": _fn_is_const,
    "rank": _fn_rank,
    "shape": _fn_shape,
    "dtype": _dtype_of,
    "size": _fn_size,
    "value": _fn_value,
    "item": _fn_item,
    "sqrt": lambda x: np.sqrt(to_array(x)),
    "abs": lambda x: np.abs(to_array(x)),
    "exp": lambda x: np.exp(to_array(x)),
    "along": _fn_along,
    "per_channel": _fn_per_channel,
    "is_per_channel": _fn_is_per_channel,
    "concat": _fn_concat,
    "broadcasts_to": _fn_broadcasts_to,
    "trailing_axis": _fn_trailing_axis,
    "expand_to": _fn_expand_to,
    "default": _fn_default,
    "int64": _cast("int64"),
    "int32": _cast("int32"),
    "float32": _cast("float32"),
    "compose_perm": _fn_compose_perm,
    "inverse_perm": _fn_inverse_perm,
    "is_identity_perm": _fn_is_identity_perm,
    "allclose": _fn_allclose,
    "all": _fn_all,
    "any": _fn_any,
    "len": lambda x: len(x),
    "min": lambda *xs: min(xs) if len(xs) > 1 else min(xs[0]),
    "max": lambda *xs: max(xs) if len(xs) > 1 else max(xs[0]),
    "reshape": lambda x, s: np.reshape(to_array(x), [int(d) for d in s]),
    "transpose": lambda x, p: np.transpose(to_array(x), [int(i) for i in p]),
    "matmul": lambda a, b: np.matmul(to_array(a), to_array(b)),
    "list": lambda x: [v.item() if isinstance(v, np.generic) else v for v in x],
    "group_channels": _fn_group_channels,
    "conv_shift_bias": _fn_conv_shift_bias,
    "dense_weight": _fn_dense_weight,
    "conv_compose": _fn_conv_compose,
    "box_filter": _fn_box_filter,
    "spatial_pads": _fn_spatial_pads,
    "dims": _fn_dims,
    "axis_dim": _fn_axis_dim,
    "zeros": _fn_zeros,
    "op_type": _fn_op_type,
    "norm_axes": _fn_norm_axes,
    "permute_axes": _fn_permute_axes,
    "reduced_perm": _fn_reduced_perm,
    "fill_reshape_zeros": _fn_fill_reshape_zeros,
    "moves_unit_dims_only": _fn_moves_unit_dims_only,
    "transposed_shape": _fn_transposed_shape,
    "as_target": _fn_as_target,
    "float32_scale": _fn_float32_scale,
    "unit_reshape_moved": _fn_unit_reshape_moved,
    "unmerged_perm": _fn_unmerged_perm,
    "is_noop_reshape": _fn_is_noop_reshape,
    "squeezed_axes": _fn_squeezed_axes,
    "merge_unsqueeze_axes": _fn_merge_unsqueeze_axes,
    "axes_before_unsqueeze": _fn_axes_before_unsqueeze,
    "merge_squeeze_axes": _fn_merge_squeeze_axes,
    "itemsize": _fn_itemsize,
    "lift_rank": _fn_lift_rank,
    "near": _fn_near,
    "is_scalar_const": _fn_is_scalar_const,
    "same_rank": _fn_same_rank,
    "single_axis": _fn_single_axis,
    "is_graph_output": _fn_is_graph_output,
    "num_uses": _fn_num_uses,
    "read_by_shapes_besides": _fn_read_by_shapes_besides,
    "is_minted_dim": _fn_is_minted_dim,
    "casts_exactly": _fn_casts_exactly,
    "broadcast_shape": _fn_broadcast_shape,
    "slice_is_full": _fn_slice_is_full,
    "slice_range": _fn_slice_range,
    "tiling_sizes": _fn_tiling_sizes,
    "einsum_matmul": _fn_einsum_matmul,
    "feeds_heads": _fn_feeds_heads,
    "transpose_ahead": _fn_transpose_ahead,
    "fits_dtype": _fn_fits_dtype,
    "values_fit_exactly": _fn_values_fit_exactly,
    "cast_like": _fn_cast_like,
    "num_outputs": _fn_num_outputs,
    "broadcasts_into": _fn_broadcasts_into,
    "producer_op": _fn_producer_op,
    "reader_op": _fn_reader_op,
    "batch_source": _fn_batch_source,
    "is_finite_mask": _fn_is_finite_mask,
    "is_finite_scores": _fn_is_finite_scores,
    "is_finite_value": _fn_is_finite_value,
    "repeats_halves": _fn_repeats_halves,
    "half_table": _fn_half_table,
    "repeats_pairs": _fn_repeats_pairs,
    "pair_table": _fn_pair_table,
    "positions": _fn_positions,
    "prod": _fn_prod,
    "is_static": _fn_is_static,
}
"""Every function an expression may call. Casts mark their result as explicitly typed."""

EXPLICIT_DTYPE_FUNCTIONS = frozenset({"int64", "int32", "float32", "cast_like"})

CONSTANT_NAMES: dict[str, Any] = {"pi": math.pi, "e": math.e, "True": True, "False": False}

_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_CMPOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}
_UNARY: dict[type, Callable[[Any], Any]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
    ast.Not: operator.not_,
}
_ALLOWED_NODES = (
    ast.Expression,
    ast.BoolOp,
    ast.And,
    ast.Or,
    ast.BinOp,
    ast.UnaryOp,
    ast.Compare,
    ast.IfExp,
    ast.Call,
    ast.Name,
    ast.Load,
    ast.Constant,
    ast.List,
    ast.Tuple,
    ast.Subscript,
    ast.Slice,
    *(_BINOPS),
    *(_CMPOPS),
    *(_UNARY),
)


# --------------------------------------------------------------------------- parsing


def _fixes_dtype(node: ast.expr) -> bool:
    """A call of a dtype-fixing function, or a conditional whose branches are such calls
    or None."""
    if isinstance(node, ast.IfExp):
        branches = [b for b in (node.body, node.orelse)
                    if not (isinstance(b, ast.Constant) and b.value is None)]
        return bool(branches) and all(_fixes_dtype(b) for b in branches)
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in EXPLICIT_DTYPE_FUNCTIONS)


@dataclass(frozen=True)
class Expression:
    """A checked expression: its source, the names it reads and its AST.

    The AST is built on first use: a rule library loaded from the cache holds a thousand
    expressions, of which a run evaluates the few whose patterns matched.
    """

    source: str
    names: frozenset[str]
    _tree: ast.Expression | None = field(default=None, repr=False, compare=False)
    _compiled: Compiled | None = field(default=None, repr=False, compare=False)
    _names_in_order: tuple[str, ...] | None = field(default=None, repr=False, compare=False)

    @property
    def tree(self) -> ast.Expression:
        if self._tree is None:  # checked by parse() before it was cached
            object.__setattr__(self, "_tree", ast.parse(self.source, mode="eval"))
        return self._tree  # type: ignore[return-value]

    def evaluate(self, env: Mapping[str, Any]) -> Any:
        """Evaluate with ``env`` (captures and let values); raises NoMatch or ExprError."""
        compiled = self._compiled
        if compiled is None:
            compiled = _closure(self.tree.body)
            object.__setattr__(self, "_compiled", compiled)
        return _run(compiled, env)

    @property
    def explicit_dtype(self) -> bool:
        """Whether the outermost call fixes the dtype itself (e.g. ``int64(...)``), also in
        both branches of a conditional (``None if b is None else cast_like(b, x)``)."""
        return _fixes_dtype(self.tree.body)

    def names_in_order(self) -> list[str]:
        """The names the expression reads, in reading (depth-first) order."""
        if self._names_in_order is None:
            names = tuple(n.id for n in _reading_order(self.tree.body)
                          if isinstance(n, ast.Name))
            object.__setattr__(self, "_names_in_order", names)
        return list(self._names_in_order)  # type: ignore[arg-type]

    def may_call(self, functions: Collection[str]) -> bool:
        """Whether the expression may call one of ``functions``: read off the source, not
        the AST (which costs a parse), so a name inside a string says yes too."""
        return any(name in self.source for name in functions)

    def __reduce__(self) -> tuple[Any, tuple[str, frozenset[str]]]:
        """Pickled as its checked source (the rule cache), without the AST."""
        return Expression, (self.source, self.names)


def _reading_order(node: ast.AST) -> Iterable[ast.AST]:
    """Nodes depth-first, left to right; the called function of a Call is not a value."""
    yield node
    children = node.args if isinstance(node, ast.Call) else ast.iter_child_nodes(node)
    for child in children:
        yield from _reading_order(child)


def parse(source: Any, known_names: Iterable[str] | None) -> Expression:
    """Parse and check an expression; every problem is an ExprError with a clear message.

    ``known_names=None`` checks syntax and safety only (used when the names are not
    knowable, e.g. the rule's match did not parse).
    """
    if isinstance(source, (bool, int, float)):
        source = repr(source)
    if not isinstance(source, str):
        raise ExprError(f"an expression must be a string, got {type(source).__name__}")
    text = source.strip()
    if not text:
        raise ExprError("empty expression")
    if len(text) > MAX_SOURCE_CHARS:
        raise ExprError(f"expression longer than {MAX_SOURCE_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ExprError(f"syntax error in expression {text!r}: {exc.msg}") from None
    except (RecursionError, MemoryError, ValueError):
        raise ExprError(f"expression {text[:40]!r}... is nested too deeply") from None
    known = None if known_names is None else set(known_names) | set(CONSTANT_NAMES)
    names: set[str] = set()
    _check(tree, known, names, depth=0)
    return Expression(text, frozenset(names), tree)


def _check(node: ast.AST, known: set[str] | None, names: set[str], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ExprError(f"expression nested deeper than {MAX_DEPTH} levels")
    if not isinstance(node, _ALLOWED_NODES):
        raise ExprError(f"{_describe(node)} is not allowed in rule expressions")
    if isinstance(node, ast.Name):
        if node.id.startswith("_"):
            raise ExprError(f"name {node.id!r} is not allowed (leading underscore)")
        if known is not None and node.id not in known:
            raise ExprError(f"undefined name {node.id!r}")
        names.add(node.id)
    elif isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            called = node.func.id if isinstance(node.func, ast.Name) else _describe(node.func)
            raise ExprError(
                f"unknown function {called!r}; known: {', '.join(sorted(FUNCTIONS))}"
            )
        if node.keywords:
            raise ExprError("keyword arguments are not allowed in rule expressions")
        for arg in node.args:
            _check(arg, known, names, depth + 1)
        return
    elif isinstance(node, ast.Constant) and not isinstance(
        node.value, (int, float, str, bool, type(None))
    ):
        raise ExprError(f"literal {node.value!r} is not allowed")
    elif (isinstance(node, ast.Constant) and type(node.value) is int
          and node.value.bit_length() > MAX_INT_BITS):
        raise ExprError(f"integer literal of {node.value.bit_length()} bits is too large "
                        f"(at most {MAX_INT_BITS})")
    for child in ast.iter_child_nodes(node):
        _check(child, known, names, depth + 1)


def _describe(node: ast.AST) -> str:
    kinds = {
        ast.Attribute: "attribute access",
        ast.Lambda: "lambda",
        ast.ListComp: "a comprehension",
        ast.SetComp: "a comprehension",
        ast.DictComp: "a comprehension",
        ast.GeneratorExp: "a generator",
        ast.NamedExpr: "assignment (:=)",
        ast.Starred: "star-unpacking",
        ast.JoinedStr: "an f-string",
        ast.Dict: "a dict literal",
        ast.Set: "a set literal",
        ast.Await: "await",
        ast.Yield: "yield",
    }
    return kinds.get(type(node), type(node).__name__)


# ------------------------------------------------------------------------ evaluation


Compiled = Callable[[Mapping[str, Any]], Any]
"""An expression turned into nested closures: evaluating it no longer walks the AST."""


def _run(compiled: Compiled, env: Mapping[str, Any]) -> Any:
    """Evaluate; Python errors inside an expression mean "no match", never a crash."""
    try:
        return compiled(env)
    except (NoMatch, ExprError):
        raise
    except (ArithmeticError, ValueError, TypeError, IndexError, KeyError,
            MemoryError) as exc:
        raise NoMatch(f"{type(exc).__name__}: {exc}") from None


def _closure(node: ast.AST) -> Compiled:  # noqa: C901 - one dispatch over node types
    """Closures for a checked AST, built once per expression (parse() allowed only the node
    types handled here; anything else raises when evaluated, as a walker would)."""
    if isinstance(node, ast.Constant):
        constant = node.value
        return lambda env: constant
    if isinstance(node, ast.Name):
        name = node.id
        return lambda env: env[name] if name in env else CONSTANT_NAMES[name]
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_closure(e) for e in node.elts]
        if isinstance(node, ast.List):
            return lambda env: [item(env) for item in items]
        return lambda env: tuple(item(env) for item in items)
    if isinstance(node, ast.BoolOp):
        values = [_closure(v) for v in node.values]
        if isinstance(node.op, ast.And):
            def all_of(env: Mapping[str, Any]) -> Any:
                result: Any = True
                for value in values:
                    result = value(env)
                    if not _truth(result):
                        return result
                return result
            return all_of

        def any_of(env: Mapping[str, Any]) -> Any:
            result: Any = False
            for value in values:
                result = value(env)
                if _truth(result):
                    return result
            return result
        return any_of
    if isinstance(node, ast.UnaryOp):
        operand = _closure(node.operand)
        if isinstance(node.op, ast.Not):
            return lambda env: not _truth(operand(env))
        unary = _UNARY[type(node.op)]
        return lambda env: unary(_numeric(operand(env)))
    if isinstance(node, ast.BinOp):
        return _binop(node)
    if isinstance(node, ast.Compare):
        first = _closure(node.left)
        pairs = [(op, _closure(c)) for op, c in zip(node.ops, node.comparators, strict=True)]

        def compare(env: Mapping[str, Any]) -> bool:
            left = first(env)
            for op, comparator in pairs:
                right = comparator(env)
                if not _compare(op, left, right):
                    return False
                left = right
            return True
        return compare
    if isinstance(node, ast.IfExp):
        test, body, orelse = _closure(node.test), _closure(node.body), _closure(node.orelse)
        return lambda env: body(env) if _truth(test(env)) else orelse(env)
    if isinstance(node, ast.Subscript):
        container_of, index_of = _closure(node.value), _index_closure(node.slice)

        def subscript(env: Mapping[str, Any]) -> Any:
            container = container_of(env)
            if is_value(container):
                container = to_array(container)
            return container[index_of(env)]
        return subscript
    if isinstance(node, ast.Call):
        assert isinstance(node.func, ast.Name)
        function, args = node.func.id, [_closure(a) for a in node.args]
        return lambda env: FUNCTIONS[function](*[arg(env) for arg in args])
    message = f"{_describe(node)} is not allowed in rule expressions"

    def refuse(env: Mapping[str, Any]) -> Any:
        raise ExprError(message)
    return refuse


def _binop(node: ast.BinOp) -> Compiled:
    left_of, right_of = _closure(node.left), _closure(node.right)
    operator, is_power = _BINOPS[type(node.op)], isinstance(node.op, ast.Pow)

    def binop(env: Mapping[str, Any]) -> Any:
        left, right = _numeric(left_of(env)), _numeric(right_of(env))
        if is_power:
            _check_power(left, right)
        result = operator(left, right)
        if isinstance(result, int) and result.bit_length() > MAX_INT_BITS:
            raise NoMatch(f"integer larger than {MAX_INT_BITS} bits")
        if isinstance(result, complex):
            raise NoMatch("complex result")
        return result
    return binop


def _index_closure(node: ast.AST) -> Compiled:
    if isinstance(node, ast.Slice):
        bounds = [None if p is None else _closure(p) for p in (node.lower, node.upper, node.step)]
        return lambda env: slice(*[None if b is None else b(env) for b in bounds])
    if isinstance(node, ast.Tuple):
        parts = [_index_closure(e) for e in node.elts]
        return lambda env: tuple(part(env) for part in parts)
    plain = _closure(node)

    def index(env: Mapping[str, Any]) -> Any:
        value = plain(env)
        return tuple(value) if isinstance(value, (list, tuple)) else value
    return index


def _numeric(value: Any) -> Any:
    """Operands of arithmetic: graph constants become arrays; text is refused."""
    if is_value(value) or value is None:
        return to_array(value)
    if isinstance(value, str):
        raise NoMatch("arithmetic on text")
    if isinstance(value, (list, tuple)):
        if len(value) > MAX_SEQUENCE:
            raise NoMatch("sequence too long")
        return np.asarray(value)
    return value


MAX_INT_BITS = 256


def _check_power(base: Any, exponent: Any) -> None:
    """Bound ``**``: a small exponent, and for exact integers a small result."""
    exp = np.asarray(exponent)
    if exp.size and float(np.max(np.abs(exp))) > MAX_EXPONENT:
        raise NoMatch(f"exponent larger than {MAX_EXPONENT}")
    exact = isinstance(base, int) and isinstance(exponent, int) and exponent > 0
    if exact and abs(base).bit_length() * exponent > MAX_INT_BITS:
        raise NoMatch(f"power larger than {MAX_INT_BITS} bits")


def _truth(value: Any) -> bool:
    if isinstance(value, np.ndarray):
        if value.size != 1:
            raise NoMatch("the truth value of a tensor with several elements is ambiguous")
        return bool(value.reshape(()))
    return bool(value)


def _compare(op: ast.cmpop, left: Any, right: Any) -> bool:
    if isinstance(op, (ast.Is, ast.IsNot)):
        result = left is right
        return result if isinstance(op, ast.Is) else not result
    if isinstance(op, (ast.In, ast.NotIn)):
        contained = left in (right if not is_value(right) else to_array(right))
        return contained if isinstance(op, ast.In) else not contained
    if is_value(left):
        left = to_array(left)
    if is_value(right):
        right = to_array(right)
    if isinstance(left, (list, tuple, np.ndarray)) or isinstance(right, (list, tuple, np.ndarray)):
        a, b = np.asarray(left), np.asarray(right)
        if isinstance(op, ast.Eq):
            return a.shape == b.shape and bool(np.all(a == b))
        if isinstance(op, ast.NotEq):
            return not (a.shape == b.shape and bool(np.all(a == b)))
        return bool(np.all(_CMPOPS[type(op)](a, b)))
    return bool(_CMPOPS[type(op)](left, right))
