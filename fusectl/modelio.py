"""Load and save ONNX models through onnx-ir, defensively.

Why this module exists: a model file is untrusted input. Loading must turn every way it
can be broken (missing, empty, not protobuf, missing or escaping external data) into one
``BadInputError`` line instead of a traceback, and must never read a file outside the
model's folder. Saving must never leave a half-written model behind, must keep large
weights streaming from disk (onnx-ir memory-maps external tensors), and must never
clobber the input unless the caller asked for an in-place rewrite.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import re
import shutil
import stat
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import onnx
import onnx.version_converter
import onnx_ir as ir
from google.protobuf.message import EncodeError

from fusectl.errors import BadInputError, InternalError
from fusectl.protowire import Encoding, encode_model, without_weights
from fusectl.repair import repair_for_checker
from fusectl.shapes import infer_proto_shapes, merge_inferred_shapes, prefer_computed_dims
from fusectl.targets import set_aside_onnxruntime_ops

__all__ = [
    "BACKUP_SUFFIX",
    "EXTERNAL_DATA_AUTO_BYTES",
    "EXTERNAL_TENSOR_MIN_BYTES",
    "Signature",
    "ValueSignature",
    "backup_model",
    "from_proto",
    "load_model",
    "model_summary",
    "restore_signature",
    "save_model",
    "snapshot_signature",
    "upgrade_opset",
]

#: Above this many initializer bytes a model is saved with external data by default.
#: 1.8 GiB leaves headroom under protobuf's hard 2 GiB message limit for the graph itself.
EXTERNAL_DATA_AUTO_BYTES = int(1.8 * 1024**3)
#: When saving with external data, tensors smaller than this stay inline: tiny shape and
#: scalar constants are cheaper in the proto than as a seek into the data file.
EXTERNAL_TENSOR_MIN_BYTES = 1024
#: Protobuf refuses to serialize messages of 2 GiB or more.
_PROTOBUF_LIMIT_BYTES = 2**31 - 1

# Non-serialized markers stored in ``model.meta`` by load_model.
_META_HAD_EXTERNAL = "fusectl.modelio.had_external_data"
_META_SOURCE_DATA_FILES = "fusectl.modelio.source_data_files"
_META_DECLARED_DIMS = "fusectl.modelio.declared_dims"
META_INPUT_REPAIRS = "fusectl.modelio.input_repairs"
"""What ``load_model`` repaired in the input (``fusectl.repair``), as notes for the report."""

_DRIVE_RE = re.compile(r"^[A-Za-z]:")
_OUTSIDE = "refusing to read outside the model's folder"


# --------------------------------------------------------------------------- helpers


def _one_line(text: object, limit: int = 300) -> str:
    """Collapse an arbitrary exception text to one short line (the CLI prints one line)."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of a ``raise ... from`` chain: the one naming the problem."""
    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    return exc


def _bad(path: str | os.PathLike[str], message: str) -> BadInputError:
    """Build the user-facing error: always ``<path>: <what is wrong>`` on one line."""
    return BadInputError(_one_line(f"{os.fspath(path)}: {message}", limit=600))


def _graph_like_nodes_subgraphs(node: ir.Node) -> Iterator[ir.Graph]:
    for attr in node.attributes.values():
        if attr.is_ref() or attr.value is None:
            continue
        if attr.type == ir.AttributeType.GRAPH:
            yield attr.value
        elif attr.type == ir.AttributeType.GRAPHS:
            yield from attr.value


def _iter_graph_likes(model: ir.Model) -> Iterator[ir.Graph | ir.Function]:
    """Main graph, every nested subgraph (depth-first, in node order), then functions.

    ``model.graphs()`` skips functions and their subgraphs; external data and base
    directories have to be handled there too.
    """

    def walk(g: ir.Graph | ir.Function) -> Iterator[ir.Graph | ir.Function]:
        yield g
        for node in g:
            for sub in _graph_like_nodes_subgraphs(node):
                yield from walk(sub)

    yield from walk(model.graph)
    for func in model.functions.values():
        yield from walk(func)


def _initializer_values(model: ir.Model) -> list[ir.Value]:
    """All initializers of all graphs, main graph first, in declaration order."""
    values: list[ir.Value] = []
    for g in _iter_graph_likes(model):
        if isinstance(g, ir.Graph):
            values.extend(g.initializers.values())
    return values


def _tensor_attrs(model: ir.Model) -> Iterator[tuple[ir.Node, str, ir.Attr]]:
    """Every (node, name, attr) holding a TENSOR/TENSORS value, subgraphs and functions too."""
    for g in _iter_graph_likes(model):
        for node in g:
            for name, attr in list(node.attributes.items()):
                if attr.is_ref() or attr.value is None:
                    continue
                if attr.type in (ir.AttributeType.TENSOR, ir.AttributeType.TENSORS):
                    yield node, name, attr


@dataclass(frozen=True)
class _Contents:
    """The initializers and tensor attributes of every graph, found once per save: saving a
    100k-node model walked the graphs five times for them."""

    initializers: list[ir.Value]
    tensor_attrs: list[tuple[ir.Node, str, ir.Attr]]

    @classmethod
    def of(cls, model: ir.Model) -> _Contents:
        return cls(_initializer_values(model), list(_tensor_attrs(model)))


def _attr_tensors(attr: ir.Attr) -> tuple[Any, ...]:
    return (attr.value,) if attr.type == ir.AttributeType.TENSOR else tuple(attr.value)


def _nbytes_from_meta(dtype: ir.DataType | None, dims: Any) -> int:
    """Bytes of a tensor from dtype and shape only; never touches the data.

    Strings (variable size) and unknown dims count as 0.
    """
    if dtype is None or dims is None:
        return 0
    try:
        bits = dtype.bitwidth
    except TypeError:  # STRING / UNDEFINED have no fixed width
        return 0
    numel = 1
    for d in dims:
        if not isinstance(d, int):
            return 0
        numel *= d
    return math.ceil(numel * bits / 8)


