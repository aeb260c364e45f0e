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
from collections.abc import Callable, Iterable, Mapping
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
    if isinstance(value, ir.Value):
        return _const_tensor(value) is not None
    return value is not None


def to_array(value: Any, name: str = "value") -> Any:
    """Numeric view of a value: arrays for graph constants, scalars stay scalars."""
    if isinstance(value, ir.Value):
        tensor = _const_tensor(value)
        if tensor is None:
            raise NoMatch(f"{value.name or name} is not a constant")
        array = tensor.numpy()
        low_precision = array.dtype == np.float16 or array.dtype.kind == "V"
        if low_precision or str(array.dtype).startswith(("bfloat16", "float8", "float4")):
            array = array.astype(np.float32)  # compute folds in fp32, cast back later
        return array
    if value is None:
        raise NoMatch(f"{name} is absent")
    if isinstance(value, (list, tuple)):
        return np.asarray(value)
    return value


def _shape_of(value: Any) -> tuple[int | str, ...]:
    if isinstance(value, ir.Value):
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
                dims.append(str(dim.value))
        return tuple(dims)
    if value is None:
        raise NoMatch("shape of an absent value")
    return tuple(np.shape(value))


def _dtype_of(value: Any) -> str:
    if isinstance(value, ir.Value):
        tensor = _const_tensor(value)
        dtype = tensor.dtype if tensor is not None else value.dtype
        if dtype is None:
            raise NoMatch(f"dtype of {value.name} is unknown")
        return dtype.numpy().name if dtype != ir.DataType.BFLOAT16 else "bfloat16"
    return np.asarray(value).dtype.name


def value_dtype(value: Any) -> np.dtype | None:
    """The numpy dtype a captured value has in the model (before any upcast)."""
    if not isinstance(value, ir.Value):
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
    return len(_shape_of(value))


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
    if isinstance(axes, ir.Value):
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


FUNCTIONS: dict[str, Callable[..., Any]] = {
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
}
"""Every function an expression may call. Casts mark their result as explicitly typed."""

EXPLICIT_DTYPE_FUNCTIONS = frozenset({"int64", "float32"})

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


@dataclass(frozen=True)
class Expression:
    """A checked expression: its source, its AST and the names it reads."""

    source: str
    tree: ast.Expression = field(repr=False, compare=False)
    names: frozenset[str]

    def evaluate(self, env: Mapping[str, Any]) -> Any:
        """Evaluate with ``env`` (captures and let values); raises NoMatch or ExprError."""
        return _Evaluator(env).run(self.tree.body)

    @property
    def explicit_dtype(self) -> bool:
        """Whether the outermost call fixes the dtype itself (e.g. ``int64(...)``)."""
        body = self.tree.body
        return (
            isinstance(body, ast.Call)
            and isinstance(body.func, ast.Name)
            and body.func.id in EXPLICIT_DTYPE_FUNCTIONS
        )

    def names_in_order(self) -> list[str]:
        """The names the expression reads, in reading (depth-first) order."""
        return [n.id for n in _reading_order(self.tree.body) if isinstance(n, ast.Name)]


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
    return Expression(text, tree, frozenset(names))


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


class _Evaluator:
    def __init__(self, env: Mapping[str, Any]) -> None:
        self.env = env

    def run(self, node: ast.AST) -> Any:
        try:
            return self.eval(node)
        except (NoMatch, ExprError):
            raise
        except (ArithmeticError, ValueError, TypeError, IndexError, KeyError,
                MemoryError) as exc:
            raise NoMatch(f"{type(exc).__name__}: {exc}") from None

    def eval(self, node: ast.AST) -> Any:  # noqa: C901 - one dispatch over node types
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in self.env:
                return self.env[node.id]
            return CONSTANT_NAMES[node.id]
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [self.eval(e) for e in node.elts]
            return items if isinstance(node, ast.List) else tuple(items)
        if isinstance(node, ast.BoolOp):
            if isinstance(node.op, ast.And):
                result: Any = True
                for value in node.values:
                    result = self.eval(value)
                    if not _truth(result):
                        return result
                return result
            result = False
            for value in node.values:
                result = self.eval(value)
                if _truth(result):
                    return result
            return result
        if isinstance(node, ast.UnaryOp):
            operand = self.eval(node.operand)
            if isinstance(node.op, ast.Not):
                return not _truth(operand)
            return _UNARY[type(node.op)](_numeric(operand))
        if isinstance(node, ast.BinOp):
            left, right = _numeric(self.eval(node.left)), _numeric(self.eval(node.right))
            if isinstance(node.op, ast.Pow):
                _check_power(left, right)
            result = _BINOPS[type(node.op)](left, right)
            if isinstance(result, int) and result.bit_length() > MAX_INT_BITS:
                raise NoMatch(f"integer larger than {MAX_INT_BITS} bits")
            if isinstance(result, complex):
                raise NoMatch("complex result")
            return result
        if isinstance(node, ast.Compare):
            left = self.eval(node.left)
            for op, comparator in zip(node.ops, node.comparators, strict=True):
                right = self.eval(comparator)
                if not _compare(op, left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            return self.eval(node.body) if _truth(self.eval(node.test)) else self.eval(node.orelse)
        if isinstance(node, ast.Subscript):
            container = self.eval(node.value)
            if isinstance(container, ir.Value):
                container = to_array(container)
            return container[self.eval_index(node.slice)]
        if isinstance(node, ast.Call):
            assert isinstance(node.func, ast.Name)
            args = [self.eval(a) for a in node.args]
            return FUNCTIONS[node.func.id](*args)
        raise ExprError(f"{_describe(node)} is not allowed in rule expressions")

    def eval_index(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Slice):
            bounds = (node.lower, node.upper, node.step)
            parts = [None if p is None else self.eval(p) for p in bounds]
            return slice(*parts)
        if isinstance(node, ast.Tuple):
            return tuple(self.eval_index(e) for e in node.elts)
        index = self.eval(node)
        if isinstance(index, (list, tuple)):
            return tuple(index)
        return index


def _numeric(value: Any) -> Any:
    """Operands of arithmetic: graph constants become arrays; text is refused."""
    if isinstance(value, ir.Value) or value is None:
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
        contained = left in (right if not isinstance(right, ir.Value) else to_array(right))
        return contained if isinstance(op, ast.In) else not contained
    if isinstance(left, ir.Value):
        left = to_array(left)
    if isinstance(right, ir.Value):
        right = to_array(right)
    if isinstance(left, (list, tuple, np.ndarray)) or isinstance(right, (list, tuple, np.ndarray)):
        a, b = np.asarray(left), np.asarray(right)
        if isinstance(op, ast.Eq):
            return a.shape == b.shape and bool(np.all(a == b))
        if isinstance(op, ast.NotEq):
            return not (a.shape == b.shape and bool(np.all(a == b)))
        return bool(np.all(_CMPOPS[type(op)](a, b)))
    return bool(_CMPOPS[type(op)](left, right))
