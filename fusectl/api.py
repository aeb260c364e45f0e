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

from . import modelio, ortprocess, traffic
from .bisect import DEFAULT_BUDGET
from .bisect import bisect as find_guilty
from .boundshapes import bound_shapes
from .compile import OVERLOAD_IR_VERSION, CompiledRule, compile_rules
from .errors import BadInputError
from .gcpolicy import fewer_collections
from .prepare import (
    PrepareResult,
    detach_legacy_initializer_inputs,
    prepare,
    reattach_legacy_initializer_inputs,
    tidy,
)
from .rewrite import Application, RewriteResult, apply_rules
from .rulefile import TARGETS, Rule, builtin_rule_paths, load_rules, rule_files
from .ruletest import op_histogram
from .symdims import forget_stand_ins
from .targets import Target, resolve_target
from .validate import (
    OutputComparison,
    ReferenceRun,
    ValidationOptions,
    ValidationResult,
    check_candidate,
    check_intermediates,
    run_reference,
    shape_named_dims,
)

__all__ = [
    "TARGETS", "Bisection", "Boundary", "OptimizeResult", "load_rule_set", "optimize",
    "select_rules",
]  # fmt: skip


@dataclass(frozen=True)
class Bisection:
    """What bisection did after the full rewrite failed validation.

    ``reverted`` applications were dropped (``unverified`` ones without proof, when the
    budget ran out); ``lost`` ones were not reverted but could not be re-applied because
    they built on a reverted one. ``explained`` is False when the prepared model without
    any application already differs (then nothing was reverted). ``validations`` counts
    candidate validations (the reference ran once, before bisection).
    """

    initial: ValidationResult
    reverted: tuple[Application, ...]
    unverified: tuple[Application, ...]
    lost: tuple[Application, ...]
    explained: bool
    validations: int
    seconds: float


@dataclass(frozen=True)
class Boundary:
    """One rewrite boundary (an output of a replaced subgraph) compared in both models."""

    value: str
    application: Application
    comparison: OutputComparison


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
    bisection: Bisection | None = None
    """Set when the full rewrite failed validation and bisection ran."""
    intermediates: tuple[Boundary, ...] | None = None
    """Rewrite boundaries compared (``check_intermediates``), in topological order."""
    input_repairs: tuple[str, ...] = ()
    """What loading repaired in the input that onnxruntime forgives (``fusectl.repair``)."""

    @property
    def passed(self) -> bool:
        """True unless validation ran and found a difference (even one since reverted)."""
        return self.verified and not (self.bisection and self.bisection.reverted)

    @property
    def verified(self) -> bool:
        """True unless validation ran and ``model`` (as returned) does not pass it."""
        return self.validation is None or self.validation.passed

    @property
    def first_drift(self) -> Boundary | None:
        """The first rewrite boundary, in topological order, whose values differ."""
        return next((b for b in self.intermediates or () if not b.comparison.passed), None)

    @property
    def bytes_saved(self) -> int:
        return self.traffic_before.total_bytes - self.traffic_after.total_bytes


def select_rules(
    rules: Sequence[Rule],
    include: Iterable[str] = (),
    exclude: Iterable[str] = (),
    *,
    opt_in: bool = False,
    also_opt_in: Iterable[str] = (),
) -> list[Rule]:
    """Keep rules whose id matches any ``include`` glob (all if none) and no ``exclude`` glob.
    An opt-in rule is kept only when an ``include`` or ``also_opt_in`` glob names it, or with
    ``opt_in`` (rule listings and rule tests see every rule). ``also_opt_in`` adds opt-in
    rules to the default selection instead of replacing it, as ``include`` does."""
    include, exclude, also = list(include), list(exclude), list(also_opt_in)

    def named(rule: Rule, globs: list[str]) -> bool:
        return any(fnmatch.fnmatchcase(rule.id, g) for g in globs)

    def included(rule: Rule) -> bool:
        if include:
            return named(rule, include) or (rule.opt_in and named(rule, also))
        return not rule.opt_in or opt_in or named(rule, also)

    chosen = [r for r in rules if included(r) and not named(r, exclude)]
    for pattern in include:
        if not any(fnmatch.fnmatchcase(r.id, pattern) for r in rules):
            raise BadInputError(f"--rule {pattern!r} matches no rule")
    for pattern in also:
        if not any(r.opt_in and fnmatch.fnmatchcase(r.id, pattern) for r in rules):
            raise BadInputError(f"--opt-in {pattern!r} matches no opt-in rule "
                                f"(`fusectl rules list` marks them)")
    return chosen


