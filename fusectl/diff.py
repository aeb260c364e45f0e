"""``fusectl diff A B``: what differs between two models, structurally and numerically.

Why this exists: a CI pipeline compares a baseline model with a candidate (an optimizer's
output, a re-export) and must fail when the candidate would break its callers (a changed
input or output signature) or compute something else (outputs beyond tolerance), while a
person wants to see what changed: opsets, op counts, nodes, weights, traffic and FLOPs.

Nodes are paired in three passes, each over the nodes the previous passes left unpaired:
by node name (non-empty names); then by op, domain and the exact input and output value
names (a renamed node); then by op, domain and output value names (a renamed node whose
inputs changed). Anything left is added (only in B) or removed (only in A). A paired node
is changed when its name, op, inputs, outputs or attributes differ. Initializers of the
main graph are paired by name; a pair is changed when its dtype, shape or values (bitwise)
differ. Each tensor is read once, external data through its memory map, and two external
tensors at the same place of the same file are equal without reading them.

The IO signature is compared by name; before IR version 4 every initializer was also listed
as a graph input, and those count as weights, not inputs (as in onnxruntime). The numerical
comparison is :func:`fusectl.validate.validate` with A as the reference: the same seeded or
given inputs, per-dtype tolerances, NaN/Inf positions. It runs only when the input
signatures agree. Nothing here prints; :func:`diff_document` is the JSON view
(schema ``fusectl.diff/1``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from . import __version__, modelio, traffic
from .boundshapes import bound_shapes
from .errors import BadInputError, first_line_of
from .ruletest import op_histogram
from .shapes import infer_model_shapes
from .validate import ValidationOptions, ValidationResult, shape_named_dims, validate
from .validate import to_dict as validation_to_dict

__all__ = [
    "DIFF_SCHEMA",
    "DiffResult",
    "InitializerChange",
    "NodeChange",
    "SignatureDiff",
    "TensorSignature",
    "diff_document",
    "diff_models",
]

DIFF_SCHEMA = "fusectl.diff/1"
_CHUNK = 1 << 20  # elements compared at a time, so a huge weight never needs a float64 copy
_LEGACY_IR_VERSION = 4


# --------------------------------------------------------------------------- result types


@dataclass(frozen=True)
class TensorSignature:
    """Name, element type and shape of a graph input/output or an initializer."""

    name: str
    dtype: str
    shape: tuple[int | str | None, ...] | None
    """Dims are ints, symbolic names, or None for an unknown dim; None for an unknown rank."""

    def text(self) -> str:
        if self.shape is None:
            return f"{self.dtype}[?]"
        return f"{self.dtype}[{','.join('?' if d is None else str(d) for d in self.shape)}]"


@dataclass(frozen=True)
class SignatureDiff:
    """Graph inputs or outputs of A and B compared by name (order is ignored)."""

    added: tuple[TensorSignature, ...]
    removed: tuple[TensorSignature, ...]
    changed: tuple[tuple[TensorSignature, TensorSignature], ...]

    @property
    def same(self) -> bool:
        return not (self.added or self.removed or self.changed)


@dataclass(frozen=True)
class NodeRef:
    """A node by its display name (``name`` or ``op_index`` when unnamed) and op."""

    name: str
    op: str


@dataclass(frozen=True)
class NodeChange:
    """A node of A paired with a node of B that differs; ``changes`` says how."""

    a: NodeRef
    b: NodeRef
    matched_by: str
    """``name``, ``io`` (op and input/output names) or ``outputs`` (op and output names)."""
    changes: tuple[str, ...]


@dataclass(frozen=True)
class InitializerChange:
    """An initializer present in both models whose dtype, shape or values differ."""

    a: TensorSignature
    b: TensorSignature
    changes: tuple[str, ...]
    max_abs_diff: float | None = None
    """Largest |a - b| over finite elements, when the values were compared numerically."""


@dataclass(frozen=True)
class DiffResult:
    """Everything ``fusectl diff`` found; ``passed`` is the exit-code verdict."""

    a: str
    b: str
    inputs: SignatureDiff
    outputs: SignatureDiff
    opsets_a: dict[str, int]
    opsets_b: dict[str, int]
    ir_version_a: int
    ir_version_b: int
    ops_a: Counter[str]
    ops_b: Counter[str]
    nodes_added: tuple[NodeRef, ...]
    nodes_removed: tuple[NodeRef, ...]
    nodes_changed: tuple[NodeChange, ...]
    nodes_unchanged: int
    initializers_added: tuple[TensorSignature, ...]
    initializers_removed: tuple[TensorSignature, ...]
    initializers_changed: tuple[InitializerChange, ...]
    initializers_unchanged: int
    traffic_a: traffic.TrafficReport
    traffic_b: traffic.TrafficReport
    validation: ValidationResult | None
    validation_skipped: str | None
    """Why the numerical comparison did not run (None when it ran)."""

    @property
    def io_same(self) -> bool:
        return self.inputs.same and self.outputs.same

    @property
    def opsets_same(self) -> bool:
        return self.opsets_a == self.opsets_b

    @property
    def structurally_identical(self) -> bool:
        """Same signature, opsets, IR version, nodes and initializers."""
        return (
            self.io_same
            and self.opsets_same
            and self.ir_version_a == self.ir_version_b
            and not (self.nodes_added or self.nodes_removed or self.nodes_changed)
            and not (self.initializers_added or self.initializers_removed
                     or self.initializers_changed)
        )

    @property
    def numerics_passed(self) -> bool:
        """False only when the comparison ran and found a difference."""
        return self.validation is None or self.validation.passed

    @property
    def passed(self) -> bool:
        """Exit 0: same IO signature and (when compared) outputs within tolerance."""
        return self.io_same and self.numerics_passed


# --------------------------------------------------------------------------- signatures


def _dim(d: object) -> int | str | None:
    if isinstance(d, int):
        return d
    value = getattr(d, "value", None)
    return None if value is None else str(value)


def _signature(value: ir.Value) -> TensorSignature:
    dtype = value.dtype.name.lower() if value.dtype is not None else "?"
    if value.type is not None and not isinstance(value.type, ir.TensorType):
        dtype = str(value.type)
    shape = None if value.shape is None else tuple(_dim(d) for d in value.shape)
    return TensorSignature(value.name or "", dtype, shape)


def _tensor_signature(name: str, tensor: ir.TensorProtocol) -> TensorSignature:
    return TensorSignature(name, tensor.dtype.name.lower(), tuple(int(d) for d in tensor.shape))


def _runtime_inputs(model: ir.Model) -> list[ir.Value]:
    """Graph inputs a caller feeds: before IR version 4 every initializer had to be listed
    as an input too, and runtimes treat those as weights, not inputs."""
    if model.ir_version >= _LEGACY_IR_VERSION:
        return list(model.graph.inputs)
    return [v for v in model.graph.inputs if not v.is_initializer()]


def _compare_signatures(a: Iterable[ir.Value], b: Iterable[ir.Value]) -> SignatureDiff:
    sig_a = {s.name: s for s in map(_signature, a)}
    sig_b = {s.name: s for s in map(_signature, b)}
    return SignatureDiff(
        tuple(s for name, s in sig_b.items() if name not in sig_a),
        tuple(s for name, s in sig_a.items() if name not in sig_b),
        tuple((s, sig_b[name]) for name, s in sig_a.items()
              if name in sig_b and sig_b[name] != s),
    )


# --------------------------------------------------------------------------- nodes


def _qualified(node: ir.Node) -> str:
    return f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type


def _refs(graph: ir.Graph) -> dict[ir.Node, NodeRef]:
    return {node: NodeRef(node.name or f"{node.op_type}_{i}", _qualified(node))
            for i, node in enumerate(graph)}


def _value_names(values: Iterable[ir.Value | None]) -> tuple[str, ...]:
    return tuple("" if v is None else (v.name or "") for v in values)


def _io_key(node: ir.Node) -> Hashable:
    return (_qualified(node), _value_names(node.inputs), _value_names(node.outputs))


def _outputs_key(node: ir.Node) -> Hashable:
    return (_qualified(node), _value_names(node.outputs))


def _name_key(node: ir.Node) -> Hashable:
    return node.name or None


def _pair(
    left: list[ir.Node], right: list[ir.Node], key: Callable[[ir.Node], Hashable]
) -> tuple[list[tuple[ir.Node, ir.Node]], list[ir.Node], list[ir.Node]]:
    """Pair nodes with equal keys in graph order; a None key never pairs."""
    waiting: dict[Hashable, list[ir.Node]] = {}
    for node in right:
        k = key(node)
        if k is not None:
            waiting.setdefault(k, []).append(node)
    for queue in waiting.values():
        queue.reverse()
    pairs, rest_left = [], []
    paired_right: set[ir.Node] = set()
    for node in left:
        k = key(node)
        queue = waiting.get(k) if k is not None else None
        if queue:
            match = queue.pop()
            pairs.append((node, match))
            paired_right.add(match)
        else:
            rest_left.append(node)
    return pairs, rest_left, [n for n in right if n not in paired_right]


def _attr_key(attr: ir.Attr) -> object:
    """A comparable value of an attribute (tensors by bytes, graphs by their protobuf)."""
    if attr.is_ref():
        return ("ref", attr.ref_attr_name)
    if attr.type == ir.AttributeType.TENSOR:
        tensor = attr.value
        return (tensor.dtype, tuple(tensor.shape), tensor.tobytes())
    if attr.type == ir.AttributeType.TENSORS:
        return tuple((t.dtype, tuple(t.shape), t.tobytes()) for t in attr.value)
    if attr.type == ir.AttributeType.GRAPH:
        return ir.serde.serialize_graph(attr.value).SerializeToString(deterministic=True)
    if attr.type == ir.AttributeType.GRAPHS:
        return tuple(ir.serde.serialize_graph(g).SerializeToString(deterministic=True)
                     for g in attr.value)
    value = attr.value
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _attr_text(attr: ir.Attr | None) -> str:
    if attr is None:
        return "(absent)"
    if attr.is_ref():
        return f"@{attr.ref_attr_name}"
    if attr.type == ir.AttributeType.TENSOR:
        return f"tensor {attr.value.dtype.name.lower()}{list(attr.value.shape)}"
    if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
        graphs = [attr.value] if attr.type == ir.AttributeType.GRAPH else list(attr.value)
        return f"{len(graphs)} graph(s) of {sum(len(g) for g in graphs)} nodes"
    value = attr.value
    return str(list(value)) if isinstance(value, (list, tuple)) else repr(value)


def _node_changes(a: ir.Node, b: ir.Node, ref_a: NodeRef, ref_b: NodeRef) -> list[str]:
    changes = []
    if ref_a.name != ref_b.name:
        changes.append(f"name {ref_a.name} -> {ref_b.name}")
    if ref_a.op != ref_b.op:
        changes.append(f"op {ref_a.op} -> {ref_b.op}")
    for what, va, vb in (("inputs", a.inputs, b.inputs), ("outputs", a.outputs, b.outputs)):
        names_a, names_b = _value_names(va), _value_names(vb)
        if names_a != names_b:
            changes.append(f"{what} {list(names_a)} -> {list(names_b)}")
    for name in sorted(set(a.attributes) | set(b.attributes)):
        attr_a, attr_b = a.attributes.get(name), b.attributes.get(name)
        if attr_a is None or attr_b is None or _attr_key(attr_a) != _attr_key(attr_b):
            changes.append(f"attribute {name}: {_attr_text(attr_a)} -> {_attr_text(attr_b)}")
    return changes


def _compare_nodes(graph_a: ir.Graph, graph_b: ir.Graph):
    refs_a, refs_b = _refs(graph_a), _refs(graph_b)
    left, right = list(graph_a), list(graph_b)
    changed: list[NodeChange] = []
    unchanged = 0
    for how, key in (("name", _name_key), ("io", _io_key), ("outputs", _outputs_key)):
        pairs, left, right = _pair(left, right, key)
        for a, b in pairs:
            changes = _node_changes(a, b, refs_a[a], refs_b[b])
            if changes:
                changed.append(NodeChange(refs_a[a], refs_b[b], how, tuple(changes)))
            else:
                unchanged += 1
    added = tuple(refs_b[n] for n in right)
    removed = tuple(refs_a[n] for n in left)
    return added, removed, tuple(changed), unchanged


# --------------------------------------------------------------------------- initializers


def _same_external_data(ta: object, tb: object) -> bool:
    if not (isinstance(ta, ir.ExternalTensor) and isinstance(tb, ir.ExternalTensor)):
        return False
    return (Path(ta.path).resolve() == Path(tb.path).resolve()
            and ta.offset == tb.offset and ta.length == tb.length)


def _read(name: str, tensor: ir.TensorProtocol) -> np.ndarray:
    try:
        return tensor.numpy()
    except Exception as exc:  # noqa: BLE001 - missing or short external data, bad raw data
        raise BadInputError(f"initializer {name!r}: cannot read its data: "
                            f"{first_line_of(exc)}") from None


def _as_wide(chunk: np.ndarray) -> np.ndarray:
    """float64 (complex128 for complex data) for the difference statistic."""
    return chunk.astype(np.complex128 if chunk.dtype.kind == "c" else np.float64)


def _compare_values(name: str, ta: ir.TensorProtocol, tb: ir.TensorProtocol
                    ) -> tuple[bool, float | None]:
    """(bitwise equal, max |a - b| over elements finite in both, or None if not numeric)."""
    if _same_external_data(ta, tb):
        return True, 0.0
    a, b = _read(name, ta).reshape(-1), _read(name, tb).reshape(-1)
    if a.dtype.kind in "OUS" or b.dtype.kind in "OUS":
        return a.tolist() == b.tolist(), None
    equal = True
    worst: float | None = 0.0
    for start in range(0, a.size, _CHUNK):
        ca = np.ascontiguousarray(a[start:start + _CHUNK])
        cb = np.ascontiguousarray(b[start:start + _CHUNK])
        if ca.tobytes() == cb.tobytes():
            continue
        equal = False
        if worst is None:
            continue
        try:
            fa, fb = _as_wide(ca), _as_wide(cb)
        except (TypeError, ValueError):
            worst = None
            continue
        finite = np.isfinite(fa) & np.isfinite(fb)
        if finite.any():
            worst = max(worst, float(np.max(np.abs(fa[finite] - fb[finite]))))
    return equal, worst


def _compare_initializers(graph_a: ir.Graph, graph_b: ir.Graph):
    inits_a = {n: v for n, v in graph_a.initializers.items() if v.const_value is not None}
    inits_b = {n: v for n, v in graph_b.initializers.items() if v.const_value is not None}
    added = tuple(_tensor_signature(n, v.const_value) for n, v in inits_b.items()
                  if n not in inits_a)
    removed = tuple(_tensor_signature(n, v.const_value) for n, v in inits_a.items()
                    if n not in inits_b)
    changed: list[InitializerChange] = []
    unchanged = 0
    for name, value_a in inits_a.items():
        value_b = inits_b.get(name)
        if value_b is None:
            continue
        ta, tb = value_a.const_value, value_b.const_value
        sig_a, sig_b = _tensor_signature(name, ta), _tensor_signature(name, tb)
        changes = []
        if sig_a.dtype != sig_b.dtype:
            changes.append(f"dtype {sig_a.dtype} -> {sig_b.dtype}")
        if sig_a.shape != sig_b.shape:
            changes.append(f"shape {list(sig_a.shape or ())} -> {list(sig_b.shape or ())}")
        worst = None
        if not changes:
            equal, worst = _compare_values(name, ta, tb)
            if equal:
                unchanged += 1
                continue
            changes.append("values")
        changed.append(InitializerChange(sig_a, sig_b, tuple(changes), worst))
    return added, removed, tuple(changed), unchanged


# --------------------------------------------------------------------------- diff


def _load(model: str | Path | ir.Model) -> tuple[ir.Model, str]:
    if isinstance(model, ir.Model):
        return model, model.graph.name or "<model>"
    return modelio.load_model(model), str(model)


def _measure(model: ir.Model, dims: Mapping[str, int]) -> traffic.TrafficReport:
    """Traffic of a model after onnx shape inference (which only annotates values in
    memory: nodes and initializers, what the diff compares, stay as they are)."""
    infer_model_shapes(model)
    return traffic.measure(model, dims=dims, bound=bound_shapes(model, dims))


def diff_models(
    a: str | Path | ir.Model,
    b: str | Path | ir.Model,
    *,
    structural_only: bool = False,
    validation: ValidationOptions | None = None,
    dims: Mapping[str, int] | None = None,
    progress: Callable[[str], None] | None = None,
) -> DiffResult:
    """Compare model ``b`` with model ``a`` (the reference).

    ``structural_only`` skips running the models. ``validation`` gives the inputs, seed,
    samples and tolerances of the numerical comparison (its ``dims`` default to ``dims``).
    Models given as ``ir.Model`` get inferred shapes added in place.
    """
    say = progress or (lambda _message: None)
    bound = dict(dims or {})
    say("loading models")
    model_a, name_a = _load(a)
    model_b, name_b = _load(b)
    graph_a, graph_b = model_a.graph, model_b.graph
    inputs = _compare_signatures(_runtime_inputs(model_a), _runtime_inputs(model_b))
    outputs = _compare_signatures(graph_a.outputs, graph_b.outputs)
    say("comparing nodes and initializers")
    nodes_added, nodes_removed, nodes_changed, nodes_unchanged = _compare_nodes(graph_a, graph_b)
    inits = _compare_initializers(graph_a, graph_b)
    measured = bound  # and the dims that given input shapes size, as --dim would
    if validation is not None and validation.shapes:
        measured = {**shape_named_dims(model_a, validation), **bound}
    say("measuring traffic")
    traffic_a, traffic_b = _measure(model_a, measured), _measure(model_b, measured)

    result_validation: ValidationResult | None = None
    skipped: str | None = None
    if structural_only:
        skipped = "--structural-only"
    elif not inputs.same:
        skipped = "the input signatures differ"
    else:
        options = validation or ValidationOptions(dims=bound)
        if not options.dims and bound:
            options = replace(options, dims=bound)
        source_a = a if not isinstance(a, ir.Model) else model_a
        source_b = b if not isinstance(b, ir.Model) else model_b
        result_validation = validate(source_a, source_b, options, progress=say)

    return DiffResult(
        a=name_a,
        b=name_b,
        inputs=inputs,
        outputs=outputs,
        opsets_a=dict(model_a.opset_imports),
        opsets_b=dict(model_b.opset_imports),
        ir_version_a=model_a.ir_version,
        ir_version_b=model_b.ir_version,
        ops_a=op_histogram(graph_a),
        ops_b=op_histogram(graph_b),
        nodes_added=nodes_added,
        nodes_removed=nodes_removed,
        nodes_changed=nodes_changed,
        nodes_unchanged=nodes_unchanged,
        initializers_added=inits[0],
        initializers_removed=inits[1],
        initializers_changed=inits[2],
        initializers_unchanged=inits[3],
        traffic_a=traffic_a,
        traffic_b=traffic_b,
        validation=result_validation,
        validation_skipped=skipped,
    )


# --------------------------------------------------------------------------- JSON view


def _sig_dict(sig: TensorSignature) -> dict[str, Any]:
    return {"name": sig.name, "dtype": sig.dtype,
            "shape": None if sig.shape is None else list(sig.shape)}


def _signature_dict(diff: SignatureDiff) -> dict[str, Any]:
    return {
        "same": diff.same,
        "added": [_sig_dict(s) for s in diff.added],
        "removed": [_sig_dict(s) for s in diff.removed],
        "changed": [{"name": a.name, "a": _sig_dict(a), "b": _sig_dict(b)}
                    for a, b in diff.changed],
    }


def _traffic_dict(report: traffic.TrafficReport) -> dict[str, int]:
    return {
        "bytes": report.total_bytes,
        "bytes_read": report.bytes_read,
        "bytes_written": report.bytes_written,
        "flops": report.flops,
        "macs": report.macs,
        "param_bytes": report.param_bytes,
        "kernels": report.kernel_count,
        "nodes": report.node_count,
        "unknown_shape_nodes": report.unknown_nodes,
    }


def _max_abs(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else value


def diff_document(result: DiffResult) -> dict[str, Any]:
    """The ``--json`` document of ``fusectl diff`` (schema ``fusectl.diff/1``)."""
    ta, tb = _traffic_dict(result.traffic_a), _traffic_dict(result.traffic_b)
    domains = sorted(set(result.opsets_a) | set(result.opsets_b))
    ops = sorted(set(result.ops_a) | set(result.ops_b))
    return {
        "schema": DIFF_SCHEMA,
        "fusectl_version": __version__,
        "a": result.a,
        "b": result.b,
        "passed": result.passed,
        "identical": result.structurally_identical and result.numerics_passed,
        "io": {"same": result.io_same, "inputs": _signature_dict(result.inputs),
               "outputs": _signature_dict(result.outputs)},
        "opsets": {
            "a": dict(result.opsets_a),
            "b": dict(result.opsets_b),
            "changed": [{"domain": d, "a": result.opsets_a.get(d), "b": result.opsets_b.get(d)}
                        for d in domains if result.opsets_a.get(d) != result.opsets_b.get(d)],
        },
        "ir_version": {"a": result.ir_version_a, "b": result.ir_version_b},
        "ops": {
            "a": dict(result.ops_a),
            "b": dict(result.ops_b),
            "changed": [{"op": op, "a": result.ops_a.get(op, 0), "b": result.ops_b.get(op, 0)}
                        for op in ops if result.ops_a.get(op, 0) != result.ops_b.get(op, 0)],
        },
        "nodes": {
            "a": sum(result.ops_a.values()),
            "b": sum(result.ops_b.values()),
            "unchanged": result.nodes_unchanged,
            "added": [{"name": r.name, "op": r.op} for r in result.nodes_added],
            "removed": [{"name": r.name, "op": r.op} for r in result.nodes_removed],
            "changed": [
                {"a": c.a.name, "b": c.b.name, "op_a": c.a.op, "op_b": c.b.op,
                 "matched_by": c.matched_by, "changes": list(c.changes)}
                for c in result.nodes_changed
            ],
        },
        "initializers": {
            "unchanged": result.initializers_unchanged,
            "added": [_sig_dict(s) for s in result.initializers_added],
            "removed": [_sig_dict(s) for s in result.initializers_removed],
            "changed": [
                {"name": c.a.name, "a": _sig_dict(c.a), "b": _sig_dict(c.b),
                 "changes": list(c.changes), "max_abs_diff": _max_abs(c.max_abs_diff)}
                for c in result.initializers_changed
            ],
        },
        "traffic": {"a": ta, "b": tb, "delta": {k: tb[k] - ta[k] for k in ta}},
        "validation": validation_to_dict(result.validation) if result.validation else None,
        "validation_skipped": result.validation_skipped,
    }
