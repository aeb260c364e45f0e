"""The one-way pipeline: load -> prepare -> rewrite -> validate -> measure.

Each stage returns a plain result object; ``optimize`` strings them together
and returns an ``OptimizeResult`` that the CLI (or a Python user) reports on
and saves. Nothing here prints.
"""

from __future__ import annotations

import fnmatch
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx_ir as ir

from . import modelio, traffic
from .compile import OVERLOAD_IR_VERSION, CompiledRule, compile_rules
from .errors import BadInputError
from .prepare import (
    PrepareResult,
    detach_legacy_initializer_inputs,
    prepare,
    reattach_legacy_initializer_inputs,
)
from .rewrite import RewriteResult, apply_rules
from .rulefile import TARGETS, Rule, builtin_rule_paths, load_rules
from .ruletest import op_histogram
from .targets import Target, resolve_target
from .validate import ValidationOptions, ValidationResult, validate

__all__ = ["TARGETS", "OptimizeResult", "load_rule_set", "optimize", "select_rules"]


@dataclass(frozen=True)
class OptimizeResult:
    """Everything one optimization run produced; ``model`` is ready to save."""

    model: ir.Model
    rewrite: RewriteResult
    prepared: PrepareResult
    validation: ValidationResult | None
    traffic_before: traffic.TrafficReport
    traffic_after: traffic.TrafficReport
    ops_before: Counter[str]
    ops_after: Counter[str]
    nodes_before: int
    nodes_after: int
    seconds: dict[str, float] = field(default_factory=dict)
    rules: tuple[str, ...] = ()
    source: str | None = None

    @property
    def passed(self) -> bool:
        """True unless validation ran and found a difference."""
        return self.validation is None or self.validation.passed

    @property
    def bytes_saved(self) -> int:
        return self.traffic_before.total_bytes - self.traffic_after.total_bytes


def select_rules(
    rules: Sequence[Rule],
    include: Iterable[str] = (),
    exclude: Iterable[str] = (),
) -> list[Rule]:
    """Keep rules whose id matches any ``include`` glob (all if none) and no ``exclude`` glob."""
    include, exclude = list(include), list(exclude)
    chosen = [
        r for r in rules
        if (not include or any(fnmatch.fnmatchcase(r.id, g) for g in include))
        and not any(fnmatch.fnmatchcase(r.id, g) for g in exclude)
    ]
    for pattern in include:
        if not any(fnmatch.fnmatchcase(r.id, pattern) for r in rules):
            raise BadInputError(f"--rule {pattern!r} matches no rule")
    return chosen


def load_rule_set(
    paths: Iterable[str | Path] = (),
    *,
    builtin: bool = True,
    include: Iterable[str] = (),
    exclude: Iterable[str] = (),
    target: str | Path | Target = "onnx",
) -> list[CompiledRule]:
    """Built-in rules (unless disabled), user rule files/folders, then the target file's
    rules (they run last, on what the standard fusions left), selected and compiled."""
    all_paths: list[str | Path] = [*builtin_rule_paths()] if builtin else []
    for path in paths:
        if not Path(path).exists():
            raise BadInputError(f"{path}: rule path not found")
        all_paths.append(path)
    rules = load_rules(all_paths)
    extra = resolve_target(target).rules
    clash = {r.id for r in rules} & {r.id for r in extra}
    if clash:
        raise BadInputError(f"target file redefines rule(s) {', '.join(sorted(clash))}")
    return compile_rules(select_rules([*rules, *extra], include, exclude))


def optimize(
    model: str | Path | ir.Model,
    *,
    rules: Sequence[CompiledRule] | None = None,
    target: str | Path | Target = "onnx",
    opset: int | None = None,
    dims: Mapping[str, int] | None = None,
    check: bool = True,
    validation: ValidationOptions | None = None,
    fold_constants: bool = True,
    progress: Callable[[str], None] | None = None,
) -> OptimizeResult:
    """Optimize a model (a path or an ``ir.Model``, which is not modified).

    ``check=False`` skips validation on onnxruntime. ``dims`` binds symbolic
    dimensions for the traffic model and generated validation inputs.
    """
    say = progress or (lambda _msg: None)
    seconds: dict[str, float] = {}
    clock = time.perf_counter()
    active = resolve_target(target)
    dims = dict(dims or {})
    say("loading model")
    if isinstance(model, ir.Model):
        proto = ir.to_proto(model)  # the caller's model is never modified
        reference: ir.Model | str = ir.from_proto(proto)
        working = ir.from_proto(proto)
        source = None
    else:
        working = modelio.load_model(model)
        reference = str(model)
        source = str(model)
    if rules is None:
        rules = load_rule_set(target=active)
    seconds["load"] = time.perf_counter() - clock

    clock = time.perf_counter()
    if opset is not None:
        working = modelio.upgrade_opset(working, opset)
    detach_legacy_initializer_inputs(working)
    signature = modelio.snapshot_signature(working)
    ops_before = op_histogram(working.graph)
    nodes_before = sum(ops_before.values())
    say("folding constants and inferring shapes")
    prepared = prepare(working, fold=fold_constants)
    traffic_before = traffic.measure(working, dims=dims)
    seconds["prepare"] = time.perf_counter() - clock

    clock = time.perf_counter()
    say("applying rules")
    rewrite = apply_rules(working, rules, target=active.names, dims=dims)
    modelio.restore_signature(working, signature, keep_opsets=opset is not None)
    if any(f.overload for f in working.functions.values()):
        working.ir_version = max(working.ir_version, OVERLOAD_IR_VERSION)
    reattach_legacy_initializer_inputs(working)
    seconds["rewrite"] = time.perf_counter() - clock

    clock = time.perf_counter()
    traffic_after = traffic.measure(working, dims=dims)
    ops_after = op_histogram(working.graph)
    seconds["measure"] = time.perf_counter() - clock

    result_validation = None
    if check:
        clock = time.perf_counter()
        options = validation or ValidationOptions(dims=dims)
        result_validation = validate(reference, working, options, progress=say)
        seconds["validate"] = time.perf_counter() - clock

    return OptimizeResult(
        model=working,
        rewrite=rewrite,
        prepared=prepared,
        validation=result_validation,
        traffic_before=traffic_before,
        traffic_after=traffic_after,
        ops_before=ops_before,
        ops_after=ops_after,
        nodes_before=nodes_before,
        nodes_after=sum(ops_after.values()),
        seconds=seconds,
        rules=tuple(r.id for r in rules),
        source=source,
    )
