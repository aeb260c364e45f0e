"""Targets: what a rewritten model may contain (SPEC §4).

``onnx`` allows standard ops only, ``onnxruntime`` also its contrib ops, and a
target file (YAML with a ``target:`` header) names a custom domain whose fused
kernels its own rules emit, on top of a base target. A rule runs when its
``when.target`` names any of the active target names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import BadInputError
from .rulefile import TARGETS, Rule, TargetSpec, load_target_file

ONNXRUNTIME_DEFAULT_DOMAIN_OPS: dict[str, dict[str, int | float]] = {
    "SimplifiedLayerNormalization": {"axis": -1, "epsilon": 1e-5, "stash_type": 1},
}
"""Contrib ops onnxruntime registers in the default ONNX domain, with their attribute
defaults: valid for onnxruntime, unknown to onnx's checker and schemas."""


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
