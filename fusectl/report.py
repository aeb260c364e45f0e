"""Reports from result objects: rich terminal tables and a JSON document.

The only module that imports rich. The JSON carries the same numbers as the
terminal report; its schema is versioned (``schema``) and documented in the
README.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn
from rich.table import Table
from rich.text import Text

from . import __version__
from .api import Bisection, OptimizeResult
from .gates import GateResult
from .rewrite import Application
from .ruletest import TestOutcome
from .traffic import TrafficReport
from .validate import (
    HISTOGRAM_LABELS,
    OutputComparison,
    ProgressStep,
    ValidationResult,
    comparison_to_dict,
)
from .validate import to_dict as validation_to_dict

JSON_SCHEMA = "fusectl.optimize/1"


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; negative numbers keep their sign."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    return f"{sign}{n:.1f} TiB"


def _pct(saved: float, total: float) -> str:
    return f"{100.0 * saved / total:.1f}%" if total else "0.0%"


def _fmt_float(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.3g}"


# ------------------------------------------------------------------------ terminal


Cell = str | Text


def text_table(title: str, columns: Iterable[str], rows: Iterable[Iterable[Cell]],
               right: Iterable[str] = ()) -> Table:
    """A table whose string cells are literal text: node names and reasons may contain
    ``[``, which rich would read as markup."""
    aligned = set(right)
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, justify="right" if column in aligned else "left")
    for row in rows:
        table.add_row(*(Text(cell) if isinstance(cell, str) else cell for cell in row))
    return table


def print_optimize(result: OptimizeResult, console: Console, *, verbose: bool = False,
                   output: str | None = None) -> None:
    """The terminal report of ``fusectl optimize``."""
    rw = result.rewrite
    title = Text.assemble(("fusectl optimize ", "bold"), (result.source or "<model>", "cyan"))
    console.print(title)
    for note in result.input_repairs:
        console.print(Text(f"note: {note}"), style="yellow")
    if result.prepared.folded_nodes:
        console.print(f"folded {result.prepared.folded_nodes} constant nodes before matching")

    counts, saved = rw.counts(), rw.saved_by_rule()
    if counts:
        console.print(text_table(
            "Rules applied", ("rule", "applications", "bytes saved"),
            ((rule_id, str(count), human_bytes(saved[rule_id]))
             for rule_id, count in counts.items()),
            right=("applications", "bytes saved"),
        ))
    else:
        console.print("[yellow]no rule fired[/yellow]")
    if rw.capped:
        console.print(f"[yellow]capped (possible runaway): {', '.join(rw.capped)}[/yellow]")
    if not rw.converged:
        console.print(f"[yellow]rules still fired after {rw.passes} passes; stopped there "
                      "(no fixed point)[/yellow]")
    if verbose and rw.skipped:
        console.print(text_table("Rules skipped", ("rule", "reason"), rw.skipped))
    elif rw.skipped:
        console.print(f"{len(rw.skipped)} rules skipped for this model (--verbose lists why)")
    if verbose and rw.rejections:
        console.print(text_table("Matches refused by a condition", ("rule", "node", "reason"),
                             ((r.rule_id, r.node, r.reason) for r in rw.rejections)))

    ops = Table(title="Ops before -> after", title_justify="left")
    ops.add_column("op")
    ops.add_column("before", justify="right")
    ops.add_column("after", justify="right")
    for op in sorted(set(result.ops_before) | set(result.ops_after)):
        before, after = result.ops_before.get(op, 0), result.ops_after.get(op, 0)
        if verbose or before != after:
            ops.add_row(op, str(before), str(after))
    ops.add_row("[bold]nodes[/bold]", str(result.nodes_before), str(result.nodes_after))
    console.print(ops)

    tb, ta = result.traffic_before, result.traffic_after
    summary = Table(title="Memory traffic (SPEC §6 model)", title_justify="left")
    summary.add_column("")
    summary.add_column("before", justify="right")
    summary.add_column("after", justify="right")
    summary.add_column("saved", justify="right")
    saved_bytes = tb.total_bytes - ta.total_bytes
    summary.add_row("bytes moved", human_bytes(tb.total_bytes), human_bytes(ta.total_bytes),
                    f"{human_bytes(saved_bytes)} ({_pct(saved_bytes, tb.total_bytes)})")
    summary.add_row("kernels", str(tb.kernel_count), str(ta.kernel_count),
                    str(tb.kernel_count - ta.kernel_count))
    summary.add_row("FLOPs", f"{tb.flops:,}", f"{ta.flops:,}", f"{tb.flops - ta.flops:,}")
    summary.add_row("parameters", human_bytes(tb.param_bytes), human_bytes(ta.param_bytes), "")
    console.print(summary)
    if tb.unknown_nodes or ta.unknown_nodes:
        console.print(f"[yellow]{tb.unknown_nodes} nodes before and {ta.unknown_nodes} after "
                      "have unknown shapes; their traffic is partial (bind symbolic dims with "
                      "--dim)[/yellow]")
    if verbose:
        console.print(text_table(
            "Top nodes by traffic (after)", ("node", "op", "read", "written"),
            ((n.name, n.op_type, human_bytes(n.bytes_read), human_bytes(n.bytes_written))
             for n in ta.top(10)),
            right=("read", "written"),
        ))
    print_validation(result, console, verbose=verbose)
    if output:
        console.print(f"wrote {output}")


def print_validation(result: OptimizeResult, console: Console, *,
                     verbose: bool = False) -> None:
    """Validation verdicts per output, what bisection reverted, the rewrite boundaries
    compared (``--check-intermediates``) and, when ``verbose``, the error histograms."""
    validation = result.validation
    if validation is None:
        console.print("[yellow]validation skipped (--no-validate)[/yellow]")
        return
    title = "Validation on onnxruntime (optimizations disabled)"
    bisection = result.bisection
    if bisection is not None:
        _print_comparisons(bisection.initial, console, verbose, title + ": every rule applied")
        _print_bisection(bisection, console)
        if bisection.reverted:
            title += ": after reverting"
    if bisection is None or bisection.reverted:
        _print_comparisons(validation, console, verbose, title)
    if result.intermediates is not None:
        _print_boundaries(result, console)
    if bisection is not None and bisection.reverted and validation.passed:
        count = len(bisection.reverted)
        console.print(f"validation: [yellow]outputs differed; they match after reverting {count} "
                      f"rule application{'s' if count > 1 else ''}[/yellow]")
        return
    verdict = "[green]outputs match[/green]" if validation.passed else "[red]outputs differ[/red]"
    console.print(f"validation: {verdict}")


def _print_comparisons(validation: ValidationResult, console: Console, verbose: bool,
                       title: str) -> None:
    table = Table(title=title, title_justify="left")
    several = validation.samples > 1
    columns = ["output", *(["sample"] if several else []), "dtype", "shape", "max abs",
               "max rel", "cosine", "% out", "status"]
    for col in columns:
        table.add_column(col, justify="right" if col in _NUMERIC_COLUMNS else "left")
    for out in validation.outputs:
        status = "[green]ok[/green]" if out.passed else "[red]MISMATCH[/red]"
        if out.nondeterministic:
            status = "[yellow]non-deterministic[/yellow]"
        sample = "fp16 range" if out.range_sample else str(out.sample)
        cells = [Text(out.name), *([sample] if several else []), out.dtype,
                 str(list(out.shape)), _fmt_float(out.max_abs), _fmt_float(out.max_rel),
                 _fmt_float(out.cosine), _fmt_float(out.pct_out_of_tol), status]
        table.add_row(*cells)
    console.print(table)
    if validation.compute_dtype:
        console.print(f"the model computes in {validation.compute_dtype}: its float outputs are "
                      f"judged with {validation.compute_dtype} tolerances")
    if validation.range_scale:
        scale = f"{validation.range_scale:g}"
        console.print(f"fp16 range sample: generated floats in [-{scale}, {scale}), the widest "
                      "range the model's own float16 values stay finite in")
    if validation.batch_note:
        console.print(Text(validation.batch_note, style="yellow"))
    if validation.error:
        console.print(Text(validation.error, style="red"))
    for out in validation.outputs:
        if not out.passed and out.reason:
            console.print(Text(f"  {out.name}: {out.reason}", style="red"))
        elif out.float64_floor is not None:  # passed on the reference's own rounding error
            console.print(Text(f"  {out.name}: {out.reason}", style="yellow"))
    if verbose:
        for out in validation.outputs:
            _print_histogram(out, console)


_NUMERIC_COLUMNS = {"max abs", "max rel", "cosine", "% out", "count"}


def _bucket_text(label: str) -> str:
    if label == "0":
        return "exact"
    if label == "nan/inf":
        return "NaN/Inf mismatch"
    if label.startswith(("<", ">=")):
        return label.replace(">=", ">= ")
    exponent = int(label[2:])
    return f"[1e{exponent}, 1e{exponent + 1})"


def _print_histogram(out: OutputComparison, console: Console) -> None:
    """Absolute errors of one output per decade, as a small bar chart."""
    if not out.histogram:
        return
    total = max(sum(out.histogram), 1)
    sample = " (fp16 range sample)" if out.range_sample else f" (sample {out.sample})"
    table = Table(title=f"|candidate - reference| of {out.name}{sample}", title_justify="left")
    for col in ("error", "count", ""):
        table.add_column(col, justify="right" if col == "count" else "left")
    for label, count in zip(HISTOGRAM_LABELS, out.histogram, strict=True):
        if count:
            bar = "#" * max(1, round(30 * count / total))
            table.add_row(_bucket_text(label), str(count), bar)
    console.print(table)


def _application_text(app: Application) -> Text:
    return Text.assemble((app.rule_id, "bold"), " on ", ", ".join(app.matched))


def _print_bisection(bisection: Bisection, console: Console) -> None:
    seconds = f"{bisection.validations} candidate validations, {bisection.seconds:.1f} s"
    if not bisection.explained:
        console.print(Text(
            f"bisection ({seconds}): the prepared model without any rule application already "
            "differs (constant folding or a non-deterministic model); nothing reverted",
            style="red"))
        return
    console.print(Text(f"bisection ({seconds}) reverted {len(bisection.reverted)} rule "
                       "application(s) that changed outputs:", style="yellow"))
    unverified = set(bisection.unverified)
    for app in bisection.reverted:
        note = " (unverified: bisection budget ran out)" if app in unverified else ""
        console.print(Text("  ").append_text(_application_text(app)).append(note))
    if bisection.lost:
        console.print(Text(f"{len(bisection.lost)} other application(s) built on a reverted "
                           "one and were not re-applied:", style="yellow"))
        for app in bisection.lost:
            console.print(Text("  ").append_text(_application_text(app)))


def _print_boundaries(result: OptimizeResult, console: Console) -> None:
    boundaries = result.intermediates or ()
    if not boundaries:
        console.print("intermediate values: no rewrite boundary exists by name in both models")
        return
    table = Table(title="Values at rewrite boundaries (topological order)",
                  title_justify="left")
    for col in ("value", "rule", "max abs", "max rel", "% out", "status"):
        table.add_column(col, justify="right" if col in _NUMERIC_COLUMNS else "left")
    for boundary in boundaries:
        out = boundary.comparison
        status = "[green]ok[/green]" if out.passed else "[red]DRIFT[/red]"
        if out.nondeterministic:
            status = "[yellow]non-deterministic[/yellow]"
        table.add_row(Text(boundary.value), Text(boundary.application.rule_id),
                      _fmt_float(out.max_abs), _fmt_float(out.max_rel),
                      _fmt_float(out.pct_out_of_tol), status)
    console.print(table)
    drift = result.first_drift
    if drift is not None:
        console.print(Text("first drift: ", style="red").append(drift.value).append(
            " (").append_text(_application_text(drift.application)).append(")"))


@contextlib.contextmanager
def validation_progress(console: Console, *, enabled: bool) -> Iterator[Callable[[str], None]]:
    """A progress callback: stage names, and a bar over a session's runs (ProgressStep)."""
    if not enabled:
        yield lambda _message: None
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               MofNCompleteColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("starting", total=None)

        def update(message: str) -> None:
            if isinstance(message, ProgressStep):
                bar.update(task, description=str(message), completed=message.done,
                           total=message.total)
            else:
                bar.update(task, description=str(message), completed=0, total=None)

        yield update


def print_rule_tests(outcomes: Iterable[TestOutcome], console: Console) -> None:
    outcomes = list(outcomes)
    failed = [o for o in outcomes if not o.passed]
    for outcome in failed:
        console.print(f"[red]FAIL[/red] {outcome.rule_id} / {outcome.test} ({outcome.location})")
        for problem in outcome.problems:
            console.print(f"     {problem}")
    passed = len(outcomes) - len(failed)
    colour = "red" if failed else "green"
    console.print(f"[{colour}]{passed} passed, {len(failed)} failed[/{colour}]")


# ---------------------------------------------------------------------------- json


def optimize_json(result: OptimizeResult, *, output: str | None = None,
                  gates: Iterable[GateResult] = ()) -> dict[str, Any]:
    """The ``--json`` document of ``fusectl optimize`` (schema ``fusectl.optimize/1``);
    ``gates`` are the verdicts of the CI gates the run was given."""
    tb, ta = result.traffic_before, result.traffic_after
    rw = result.rewrite
    saved = rw.saved_by_rule()
    return {
        "schema": JSON_SCHEMA,
        "fusectl_version": __version__,
        "model": result.source,
        "output": output,
        "passed": result.passed,
        "input_repairs": list(result.input_repairs),
        "rules": {
            "run": list(rw.rules_run),
            "applied": [
                {"id": rule_id, "applications": count, "bytes_saved": saved[rule_id]}
                for rule_id, count in rw.counts().items()
            ],
            "skipped": [{"id": rule_id, "reason": reason} for rule_id, reason in rw.skipped],
            "capped": list(rw.capped),
            "passes": rw.passes,
            "converged": rw.converged,
        },
        "applications": [app.to_dict() for app in rw.applications],
        "ops": {"before": dict(result.ops_before), "after": dict(result.ops_after)},
        "nodes": {"before": result.nodes_before, "after": result.nodes_after},
        "constant_nodes_folded": result.prepared.folded_nodes,
        "traffic": {
            "bytes_before": tb.total_bytes,
            "bytes_after": ta.total_bytes,
            "bytes_saved": tb.total_bytes - ta.total_bytes,
            "percent_saved": round(100.0 * (tb.total_bytes - ta.total_bytes) / tb.total_bytes, 3)
            if tb.total_bytes else 0.0,
            "kernels_before": tb.kernel_count,
            "kernels_after": ta.kernel_count,
            "flops_before": tb.flops,
            "flops_after": ta.flops,
            "param_bytes_before": tb.param_bytes,
            "param_bytes_after": ta.param_bytes,
            "unknown_shape_nodes_after": ta.unknown_nodes,
        },
        "validation": validation_to_dict(result.validation) if result.validation else None,
        "bisection": _bisection_json(result.bisection),
        "intermediates": None if result.intermediates is None else [
            {"value": b.value, "rule": b.application.rule_id,
             "matched": list(b.application.matched), **comparison_to_dict(b.comparison)}
            for b in result.intermediates
        ],
        "seconds": {k: round(v, 4) for k, v in result.seconds.items()},
        "node_traffic": {"before": _node_rows(tb), "after": _node_rows(ta)},
        "gates": [gate.to_dict() for gate in gates],
    }


def _node_rows(report: TrafficReport) -> list[dict[str, Any]]:
    """Per-node traffic in graph order: what the HTML chart draws, bar by bar."""
    return [
        {
            "name": n.name,
            "op": n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}",
            "bytes_read": n.bytes_read,
            "bytes_written": n.bytes_written,
            "flops": n.flops,
            "kernel": n.is_kernel,
            "known": n.known,
        }
        for n in report.nodes
    ]


def _bisection_json(bisection: Bisection | None) -> dict[str, Any] | None:
    """What bisection reverted and why; ``validation`` then describes the kept model."""
    if bisection is None:
        return None

    def apps(applications: Iterable[Application]) -> list[dict[str, Any]]:
        return [{"rule": a.rule_id, "matched": list(a.matched), "created": list(a.created)}
                for a in applications]

    return {
        "explained": bisection.explained,
        "reverted": apps(bisection.reverted),
        "unverified": apps(bisection.unverified),
        "lost": apps(bisection.lost),
        "validations": bisection.validations,
        "seconds": round(bisection.seconds, 4),
        "initial_validation": validation_to_dict(bisection.initial),
    }


def write_json(document: dict[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=2, allow_nan=False)
        f.write("\n")