def _tensor_nbytes(tensor: Any) -> int:
    return _nbytes_from_meta(tensor.dtype, tuple(tensor.shape.dims))


def _value_nbytes(value: ir.Value) -> int:
    if value.const_value is not None:
        return _tensor_nbytes(value.const_value)
    shape = value.shape
    return _nbytes_from_meta(value.dtype, None if shape is None else tuple(shape.dims))


def _to_memory_tensor(tensor: Any) -> ir.Tensor:
    """Copy an external tensor into memory (for small tensors whose file may be replaced)."""
    return ir.Tensor(
        tensor.numpy().copy(),
        dtype=tensor.dtype,
        name=tensor.name,
        doc_string=tensor.doc_string,
        metadata_props=dict(tensor.metadata_props) or None,
    )


def _inline_view(tensor: Any) -> ir.Tensor:
    """Wrap an external tensor so serde writes its bytes inline (mmap-backed, no copy)."""
    return ir.Tensor(
        tensor.numpy(),
        dtype=tensor.dtype,
        name=tensor.name,
        doc_string=tensor.doc_string,
        metadata_props=dict(tensor.metadata_props) or None,
    )


def _same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


# --------------------------------------------------------------------------- loading


def _read_model_bytes(path: Path) -> bytes:
    """Read the model file, refusing non-regular files without blocking on a FIFO."""
    if path.is_dir():  # os.open() on a directory differs across platforms; say it plainly
        raise _bad(path, "is a directory, not an ONNX model file")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise _bad(path, "no such file") from None
    except IsADirectoryError:
        raise _bad(path, "is a directory, not an ONNX model file") from None
    except OSError as e:
        raise _bad(path, f"cannot open: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise _bad(path, "is a directory, not an ONNX model file")
        if not stat.S_ISREG(st.st_mode):
            raise _bad(path, "is not a regular file")
        if st.st_size == 0:
            raise _bad(path, "file is empty, not an ONNX model")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    except OSError as e:
        raise _bad(path, f"cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)


def _parse_model_proto(path: Path, data: bytes) -> onnx.ModelProto:
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception as e:  # DecodeError, or anything protobuf raises on garbage
        raise _bad(
            path, f"not a valid ONNX model (protobuf parse failed: {_one_line(e)})"
        ) from None
    # Protobuf happily "parses" many garbage byte strings into a near-empty message.
    missing = [
        what
        for what, ok in (
            ("ir_version", proto.ir_version > 0),
            ("graph", proto.HasField("graph")),
            ("opset_import", len(proto.opset_import) > 0),
        )
        if not ok
    ]
    if missing:
        raise _bad(
            path,
            f"not a valid ONNX model (no {', no '.join(missing)}; truncated or not an .onnx file?)",
        )
    return proto


def _proto_graph_tensors(g: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from g.initializer
    for sp in g.sparse_initializer:
        yield sp.values
        yield sp.indices
    for node in g.node:
        yield from _proto_node_tensors(node)


def _proto_node_tensors(node: onnx.NodeProto) -> Iterator[onnx.TensorProto]:
    for a in node.attribute:
        if a.HasField("t"):
            yield a.t
        yield from a.tensors
        if a.HasField("sparse_tensor"):
            yield a.sparse_tensor.values
            yield a.sparse_tensor.indices
        for sp in a.sparse_tensors:
            yield sp.values
            yield sp.indices
        if a.HasField("g"):
            yield from _proto_graph_tensors(a.g)
        for sub in a.graphs:
            yield from _proto_graph_tensors(sub)


def _proto_all_tensors(proto: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every TensorProto in the model: graphs, subgraphs, Constant attrs, functions, training."""
    yield from _proto_graph_tensors(proto.graph)
    for func in proto.functions:
        for node in func.node:
            yield from _proto_node_tensors(node)
    for info in proto.training_info:
        yield from _proto_graph_tensors(info.initialization)
        yield from _proto_graph_tensors(info.algorithm)


def _clear_negative_dims(proto: onnx.ModelProto) -> tuple[dict[tuple[str, str], tuple], bool]:
    """Make every negative ``dim_value`` (``-1``: how older exporters such as Paddle2ONNX
    spell a dynamic dim) an unknown dim, in every graph's inputs, outputs and value_info,
    so that shape inference, rules and the traffic model never compute with it. Returns the
    main graph's inputs and outputs that had one, as declared, keyed by ("inputs"|"outputs",
    name): the saved model declares them as the user's did; and whether any dim anywhere
    was cleared (the proto's bytes then differ from the file's)."""
    declared: dict[tuple[str, str], tuple] = {}
    cleared = False

    def clear(type_proto: onnx.TypeProto) -> bool:
        nonlocal cleared
        kind = type_proto.WhichOneof("value")
        if kind in ("sequence_type", "optional_type"):
            return clear(getattr(type_proto, kind).elem_type)
        if kind not in ("tensor_type", "sparse_tensor_type"):
            return False
        tensor = getattr(type_proto, kind)
        found = False
        for dim in tensor.shape.dim:
            if dim.HasField("dim_value") and dim.dim_value < 0:
                dim.ClearField("dim_value")
                found = cleared = True
        return found

    def dims_of(info: onnx.ValueInfoProto) -> tuple:
        return tuple(d.dim_value if d.HasField("dim_value") else
                     (d.dim_param if d.HasField("dim_param") else None)
                     for d in info.type.tensor_type.shape.dim)

    def walk(graph: onnx.GraphProto, main: bool) -> None:
        for part, infos in (("inputs", graph.input), ("outputs", graph.output),
                            ("value_info", graph.value_info)):
            for info in infos:
                before = dims_of(info) if main and part != "value_info" else None
                if clear(info.type) and before is not None:
                    declared[(part, info.name)] = before
        walk_subgraphs(graph.node)

    def walk_subgraphs(nodes: Iterable[onnx.NodeProto]) -> None:
        for node in nodes:
            for attr in node.attribute:
                for sub in (*([attr.g] if attr.HasField("g") else []), *attr.graphs):
                    walk(sub, False)

    walk(proto.graph, True)
    for function in proto.functions:
        for info in function.value_info:
            clear(info.type)
        walk_subgraphs(function.node)
    return declared, cleared


def _resolve_location(
    path: Path, base_dir: str, location: str | None, tensor: str
) -> tuple[str, os.stat_result]:
    """Map an external-data location to a real path inside ``base_dir``, or refuse.

    Only path arithmetic, ``realpath`` and ``stat`` are used: a refused file is never opened.
    """
    what = f"external data for tensor {tensor!r}"
    if not location:
        raise _bad(path, f"{what} has no location")
    if "\x00" in location:
        raise _bad(path, f"{what} has an invalid location {location!r}")
    if os.path.isabs(location) or location.startswith(("/", "\\")) or _DRIVE_RE.match(location):
        raise _bad(path, f"{what} uses absolute path {location!r}; {_OUTSIDE}")
    if ".." in re.split(r"[\\/]", location):
        raise _bad(path, f"{what} location {location!r} contains '..'; {_OUTSIDE}")
    real_base = os.path.realpath(base_dir)
    real = os.path.realpath(os.path.join(base_dir, location))
    try:
        inside = os.path.commonpath([real_base, real]) == real_base
    except ValueError:  # different drives on Windows
        inside = False
    if not inside:
        raise _bad(
            path,
            f"{what} location {location!r} resolves to {real}; {_OUTSIDE} "
            "(copy the model and its data into one folder)",
        )
    try:
        st = os.stat(real)
    except FileNotFoundError:
        raise _bad(path, f"{what}: file {location!r} not found beside the model") from None
    except OSError as e:
        raise _bad(path, f"{what}: cannot access {location!r}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _bad(path, f"{what}: {location!r} is not a regular file")
    if st.st_nlink > 1:
        # onnx-ir refuses hard-linked data files when it first touches them; say so now.
        raise _bad(
            path,
            f"{what}: {location!r} has {st.st_nlink} hard links, which onnx-ir refuses "
            "(possible hard-link attack); copy the file instead",
        )
    return real, st


def _check_external_data(path: Path, proto: onnx.ModelProto, base_dir: str) -> set[str]:
    """Validate every external reference before anything is read; return the data files used."""
    resolved: dict[str, tuple[str, os.stat_result]] = {}
    for t in _proto_all_tensors(proto):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        location = info.get("location") or ""
        if location not in resolved:
            resolved[location] = _resolve_location(path, base_dir, location, t.name)
        _, st = resolved[location]
        try:
            offset = int(info.get("offset") or 0)
            length = int(info["length"]) if info.get("length") else None
        except ValueError:
            raise _bad(
                path, f"external data for tensor {t.name!r} has a non-integer offset/length"
            ) from None
        if length is None:
            try:
                dtype = ir.DataType(t.data_type)
            except ValueError:
                dtype = None
            length = _nbytes_from_meta(dtype, tuple(t.dims))
        if offset < 0 or length < 0 or offset + length > st.st_size:
            raise _bad(
                path,
                f"external data for tensor {t.name!r} (offset {offset}, {length} bytes) lies "
                f"beyond the end of {location!r} ({st.st_size} bytes); truncated or wrong file",
            )
    return {real for real, _ in resolved.values()}


@contextlib.contextmanager
def _checker_view(proto: onnx.ModelProto) -> Iterator[None]:
    """Temporarily hide two things onnx's checker gets wrong for us, then restore them.

    * External tensors: given a proto, the checker resolves their files against the current
      directory. Their locations were already checked by ``_check_external_data``, so each
      is shown as an empty inline tensor; the data files are never opened here.
    * Main-graph inputs/outputs without a ``shape`` field (rank unknown): valid for
      onnxruntime, rejected by the checker; they get an empty shape field for the check.
    """
    stashed: list[tuple[onnx.TensorProto, list[int], list[onnx.StringStringEntryProto]]] = []
    shaped: list[onnx.TypeProto.Tensor] = []
    try:
        for t in _proto_all_tensors(proto):
            if t.data_location == onnx.TensorProto.EXTERNAL:
                entries = [onnx.StringStringEntryProto(key=e.key, value=e.value)
                           for e in t.external_data]
                stashed.append((t, list(t.dims), entries))
                del t.dims[:]
                t.dims.append(0)
                del t.external_data[:]
                t.data_location = onnx.TensorProto.DEFAULT
                t.raw_data = b""
        for vi in (*proto.graph.input, *proto.graph.output):
            if vi.type.HasField("tensor_type") and not vi.type.tensor_type.HasField("shape"):
                vi.type.tensor_type.shape.SetInParent()
                shaped.append(vi.type.tensor_type)
        yield
    finally:
        for tensor_type in shaped:
            tensor_type.ClearField("shape")
        for t, dims, entries in stashed:
            t.ClearField("raw_data")
            del t.dims[:]
            t.dims.extend(dims)
            t.external_data.extend(entries)
            t.data_location = onnx.TensorProto.EXTERNAL


MAX_REPAIRS = 4
"""Checker rounds that may end in a repair (each repair is of another kind)."""


def _run_checker(path: Path, proto: onnx.ModelProto, external: bool) -> tuple[str, ...]:
    """onnx's checker (structure, node schemas, opsets, tensor sizes): a model it rejects
    would be rejected by runtimes too, so it is bad input, never something to optimize.
    The two faults onnxruntime itself forgives (``fusectl.repair``) are repaired in
    ``proto`` instead; the notes saying so are returned."""
    notes: list[str] = []
    while True:
        try:
            _check_once(path, proto, external or bool(notes))
            return tuple(notes)
        except BadInputError as e:
            note = None if len(notes) >= MAX_REPAIRS else repair_for_checker(proto, str(e))
            if note is None or note in notes:
                raise
            notes.append(note)


def _check_once(path: Path, proto: onnx.ModelProto, from_proto: bool) -> None:
    """One run of the checker; ``from_proto`` checks ``proto`` rather than the file."""
    newest = onnx.defs.onnx_opset_version()
    for opset in proto.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version > newest:
            raise _bad(path, f"imports ai.onnx opset {opset.version}, but the installed onnx "
                             f"knows opsets up to {newest}; upgrade onnx")
    shapeless = any(vi.type.HasField("tensor_type") and not vi.type.tensor_type.HasField("shape")
                    for vi in (*proto.graph.input, *proto.graph.output))
    checked = set_aside_onnxruntime_ops(proto)  # a model fusectl or onnxruntime optimized
    try:
        if from_proto or shapeless or checked is not proto:
            with _checker_view(checked):  # an external-data proto is small: serializing is cheap
                onnx.checker.check_model(checked)
        else:
            # From the file: C++ holds the only extra copy (serializing ``proto`` makes two).
            onnx.checker.check_model(os.fspath(path))
    except (onnx.checker.ValidationError, ValueError) as e:
        raise _bad(path, f"not a valid ONNX model (onnx checker: {_one_line(e)})") from None


INFER_AT_LOAD_LIMIT = 256 << 20
"""Protos up to this size get onnx's shape inference before onnx-ir sees them."""


def _inferred_shapes(proto: onnx.ModelProto, size: int | None,
                     light: bytes | None = None) -> onnx.ModelProto | None:
    """onnx's shape inference on the proto as parsed: in C++ that costs a microsecond a
    node, where inferring on the IR later costs fifty (onnx-ir serializes the graph first).
    The types are copied onto the IR after deserializing (onnx-ir reads value_info slowly).
    ``light``, the proto's bytes without its big weights (``protowire.without_weights``),
    is inferred instead when given (BERT: 42 -> 1 ms). Bigger protos that still hold their
    weights would be copied twice, so they, and models onnx cannot infer, are left to
    preparation's inference."""
    if light is not None:
        size = len(light)
    if (proto.ByteSize() if size is None else size) > INFER_AT_LOAD_LIMIT:
        return None
    try:
        return infer_proto_shapes(light if light is not None else proto)
    except Exception:  # noqa: BLE001 - inference is an optimisation, never fatal
        return None


def _computed_shapes(proto: onnx.ModelProto, size: int | None,
                     light: bytes | None) -> onnx.ModelProto | None:
    """onnx's inference without the main graph's declared ``value_info``: the shapes the
    model's arithmetic gives, which the declared ones must not contradict
    (:func:`fusectl.shapes.prefer_computed_dims`). None when nothing is declared (most
    models: no second inference) or inference fails."""
    if not proto.graph.value_info:
        return None
    if light is not None:
        bare = onnx.ModelProto.FromString(light)  # no -1 dims (from_proto checked)
        del bare.graph.value_info[:]
        return _inferred_shapes(bare, None)
    declared = onnx.GraphProto()  # set aside, not copied with the weights
    declared.value_info.extend(proto.graph.value_info)
    del proto.graph.value_info[:]
    try:
        return _inferred_shapes(proto, size)
    finally:
        proto.graph.value_info.extend(declared.value_info)


def _set_base_dir(model: ir.Model, base_dir: str) -> None:
    """Point every external tensor (initializers, Constant attrs, functions) at ``base_dir``."""
    for value in _initializer_values(model):
        if isinstance(value.const_value, ir.ExternalTensor):
            value.const_value.base_dir = base_dir
    for _, _, attr in _tensor_attrs(model):
        for tensor in _attr_tensors(attr):
            if isinstance(tensor, ir.ExternalTensor):
                tensor.base_dir = base_dir


def from_proto(proto: onnx.ModelProto, *, size: int | None = None,
               light: bytes | None = None) -> ir.Model:
    """The IR of a checked proto, typed by onnx's inference, ``-1`` dims read as dynamic
    (remembered, so the saved signature declares them again). ``proto`` is modified.
    ``size`` is its serialized size when known (the file's length), else protobuf's;
    ``light``, the bytes it was parsed from without their big weights, when at hand."""
    declared, cleared = _clear_negative_dims(proto)
    light = None if cleared else light  # the light bytes still hold the -1s
    inferred = _inferred_shapes(proto, size, light)
    computed = _computed_shapes(proto, size, light) if inferred is not None else None
    model = ir.serde.deserialize_model(proto)
    if inferred is not None:
        merge_inferred_shapes(model.graph, inferred.graph, keep_signature=True)
    if computed is not None:
        prefer_computed_dims(model.graph, computed.graph)
    if declared:
        model.meta[_META_DECLARED_DIMS] = declared
    return model


_STRIP_MIN_BYTES_PER_ENTRY = 1024


def _entries(proto: onnx.ModelProto) -> int:
    """Fields of the main graph a wire-level walk visits (counting them is free)."""
    g = proto.graph
    return max(1, len(g.node) + len(g.initializer) + len(g.value_info) + len(g.input)
               + len(g.output))


def _if_without_its_outputs(graph: onnx.GraphProto) -> str | None:
    """An If whose branches return another number of values than it has outputs, which
    onnx's checker lets through and onnxruntime refuses (onnxoptimizer's tests build one)."""
    for node in graph.node:
        if node.op_type not in ("If", "Loop", "Scan"):  # (a 100k-node graph: no attribute walk)
            continue
        branches = [a.g for a in node.attribute if a.HasField("g")]
        if node.op_type == "If" and node.domain in ("", "ai.onnx"):
            for branch in branches:
                if len(branch.output) != len(node.output):
                    return (f"If node {node.name or node.output[0]!r} has {len(node.output)} "
                            f"outputs but its branch {branch.name!r} returns "
                            f"{len(branch.output)}")
        for sub in (*branches, *(g for a in node.attribute for g in a.graphs)):
            found = _if_without_its_outputs(sub)
            if found is not None:
                return found
    return None


def _map_typed_value(graph: onnx.GraphProto) -> str | None:
    """The name of a graph input, output or typed value whose type holds a map, if any."""
    for value in (*graph.input, *graph.output, *graph.value_info):
        kind = value.type
        while kind.HasField("sequence_type") or kind.HasField("optional_type"):
            kind = (kind.sequence_type.elem_type if kind.HasField("sequence_type")
                    else kind.optional_type.elem_type)
        if kind.HasField("map_type"):
            return value.name
    return None


def _map_message(graph: onnx.GraphProto, what: str) -> str:
    """Why a model with a map cannot be optimized, and how skl2onnx avoids ZipMap's."""
    zipmap = any(n.op_type == "ZipMap" for n in graph.node)
    hint = ("; export without ZipMap (skl2onnx: options={id(model): {'zipmap': False}})"
            if zipmap else "")
    return (f"{what}, which onnx-ir, the graph library fusectl rewrites with, cannot hold yet"
            + hint)


def load_model(path: str | Path) -> ir.Model:
    """Load an ONNX model, with external weights left lazy (memory-mapped on first use).

    The file is parsed once with external data *not* loaded, every external-data location is
    checked (inside the model's folder, symlinks resolved, file present and long enough)
    before any of it is opened, onnx's checker vets the structure, and the same proto is then
    handed to onnx-ir. Any problem is raised as ``BadInputError("<path>: ...")``.
    """
    p = Path(path)
    data = _read_model_bytes(p)
    proto = _parse_model_proto(p, data)
    size = len(data)  # the proto's size: asking protobuf walks the whole message again
    # For shape inference, which would copy the weights four times; walking the graph's
    # entries in Python only pays when they are few per byte (a 100k-node graph of small
    # tensors: 0.35 s for nothing).
    light = without_weights(data) if size >= _STRIP_MIN_BYTES_PER_ENTRY * _entries(proto) \
        else None
    del data
    base_dir = os.path.dirname(os.path.abspath(p))
    data_files = _check_external_data(p, proto, base_dir)
    repairs = _run_checker(p, proto, external=bool(data_files))
    if repairs:
        light = None  # the bytes as read hold the faults
    branchless = _if_without_its_outputs(proto.graph)
    if branchless is not None:
        raise _bad(p, f"not a valid ONNX model ({branchless})")
    mapped = _map_typed_value(proto.graph)
    if mapped is not None:
        raise _bad(p, _map_message(proto.graph, f"value {mapped!r} is a map"))
    try:
        model = from_proto(proto, size=size, light=light)
    except Exception as e:  # malformed graphs surface here; the user needs one line
        cause = _root_cause(e)  # onnx-ir wraps the real reason in "Error calling ..." layers
        if "Map types are not supported" in str(cause):  # a map typed deeper (a subgraph)
            raise _bad(p, _map_message(proto.graph, "a value is a map")) from None
        raise _bad(p, f"not a valid ONNX model ({_one_line(cause)})") from None
    if data_files:  # walking every tensor of a model without external data finds nothing
        _set_base_dir(model, base_dir)
    model.meta[_META_HAD_EXTERNAL] = bool(data_files)
    model.meta[_META_SOURCE_DATA_FILES] = frozenset(data_files)
    model.meta[META_INPUT_REPAIRS] = repairs
    return model


# --------------------------------------------------------------------------- saving


def _had_external_data(model: ir.Model, initializers: list[ir.Value]) -> bool:
    if model.meta.get(_META_HAD_EXTERNAL):
        return True
    return any(isinstance(v.const_value, ir.ExternalTensor) for v in initializers)


def _check_overwrite(shown: str, targets: list[Path], protect: Path, model: ir.Model) -> None:
    """Refuse to write over the input model or over the external data it reads from."""
    for target in targets:
        if _same_file(target, protect):
            raise _bad(
                shown,
                f"refusing to overwrite the input model {os.fspath(protect)} "
                "(use --in-place to rewrite it)",
            )
        for data_file in model.meta.get(_META_SOURCE_DATA_FILES, ()):
            if _same_file(target, data_file):
                raise _bad(
                    shown,
                    f"writing {target.name} would overwrite the external data file of the "
                    f"input model {os.fspath(protect)}; choose another output name",
                )


def _materialize_external_attrs(tensor_attrs: list[tuple[ir.Node, str, ir.Attr]]) -> None:
    """Inline external tensors held in node attributes (Constant values).

    onnx-ir only re-homes initializers when writing external data; an attribute tensor
    would otherwise keep a location relative to the *input* folder.
    """
    for node, name, attr in tensor_attrs:
        tensors = _attr_tensors(attr)
        if not any(isinstance(t, ir.ExternalTensor) for t in tensors):
            continue
        new = [_to_memory_tensor(t) if isinstance(t, ir.ExternalTensor) else t for t in tensors]
        value = new[0] if attr.type == ir.AttributeType.TENSOR else new
        node.attributes[name] = ir.Attr(name, attr.type, value, doc_string=attr.doc_string)


def _write_encoding(encoding: Encoding, f: Any) -> None:
    """Write the model's bytes into an open binary file (separate so tests can break it)."""
    encoding.write(f)


def _fsync_path(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_dir(path: Path) -> None:
    if os.name == "posix":
        _fsync_path(path)


def _current_umask() -> int:
    """The process umask, read without changing it where the OS allows."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _make_temp(final: Path) -> Path:
    """An empty temp file beside ``final`` with the mode ``final`` should end up with.

    mkstemp creates 0600 files; without this every saved model would be private to its
    owner. An existing destination keeps its mode, a new one gets the umask default.
    """
    fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    try:
        try:
            mode = stat.S_IMODE(os.stat(final).st_mode)
        except OSError:
            mode = 0o666 & ~_current_umask()
        with contextlib.suppress(OSError):
            if hasattr(os, "fchmod"):
                os.fchmod(fd, mode)
            else:
                os.chmod(name, mode)
    finally:
        os.close(fd)
    return Path(name)


def _write_model_file(encoding: Encoding, tmp: Path) -> None:
    with open(tmp, "wb") as f:
        _write_encoding(encoding, f)
        f.flush()
        os.fsync(f.fileno())


def _encode(model: ir.Model, shown: str) -> Encoding:
    """The model's bytes, big weights written from their own buffers (no proto copy)."""
    too_big = "model proto exceeds protobuf's 2 GiB limit; save with external data"
    try:
        encoding = encode_model(model)
    except EncodeError:  # protobuf's own refusal: over 2 GiB outside the initializers
        raise _bad(shown, too_big) from None
    if encoding.size > _PROTOBUF_LIMIT_BYTES:
        raise _bad(shown, too_big)
    return encoding


def _save_inline(model: ir.Model, dest: Path, shown: str, contents: _Contents
                 ) -> list[Path]:
    values = [v for v in contents.initializers if isinstance(v.const_value, ir.ExternalTensor)]
    originals = [v.const_value for v in values]
    tmp: Path | None = None
    try:
        # serde writes ExternalTensors as references; wrap them so the bytes go inline.
        for v, t in zip(values, originals, strict=True):
            v.const_value = _inline_view(t)
        encoding = _encode(model, shown)
        tmp = _make_temp(dest)
        _write_model_file(encoding, tmp)
        del encoding
        os.replace(tmp, dest)
        tmp = None
        _fsync_dir(dest.parent)
    finally:
        for v, t in zip(values, originals, strict=True):
            v.const_value = t
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()
    return [dest]


def _save_external(model: ir.Model, dest: Path, data_dest: Path, shown: str,
                   contents: _Contents) -> list[Path]:
    """Write ``dest`` + ``dest.data`` so that the pair only appears once both are complete.

    Order: stream tensors into a temp data file (old data file untouched, so lazy tensors
    that read from it, even in place, still see the old bytes); serialize the model,
    referencing the FINAL data name, into a temp model file; fsync both; then rename data,
    then model. Any failure before the renames leaves the destination untouched. The two
    renames cannot be one atomic step: a crash exactly between them leaves the new data
    beside the old model file.
    """
    parent = dest.parent
    values = [v for v in contents.initializers if v.const_value is not None]
    originals = {id(v): v.const_value for v in values}
    big = [v for v in values if _tensor_nbytes(v.const_value) >= EXTERNAL_TENSOR_MIN_BYTES]
    big_ids = {id(v) for v in big}
    small_external = [
        v for v in values if id(v) not in big_ids and isinstance(v.const_value, ir.ExternalTensor)
    ]
    data_real = os.path.realpath(data_dest)
    replaced = [
        t
        for t in originals.values()
        if isinstance(t, ir.ExternalTensor) and os.path.realpath(t.path) == data_real
    ]
    tmp_data: Path | None = None
    tmp_model: Path | None = None
    data_swapped = committed = False
    try:
        written: list[Path] = []
        if big:
            tmp_data = _make_temp(data_dest)
            staged = ir.external_data.convert_tensors_to_external(
                [v.const_value for v in big], base_dir=str(parent), relative_path=tmp_data.name
            )
            for v, st in zip(big, staged, strict=True):
                old = originals[id(v)]
                v.const_value = ir.ExternalTensor(
                    data_dest.name,  # the proto must name the FINAL file, not the temp one
                    st.offset,
                    st.length,
                    st.dtype,
                    shape=st.shape,
                    name=st.name,
                    doc_string=old.doc_string,
                    metadata_props=dict(old.metadata_props) or None,
                    base_dir=str(parent),
                )
        for v in small_external:
            v.const_value = _to_memory_tensor(originals[id(v)])
        encoding = _encode(model, shown)
        tmp_model = _make_temp(dest)
        _write_model_file(encoding, tmp_model)
        del encoding
        if tmp_data is not None:
            _fsync_path(tmp_data)
            # Drop mmaps of the data file about to be replaced (Windows cannot replace it).
            for t in replaced:
                with contextlib.suppress(BufferError):
                    t.release()
            os.replace(tmp_data, data_dest)
            tmp_data = None
            data_swapped = True
            written.append(data_dest)
        os.replace(tmp_model, dest)
        tmp_model = None
        committed = True
        _fsync_dir(parent)
        return [dest, *written]
    finally:
        if data_swapped:
            # Old tensors backed by data_dest now read different bytes; the new ones are right.
            for t in replaced:
                t.invalidate()
        elif not committed:
            for v in values:
                v.const_value = originals[id(v)]
        for tmp in (tmp_data, tmp_model):
            if tmp is not None:
                with contextlib.suppress(OSError):
                    tmp.unlink()


def save_model(
    model: ir.Model,
    path: str | Path,
    *,
    external_data: bool | None = None,
    overwrite_protect: Path | None = None,
) -> list[Path]:
    """Atomically write ``model`` to ``path``; return the files written (model first).

    ``external_data=None`` picks external data when initializers exceed
    ``EXTERNAL_DATA_AUTO_BYTES`` or the model was loaded with external data; the data file is
    ``<file name>.data`` beside the model and only tensors of at least
    ``EXTERNAL_TENSOR_MIN_BYTES`` go into it (so it is not written when none qualify).
    After an external-data save the model's initializers point at the new data file.
    ``overwrite_protect`` is the input model path: writing over it, or over the external data
    it uses, is refused; pass ``None`` only for an explicit in-place rewrite. A symlink at
    ``path`` is replaced by the new file, not followed.
    """
    shown = os.fspath(path)
    dest = Path(os.path.abspath(path))
    if dest.is_dir():
        raise _bad(shown, "is a directory; give an output file name")
    if not dest.parent.is_dir():
        raise _bad(shown, f"output folder {dest.parent} does not exist")
    data_dest = dest.with_name(dest.name + ".data")

    contents = _Contents.of(model)
    total = sum(_value_nbytes(v) for v in contents.initializers)
    use_external = (
        external_data
        if external_data is not None
        else total > EXTERNAL_DATA_AUTO_BYTES or _had_external_data(model, contents.initializers)
    )
    if not use_external and total > _PROTOBUF_LIMIT_BYTES:
        raise _bad(
            shown,
            f"weights total {total / 2**30:.2f} GiB, over protobuf's 2 GiB limit; "
            "save with external data",
        )
    if overwrite_protect is not None:
        targets = [dest, data_dest] if use_external else [dest]
        _check_overwrite(shown, targets, overwrite_protect, model)

    _materialize_external_attrs(contents.tensor_attrs)
    try:
        if use_external:
            return _save_external(model, dest, data_dest, shown, contents)
        return _save_inline(model, dest, shown, contents)
    except OSError as e:
        where = os.fspath(e.filename) if e.filename else shown
        raise _bad(shown, f"saving failed ({where}: {e.strerror or e})") from None


BACKUP_SUFFIX = ".bak"


def backup_model(path: str | Path, model: ir.Model) -> list[Path]:
    """Before an in-place rewrite: copy ``path`` and the external data files ``model`` reads
    to ``<file>.bak`` beside them; return the copies.

    Each copy is written to a temp file and renamed, so a backup is either complete or
    absent; an existing ``.bak`` is replaced. Copies (not hard links): the save that follows
    reads the old data file while writing the new one, and onnx-ir refuses hard-linked data.
    """
    sources = [Path(os.path.abspath(path))]
    sources += sorted(Path(f) for f in model.meta.get(_META_SOURCE_DATA_FILES, ()))
    written: list[Path] = []
    for source in sources:
        backup = source.with_name(source.name + BACKUP_SUFFIX)
        tmp = _make_temp(backup)
        try:
            shutil.copyfile(source, tmp)
            shutil.copymode(source, tmp)
            _fsync_path(tmp)
            os.replace(tmp, backup)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise _bad(path, f"cannot write the backup {backup}: {e.strerror or e}") from None
        written.append(backup)
    _fsync_dir(sources[0].parent)
    return written


# --------------------------------------------------------------------------- signature


@dataclass(frozen=True)
class ValueSignature:
    """One graph input/output as the user's model declared it."""

    name: str | None
    type: ir.TypeProtocol | None
    dims: tuple[int | str | None, ...] | None  # None = no shape; str = symbolic; None dim = unknown
    denotations: tuple[str | None, ...] | None


@dataclass(frozen=True)
class Signature:
    """What a user's tooling keys on; the optimizer must hand it back unchanged."""

    inputs: tuple[ValueSignature, ...]
    outputs: tuple[ValueSignature, ...]
    opset_imports: tuple[tuple[str, int], ...]
    ir_version: int
    producer_name: str | None
    producer_version: str | None
    domain: str | None
    model_version: int | None
    doc_string: str | None
    metadata_props: tuple[tuple[str, str], ...]
    graph_name: str | None
    graph_doc_string: str | None


def _value_signature(value: ir.Value) -> ValueSignature:
    shape = value.shape
    dims = denots = None
    if shape is not None:
        dims = tuple(d if isinstance(d, int) else d.value for d in shape.dims)
        denots = tuple(shape.get_denotation(i) for i in range(shape.rank()))
    return ValueSignature(value.name, copy.deepcopy(value.type), dims, denots)


def _matches(value: ir.Value, vs: ValueSignature) -> bool:
    return _value_signature(value) == vs


def _apply(value: ir.Value, vs: ValueSignature) -> None:
    value.name = vs.name
    value.type = copy.deepcopy(vs.type)
    if vs.dims is None:
        value.shape = None
    else:
        dims = [d if isinstance(d, int) else ir.SymbolicDim(d) for d in vs.dims]
        value.shape = ir.Shape(dims, denotations=vs.denotations)


def snapshot_signature(model: ir.Model) -> Signature:
    """Record the model's IO signature and metadata before optimization touches them."""
    g = model.graph
    declared = model.meta.get(_META_DECLARED_DIMS, {})

    def signature(part: str, value: ir.Value) -> ValueSignature:
        current = _value_signature(value)
        dims = declared.get((part, value.name))  # a -1 the loader read as unknown
        if dims is None or current.dims is None or len(dims) != len(current.dims):
            return current
        return replace(current, dims=dims)

    return Signature(
        inputs=tuple(signature("inputs", v) for v in g.inputs),
        outputs=tuple(signature("outputs", v) for v in g.outputs),
        opset_imports=tuple(model.opset_imports.items()),
        ir_version=model.ir_version,
        producer_name=model.producer_name,
        producer_version=model.producer_version,
        domain=model.domain,
        model_version=model.model_version,
        doc_string=model.doc_string,
        metadata_props=tuple(model.metadata_props.items()),
        graph_name=g.name,
        graph_doc_string=g.doc_string,
    )


def _free_name(graph: ir.Graph, wanted: str, keep: ir.Value) -> None:
    """Rename any other value in ``graph`` called ``wanted`` so ``keep`` can take the name."""
    others: list[ir.Value] = [*graph.inputs, *graph.initializers.values()]
    for node in graph:
        others.extend(node.outputs)
    taken = {v.name for v in others}
    for v in others:
        if v is not keep and v.name == wanted:
            n = 1
            while f"{wanted}__{n}" in taken:
                n += 1
            v.name = f"{wanted}__{n}"
            taken.add(v.name)


def restore_signature(model: ir.Model, sig: Signature, *, keep_opsets: bool = False) -> None:
    """Put the recorded IO names/types/shapes and metadata back, exactly.

    Shape inference may refine output shapes and passes may rename values; the saved model
    must still look like the user's. An output that is also a graph input, an initializer,
    or another output (e.g. after Identity removal) gets a fresh ``Identity`` so renaming it
    cannot change anything else. Opset domains the optimizer added are kept; original domains
    get their original versions back unless ``keep_opsets`` (the caller upgraded the opset),
    in which case current versions and a newer ``ir_version`` are kept.
    """
    g = model.graph
    if len(g.inputs) != len(sig.inputs) or len(g.outputs) != len(sig.outputs):
        raise InternalError(
            f"optimizer changed the graph signature: {len(sig.inputs)}/{len(sig.outputs)} "
            f"inputs/outputs became {len(g.inputs)}/{len(g.outputs)}"
        )
    for value, vs in zip(g.inputs, sig.inputs, strict=True):
        if not _matches(value, vs):
            if vs.name and value.name != vs.name:
                _free_name(g, vs.name, value)
            _apply(value, vs)
    seen: set[int] = set()
    for i, vs in enumerate(sig.outputs):
        value = g.outputs[i]
        shared = value.is_graph_input() or value.is_initializer() or id(value) in seen
        if not _matches(value, vs):
            if shared and value.name != vs.name:
                node = ir.Node("", "Identity", inputs=[value], num_outputs=1)
                g.append(node)
                value = node.outputs[0]
                g.outputs[i] = value
            if vs.name and value.name != vs.name:
                _free_name(g, vs.name, value)
            _apply(value, vs)
        seen.add(id(value))

    for domain, version in sig.opset_imports:
        if not (keep_opsets and domain in model.opset_imports):
            model.opset_imports[domain] = version
    model.ir_version = max(model.ir_version, sig.ir_version) if keep_opsets else sig.ir_version
    model.producer_name = sig.producer_name
    model.producer_version = sig.producer_version
    model.domain = sig.domain
    model.model_version = sig.model_version
    model.doc_string = sig.doc_string
    model.metadata_props.clear()
    model.metadata_props.update(sig.metadata_props)
    g.name = sig.graph_name
    g.doc_string = sig.graph_doc_string


# --------------------------------------------------------------------------- opset / summary


def _default_opset(model: ir.Model) -> int | None:
    imports = model.opset_imports
    return imports.get("", imports.get("ai.onnx"))


def upgrade_opset(model: ir.Model, version: int) -> ir.Model:
    """Convert the default-domain opset up to ``version`` with onnx's version converter.

    This path materializes the model in memory: the whole graph and every in-memory or
    inline tensor is serialized to one ModelProto (2 GiB protobuf limit) and converted in
    C++. External tensors stay file references and are re-attached to their files.
    Downgrades are refused. Returns a new model (or ``model`` itself if already at
    ``version``).
    """
    current = _default_opset(model)
    if current is None:
        raise BadInputError("cannot upgrade opset: the model imports no default-domain opset")
    if version < current:
        raise BadInputError(
            f"refusing to downgrade the opset from {current} to {version}; only upgrades work"
        )
    newest = onnx.defs.onnx_opset_version()
    if version > newest:
        raise BadInputError(
            f"cannot upgrade opset to {version}: this onnx supports at most opset {newest}"
        )
    if version == current:
        return model
    try:
        converted = onnx.version_converter.convert_version(ir.to_proto(model), version)
        new_model = ir.from_proto(converted)
    except Exception as e:  # the converter reports unsupported ops via RuntimeError etc.
        raise BadInputError(
            f"cannot upgrade opset {current} to {version}: {_one_line(e)}"
        ) from None

    # from_proto has no folder for external tensors; re-attach them to the originals.
    by_key: dict[tuple[str, int | None, int | None], Any] = {}
    for value in _initializer_values(model):
        t = value.const_value
        if isinstance(t, ir.ExternalTensor):
            by_key[(os.fspath(t.location), t.offset, t.length)] = t
    for value in _initializer_values(new_model):
        t = value.const_value
        if isinstance(t, ir.ExternalTensor):
            orig = by_key.get((os.fspath(t.location), t.offset, t.length))
            if orig is not None:
                value.const_value = orig
    for _, _, attr in _tensor_attrs(new_model):
        for t in _attr_tensors(attr):
            if isinstance(t, ir.ExternalTensor):
                orig = by_key.get((os.fspath(t.location), t.offset, t.length))
                if orig is not None:
                    t.base_dir = orig.base_dir
    for key in (_META_HAD_EXTERNAL, _META_SOURCE_DATA_FILES):
        if key in model.meta:
            new_model.meta[key] = model.meta[key]
    return new_model


def _op_key(node: ir.Node) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"


def model_summary(model: ir.Model) -> dict[str, Any]:
    """Cheap facts for reports, computed from metadata only (no weight is read).

    ``node_count`` is the main graph's top-level nodes; ``op_histogram`` counts every node
    including those inside subgraphs (``subgraph_node_count`` says how many of those there
    are). Function bodies are not counted. Initializer bytes come from dtype and shape.
    """
    hist: Counter[str] = Counter()
    total_nodes = 0
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        hist[_op_key(node)] += 1
        total_nodes += 1
    inits = _initializer_values(model)
    return {
        "node_count": len(model.graph),
        "subgraph_node_count": total_nodes - len(model.graph),
        "op_histogram": hist,
        "initializer_count": len(inits),
        "initializer_bytes": sum(_value_nbytes(v) for v in inits),
        "opset_imports": dict(model.opset_imports),
    }