@fewer_collections()
def load_rule_set(
    paths: Iterable[str | Path] = (),
    *,
    builtin: bool = True,
    include: Iterable[str] = (),
    exclude: Iterable[str] = (),
    target: str | Path | Target = "onnx",
    opt_in: bool = False,
    also_opt_in: Iterable[str] = (),
) -> list[CompiledRule]:
    """Built-in rules (unless disabled), user rule files/folders, then the target file's
    rules (they run last, on what the standard fusions left), selected and compiled.
    Opt-in rules come only when ``include`` or ``also_opt_in`` names them or ``opt_in`` is
    set."""
    builtin_paths = builtin_rule_paths() if builtin else []
    all_paths: list[str | Path] = list(builtin_paths)
    for path in paths:
        if not Path(path).exists():
            raise BadInputError(f"{path}: rule path not found")
        all_paths.append(path)
    rules = load_rules(all_paths)
    extra = resolve_target(target).rules
    clash = {r.id for r in rules} & {r.id for r in extra}
    if clash:
        raise BadInputError(f"target file redefines rule(s) {', '.join(sorted(clash))}")
    selected = select_rules([*rules, *extra], include, exclude, opt_in=opt_in,
                            also_opt_in=also_opt_in)
    # The built-in library is tested rule by rule: its patterns are built on first use.
    builtin_files = {str(f) for folder in builtin_paths for f in rule_files(folder)}
    return compile_rules(selected, lazy=[r for r in selected if r.file in builtin_files])


