"""Protobuf wire-level work on whole models, where going through protobuf would copy weights.

Writing: a model's encoding with its big tensors' bytes taken straight from their arrays.
Why: ``ir.to_proto(model).SerializeToString()`` copies every weight twice (array -> proto ->
bytes) before a byte reaches the file; on VGG-19's 548 MB that was 2 of the 3.5 s a save
took, and the copies doubled the peak memory. Here the big initializers of the main graph
stand in as hollow tensors (16 placeholder bytes) while the proto is built and serialized;
the placeholders are then spliced out and the arrays' own buffers written in their place,
with the three length prefixes they change (raw_data, the TensorProto entry, the graph)
recomputed. The result is byte for byte what ``SerializeToString`` gives: protobuf writes
fields in field-number order, and nothing else about the message moves.

Reading: the model's bytes with big initializers' data cut out, for onnx's shape inference,
which needs their types but would otherwise copy a BERT's weights four times (serialize,
parse in C++, serialize back, parse in Python).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

__all__ = ["STREAM_MIN_BYTES", "Encoding", "encode_model", "without_weights"]

#: Initializers at least this big are written from their buffers; smaller ones are not
#: worth a splice.
STREAM_MIN_BYTES = 64 * 1024

_RAW_DATA_TAG = b"\x4a"  # TensorProto.raw_data: field 9, length-delimited
_INITIALIZER_TAG = b"\x2a"  # GraphProto.initializer: field 5, length-delimited
_GRAPH_TAG = b"\x3a"  # ModelProto.graph: field 7, length-delimited
_MODEL_FIELDS_BEFORE_GRAPH = ("ir_version", "producer_name", "producer_version", "domain",
                              "model_version", "doc_string")


class Encoding:
    """The file's bytes as pieces (serialized proto parts and tensor buffers), in order."""

    def __init__(self, pieces: Sequence[bytes | memoryview]) -> None:
        self.pieces = list(pieces)

    @property
    def size(self) -> int:
        return sum(len(p) for p in self.pieces)

    def write(self, f: Any) -> None:
        for piece in self.pieces:
            f.write(piece)

    def tobytes(self) -> bytes:
        return b"".join(self.pieces)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _payload(tensor: Any) -> bytes | memoryview | None:
    """The bytes ``raw_data`` would hold, without a copy where the tensor is a plain
    little-endian array; None for tensors serde must write itself (strings, proto tensors
    kept as typed fields)."""
    dtype = tensor.dtype
    if dtype == ir.DataType.STRING or isinstance(tensor, ir.StringTensor):
        return None
    if isinstance(tensor, ir.serde.TensorProtoTensor):
        proto = tensor.raw
        if not proto.HasField("raw_data") or proto.HasField("segment") \
                or proto.data_location == onnx.TensorProto.EXTERNAL:
            return None
        return proto.raw_data
    if isinstance(tensor, ir.ExternalTensor):
        return None  # written as a reference; the caller inlines what must be inline
    raw = getattr(tensor, "raw", None)
    if (isinstance(raw, np.ndarray) and sys.byteorder == "little"
            and dtype.bitwidth in (8, 16, 32, 64, 128) and raw.dtype.itemsize * 8 == dtype.bitwidth
            and raw.dtype.byteorder in ("=", "|", "<")):
        return memoryview(np.ascontiguousarray(raw).reshape(-1).view(np.uint8))
    return tensor.tobytes()


class _Hollow:
    """Stands in for a big tensor while the proto is built: serde writes ``placeholder`` as
    its raw_data, and everything else (name, type, dims, doc, metadata) as the tensor's."""

    def __init__(self, tensor: Any, placeholder: bytes) -> None:
        self.name = tensor.name
        self.doc_string = tensor.doc_string
        self.dtype = tensor.dtype
        self.shape = tensor.shape
        self.metadata_props = tensor.metadata_props
        self.meta = getattr(tensor, "meta", None)
        self._placeholder = placeholder

    @property
    def nbytes(self) -> int:
        return len(self._placeholder)

    def tobytes(self) -> bytes:
        return self._placeholder


def _graph_prefix_at(model_proto: onnx.ModelProto) -> int:
    """Offset of the graph field's tag in the serialized model: after fields 1-6."""
    head = onnx.ModelProto()
    for field in _MODEL_FIELDS_BEFORE_GRAPH:
        if model_proto.HasField(field):
            setattr(head, field, getattr(model_proto, field))
    return head.ByteSize()


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7


