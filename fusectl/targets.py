"""Targets: what a rewritten model may contain (SPEC §4).

``onnx`` allows standard ops only, ``onnxruntime`` also its contrib ops, and a
target file (YAML with a ``target:`` header) names a custom domain whose fused
kernels its own rules emit, on top of a base target. A rule runs when its
``when.target`` names any of the active target names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx

from .errors import BadInputError
from .rulefile import TARGETS, Rule, TargetSpec, load_target_file

ONNXRUNTIME_DEFAULT_DOMAIN_OPS: dict[str, dict[str, int | float]] = {
    "SimplifiedLayerNormalization": {"axis": -1, "epsilon": 1e-5, "stash_type": 1},
    "LayerNormalization": {"axis": -1, "epsilon": 1e-5, "stash_type": 1},
}
"""Contrib ops onnxruntime registers in the default ONNX domain, with their attribute
defaults: valid for onnxruntime, unknown to onnx's checker and schemas. LayerNormalization
is standard from opset 17; onnxruntime runs it at every opset, so the entry serves models
below 17 (attribute defaults are read here only where onnx has no schema at the model's
opset)."""


SET_ASIDE_DOMAIN = "fusectl.onnxruntime-default-domain"


def set_aside_onnxruntime_ops(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` itself, or a copy in which the default-domain contrib ops of onnxruntime
    that onnx has no schema for at the model's opset (SimplifiedLayerNormalization;
    LayerNormalization below 17) sit in a private domain: onnx's checker rejects them,
    though onnxruntime runs them, and the rest of the model is still checked."""
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    unknown = {op for op in ONNXRUNTIME_DEFAULT_DOMAIN_OPS if not _has_schema(op, opset)}
    if not any(n.domain in ("", "ai.onnx") and n.op_type in unknown for n in proto.graph.node):
        return proto
    aside = onnx.ModelProto()
    aside.CopyFrom(proto)
    for node in aside.graph.node:
        if node.domain in ("", "ai.onnx") and node.op_type in unknown:
            node.domain = SET_ASIDE_DOMAIN
    aside.opset_import.add(domain=SET_ASIDE_DOMAIN, version=1)
    return aside


def _has_schema(op_type: str, opset: int) -> bool:
    try:
        onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return False
    return True


@dataclass(frozen=True)
class Target:
    """The active target: its names (own name first, then the base) and its rules."""

    name: str
    names: tuple[str, ...]
    spec: TargetSpec | None = None
    rules: tuple[Rule, ...] = ()
    path: str | None = None


def resolve_target(target: str | Path | Target) -> Target:
    """``onnx``, ``onnxruntime`` or the path of a target file."""
    if isinstance(target, Target):
        return target
    text = str(target)
    if text in TARGETS:
        return Target(text, (text,))
    path = Path(text)
    if path.suffix not in (".yaml", ".yml"):
        raise BadInputError(f"unknown target {text!r}; choose one of {', '.join(TARGETS)} "
                            "or a target file (.yaml)")
    if not path.is_file():
        raise BadInputError(f"{text}: target file not found")
    spec, rules = load_target_file(path)
    return Target(spec.name, (spec.name, spec.base), spec, tuple(rules), str(path))