@fewer_collections()
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
    conv_algo: str = "direct",
    bisect: bool = True,
    bisect_budget: int = DEFAULT_BUDGET,
    intermediates: bool = False,
) -> OptimizeResult:
    """Optimize a model (a path or an ``ir.Model``, which is not modified).

    ``check=False`` skips validation on onnxruntime. ``dims`` binds symbolic
    dimensions for the traffic model and generated validation inputs; ``conv_algo``
    (direct, im2col, indirect) is the traffic model's convolution algorithm.
    When validation fails and ``bisect`` is on, the rule applications responsible are
    found (at most ``bisect_budget`` candidate validations) and reverted: ``model`` then
    keeps every verified fusion, and ``bisection`` says what was reverted.
    ``intermediates`` also compares the values at every rewrite boundary.
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
        working = modelio.from_proto(proto)  # (typed as a loaded file is; -1 dims dynamic)
        source = None
    else:
        working = modelio.load_model(model)
        reference = str(model)
        source = str(model)
    input_repairs = tuple(working.meta.get(modelio.META_INPUT_REPAIRS, ()))
    if check:
        ortprocess.warm_up()  # onnxruntime's process starts while the model is rewritten
    if rules is None:
        rules = load_rule_set(target=active)
    seconds["load"] = time.perf_counter() - clock

    clock = time.perf_counter()
    if opset is not None:
        working = modelio.upgrade_opset(working, opset)
    detach_legacy_initializer_inputs(working)
    if validation is not None and validation.shapes:
        dims = {**shape_named_dims(working, validation), **dims}
    signature = modelio.snapshot_signature(working)
    ops_before = op_histogram(working.graph)
    nodes_before = sum(ops_before.values())
    say("folding constants and inferring shapes")
    prepared = prepare(working, fold=fold_constants)
    _name_unnamed_nodes(working)  # applications (and bisection) name the nodes they matched
    pristine = working.clone() if check and bisect else None
    bound = bound_shapes(working, dims)  # what a dynamic width costs once --dim binds it
    traffic_before = traffic.measure(working, dims=dims, conv_algo=conv_algo, bound=bound)
    seconds["prepare"] = time.perf_counter() - clock

    clock = time.perf_counter()
    say("applying rules")

    def finish(model: ir.Model, rewritten: RewriteResult) -> None:
        if rewritten.applications:
            tidy(model, [name for app in rewritten.applications for name in app.initializers])
        forget_stand_ins(model)
        modelio.restore_signature(model, signature, keep_opsets=opset is not None)
        if any(f.overload for f in model.functions.values()):
            model.ir_version = max(model.ir_version, OVERLOAD_IR_VERSION)
        reattach_legacy_initializer_inputs(model)

    rewrite = apply_rules(working, rules, target=active.names, dims=dims, bound=bound)
    finish(working, rewrite)
    seconds["rewrite"] = time.perf_counter() - clock

    clock = time.perf_counter()
    traffic_after = traffic.measure(working, dims=dims, conv_algo=conv_algo,
                                    bound=bound_shapes(working, dims))
    ops_after = op_histogram(working.graph)
    seconds["measure"] = time.perf_counter() - clock

    result_validation = bisection = boundaries = None
    if check:
        clock = time.perf_counter()
        options = validation or ValidationOptions(dims=dims)
        expected = run_reference(reference, options, progress=say)
        result_validation = check_candidate(expected, working, options, progress=say)
        seconds["validate"] = time.perf_counter() - clock
        if intermediates:
            clock = time.perf_counter()
            boundaries = _check_boundaries(reference, working, rewrite, expected, options, say)
            seconds["intermediates"] = time.perf_counter() - clock
        if pristine is not None and not result_validation.passed and rewrite.applications:

            def replay(accept: Accept) -> tuple[ir.Model, RewriteResult]:
                model = pristine.clone()
                replayed = apply_rules(model, rules, target=active.names, dims=dims,
                                       accept=accept, bound=bound)
                finish(model, replayed)
                return model, replayed

            bisection, kept = _bisect(rewrite, result_validation, replay, expected, options,
                                      bisect_budget, say)
            if kept is not None:
                working, rewrite, result_validation = kept
                traffic_after = traffic.measure(working, dims=dims, conv_algo=conv_algo,
                                                bound=bound_shapes(working, dims))
                ops_after = op_histogram(working.graph)
            seconds["bisect"] = bisection.seconds

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
        bisection=bisection,
        intermediates=boundaries,
        input_repairs=input_repairs,
    )


def _name_unnamed_nodes(model: ir.Model) -> None:
    """Give every unnamed node a unique ``Op_N`` name, so reports and bisection can say
    which nodes a rule matched."""
    graphs = list(model.graphs())
    used = {node.name for graph in graphs for node in graph if node.name}
    counter = 0
    for graph in graphs:
        for node in graph:
            if node.name:
                continue
            while f"{node.op_type}_{counter}" in used:
                counter += 1
            node.name = f"{node.op_type}_{counter}"
            used.add(node.name)


Accept = Callable[[str, tuple[str, ...]], bool]
Replay = Callable[[Accept], tuple[ir.Model, RewriteResult]]
Kept = tuple[ir.Model, RewriteResult, ValidationResult]


def _bisect(
    rewrite: RewriteResult,
    initial: ValidationResult,
    replay: Replay,
    expected: ReferenceRun,
    options: ValidationOptions,
    budget: int,
    say: Callable[[str], None],
) -> tuple[Bisection, Kept | None]:
    """Find and revert the applications that change outputs (fusectl.bisect's search).

    A candidate is the prepared model rewritten again with only some recorded applications
    allowed (``replay``), checked against the reference outputs already computed. Returns
    the summary and the kept (model, rewrite, validation), or None when the difference
    does not come from any application.
    """
    clock = time.perf_counter()
    first: dict[tuple[str, tuple[str, ...]], Application] = {}
    for app in rewrite.applications:
        first.setdefault((app.rule_id, app.matched), app)
    keys = list(first)
    last: list[tuple[frozenset[int], Kept]] = []

    def oracle(vetoed: frozenset[int]) -> bool:
        allowed = {key for i, key in enumerate(keys) if i not in vetoed}
        say(f"bisecting: validating without {len(vetoed)} of {len(keys)} rule applications")
        model, replayed = replay(lambda rule_id, matched: (rule_id, matched) in allowed)
        checked = check_candidate(expected, model, options, progress=say)
        last[:] = [(vetoed, (model, replayed, checked))]
        return checked.passed

    outcome = find_guilty([rule_id for rule_id, _ in keys], oracle, budget=budget)
    calls = outcome.calls
    kept: Kept | None = None
    if outcome.explained:
        if last[0][0] != frozenset(outcome.guilty):
            oracle(frozenset(outcome.guilty))  # re-validate the model that is kept
            calls += 1
        kept = last[0][1] if last[0][1][2].passed else None  # else: a non-deterministic model
    reverted = tuple(first[keys[i]] for i in outcome.guilty) if kept else ()
    replayed = {(a.rule_id, a.matched) for a in kept[1].applications} if kept else set()
    summary = Bisection(
        initial=initial,
        reverted=reverted,
        unverified=tuple(first[keys[i]] for i in outcome.unverified) if kept else (),
        lost=tuple(
            app for key, app in first.items()
            if kept and key not in replayed and app not in reverted
        ),  # fmt: skip
        explained=kept is not None,
        validations=calls,
        seconds=time.perf_counter() - clock,
    )
    return summary, kept


def _check_boundaries(
    reference: ir.Model | str,
    candidate: ir.Model,
    rewrite: RewriteResult,
    expected: ReferenceRun,
    options: ValidationOptions,
    say: Callable[[str], None],
) -> tuple[Boundary, ...]:
    """Compare the outputs of every node a rule created that still exist by name in the
    reference, in the candidate's topological order."""
    made_by = {name: app for app in rewrite.applications for name in app.created}
    owner: dict[str, Application] = {}
    for node in candidate.graph:
        app = made_by.get(node.name or "")
        if app is not None:
            owner.update((v.name, app) for v in node.outputs if v.name)
    say("comparing intermediate values at rewrite boundaries")
    compared = check_intermediates(reference, candidate, list(owner), expected, options, say)
    return tuple(Boundary(c.name, owner[c.name], c) for c in compared)