def _splice(serialized: bytes, model_proto: onnx.ModelProto,
            streamed: list[tuple[str, bytes, bytes | memoryview]]) -> list[bytes | memoryview]:
    """Replace each placeholder by its payload and fix the three length prefixes around it.

    ``streamed``: (initializer name, placeholder, payload) in initializer order. Raises
    ValueError when the bytes are not laid out as expected (the caller falls back)."""
    graph_at = _graph_prefix_at(model_proto)
    if serialized[graph_at:graph_at + 1] != _GRAPH_TAG:
        raise ValueError("graph field not where expected")
    graph_len, graph_start = _read_varint(serialized, graph_at + 1)
    protos = {t.name: t for t in model_proto.graph.initializer}
    view = memoryview(serialized)  # slices of it are not copies
    pieces: list[bytes | memoryview] = [view[:graph_at]]
    body: list[bytes | memoryview] = []
    cursor = graph_start
    growth = 0
    for name, placeholder, payload in streamed:
        hollow = protos[name].SerializeToString()
        raw_field = _RAW_DATA_TAG + _varint(len(placeholder)) + placeholder
        inside = hollow.find(raw_field)
        found = serialized.find(placeholder, cursor)
        entry = _INITIALIZER_TAG + _varint(len(hollow))
        start = found - len(raw_field) + len(placeholder) - inside  # the tensor's first byte
        if inside < 0 or found < 0 or serialized[start - len(entry):start] != entry \
                or serialized[start:start + len(hollow)] != hollow:
            raise ValueError(f"initializer {name!r} not where expected")
        new_len = len(hollow) - len(raw_field) + len(_RAW_DATA_TAG) \
            + len(_varint(len(payload))) + len(payload)
        new_entry = _INITIALIZER_TAG + _varint(new_len)
        body += [view[cursor:start - len(entry)], new_entry,
                 hollow[:inside], _RAW_DATA_TAG + _varint(len(payload)), payload,
                 hollow[inside + len(raw_field):]]
        growth += len(new_entry) + new_len - len(entry) - len(hollow)
        cursor = start + len(hollow)
    graph_end = graph_start + graph_len
    if cursor > graph_end:
        raise ValueError("initializers past the graph's end")
    body.append(view[cursor:graph_end])
    pieces += [_GRAPH_TAG + _varint(graph_len + growth), *body, view[graph_end:]]
    return [p for p in pieces if len(p)]


def encode_model(model: ir.Model, min_bytes: int = STREAM_MIN_BYTES) -> Encoding:
    """The serialized model, big main-graph initializers written from their buffers.

    ``model`` is left as it was (its tensors are swapped back even on failure)."""
    token = os.urandom(12)
    streamed: list[tuple[ir.Value, Any, bytes, bytes | memoryview]] = []
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is None or tensor.nbytes < min_bytes:
            continue
        payload = _payload(tensor)
        if payload is not None:
            placeholder = token + len(streamed).to_bytes(4, "little")
            streamed.append((value, tensor, placeholder, payload))
    if not streamed:
        return Encoding([ir.to_proto(model).SerializeToString()])
    try:
        for value, tensor, placeholder, _ in streamed:
            value.const_value = _Hollow(tensor, placeholder)  # type: ignore[assignment]
        proto = ir.to_proto(model)
    finally:
        for value, tensor, _, _ in streamed:
            value.const_value = tensor
    serialized = proto.SerializeToString()
    try:
        pieces = _splice(serialized, proto,
                         [(v.name, ph, payload) for v, _, ph, payload in streamed])
    except ValueError:
        return Encoding([ir.to_proto(model).SerializeToString()])  # the plain way
    return Encoding(pieces)


def _fields(data: bytes | memoryview, start: int, end: int
            ) -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, entry start, payload start, entry end) of each field of the
    message in ``data[start:end]``; raises ValueError on what no ONNX proto holds."""
    at = start
    while at < end:
        tag, payload = _read_varint(data, at)
        wire = tag & 7
        if wire == 0:
            _, stop = _read_varint(data, payload)
        elif wire == 1:
            stop = payload + 8
        elif wire == 2:
            length, payload = _read_varint(data, payload)
            stop = payload + length
        elif wire == 5:
            stop = payload + 4
        else:
            raise ValueError(f"wire type {wire}")
        if stop > end:
            raise ValueError("field runs past its message")
        yield tag >> 3, wire, at, payload, stop
        at = stop


def _hollow_tensor(data: memoryview, start: int, end: int) -> bytes | None:
    """The TensorProto in ``data[start:end]`` with an empty raw_data, or None if it has
    no raw_data."""
    parts: list[bytes | memoryview] = []
    found = False
    for field, wire, entry, _, stop in _fields(data, start, end):
        if field == 9 and wire == 2:
            parts.append(_RAW_DATA_TAG + b"\x00")
            found = True
        else:
            parts.append(data[entry:stop])
    return b"".join(parts) if found else None


def without_weights(data: bytes, min_bytes: int = STREAM_MIN_BYTES) -> bytes | None:
    """``data`` (a serialized ModelProto) with the raw_data of every main-graph initializer
    of at least ``min_bytes`` emptied, or None when there is none or the bytes are not a
    well-formed model. Shape inference reads such a model as it reads the real one; data
    propagation only ever needs small (shape) initializers."""
    view = memoryview(data)
    try:
        model_parts: list[bytes | memoryview] = []
        stripped = False
        for field, wire, entry, payload, stop in _fields(view, 0, len(data)):
            if field != 7 or wire != 2:
                model_parts.append(view[entry:stop])
                continue
            graph_parts: list[bytes | memoryview] = []
            hollowed = False
            for g_field, g_wire, g_entry, g_payload, g_stop in _fields(view, payload, stop):
                hollow = None
                if g_field == 5 and g_wire == 2 and g_stop - g_payload >= min_bytes:
                    hollow = _hollow_tensor(view, g_payload, g_stop)
                if hollow is None:
                    graph_parts.append(view[g_entry:g_stop])
                else:
                    graph_parts += [_INITIALIZER_TAG + _varint(len(hollow)), hollow]
                    hollowed = True
            if not hollowed:  # no copy of a graph whose weights are elsewhere (Constants)
                model_parts.append(view[entry:stop])
                continue
            stripped = True
            graph = b"".join(graph_parts)
            model_parts += [_GRAPH_TAG + _varint(len(graph)), graph]
    except (ValueError, IndexError):
        return None
    return b"".join(model_parts) if stripped else None
