"""Merge initializers that hold the same tensor, so that equal computations become equal nodes.

Exporters and the constant folder leave one initializer per use: two Conv+Relu branches reading
one input with equal weights (the onnx wheel's light models fill weights with ConstantOfShape)
are two computations only because their weights have two names. Once the weights are one value,
common-subexpression elimination merges the branches (onnx-simplifier does the same).

onnx-ir's ``DeduplicateHashedInitializersPass`` is close but reads every weight in full (a
model with external data is paged in entirely), copies both tensors to compare them, sizes its
limit in elements and logs a warning per overridable initializer. Here a tensor is read in
full only when its dtype, shape and first and last bytes equal another's, and compared in
chunks without copies.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from collections.abc import Iterable

import numpy as np
import onnx
import onnx_ir as ir

from .irdata import plain

MAX_BYTES = 256 << 20
"""Tensors larger than this are never compared. Merging a pair reads both tensors twice
(hash, then byte comparison): at the ~0.8 GB/s hashing measured on the reference machine this
bounds a merge at about a second. Larger tensors are embedding tables and LM heads, rarely
stored twice, and on external data every read goes through the page cache."""

SAMPLE_BYTES = 4096
"""Bytes read from each end of a tensor before hashing it: trained weights of the same shape
(every layer of a transformer) already differ there, so they are never read in full."""

_COMPARE_CHUNK = 1 << 22


def merge_equal_initializers(graph: ir.Graph, *, max_bytes: int = MAX_BYTES) -> int:
    """Point every use of an initializer at the first earlier one equal in dtype, shape and
    bytes, and drop it; return how many were dropped.

    Graph inputs (overridable defaults) and graph outputs keep their identity. Time is linear
    in the initializers' bytes; a tensor is hashed at most once and byte-compared only with
    those of equal hash.
    """
    by_layout: dict[tuple[object, ...], list[ir.Value]] = defaultdict(list)
    small: dict[tuple[object, ...], list[ir.Value]] = defaultdict(list)
    small_limit = min(2 * SAMPLE_BYTES, max_bytes + 1)
    initializers = graph.initializers
    for value in plain(initializers).values():
        tensor = value.const_value
        if tensor is None or value.is_graph_input() or value.is_graph_output():
            continue
        key = _small_key(tensor, small_limit)
        if key is not None:  # the whole content is the key: no sampling, no hashing
            small[key].append(value)
            continue
        if tensor.nbytes > max_bytes:
            continue
        by_layout[(tensor.dtype, tuple(tensor.shape))].append(value)

    merged = 0
    for values in _groups_of_two_or_more(small.values()):
        merged += _merge_into_first(graph, values)
    for values in _groups_of_two_or_more(by_layout.values()):
        by_sample: dict[bytes, list[ir.Value]] = defaultdict(list)
        for value in values:
            by_sample[_sample(_content(value))].append(value)
        for same in _groups_of_two_or_more(by_sample.values()):
            merged += _merge_identical(graph, same)
    return merged


def _merge_identical(graph: ir.Graph, values: list[ir.Value]) -> int:
    """Merge the values whose contents are equal byte for byte (hash first, then compare)."""
    kept: dict[bytes, list[ir.Value]] = defaultdict(list)
    merged = 0
    for value in values:
        data = _content(value)
        bucket = kept[hashlib.sha256(data).digest()]
        twin = next((k for k in bucket if _same_bytes(_content(k), data)), None)
        if twin is None:
            bucket.append(value)
            continue
        value.replace_all_uses_with(twin)
        assert value.name is not None  # initializers are named
        graph.initializers.pop(value.name)
        merged += 1
    return merged


def _small_key(tensor: ir.TensorProtocol, limit: int) -> tuple[object, ...] | None:
    """(dtype code, shape, bytes) of a numeric tensor in memory below ``limit`` bytes, or None.
    Most initializers are small (norm scales, biases, shape constants): they are keyed by
    their bytes directly, a hundredth of the cost of hashing. The dtype is a plain int:
    hashing an enum member is a Python call.

    A tensor straight from the file is read from its proto (dims, data type and raw bytes
    as stored, which is what ``tobytes`` returns for them): a 100k-node graph has 166k
    such tensors, and building a Shape per tensor was most of this function's time."""
    if type(tensor) is ir.serde.TensorProtoTensor:
        proto = tensor.raw
        if proto.HasField("raw_data") and proto.data_location != onnx.TensorProto.EXTERNAL:
            sized = _sized_dtype(proto.data_type)
            if sized is None:
                return None
            dtype, itemsize = sized
            if dtype not in _VALIDATED_ON_READ:
                shape = tuple(proto.dims)
                if math.prod(shape) * itemsize >= limit:
                    return None
                return proto.data_type, shape, proto.raw_data
    elif isinstance(tensor, ir.ExternalTensor):
        return None
    sized = _sized_dtype(tensor.dtype)
    if sized is None:
        return None
    dtype, itemsize = sized
    shape = tuple(tensor.shape)
    if math.prod(shape) * itemsize >= limit:
        return None
    return int(dtype), shape, tensor.tobytes()


_VALIDATED_ON_READ = frozenset({ir.DataType.FLOAT6E2M3, ir.DataType.FLOAT6E3M2})
"""Packed types whose ``tobytes`` checks the packing (and raises on a bad one)."""

_SIZED: dict[int, tuple[ir.DataType, float] | None] = {}


def _sized_dtype(code: int) -> tuple[ir.DataType, float] | None:
    """The DataType of ``code`` and its size in bytes, or None for strings (compared framed,
    not by their bytes). Raises as ``ir.DataType`` and ``DataType.itemsize`` do for codes
    without a size."""
    if code not in _SIZED:
        dtype = ir.DataType(code)
        itemsize = None if dtype == ir.DataType.STRING else dtype.itemsize
        _SIZED[code] = None if itemsize is None else (dtype, itemsize)
    return _SIZED[code]


