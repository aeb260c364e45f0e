"""Memory-traffic and FLOPs model: what each kernel of a model reads, writes and computes.

Why this exists: fusectl's whole pitch is "this fusion saves N bytes of memory traffic".
That number is only honest if every node is costed by one simple, documented model that
works the same on the original graph, on matched subgraphs the rewriter is about to
replace, and on the replacement nodes.  The model (product spec):

* Every node is one kernel.  It reads each *distinct* input tensor once and writes each
  output once.  ``bytes = elements * dtype size``; sub-byte dtypes (INT4, FLOAT4E2M1, ...)
  are ``ceil(elements * bits / 8)`` over the whole tensor.
* Weights (initializers that are not graph inputs, outputs of ``Constant`` nodes) are read
  by the kernel that consumes them.  A node whose inputs are all constant is folded at load
  time: 0 bytes, 0 FLOPs, not a kernel.
* View ops (Reshape, Flatten, Squeeze, Unsqueeze, Identity, Dropout) move 0 bytes but are
  still kernels.  Shape and Size read only metadata (0 bytes read) and write their output.
* A fused kernel (a call of a model-local function, or any node in a non-ONNX domain)
  reads its external inputs and writes its outputs; the body's intermediates never touch
  memory.  Its FLOPs are those of its body.
* Control-flow nodes (If/Loop/Scan, or any node carrying a graph attribute) are costed by
  their own inputs and outputs only; the subgraph bodies are not counted (not their bytes,
  not their FLOPs - the op is listed as "not counted").

Shapes are read from ``value.shape``/``value.dtype`` (falling back to the metadata of
``value.const_value`` or of a ``Constant`` node's attribute).  Tensor *data* is never read,
so lazily loaded external data (>2 GB models) stays on disk.

Symbolic dims are bound through ``dims``.  An unbound named dim counts as **1** (so a
dynamic batch defaults to batch size 1).  Anonymous dims - ``SymbolicDim(None)`` and the
``unk__<n>`` names ONNX shape inference invents for dims it could not infer - are unknown
unless bound explicitly; a node touching an unknown shape or dtype gets ``known=False``
and only its known tensors are counted.

FLOPs conventions (a multiply-add is 2 FLOPs; MACs are reported for Conv, ConvTranspose,
Gemm and MatMul and their quantized variants, 0 elsewhere):

* Conv: ``2 * N*Cout*spatial_out * (Cin/group)*prod(kernel)`` + one add per output
  element when there is a bias.  ConvTranspose: ``2 * N*Cin*spatial_in *
  (Cout/group)*prod(kernel)`` (+ bias adds).  Gemm: ``2*M*N*K`` + ``M*N`` when C is given
  (alpha/beta ignored).  MatMul: ``2 * prod(broadcast batch) * M*N*K``.
* Elementwise unary/binary ops: 1 per output element.  Transcendentals (Exp, Erf, Tanh,
  Sigmoid, Sqrt, ...) are deliberately also 1: we count operations, not instruction
  latency.  Variadic Sum/Max/Min: ``inputs - 1`` per element; Mean: ``inputs``.
  Quantize/DequantizeLinear: 2 per element.
* Reductions (Reduce*, ArgMax/ArgMin): 1 per *input* element.  Softmax/LogSoftmax: 5 per
  element.  BatchNormalization: 2 per element (inference: a folded scale and shift).
  Layer/RMS/Instance/Group normalization and MeanVarianceNormalization: 8 per element.
  LpNormalization: 3 per element.  Gelu: like its decomposition, 5 per element for the
  erf form ``0.5*x*(1 + erf(x/sqrt(2)))``, 8 for ``approximate="tanh"``;
  ``com.microsoft`` Gelu 5, BiasGelu 6 (the bias add), FastGelu 8 (+1 with a bias),
  QuickGelu ``x*sigmoid(alpha*x)`` 3.
* Pools: output elements * prod(kernel_shape); global pools: 1 per input element.
* Pure data movement (Transpose, Concat, Gather, Slice, Cast, Pad, ...) and views: 0.
* Anything else (Einsum, LSTM, Resize, TopK, control flow, ...): 0 FLOPs and the node is
  flagged ``flops_counted=False`` so reports can list it as "not counted".
* A non-ONNX-domain node without a local function body: a few well-known
  ``com.microsoft`` ops are costed like their ONNX equivalents; anything else gets the
  elementwise estimate (1 per output element).
* A function call: the sum of its body nodes' FLOPs, with body shapes propagated from the
  call site (the body usually has no shape annotations).  A body node whose FLOPs cannot
  be determined is estimated as elementwise over the call's outputs.
* Attention (ONNX ``Attention``, ``com.microsoft.MultiHeadAttention``): costed like the
  decomposition it replaces, so fusing it does not change the FLOPs.  With ``S =
  batch*q_heads*q_len*kv_len`` scores (``kv_len`` includes a past key), ``D``/``Dv`` the
  key/value head sizes: MACs ``S*(D + Dv)`` (Q.K^T and P.V); FLOPs ``2*MACs + 6*S``
  (scale 1, softmax 5) ``+ S`` with a mask or ``is_causal`` ``+ 3*S`` with ``softcap``;
  MultiHeadAttention adds one FLOP per element of Q, K and V when it has a bias.
* ``com.microsoft`` FusedMatMul/FusedGemm: like MatMul/Gemm (transposes honoured), plus one
  FLOP per output element for a scale ``alpha != 1`` (FusedMatMul) or an activation
  (FusedGemm).

Convolution algorithm (``conv_algo``, SPEC section 6): ``direct`` (default) costs a Conv
as above.  ``im2col`` adds the write and the read of the column buffer: it holds
``OH*OW*KH*KW*C/group`` elements (the input's dtype) per image and group and is filled
once per group, so the traffic grows by ``2 * N*OH*OW*KH*KW*C * itemsize``.  ``indirect``
adds the read of the indirection buffer, ``N*OH*OW*KH*KW`` pointers of 8 bytes (it is
built once when the model is loaded, so it is read, not written).  A pointwise Conv (1x1
kernel, stride 1, no padding) needs neither buffer: its input already is the GEMM
operand.  This applies to Conv, ConvInteger, QLinearConv and ``com.microsoft.FusedConv``;
the extra bytes are also given as ``NodeTraffic.workspace_bytes``.  ConvTranspose and the
bodies of fused kernels (whose convolution algorithm is the target's business) are
costed as direct.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import onnx_ir as ir

from fusectl.errors import BadInputError
from fusectl.shapeexpr import (
    expression_symbols,
    input_dim_names,
    is_minted,
    is_stand_in,
    mentions_minted,
    mentions_stand_in,
)

__all__ = [
    "CONV_ALGOS",
    "NodeTraffic",
    "TrafficReport",
    "constant_values",
    "measure",
    "node_traffic",
]

Dims = tuple[int, ...]
ShapeOf = Callable[[ir.Value | None], Dims | None]
AttrOf = Callable[[str], object]
FunctionKey = tuple[str, str, str]

CONV_ALGOS = ("direct", "im2col", "indirect")
# Before IR version 4 initializers had to be graph inputs too; runtimes treat them as constants.
_LEGACY_IR_VERSION = 4
POINTER_BYTES = 8

# ---------------------------------------------------------------------------------------
# Public data model
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeTraffic:
    """Cost of one node as one kernel launch; immutable so reports can be shared freely.

    ``name`` is ``node.name`` or ``f"{op_type}_{index}"``.  ``is_kernel`` is False for
    nodes folded at load time.  ``known`` is False when a tensor's shape or dtype was
    unknown, so the bytes (and maybe FLOPs) are a lower bound; view ops stay known since
    they move nothing anyway.  ``macs`` is 0 for ops without multiply-accumulates.
    ``flops_counted`` is False for ops the FLOPs model does not cover (0 FLOPs reported).
    ``workspace_bytes`` is the part of ``bytes_read + bytes_written`` spent on a
    convolution's column or indirection buffer (0 unless ``conv_algo`` asks for one).
    """

    name: str
    op_type: str
    domain: str
    bytes_read: int
    bytes_written: int
    flops: int
    param_bytes: int
    is_kernel: bool
    known: bool
    macs: int = 0
    flops_counted: bool = True
    workspace_bytes: int = 0

    @property
    def bytes_total(self) -> int:
        """Bytes this kernel moves; the figure fusions are ranked by."""
        return self.bytes_read + self.bytes_written


@dataclass(frozen=True)
class TrafficReport:
    """Per-node costs of a graph plus the totals users care about.

    ``distinct_param_bytes`` is filled by :func:`measure`: a weight shared by two kernels
    is read by both (it is in both nodes' ``param_bytes``) but only occupies memory once.
    When it is None (a report assembled by hand) ``param_bytes`` falls back to the sum of
    the nodes' ``param_bytes``.
    """

    nodes: tuple[NodeTraffic, ...]
    distinct_param_bytes: int | None = None

    @property
    def total_bytes(self) -> int:
        """All bytes read and written by all kernels."""
        return sum(n.bytes_read + n.bytes_written for n in self.nodes)

    @property
    def bytes_read(self) -> int:
        """All bytes read by all kernels."""
        return sum(n.bytes_read for n in self.nodes)

    @property
    def bytes_written(self) -> int:
        """All bytes written by all kernels."""
        return sum(n.bytes_written for n in self.nodes)

    @property
    def kernel_count(self) -> int:
        """Nodes that launch at run time (folded constants excluded)."""
        return sum(1 for n in self.nodes if n.is_kernel)

    @property
    def node_count(self) -> int:
        """All nodes of the graph, folded or not."""
        return len(self.nodes)

    @property
    def flops(self) -> int:
        """Total FLOPs (multiply-add = 2) over the counted ops."""
        return sum(n.flops for n in self.nodes)

    @property
    def macs(self) -> int:
        """Total multiply-accumulates of the MAC-shaped ops (Conv, Gemm, MatMul, ...)."""
        return sum(n.macs for n in self.nodes)

    @property
    def workspace_bytes(self) -> int:
        """Bytes moved through convolution work buffers (``conv_algo`` im2col/indirect)."""
        return sum(n.workspace_bytes for n in self.nodes)

    @property
    def param_bytes(self) -> int:
        """Bytes of distinct constant tensors read by kernels, each counted once."""
        if self.distinct_param_bytes is not None:
            return self.distinct_param_bytes
        return sum(n.param_bytes for n in self.nodes)

    @property
    def unknown_nodes(self) -> int:
        """Nodes whose cost is a lower bound because some shape/dtype was unknown."""
        return sum(1 for n in self.nodes if not n.known)

    @property
    def not_counted(self) -> tuple[str, ...]:
        """Op types (``domain::op`` outside ONNX) whose FLOPs the model does not know."""
        ops = {_qualified_op(n.domain, n.op_type) for n in self.nodes if not n.flops_counted}
        return tuple(sorted(ops))

    def top(self, n: int) -> list[NodeTraffic]:
        """The ``n`` heaviest nodes by bytes moved, heaviest first (ties keep graph order)."""
        if n <= 0:
            return []
        return sorted(self.nodes, key=lambda t: t.bytes_total, reverse=True)[:n]

    def by_op(self) -> dict[str, int]:
        """Bytes moved per op type, largest first (ties in first-seen order)."""
        totals: dict[str, int] = {}
        for t in self.nodes:
            totals[t.op_type] = totals.get(t.op_type, 0) + t.bytes_total
        return dict(sorted(totals.items(), key=lambda kv: kv[1], reverse=True))


# ---------------------------------------------------------------------------------------
# Op tables
# ---------------------------------------------------------------------------------------

_ONNX_DOMAINS = frozenset({"", "ai.onnx"})
# Official ONNX domains: their ops are ordinary kernels, not "fused" custom ones.
_STANDARD_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training"})

_VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout"})
_METADATA_OPS = frozenset({"Shape", "Size"})
_CONTROL_FLOW_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})
# Never folded even with constant inputs: the runtime must draw fresh values each run.
_NONDETERMINISTIC_OPS = frozenset(
    {
        "RandomNormal",
        "RandomUniform",
        "RandomNormalLike",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
    }
)


def _names(text: str) -> list[str]:
    return text.split()


_UNARY_OPS = (
    "Abs Neg Exp Log Sqrt Reciprocal Relu LeakyRelu Sigmoid HardSigmoid HardSwish Tanh Erf "
    "Floor Ceil Round Sign Sin Cos Tan Asin Acos Atan Sinh Cosh Asinh Acosh Atanh Softplus "
    "Softsign Elu Selu Celu Mish ThresholdedRelu Shrink Not IsNaN IsInf BitwiseNot Clip"
)
_BINARY_OPS = (
    "Add Sub Mul Div Pow Mod PRelu And Or Xor Equal Greater Less GreaterOrEqual LessOrEqual "
    "BitShift BitwiseAnd BitwiseOr BitwiseXor Where"
)
# FLOPs per output element.
_PER_OUTPUT: dict[str, int] = {op: 1 for op in _names(_UNARY_OPS + " " + _BINARY_OPS)}
_PER_OUTPUT.update({"QuantizeLinear": 2, "DequantizeLinear": 2})
_GELU_FLOPS = {"none": 5, "tanh": 8}  # per element, as the decomposed forms
_VARIADIC_OPS = frozenset({"Sum", "Max", "Min", "Mean"})
# FLOPs per element of input 0.
_PER_INPUT: dict[str, int] = {
    op: 1
    for op in _names(
        "ReduceSum ReduceMean ReduceMax ReduceMin ReduceProd ReduceL1 ReduceL2 ReduceLogSum "
        "ReduceLogSumExp ReduceSumSquare ArgMax ArgMin GlobalAveragePool GlobalMaxPool "
        "GlobalLpPool Hardmax"
    )
}
_PER_INPUT.update(
    {
        "Softmax": 5,
        "LogSoftmax": 5,
        "BatchNormalization": 2,
        "LayerNormalization": 8,
        "RMSNormalization": 8,
        "InstanceNormalization": 8,
        "GroupNormalization": 8,
        "MeanVarianceNormalization": 8,
        "LpNormalization": 3,
    }
)
_ZERO_FLOP_OPS = (
    frozenset(
        _names(
            "Transpose Concat Split Slice Gather GatherElements GatherND Scatter ScatterElements "
            "ScatterND Expand Tile Pad Cast CastLike DepthToSpace SpaceToDepth ConstantOfShape "
            "Constant Compress NonZero OneHot ReverseSequence Trilu EyeLike Range "
            "SequenceConstruct SequenceAt SequenceInsert SequenceErase SequenceLength "
            "SequenceEmpty SplitToSequence ConcatFromSequence Optional OptionalGetElement "
            "OptionalHasElement"
        )
    )
    | _VIEW_OPS
    | _METADATA_OPS
)
_POOL_OPS = frozenset({"MaxPool", "AveragePool", "LpPool"})
_REDUCE_OPS = frozenset(op for op in _PER_INPUT if op.startswith("Reduce"))
# (x index, w index, bias index or None)
_CONV_LAYOUT: dict[str, tuple[int, int, int | None]] = {
    "Conv": (0, 1, 2),
    "ConvInteger": (0, 1, None),
    "QLinearConv": (0, 3, 8),
}
_MATMUL_LAYOUT: dict[str, tuple[int, int]] = {
    "MatMul": (0, 1),
    "MatMulInteger": (0, 1),
    "QLinearMatMul": (0, 3),
}
# Well-known onnxruntime contrib ops, costed like their ONNX counterpart.
_CONTRIB_EQUIVALENT: dict[str, str] = {
    "FusedConv": "Conv",
    "SkipLayerNormalization": "LayerNormalization",
    "SkipSimplifiedLayerNormalization": "LayerNormalization",
    "SimplifiedLayerNormalization": "LayerNormalization",
}

_MISSING = object()
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

def unbound_dim(name: str) -> int | None:
    """What a symbolic dim no binding names counts as: 1 when named (a dynamic batch
    defaults to 1), unknown (None) when anonymous or not a plain name (an expression)."""
    if not _IDENTIFIER.match(name):
        return None
    return None if is_minted(name) or is_stand_in(name) else 1


_BITS: dict[ir.DataType, int] = {}
for _dt in ir.DataType:
    with contextlib.suppress(TypeError, ValueError):  # STRING, UNDEFINED: no fixed size
        _BITS[_dt] = _dt.bitwidth


def _qualified_op(domain: str, op_type: str) -> str:
    return op_type if domain in _ONNX_DOMAINS else f"{domain}::{op_type}"


# ---------------------------------------------------------------------------------------
# Constness
# ---------------------------------------------------------------------------------------


def _is_constant_node(node: ir.Node) -> bool:
    return node.op_type == "Constant" and node.domain in _ONNX_DOMAINS


def _has_subgraph(node: ir.Node) -> bool:
    if node.domain in _ONNX_DOMAINS:  # only the control-flow ops carry graphs in ONNX
        return node.op_type in _CONTROL_FLOW_OPS
    attributes = node.attributes
    if not attributes:
        return False
    for attr in attributes.values():
        if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            return True
    return False


def can_fold(node: ir.Node) -> bool:
    """Whether ``node`` would be folded if all its inputs were constant (preparation folds
    by this too).

    Control-flow nodes are never folded: their bodies may capture non-constant outer
    values we do not look at.  Random ops are never folded either.
    """
    if node.op_type in _NONDETERMINISTIC_OPS and node.domain in _ONNX_DOMAINS:
        return False
    return not _has_subgraph(node)


def _is_folded(
    node: ir.Node, is_const: Callable[[ir.Value], bool], *, foldable: bool | None = None
) -> bool:
    """Whether ``node`` is folded at load time; ``foldable`` skips recomputing can_fold."""
    if _is_constant_node(node):
        return True
    if not (can_fold(node) if foldable is None else foldable):
        return False
    has_input = False
    for value in node.inputs:
        if value is None:
            continue
        has_input = True
        if not is_const(value):
            return False
    return has_input


def _is_weight(value: ir.Value) -> bool:
    """A constant by declaration: an initializer (not overridable) or a Constant output."""
    if value.is_initializer() and not value.is_graph_input():
        return True
    producer = value.producer()
    return producer is not None and _is_constant_node(producer)


def constant_values(graph: ir.Graph, *, legacy_inputs: bool = False) -> set[ir.Value]:
    """Values of ``graph`` known at load time, which a runtime would constant-fold.

    Seeds are initializers that are not graph inputs (a graph input may override them)
    and outputs of Constant nodes - with ``legacy_inputs`` (IR version < 4, where every
    initializer had to be listed as an input) all initializers, as onnxruntime does; then
    every output of a node whose inputs are all constant.  Propagation is a worklist over
    uses, so it is linear and does not depend on the nodes being stored in topological
    order.  Only the main graph's nodes are considered.
    """
    constants: set[ir.Value] = {
        v for v in graph.initializers.values() if legacy_inputs or not v.is_graph_input()
    }
    nodes = list(graph)
    for node in nodes:
        if _is_constant_node(node):
            constants.update(node.outputs)

    remaining: dict[ir.Node, int] = {}
    ready: list[ir.Node] = []
    for node in nodes:
        if _is_constant_node(node) or not can_fold(node):
            continue
        pending = 0
        has_input = False
        for value in node.inputs:
            if value is None:
                continue
            has_input = True
            if value not in constants:
                pending += 1
        if not has_input:
            continue
        remaining[node] = pending
        if pending == 0:
            ready.append(node)

    while ready:
        node = ready.pop()
        for out in node.outputs:
            if out in constants:
                continue
            constants.add(out)
            for use in out.uses():
                consumer = use.node
                count = remaining.get(consumer)
                if count is None:  # not foldable, or lives in a subgraph
                    continue
                remaining[consumer] = count - 1
                if count == 1:
                    ready.append(consumer)
    return constants


# ---------------------------------------------------------------------------------------
# Shapes and bytes
# ---------------------------------------------------------------------------------------


class _Ctx:
    """Per-call state: dim bindings, local functions and memo tables."""

    __slots__ = (
        "dims", "functions", "conv_algo", "bound", "named", "symbols", "shapes", "sizes",
        "fn_cache", "stack",
    )

    def __init__(
        self,
        dims: Mapping[str, int],
        functions: Mapping[FunctionKey, ir.Function],
        conv_algo: str = "direct",
        bound: Mapping[str, Dims] | None = None,
        named: frozenset[str] | None = None,
    ):
        self.dims = dims
        self.functions = functions
        self.conv_algo = conv_algo
        self.bound = bound or {}
        self.named = named
        """The dims a dim expression may be made of (the graph inputs'); None: any."""
        self.symbols: dict[str, int | None] = {}
        self.shapes: dict[ir.Value, Dims | None] = {}
        self.sizes: dict[ir.Value, int | None] = {}
        self.fn_cache: dict[object, _Flops] = {}
        self.stack: set[FunctionKey] = set()

    def dim(self, d: object) -> int | None:
        if isinstance(d, int):
            return d if d >= 0 else None  # -1: an older exporter's unnamed dynamic dim
        name = getattr(d, "value", None)
        if name is None:
            return None
        if not isinstance(name, str):
            name = str(name)
        cached = self.symbols.get(name, _MISSING)
        if cached is not _MISSING:
            return cached  # type: ignore[return-value]
        result = self.dims.get(name)
        if result is None:
            result = unbound_dim(name) if _IDENTIFIER.match(name) else self._expression(d)
        self.symbols[name] = result
        return result

    def _expression(self, d: object) -> int | None:
        """A dim like ``N*2``: bind its symbols (unbound named ones as 1) and evaluate. A
        dim that is not an expression of the model's input dims (``seq-len``) is a name, and
        so is one whose unbound symbols make it smaller than 1 (``s0 - 1``)."""
        named = self.named
        symbols = expression_symbols(
            d, lambda s: s in self.dims or named is None or s in named)  # type: ignore[arg-type]
        text = str(getattr(d, "value", ""))
        if symbols is None:
            return None if mentions_stand_in(text) or mentions_minted(text) else 1
        if any((is_minted(s) or is_stand_in(s)) and s not in self.dims for s in symbols):
            return None
        try:
            value = d.evaluate({s: self.dims.get(s, 1) for s in symbols})  # type: ignore[attr-defined]
        except Exception:  # a dim we cannot evaluate is just unknown
            return None
        if not isinstance(value, int) or value < 0:
            return None
        return 1 if value < 1 and any(s not in self.dims for s in symbols) else value

    def shape(self, value: ir.Value | None) -> Dims | None:
        if value is None:
            return None
        cached = self.shapes.get(value, _MISSING)
        if cached is not _MISSING:
            return cached  # type: ignore[return-value]
        result = self._shape(value)
        self.shapes[value] = result
        return result

    def _shape(self, value: ir.Value) -> Dims | None:
        shape = value.shape
        if shape is None:
            tensor = value.const_value
            if tensor is not None:
                shape = tensor.shape
            else:
                meta = _constant_attr_meta(value)
                if meta is None:
                    return self.bound.get(value.name) if value.name else None
                return meta[0]
        dims: list[int] = []
        for d in shape:
            if type(d) is not int and self.bound and value.name in self.bound:
                # a symbolic dim: what inference gives once the inputs' dims are bound is
                # what it stands for (an output declared [1, 8, H2, W2] behind a Conv)
                return self.bound[value.name]
            n = self.dim(d)
            if n is None:
                return None
            dims.append(n)
        return tuple(dims)

    def nbytes(self, value: ir.Value) -> int | None:
        cached = self.sizes.get(value, _MISSING)
        if cached is not _MISSING:
            return cached  # type: ignore[return-value]
        result: int | None = None
        bits = _BITS.get(_dtype(value))  # type: ignore[arg-type]
        if bits is not None:
            shape = self.shape(value)
            if shape is not None:
                result = (math.prod(shape) * bits + 7) // 8
        self.sizes[value] = result
        return result


def _dtype(value: ir.Value) -> ir.DataType | None:
    dtype = value.dtype
    if dtype is not None:
        return dtype
    tensor = value.const_value
    if tensor is not None:
        return tensor.dtype
    meta = _constant_attr_meta(value)
    return None if meta is None else meta[1]


_SCALAR_ATTRS: dict[str, tuple[bool, ir.DataType]] = {
    "value_float": (False, ir.DataType.FLOAT),
    "value_floats": (True, ir.DataType.FLOAT),
    "value_int": (False, ir.DataType.INT64),
    "value_ints": (True, ir.DataType.INT64),
    "value_string": (False, ir.DataType.STRING),
    "value_strings": (True, ir.DataType.STRING),
}


def _constant_attr_meta(value: ir.Value) -> tuple[Dims, ir.DataType] | None:
    """Shape/dtype of a Constant node's output from its attribute (shape inference missing)."""
    producer = value.producer()
    if producer is None or not _is_constant_node(producer):
        return None
    for name, attr in producer.attributes.items():
        if attr.is_ref():
            return None
        if name == "value":
            tensor = attr.value
            return tuple(int(d) for d in tensor.shape), tensor.dtype
        if name in _SCALAR_ATTRS:
            is_list, dtype = _SCALAR_ATTRS[name]
            return ((len(attr.value),) if is_list else ()), dtype
    return None


# ---------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------


class _Flops(NamedTuple):
    flops: int
    macs: int
    status: str  # "ok" | "unknown" (shapes missing) | "uncounted" (op not modelled)


_UNKNOWN = _Flops(0, 0, "unknown")
_UNCOUNTED = _Flops(0, 0, "uncounted")
_ZERO = _Flops(0, 0, "ok")


def _broadcast(shapes: Iterable[Dims | None]) -> Dims | None:
    result: list[int] = []
    for shape in shapes:
        if shape is None:
            return None
        if len(shape) > len(result):
            result = [1] * (len(shape) - len(result)) + result
        offset = len(result) - len(shape)
        for i, d in enumerate(shape):
            cur = result[offset + i]
            if cur == 1 or d == cur:
                result[offset + i] = d
            elif d != 1:
                return None
    return tuple(result)


def _ints(attr_of: AttrOf, name: str) -> list[int] | None:
    value = attr_of(name)
    if value is None:
        return None
    return [int(v) for v in value]  # type: ignore[attr-defined]


def _int(attr_of: AttrOf, name: str, default: int) -> int:
    value = attr_of(name)
    return default if value is None else int(value)  # type: ignore[call-overload]


def _str(attr_of: AttrOf, name: str, default: str) -> str:
    value = attr_of(name)
    if value is None:
        return default
    return value.decode() if isinstance(value, bytes) else str(value)


def _window_out(
    spatial: Dims, kernel: list[int], attr_of: AttrOf, *, ceil_mode: bool = False
) -> Dims | None:
    """Output spatial dims of a conv/pool window (ONNX formulas incl. auto_pad)."""
    rank = len(spatial)
    if len(kernel) != rank:
        return None
    strides = _ints(attr_of, "strides") or [1] * rank
    dilations = _ints(attr_of, "dilations") or [1] * rank
    auto_pad = _str(attr_of, "auto_pad", "NOTSET")
    pads = _ints(attr_of, "pads") or [0] * (2 * rank)
    if len(strides) != rank or len(dilations) != rank or len(pads) != 2 * rank:
        return None
    out: list[int] = []
    for i in range(rank):
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out.append(-(-spatial[i] // strides[i]))
            continue
        extent = dilations[i] * (kernel[i] - 1) + 1
        padded = spatial[i] + (0 if auto_pad == "VALID" else pads[i] + pads[i + rank])
        span = padded - extent
        size = (-(-span // strides[i]) if ceil_mode else span // strides[i]) + 1
        out.append(max(size, 0))
    return tuple(out)


def _infer_output(node: ir.Node, shape_of: ShapeOf, attr_of: AttrOf) -> Dims | None:
    """Shape of output 0 from input shapes, for the common ops (function bodies lack shapes)."""
    if node.domain not in _ONNX_DOMAINS:
        return None
    op = node.op_type
    ins = node.inputs

    def inp(i: int) -> Dims | None:
        return shape_of(ins[i]) if i < len(ins) else None

    if op in _PER_OUTPUT or op in _VARIADIC_OPS or op == "Gelu":
        return _broadcast(shape_of(v) for v in ins if v is not None)
    if (op in _PER_INPUT and op not in _REDUCE_OPS and not op.startswith(("Arg", "Global"))) or (
        op in {"Cast", "CastLike", "Identity", "Dropout", "Hardmax"}
    ):
        return inp(0)
    if op in _MATMUL_LAYOUT:
        return _matmul_shape(inp(_MATMUL_LAYOUT[op][0]), inp(_MATMUL_LAYOUT[op][1]))[0]
    if op == "Gemm":
        mnk = _gemm_mnk(node, inp(0), inp(1), attr_of)
        return None if mnk is None else (mnk[0], mnk[1])
    if op == "Transpose":
        x = inp(0)
        if x is None:
            return None
        perm = _ints(attr_of, "perm") or list(range(len(x)))[::-1]
        if sorted(perm) != list(range(len(x))):
            return None
        return tuple(x[p] for p in perm)
    if op.startswith("Global"):
        x = inp(0)
        return None if x is None or len(x) < 2 else x[:2] + (1,) * (len(x) - 2)
    if op in _REDUCE_OPS or op in ("ArgMax", "ArgMin"):
        return _reduce_shape(node, inp(0), attr_of)
    if op == "Flatten":
        x = inp(0)
        if x is None:
            return None
        axis = _int(attr_of, "axis", 1)
        axis = axis + len(x) if axis < 0 else axis
        return (math.prod(x[:axis]), math.prod(x[axis:]))
    if op in _CONV_LAYOUT:
        xi, wi, _ = _CONV_LAYOUT[op]
        x, w = inp(xi), inp(wi)
        if x is None or w is None or len(x) < 3 or len(w) != len(x):
            return None
        spatial = _window_out(x[2:], list(w[2:]), attr_of)
        return None if spatial is None else (x[0], w[0], *spatial)
    if op in _POOL_OPS:
        x = inp(0)
        kernel = _ints(attr_of, "kernel_shape")
        if x is None or kernel is None or len(x) < 3:
            return None
        ceil_mode = bool(_int(attr_of, "ceil_mode", 0))
        spatial = _window_out(x[2:], kernel, attr_of, ceil_mode=ceil_mode)
        return None if spatial is None else (x[0], x[1], *spatial)
    return None


def _reduce_shape(node: ir.Node, x: Dims | None, attr_of: AttrOf) -> Dims | None:
    if x is None:
        return None
    keepdims = bool(_int(attr_of, "keepdims", 1))
    rank = len(x)
    if node.op_type in ("ArgMax", "ArgMin"):
        axes = [_int(attr_of, "axis", 0)]
    else:
        if len(node.inputs) > 1 and node.inputs[1] is not None:
            return None  # axes given as a tensor: we do not read tensor data
        axes = _ints(attr_of, "axes")
        if not axes:
            if _int(attr_of, "noop_with_empty_axes", 0):
                return x
            axes = list(range(rank))
    norm = {a + rank if a < 0 else a for a in axes}
    if keepdims:
        return tuple(1 if i in norm else d for i, d in enumerate(x))
    return tuple(d for i, d in enumerate(x) if i not in norm)


def _matmul_shape(a: Dims | None, b: Dims | None) -> tuple[Dims | None, int]:
    """(output shape, MACs) of numpy-style matmul; (None, 0) when unknown."""
    if a is None or b is None or not a or not b:
        return None, 0
    a2 = (1, a[0]) if len(a) == 1 else a
    b2 = (b[0], 1) if len(b) == 1 else b
    m, k = a2[-2], a2[-1]
    n = b2[-1]
    batch = _broadcast([a2[:-2], b2[:-2]])
    if batch is None:
        return None, 0
    out = batch + ((m,) if len(a) > 1 else ()) + ((n,) if len(b) > 1 else ())
    return out, math.prod(batch) * m * n * k


def _gemm_mnk(
    node: ir.Node, a: Dims | None, b: Dims | None, attr_of: AttrOf
) -> tuple[int, int, int] | None:
    if a is None or b is None or len(a) != 2 or len(b) != 2:
        return None
    m, k = (a[1], a[0]) if _int(attr_of, "transA", 0) else (a[0], a[1])
    n = b[0] if _int(attr_of, "transB", 0) else b[1]
    return m, n, k


def _float(attr_of: AttrOf, name: str, default: float) -> float:
    value = attr_of(name)
    return default if value is None else float(value)  # type: ignore[arg-type]


def _attention_cost(scores: int, d: int, dv: int, extra_per_score: int) -> _Flops:
    """Q.K^T and P.V as MACs; scale (1) and softmax (5) plus ``extra`` per score."""
    macs = scores * (d + dv)
    return _Flops(2 * macs + (6 + extra_per_score) * scores, macs, "ok")


def _attention_flops(node: ir.Node, shape_of: ShapeOf, attr_of: AttrOf) -> _Flops:
    """ONNX Attention (opset 23): Q/K/V either [B, H, L, D] or [B, L, H*D]."""
    ins = node.inputs

    def inp(i: int) -> Dims | None:
        return shape_of(ins[i]) if i < len(ins) and ins[i] is not None else None

    q, k, v = inp(0), inp(1), inp(2)
    if q is None or k is None or v is None or not len(q) == len(k) == len(v):
        return _UNKNOWN
    past = inp(4)
    past_len = past[2] if past is not None and len(past) == 4 else 0
    if len(q) == 4:
        batch, heads, q_len, d = q
        kv_len, dv = k[2], v[3]
    elif len(q) == 3:
        heads, kv_heads = attr_of("q_num_heads"), attr_of("kv_num_heads")
        if not heads or not kv_heads:
            return _UNKNOWN
        heads, kv_heads = int(heads), int(kv_heads)  # type: ignore[call-overload]
        batch, q_len = q[0], q[1]
        d, kv_len, dv = q[2] // heads, k[1], v[2] // kv_heads
    else:
        return _UNKNOWN
    extra = 0
    if (len(ins) > 3 and ins[3] is not None) or _int(attr_of, "is_causal", 0):
        extra += 1  # the mask is added (or applied) once per score
    if _float(attr_of, "softcap", 0.0) > 0:
        extra += 3  # softcap * tanh(x / softcap)
    return _attention_cost(batch * heads * q_len * (kv_len + past_len), d, dv, extra)


def _multihead_attention_flops(node: ir.Node, shape_of: ShapeOf, attr_of: AttrOf) -> _Flops:
    """com.microsoft.MultiHeadAttention: query [B, S, H*D]; key/value [B, L, H*D] or
    [B, H, L, D]; or query packed as [B, S, H, 3, D] without key and value."""
    ins = node.inputs

    def inp(i: int) -> Dims | None:
        return shape_of(ins[i]) if i < len(ins) and ins[i] is not None else None

    heads = attr_of("num_heads")
    q = inp(0)
    if not heads or q is None:
        return _UNKNOWN
    heads = int(heads)  # type: ignore[call-overload]
    k, v = inp(1), inp(2)
    if len(q) == 5 and k is None and v is None:  # packed QKV
        batch, q_len, _, _, d = q
        kv_len, dv = q_len, d
        qkv_elements = math.prod(q)
    elif len(q) == 3 and k is not None and v is not None and len(k) == len(v):
        batch, q_len = q[0], q[1]
        d = q[2] // heads
        if len(k) == 3:
            kv_len, dv = k[1], v[2] // heads
        elif len(k) == 4:
            kv_len, dv = k[2], v[3]
        else:
            return _UNKNOWN
        qkv_elements = math.prod(q) + math.prod(k) + math.prod(v)
    else:
        return _UNKNOWN
    past = inp(6)
    past_len = past[2] if past is not None and len(past) == 4 else 0
    extra = 1 if (inp(4) is not None or inp(5) is not None) else 0
    cost = _attention_cost(batch * heads * q_len * (kv_len + past_len), d, dv, extra)
    if inp(3) is not None:  # bias added to Q, K and V
        cost = _Flops(cost.flops + qkv_elements, cost.macs, "ok")
    return cost


def _fused_matmul_flops(node: ir.Node, shape_of: ShapeOf, attr_of: AttrOf) -> _Flops:
    """com.microsoft.FusedMatMul: alpha * op(A) @ op(B), op a transpose of the last two dims."""
    if _int(attr_of, "transBatchA", 0) or _int(attr_of, "transBatchB", 0):
        return _UNKNOWN
    ins = node.inputs
    shapes = [shape_of(v) if v is not None else None for v in ins[:2]]
    if len(shapes) < 2 or shapes[0] is None or shapes[1] is None:
        return _UNKNOWN
    a, b = shapes
    if _int(attr_of, "transA", 0) and len(a) >= 2:
        a = a[:-2] + (a[-1], a[-2])
    if _int(attr_of, "transB", 0) and len(b) >= 2:
        b = b[:-2] + (b[-1], b[-2])
    out, macs = _matmul_shape(a, b)
    if out is None:
        return _UNKNOWN
    scale = math.prod(out) if _float(attr_of, "alpha", 1.0) != 1.0 else 0
    return _Flops(2 * macs + scale, macs, "ok")


def _fused_gemm_flops(node: ir.Node, shape_of: ShapeOf, attr_of: AttrOf) -> _Flops:
    """com.microsoft.FusedGemm: Gemm plus one FLOP per output element for the activation."""
    gemm = _op_flops(node, "Gemm", shape_of, None, attr_of)
    if gemm.status != "ok" or attr_of("activation") is None:
        return gemm
    mnk = _gemm_mnk(node, shape_of(node.inputs[0]), shape_of(node.inputs[1]), attr_of)
    assert mnk is not None  # the Gemm cost above needed it
    return _Flops(gemm.flops + mnk[0] * mnk[1], gemm.macs, "ok")


def _per_element(flops: int, bias_input: int | None = None
                 ) -> Callable[[ir.Node, ShapeOf, AttrOf], _Flops]:
    """A cost of ``flops`` per output element, one more when input ``bias_input`` is given."""

    def cost(node: ir.Node, shape_of: ShapeOf, attr_of: AttrOf) -> _Flops:
        out = shape_of(node.outputs[0]) if node.outputs else None
        if out is None:
            out = _broadcast(shape_of(v) for v in node.inputs if v is not None)
        if out is None:
            return _UNKNOWN
        ins = node.inputs
        extra = int(bias_input is not None and len(ins) > bias_input
                    and ins[bias_input] is not None)
        return _Flops((flops + extra) * math.prod(out), 0, "ok")

    return cost


# com.microsoft ops with a cost of their own (not just an ONNX equivalent).
_CONTRIB_FLOPS: dict[str, Callable[[ir.Node, ShapeOf, AttrOf], _Flops]] = {
    "MultiHeadAttention": _multihead_attention_flops,
    "FusedMatMul": _fused_matmul_flops,
    "FusedGemm": _fused_gemm_flops,
    "Gelu": _per_element(_GELU_FLOPS["none"]),
    "BiasGelu": _per_element(_GELU_FLOPS["none"] + 1),
    "FastGelu": _per_element(_GELU_FLOPS["tanh"], bias_input=1),
    "QuickGelu": _per_element(3),
}


def _op_flops(
    node: ir.Node,
    op: str,
    shape_of: ShapeOf,
    call_attrs: Mapping[str, ir.Attr] | None,
    attr_of: AttrOf | None = None,
) -> _Flops:
    """FLOPs of an ONNX-domain op (``op`` may be an ONNX equivalent of a contrib op)."""
    # Hot path first: most nodes are elementwise, so avoid building helpers for them.
    if op in _ZERO_FLOP_OPS:
        return _ZERO
    ins = node.inputs
    if op in _PER_INPUT:
        x = shape_of(ins[0]) if ins else None
        return _UNKNOWN if x is None else _Flops(_PER_INPUT[op] * math.prod(x), 0, "ok")
    outs = node.outputs
    if op in _PER_OUTPUT and outs:
        out = shape_of(outs[0])
        if out is not None:
            return _Flops(_PER_OUTPUT[op] * math.prod(out), 0, "ok")
    if attr_of is None:
        attr_of = _attr_getter(node, call_attrs)

    def out0() -> Dims | None:
        shape = shape_of(node.outputs[0]) if node.outputs else None
        return shape if shape is not None else _infer_output(node, shape_of, attr_of)

    if op in _PER_OUTPUT:
        out = out0()
        return _UNKNOWN if out is None else _Flops(_PER_OUTPUT[op] * math.prod(out), 0, "ok")
    if op == "Gelu":
        out = out0()
        per = _GELU_FLOPS.get(_str(attr_of, "approximate", "none"), _GELU_FLOPS["none"])
        return _UNKNOWN if out is None else _Flops(per * math.prod(out), 0, "ok")
    if op in _VARIADIC_OPS:
        out = out0()
        if out is None:
            return _UNKNOWN
        k = sum(1 for v in ins if v is not None)
        per = k if op == "Mean" else max(k - 1, 1)
        return _Flops(per * math.prod(out), 0, "ok")

    def inp(i: int) -> Dims | None:
        return shape_of(ins[i]) if i < len(ins) and ins[i] is not None else None

    def present(i: int) -> bool:
        return i < len(ins) and ins[i] is not None

    if op in _CONV_LAYOUT:
        xi, wi, bi = _CONV_LAYOUT[op]
        w = inp(wi)
        out = out0()
        if w is None or out is None or len(w) < 2:
            return _UNKNOWN
        macs = math.prod(out) * w[1] * math.prod(w[2:])
        bias = math.prod(out) if bi is not None and present(bi) else 0
        return _Flops(2 * macs + bias, macs, "ok")
    if op == "ConvTranspose":
        x, w = inp(0), inp(1)
        if x is None or w is None or len(w) < 2:
            return _UNKNOWN
        macs = math.prod(x) * w[1] * math.prod(w[2:])
        bias = 0
        if present(2):
            out = shape_of(node.outputs[0])
            if out is None:
                return _UNKNOWN
            bias = math.prod(out)
        return _Flops(2 * macs + bias, macs, "ok")
    if op in _MATMUL_LAYOUT:
        ai, bi = _MATMUL_LAYOUT[op]
        out, macs = _matmul_shape(inp(ai), inp(bi))
        return _UNKNOWN if out is None else _Flops(2 * macs, macs, "ok")
    if op == "Gemm":
        mnk = _gemm_mnk(node, inp(0), inp(1), attr_of)
        if mnk is None:
            return _UNKNOWN
        m, n, k = mnk
        return _Flops(2 * m * n * k + (m * n if present(2) else 0), m * n * k, "ok")
    if op in _POOL_OPS:
        kernel = _ints(attr_of, "kernel_shape")
        out = out0()
        if kernel is None or out is None:
            return _UNKNOWN
        return _Flops(math.prod(out) * math.prod(kernel), 0, "ok")
    if op == "Attention":
        return _attention_flops(node, shape_of, attr_of)
    return _UNCOUNTED


def _attr_getter(node: ir.Node, call_attrs: Mapping[str, ir.Attr] | None = None) -> AttrOf:
    """Attribute lookup that resolves function-body references against the call site."""

    def get(name: str) -> object:
        attr = node.attributes.get(name)
        if attr is None:
            return None
        if attr.is_ref():
            if call_attrs is None:
                return None
            target = call_attrs.get(attr.ref_attr_name)  # type: ignore[arg-type]
            return None if target is None or target.is_ref() else target.value
        return attr.value

    return get


def _flops_of(
    node: ir.Node, shape_of: ShapeOf, ctx: _Ctx, call_attrs: Mapping[str, ir.Attr] | None
) -> _Flops:
    domain, op_type = node.domain, node.op_type
    if ctx.functions:
        function = ctx.functions.get((domain, op_type, node.overload))
        if function is not None:
            return _function_flops(node, function, shape_of, ctx)
    if domain in _ONNX_DOMAINS:
        if _has_subgraph(node):
            return _UNCOUNTED
        return _op_flops(node, op_type, shape_of, call_attrs)
    if domain in _STANDARD_DOMAINS:  # ai.onnx.ml etc.: real ops we do not model
        return _UNCOUNTED
    if domain == "com.microsoft" and op_type in _CONTRIB_FLOPS:
        return _CONTRIB_FLOPS[op_type](node, shape_of, _attr_getter(node, call_attrs))
    if domain == "com.microsoft" and op_type in _CONTRIB_EQUIVALENT:
        return _op_flops(node, _CONTRIB_EQUIVALENT[op_type], shape_of, call_attrs)
    return _elementwise_estimate(node, shape_of)


def _elementwise_estimate(node: ir.Node, shape_of: ShapeOf) -> _Flops:
    total = 0
    for out in node.outputs:
        if out.name == "":
            continue
        shape = shape_of(out)
        if shape is None:
            return _UNKNOWN
        total += math.prod(shape)
    return _Flops(total, 0, "ok")


def _function_flops(node: ir.Node, function: ir.Function, shape_of: ShapeOf, ctx: _Ctx) -> _Flops:
    """Sum of the body's FLOPs, with shapes flowing in from the call site."""
    key: FunctionKey = function.identifier()
    if key in ctx.stack:  # recursive function: give up on the body
        return _elementwise_estimate(node, shape_of)
    in_shapes = tuple(shape_of(v) for v in node.inputs)
    out_shapes = tuple(shape_of(v) for v in node.outputs)
    cache_key = (key, in_shapes, out_shapes) if not node.attributes else None
    if cache_key is not None and cache_key in ctx.fn_cache:
        return ctx.fn_cache[cache_key]

    env: dict[ir.Value, Dims | None] = {}
    for formal, shape in zip(function.inputs, in_shapes, strict=False):
        env[formal] = shape
    for formal, shape in zip(function.outputs, out_shapes, strict=False):
        if shape is not None:
            env[formal] = shape

    def body_shape(value: ir.Value | None) -> Dims | None:
        if value is None:
            return None
        shape = env.get(value)
        return shape if shape is not None else ctx.shape(value)

    fallback = _elementwise_estimate(node, shape_of)
    call_attrs: dict[str, ir.Attr] = dict(function.attributes)
    call_attrs.update(node.attributes)

    flops = macs = 0
    ctx.stack.add(key)
    try:
        for body_node in function:
            if body_node.outputs and body_shape(body_node.outputs[0]) is None:
                attr_of = _attr_getter(body_node, call_attrs)
                env[body_node.outputs[0]] = _infer_output(body_node, body_shape, attr_of)
            if _is_constant_node(body_node):
                continue
            sub = _flops_of(body_node, body_shape, ctx, call_attrs)
            if sub.status == "ok":
                flops += sub.flops
                macs += sub.macs
            else:
                flops += fallback.flops
    finally:
        ctx.stack.discard(key)
    result = _Flops(flops, macs, "ok")
    if cache_key is not None:
        ctx.fn_cache[cache_key] = result
    return result


# ---------------------------------------------------------------------------------------
# Per-node traffic
# ---------------------------------------------------------------------------------------


def _check_dims(dims: Mapping[str, int] | None) -> Mapping[str, int]:
    if dims is None:
        return {}
    for name, value in dims.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise BadInputError(f"dimension {name!r} must be a non-negative integer, got {value!r}")
    return dims


def _check_bindings(dims: Mapping[str, int], named: frozenset[str]) -> Mapping[str, int]:
    """Refuse binding a dim the model computes from others (dynamo's ``s16 + s62``, of its
    inputs' dims or of other bound ones): the traffic model and the generated inputs would
    take the binding, the dims it is made of their own values, and the two may disagree."""
    for name in dims:
        symbols = expression_symbols(  # the name itself is no symbol (``batch.size``)
            ir.SymbolicDim(name), lambda s, name=name: s != name and (s in named or s in dims))
        if symbols is None:
            continue
        if not symbols:
            raise BadInputError(f"dimension {name!r} is a number, not a name to bind")
        raise BadInputError(f"dimension {name!r} is computed from "
                            f"{' and '.join(sorted(symbols))}: bind those instead")
    return dims


def _check_conv_algo(conv_algo: str) -> str:
    if conv_algo not in CONV_ALGOS:
        raise BadInputError(
            f"unknown convolution algorithm {conv_algo!r}; expected one of {', '.join(CONV_ALGOS)}"
        )
    return conv_algo


def _conv_workspace(node: ir.Node, ctx: _Ctx) -> tuple[int, int] | None:
    """(extra bytes read, extra bytes written) of a Conv's work buffer under ``ctx.conv_algo``;
    None when a shape needed for it is unknown."""
    layout = "Conv" if node.op_type == "FusedConv" else node.op_type
    xi, wi, _ = _CONV_LAYOUT[layout]
    ins = node.inputs
    x = ctx.shape(ins[xi]) if xi < len(ins) else None
    w = ctx.shape(ins[wi]) if wi < len(ins) else None
    if x is None or w is None or len(x) < 3 or len(w) != len(x):
        return None
    attr_of = _attr_getter(node)
    kernel = list(w[2:])
    rank = len(kernel)
    strides = _ints(attr_of, "strides") or [1] * rank
    pads = _ints(attr_of, "pads") or [0] * (2 * rank)
    if all(k == 1 for k in kernel) and all(s == 1 for s in strides) and not any(pads):
        return 0, 0  # pointwise (any auto_pad pads a 1x1 window by 0): no buffer needed
    out = ctx.shape(node.outputs[0]) if node.outputs else None
    spatial = out[2:] if out is not None and len(out) == len(x) else None
    if spatial is None:
        spatial = _window_out(x[2:], kernel, attr_of)
    if spatial is None:
        return None
    windows = x[0] * math.prod(spatial) * math.prod(kernel)  # N*OH*OW*KH*KW
    if ctx.conv_algo == "indirect":
        return windows * POINTER_BYTES, 0
    bits = _BITS.get(_dtype(ins[xi]))  # type: ignore[arg-type]
    if bits is None:
        return None
    column = (windows * x[1] * bits + 7) // 8  # every group's buffer: C/group * group = C
    return column, column


def _is_conv(node: ir.Node) -> bool:
    if node.domain in _ONNX_DOMAINS:
        return node.op_type in _CONV_LAYOUT
    return node.domain == "com.microsoft" and node.op_type == "FusedConv"


@dataclass
class _Moved:
    """What a node reads and writes, before its flops are counted."""

    kind: str  # "folded", "view" or "kernel"
    bytes_read: int = 0
    bytes_written: int = 0
    param_bytes: int = 0
    workspace: int = 0
    known: bool = True
    params: list[tuple[ir.Value, int]] = field(default_factory=list)
    function: ir.Function | None = None


def _moved(node: ir.Node, ctx: _Ctx, is_const: Callable[[ir.Value], bool]) -> _Moved:
    op_type, domain = node.op_type, node.domain
    onnx_domain = domain in _ONNX_DOMAINS
    functions = ctx.functions
    function = functions.get((domain, op_type, node.overload)) if functions else None
    foldable = not _has_subgraph(node) and not (onnx_domain and op_type in _NONDETERMINISTIC_OPS)
    if _is_folded(node, is_const, foldable=foldable):
        return _Moved("folded")
    onnx_op = onnx_domain and function is None
    if onnx_op and op_type in _VIEW_OPS:
        return _Moved("view")

    moved = _Moved("kernel", function=function)
    nbytes = ctx.nbytes
    if not (onnx_op and op_type in _METADATA_OPS):
        inputs = node.inputs
        # Most nodes have no repeated input; only deduplicate when they do.
        distinct = (
            dict.fromkeys(inputs) if len(inputs) > 1 and len(set(inputs)) < len(inputs) else inputs
        )
        for value in distinct:
            if value is None:
                continue
            size = nbytes(value)
            if size is None:
                moved.known = False
                continue
            moved.bytes_read += size
            if is_const(value):
                moved.params.append((value, size))
                moved.param_bytes += size

    for out in node.outputs:
        if out.name == "":  # omitted optional output: never produced
            continue
        size = nbytes(out)
        if size is None:
            moved.known = False
            continue
        moved.bytes_written += size

    if ctx.conv_algo != "direct" and function is None and _is_conv(node):
        extra = _conv_workspace(node, ctx)
        if extra is None:
            moved.known = False
        else:
            moved.bytes_read += extra[0]
            moved.bytes_written += extra[1]
            moved.workspace = extra[0] + extra[1]
    return moved


def _measure_node(
    node: ir.Node,
    index: int | None,
    ctx: _Ctx,
    is_const: Callable[[ir.Value], bool],
) -> tuple[NodeTraffic, list[tuple[ir.Value, int]]]:
    op_type, domain = node.op_type, node.domain
    name = node.name or (op_type if index is None else f"{op_type}_{index}")
    moved = _moved(node, ctx, is_const)
    if moved.kind != "kernel":
        skipped = NodeTraffic(name, op_type, domain, 0, 0, 0, 0,
                              is_kernel=moved.kind == "view", known=True)
        return skipped, []

    function = moved.function
    onnx_domain = domain in _ONNX_DOMAINS
    if function is not None:
        cost = _function_flops(node, function, ctx.shape, ctx)
    elif _has_subgraph(node) and onnx_domain:
        cost = _UNCOUNTED
    elif onnx_domain:
        cost = _op_flops(node, op_type, ctx.shape, None)
    else:
        cost = _flops_of(node, ctx.shape, ctx, None)
    status = cost.status
    traffic = NodeTraffic(
        name,
        op_type,
        domain,
        moved.bytes_read,
        moved.bytes_written,
        cost.flops,
        moved.param_bytes,
        True,
        moved.known and status != "unknown",
        cost.macs,
        status != "uncounted",
        moved.workspace,
    )
    return traffic, moved.params


def node_traffic(
    node: ir.Node,
    *,
    dims: Mapping[str, int] | None = None,
    constants: set[ir.Value] | None = None,
    functions: Mapping[FunctionKey, ir.Function] | None = None,
    index: int | None = None,
    conv_algo: str = "direct",
) -> NodeTraffic:
    """Cost of a single node, using only the node and its input/output values.

    Works on nodes detached from any graph (matched nodes about to be replaced, freshly
    built replacements).  ``constants`` says which values are constant; when None,
    initializers that are not graph inputs and Constant-node outputs are.  ``functions``
    is ``model.functions``, needed to recognise and cost function-call nodes.  Unbound
    named symbolic dims count as 1.  An unnamed node is called ``op_type`` (or
    ``f"{op_type}_{index}"`` when ``index`` is given, as :func:`measure` does).
    ``conv_algo`` is ``direct``, ``im2col`` or ``indirect`` (see the module docstring).
    """
    return Meter(dims=dims, functions=functions, conv_algo=conv_algo).node(
        node, constants=constants, index=index)


class Meter:
    """:func:`node_traffic` for many nodes of one model: the rewrite loop costs the matched
    and the new nodes of every application, and what a value's size needs (its shape, its
    symbolic dims) is worked out once per value instead of once per node reading it. A
    value whose shape changes while a meter is in use must be ``forget``-ten."""

    def __init__(
        self,
        *,
        dims: Mapping[str, int] | None = None,
        functions: Mapping[FunctionKey, ir.Function] | None = None,
        conv_algo: str = "direct",
        bound: Mapping[str, Dims] | None = None,
        named: frozenset[str] | None = None,
    ) -> None:
        """``bound`` is :func:`fusectl.boundshapes.bound_shapes` of the model: the static
        shape of a value whose own shape has a dim inference could not name. ``named`` is
        :func:`fusectl.shapeexpr.input_dim_names` of the model: the only dims a dim spelled
        as an expression is evaluated from (None: any)."""
        self._ctx = _Ctx(_check_dims(dims), functions or {}, _check_conv_algo(conv_algo),
                         bound, named)

    def node(self, node: ir.Node, *, constants: set[ir.Value] | None = None,
             index: int | None = None) -> NodeTraffic:
        """See :func:`node_traffic`."""
        is_const = _is_weight if constants is None else constants.__contains__
        return _measure_node(node, index, self._ctx, is_const)[0]

    def bytes(self, node: ir.Node) -> int:
        """``node(node).bytes_total`` without counting flops: what the rewrite loop
        compares for every application."""
        moved = _moved(node, self._ctx, _is_weight)
        return moved.bytes_read + moved.bytes_written

    def forget(self, values: Iterable[ir.Value]) -> None:
        """Drop what was worked out for ``values``: their shapes changed (a reader typed
        after an application)."""
        for value in values:
            self._ctx.shapes.pop(value, None)
            self._ctx.sizes.pop(value, None)


def measure(
    model: ir.Model, *, dims: Mapping[str, int] | None = None, conv_algo: str = "direct",
    bound: Mapping[str, Dims] | None = None,
) -> TrafficReport:
    """Cost every node of the main graph, in graph order.

    Unbound named symbolic dims count as 1 (bind e.g. ``{"batch": 8}`` via ``dims``).
    A value with a dim inference could not name (``unk__N``, behind a Conv of a dynamic
    width) takes its shape from ``bound`` when given
    (:func:`fusectl.boundshapes.bound_shapes`: the model prepared again with its input
    dims bound).
    Subgraphs of If/Loop/Scan are not entered: the control-flow node is costed by its own
    inputs and outputs.  ``conv_algo`` adds the work buffers of im2col or indirect
    convolution.  Linear in graph size; never reads tensor data.
    """
    graph = model.graph
    named = input_dim_names(graph)
    ctx = _Ctx(_check_bindings(_check_dims(dims), named), model.functions,
               _check_conv_algo(conv_algo), bound, named)
    constants = constant_values(graph, legacy_inputs=model.ir_version < _LEGACY_IR_VERSION)
    is_const = constants.__contains__
    results: list[NodeTraffic] = []
    params: dict[ir.Value, int] = {}
    for index, node in enumerate(graph):
        traffic, node_params = _measure_node(node, index, ctx, is_const)
        results.append(traffic)
        for value, size in node_params:
            params[value] = size
    return TrafficReport(nodes=tuple(results), distinct_param_bytes=sum(params.values()))
