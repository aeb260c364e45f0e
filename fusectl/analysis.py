"""``fusectl report``: where a model's memory traffic and FLOPs go, and what the rules would save.

Why this exists: before optimizing (or deploying) a model a user wants to know which
kernels move the bytes, which of them are memory-bound on their device, and which rules
would fire where - without writing anything. This module runs the optimize pipeline as a
dry run (``api.optimize(..., check=False)``: nothing is validated, nothing is saved), puts
both the prepared and the rewritten graph on the device's roofline, and returns one plain
result object; :func:`report_document` is its JSON view (schema ``fusectl.report/1``).
Nothing here prints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx_ir as ir

from . import __version__
from .api import OptimizeResult, optimize
from .compile import CompiledRule
from .rewrite import Application
from .roofline import Device, NodeRoofline, Roofline, load_device, roofline
from .targets import Target, resolve_target
from .traffic import TrafficReport

__all__ = [
    "REPORT_SCHEMA",
    "ModelReport",
    "OptInSummary",
    "RuleSummary",
    "report_document",
    "report_model",
]

REPORT_SCHEMA = "fusectl.report/1"


@dataclass(frozen=True)
class RuleSummary:
    """What one rule would do to the model: where it fires and what that saves."""

    rule_id: str
    applications: int
    bytes_saved: int
    kernels_saved: int
    where: tuple[tuple[str, ...], ...]
    """The matched nodes of each application."""


@dataclass(frozen=True)
class OptInSummary:
    """What the opt-in rules the selection left out would add: a second dry run with them,
    so a user sees a fusion that is off by default (and why) instead of missing it."""

    rules: tuple[RuleSummary, ...]
    """The left-out opt-in rules that would fire, in first-application order."""
    reasons: dict[str, str]
    """Why each of them is off by default (its ``opt_in`` text)."""
    bytes_saved: int
    """Bytes the run with them saves beyond the run without (may be negative)."""
    kernels_saved: int


@dataclass(frozen=True)
class ModelReport:
    """Traffic, FLOPs and roofline of a model before and after a dry run of the rules."""

    source: str | None
    target: str
    conv_algo: str
    dims: dict[str, int]
    device: Device
    top: int
    dry_run: OptimizeResult
    roofline_before: Roofline
    roofline_after: Roofline
    opt_in: OptInSummary | None = None
    """What the left-out opt-in rules would add; None when none of them applies."""

    @property
    def before(self) -> TrafficReport:
        """The model as a runtime executes it (constants folded, shapes inferred)."""
        return self.dry_run.traffic_before

    @property
    def after(self) -> TrafficReport:
        """The model the rules would produce."""
        return self.dry_run.traffic_after

    @property
    def rules(self) -> tuple[RuleSummary, ...]:
        """Rules that would fire, in first-application order."""
        return _summaries(self.dry_run.rewrite.applications)

    def rule_of_node(self) -> tuple[dict[str, str], dict[str, str]]:
        """(original node name -> rule that fused it, new node name -> rule that made it).

        A node made by one rule and fused again by a later one keeps the first rule for the
        original nodes it came from: each original node is named once, by the rule that
        consumed it.
        """
        fused: dict[str, str] = {}
        made: dict[str, str] = {}
        for app in self.dry_run.rewrite.applications:
            for name in app.matched:
                origin = made.pop(name, None)
                if origin is None:
                    fused.setdefault(name, app.rule_id)
            for name in app.created:
                made[name] = app.rule_id
        return fused, made

    def top_nodes(self) -> list[NodeRoofline]:
        """The ``top`` kernels moving the most bytes before optimization, heaviest first."""
        ranked = sorted(self.roofline_before.nodes, key=lambda n: n.node.bytes_total,
                        reverse=True)
        return ranked[: max(self.top, 0)]


def _summaries(applications: Sequence[Application]) -> tuple[RuleSummary, ...]:
    by_rule: dict[str, list[Application]] = {}
    for app in applications:
        by_rule.setdefault(app.rule_id, []).append(app)
    return tuple(
        RuleSummary(
            rule_id,
            len(apps),
            sum(a.bytes_saved for a in apps),
            sum(len(a.matched) - len(a.created) for a in apps),
            tuple(a.matched for a in apps),
        )
        for rule_id, apps in by_rule.items()
    )


def report_model(
    model: str | Path | ir.Model,
    *,
    rules: Sequence[CompiledRule] | None = None,
    with_opt_in: Sequence[CompiledRule] = (),
    target: str | Path | Target = "onnx",
    opset: int | None = None,
    dims: Mapping[str, int] | None = None,
    device: str | Path | Device = "cpu",
    conv_algo: str = "direct",
    top: int = 10,
    fold_constants: bool = True,
) -> ModelReport:
    """Measure ``model`` and dry-run the rule set on it; the model on disk is never written.

    ``device`` is a built-in profile name (cpu, a100, h100), a YAML file or a Device;
    ``conv_algo`` is direct, im2col or indirect; ``top`` is how many of the heaviest
    kernels :meth:`ModelReport.top_nodes` lists. ``with_opt_in`` is the rule set with the
    opt-in rules (``load_rule_set(..., opt_in=True)``): when an opt-in rule that ``rules``
    left out applies to the model, a second dry run says what it would add.
    """
    profile = load_device(device)  # a bad profile fails before any model work
    active = resolve_target(target)
    bound = dict(dims or {})
    result = optimize(model, rules=rules, target=active, opset=opset, dims=bound, check=False,
                      fold_constants=fold_constants, conv_algo=conv_algo)
    chosen = ({r.id for r in rules} if rules is not None
              else {r.id for r in with_opt_in if not r.rule.opt_in})
    present = set(result.ops_before) | set(result.ops_after)
    left_out = {r.id: r.rule.opt_in for r in with_opt_in
                if r.rule.opt_in and r.id not in chosen and _could_match(r, present)
                and not r.skip_reason(result.model, active.names)}
    opt_in = None
    if left_out:
        wider = [r for r in with_opt_in if r.id in left_out or r.id in chosen]
        again = optimize(model, rules=wider, target=active, opset=opset, dims=bound,
                         check=False, fold_constants=fold_constants, conv_algo=conv_algo)
        fired = _summaries([a for a in again.rewrite.applications if a.rule_id in left_out])
        if fired:
            opt_in = OptInSummary(
                fired, {r.rule_id: left_out[r.rule_id] for r in fired},
                result.traffic_after.total_bytes - again.traffic_after.total_bytes,
                result.traffic_after.kernel_count - again.traffic_after.kernel_count)
    return ModelReport(
        source=result.source,
        target=_target_name(target, active),
        conv_algo=conv_algo,
        dims=bound,
        device=profile,
        top=top,
        dry_run=result,
        roofline_before=roofline(result.traffic_before, profile),
        roofline_after=roofline(result.traffic_after, profile),
        opt_in=opt_in,
    )


def _could_match(rule: CompiledRule, ops: set[str]) -> bool:
    """Whether an op the rule's pattern is rooted at is in the model before or after the
    dry run (keys as ``op_histogram`` writes them): else a second dry run is not worth its
    cost (a load, a preparation and a rewrite of the whole model)."""
    return any((f"{domain}.{op}" if domain else op) in ops for domain, op in rule.root_ops)


def _target_name(spec: str | Path | Target, active: Target) -> str:
    if isinstance(spec, Target):
        return "+".join(active.names)
    return str(spec)


# --------------------------------------------------------------------------- JSON view


def _round(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else float(f"{value:.{digits}g}")


def _node_dict(row: NodeRoofline, rule: str | None) -> dict[str, Any]:
    n = row.node
    return {
        "name": n.name,
        "op": n.op_type,
        "domain": n.domain,
        "bytes_read": n.bytes_read,
        "bytes_written": n.bytes_written,
        "bytes": n.bytes_total,
        "workspace_bytes": n.workspace_bytes,
        "flops": n.flops,
        "macs": n.macs,
        "param_bytes": n.param_bytes,
        "intensity": _round(row.intensity),
        "seconds": _round(row.seconds),
        "bound": row.bound,
        "known": n.known,
        "flops_counted": n.flops_counted,
        "rule": rule,
    }


def _totals(traffic: TrafficReport, line: Roofline) -> dict[str, Any]:
    moved = traffic.total_bytes
    return {
        "bytes_read": traffic.bytes_read,
        "bytes_written": traffic.bytes_written,
        "bytes": moved,
        "workspace_bytes": traffic.workspace_bytes,
        "flops": traffic.flops,
        "macs": traffic.macs,
        "param_bytes": traffic.param_bytes,
        "kernels": traffic.kernel_count,
        "nodes": traffic.node_count,
        "unknown_shape_nodes": traffic.unknown_nodes,
        "intensity": _round(traffic.flops / moved) if moved else None,
        "seconds": _round(line.seconds),
        "memory_bound_kernels": line.count("memory"),
        "compute_bound_kernels": line.count("compute"),
    }


def report_document(report: ModelReport) -> dict[str, Any]:
    """The ``--json`` document of ``fusectl report`` (schema ``fusectl.report/1``)."""
    before, after = report.before, report.after
    saved = before.total_bytes - after.total_bytes
    seconds_before, seconds_after = report.roofline_before.seconds, report.roofline_after.seconds
    fused, made = report.rule_of_node()
    rewrite = report.dry_run.rewrite
    device = report.device
    not_counted = sorted(set(before.not_counted) | set(after.not_counted))
    return {
        "schema": REPORT_SCHEMA,
        "fusectl_version": __version__,
        "model": report.source,
        "target": report.target,
        "conv_algo": report.conv_algo,
        "dims": dict(report.dims),
        "device": {
            "name": device.name,
            "description": device.description,
            "source": device.source,
            "bandwidth_gb_s": device.bandwidth / 1e9,
            "peak_gflop_s": device.peak_flops / 1e9,
            "ridge_flop_per_byte": _round(device.ridge),
        },
        "totals": {"before": _totals(before, report.roofline_before),
                   "after": _totals(after, report.roofline_after)},
        "saved": {
            "bytes": saved,
            "percent": round(100.0 * saved / before.total_bytes, 3) if before.total_bytes else 0.0,
            "kernels": before.kernel_count - after.kernel_count,
            "seconds": _round(seconds_before - seconds_after),
            "speedup": _round(seconds_before / seconds_after) if seconds_after else None,
        },
        "flops_not_counted": not_counted,
        "constant_nodes_folded": report.dry_run.prepared.folded_nodes,
        "ops": {"before": dict(report.dry_run.ops_before),
                "after": dict(report.dry_run.ops_after)},
        "top_nodes": [
            {"name": row.node.name, "op": row.node.op_type, "bytes": row.node.bytes_total,
             "percent": round(100.0 * row.node.bytes_total / before.total_bytes, 3)
             if before.total_bytes else 0.0,
             "bound": row.bound}
            for row in report.top_nodes()
        ],
        "nodes": [_node_dict(row, fused.get(row.node.name))
                  for row in report.roofline_before.nodes],
        "nodes_after": [_node_dict(row, made.get(row.node.name))
                        for row in report.roofline_after.nodes],
        "rules": {
            "run": list(rewrite.rules_run),
            "would_fire": [
                {"id": r.rule_id, "applications": r.applications, "bytes_saved": r.bytes_saved,
                 "kernels_saved": r.kernels_saved, "where": [list(m) for m in r.where]}
                for r in report.rules
            ],
            "skipped": [{"id": rule_id, "reason": reason} for rule_id, reason in rewrite.skipped],
            "opt_in_would_fire": [] if report.opt_in is None else [
                {"id": r.rule_id, "applications": r.applications, "bytes_saved": r.bytes_saved,
                 "kernels_saved": r.kernels_saved, "why_off": report.opt_in.reasons[r.rule_id]}
                for r in report.opt_in.rules
            ],
            "passes": rewrite.passes,
            "converged": rewrite.converged,
        },
        "applications": [app.to_dict() for app in rewrite.applications],
    }