def _merge_into_first(graph: ir.Graph, values: list[ir.Value]) -> int:
    """Values known equal (same dtype, shape and bytes): all uses go to the first."""
    first = values[0]
    for value in values[1:]:
        value.replace_all_uses_with(first)
        assert value.name is not None  # initializers are named
        graph.initializers.pop(value.name)
    return len(values) - 1


def _groups_of_two_or_more(groups: Iterable[list[ir.Value]]) -> Iterable[list[ir.Value]]:
    return (group for group in groups if len(group) > 1)


def _content(value: ir.Value) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array, without a copy where numpy allows it."""
    tensor = value.const_value
    assert tensor is not None
    if tensor.dtype == ir.DataType.STRING:
        strings = tensor.string_data()  # type: ignore[attr-defined]
        framed = b"".join(len(s).to_bytes(8, "little") + s for s in strings)
        return np.frombuffer(framed, dtype=np.uint8)
    array = np.ascontiguousarray(tensor.numpy())
    return array.reshape(-1).view(np.uint8)


def _sample(data: np.ndarray) -> bytes:
    if data.size <= 2 * SAMPLE_BYTES:
        return data.tobytes()
    return data[:SAMPLE_BYTES].tobytes() + data[-SAMPLE_BYTES:].tobytes()


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Chunked, so that comparing two large tensors never allocates a tensor-sized mask."""
    if a.size != b.size:
        return False
    return all(np.array_equal(a[i:i + _COMPARE_CHUNK], b[i:i + _COMPARE_CHUNK])
               for i in range(0, a.size, _COMPARE_CHUNK))


MAX_TWIN_READERS = 64
"""Readers of a new node's input searched for a twin; past this (a scalar shared across the
model) the node is left to the final common-subexpression pass."""

_RANDOM_OPS = frozenset({"RandomUniform", "RandomNormal", "RandomUniformLike",
                         "RandomNormalLike", "Multinomial", "Bernoulli", "Dropout"})


def merge_twins(graph: ir.Graph, nodes: Iterable[ir.Node]) -> list[ir.Value]:
    """Merge each of ``nodes`` into an existing node computing the same thing (same op,
    attributes and inputs, equal small constants counting as the same input); return the
    values whose readers changed.

    A rule applied twice makes twins where one node was read twice: the rotary tables that a
    query and a key fusion each slice. Until they are one node, a pattern through the shared
    value sees two readers and cannot remove it; the final common-subexpression pass comes
    too late for the rules. Graph order may be broken (the twin kept can sit after the
    readers it gains); the rewrite loop sorts the graph when it ends."""
    changed: list[ir.Value] = []
    for node in nodes:
        if node.graph is not graph:
            continue
        twin = _twin(node)
        if twin is None:
            continue
        changed += [v for v in node.inputs if v is not None]
        changed += twin.outputs
        ir.convenience.replace_all_uses_with(node.outputs, twin.outputs)
        graph.remove(node, safe=True)
    return changed


def _twin(node: ir.Node) -> ir.Node | None:
    """Another node of the same graph computing what ``node`` computes, or None."""
    if node.op_type in _RANDOM_OPS or any(v.is_graph_output() for v in node.outputs):
        return None
    key = _attribute_key(node)
    if key is None:
        return None
    computed = [v for v in node.inputs if v is not None and v.const_value is None]
    if not computed:
        return None  # constant folding's business
    anchor = min(computed, key=lambda v: len(v.uses()))
    readers = anchor.uses()
    if len(readers) > MAX_TWIN_READERS:
        return None
    for use in readers:
        other = use.node
        if (other is node or other.graph is not node.graph or other.op_type != node.op_type
                or other.domain != node.domain or other.overload != node.overload
                or len(other.inputs) != len(node.inputs)
                or len(other.outputs) != len(node.outputs)):
            continue
        if all(_same_input(a, b) for a, b in zip(node.inputs, other.inputs, strict=True)) \
                and _attribute_key(other) == key:
            return other
    return None


def _same_input(a: ir.Value | None, b: ir.Value | None) -> bool:
    if a is b:
        return True
    if a is None or b is None or a.is_graph_input() or b.is_graph_input():
        return False
    ta, tb = a.const_value, b.const_value
    if ta is None or tb is None:
        return False
    key = _small_key(ta, SAMPLE_BYTES)
    return key is not None and key == _small_key(tb, SAMPLE_BYTES)


def _attribute_key(node: ir.Node) -> tuple[object, ...] | None:
    """The node's attributes as a comparable tuple; None for a subgraph or a large tensor."""
    items = []
    for name, attr in node.attributes.items():
        if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            return None
        if attr.is_ref():  # a function's attribute, named: equal when the names are
            items.append((name, attr.type, ("ref", attr.ref_attr_name)))
            continue
        value = attr.value
        if attr.type in (ir.AttributeType.INTS, ir.AttributeType.FLOATS,
                         ir.AttributeType.STRINGS):
            value = tuple(value)
        elif attr.type is ir.AttributeType.TENSOR:
            value = _small_key(value, SAMPLE_BYTES)
            if value is None:
                return None
        elif attr.type in (ir.AttributeType.TENSORS, ir.AttributeType.SPARSE_TENSOR,
                           ir.AttributeType.SPARSE_TENSORS, ir.AttributeType.TYPE_PROTO,
                           ir.AttributeType.TYPE_PROTOS):
            return None
        items.append((name, attr.type, value))
    return tuple(sorted(items, key=lambda item: item[0]))
