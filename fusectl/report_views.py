"""Rich terminal views of ``fusectl report`` and ``fusectl diff`` results.

Kept beside report.py (which renders optimize) so each view module stays small; like it,
this module only reads result objects and prints.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .analysis import ModelReport
from .diff import DiffResult, SignatureDiff
from .report import Cell, human_bytes
from .report import text_table as _table
from .roofline import NodeRoofline
from .validate import ValidationResult

__all__ = ["human_count", "human_seconds", "print_diff", "print_report"]

_LIST_LIMIT = 20


def human_seconds(seconds: float) -> str:
    """0.0000123 -> '12.3 µs'; the roofline estimates span ns to seconds."""
    sign = "-" if seconds < 0 else ""
    value = abs(seconds)
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if value >= scale:
            return f"{sign}{value / scale:.3g} {unit}"
    return f"{sign}{value / 1e-9:.3g} ns"


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "0.0%"


def _intensity(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _where(applications: Sequence[Sequence[str]], limit: int = 3) -> str:
    shown = ", ".join("+".join(matched) for matched in applications[:limit])
    more = len(applications) - limit
    return shown + (f" (+{more} more)" if more > 0 else "")


def human_count(n: float) -> str:
    """4718592 -> '4.72M': FLOP counts readable in a narrow column."""
    sign = "-" if n < 0 else ""
    value = abs(float(n))
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{sign}{value / scale:.3g}{unit}"
    return f"{sign}{value:.0f}"


# --------------------------------------------------------------------------- report


def _node_rows(rows: Iterable[NodeRoofline], rules: dict[str, str]) -> Iterable[list[str]]:
    for row in rows:
        n = row.node
        yield [n.name, n.op_type, human_bytes(n.bytes_total), human_count(n.flops),
               _intensity(row.intensity), human_seconds(row.seconds), row.bound,
               rules.get(n.name, "")]


_NODE_COLUMNS = ("node", "op", "bytes", "FLOPs", "FLOP/B", "time", "bound", "fused by")
_NODE_RIGHT = ("bytes", "FLOPs", "FLOP/B", "time")


def print_report(report: ModelReport, console: Console, *, verbose: bool = False) -> None:
    """The terminal view of ``fusectl report``."""
    device = report.device
    console.print(Text.assemble(("fusectl report ", "bold"), (report.source or "<model>", "cyan")))
    console.print(
        f"device {device.name}: {device.bandwidth / 1e9:g} GB/s, "
        f"{device.peak_flops / 1e9:g} GFLOP/s (ridge {device.ridge:.3g} FLOP/B); "
        f"conv algorithm {report.conv_algo}; target {report.target}",
        markup=False,
    )
    before, after = report.before, report.after
    rb, ra = report.roofline_before, report.roofline_after
    saved = before.total_bytes - after.total_bytes
    totals = Table(title="Totals (after = dry run of the rules; nothing is written)",
                   title_justify="left")
    for column in ("", "before", "after", "saved"):
        totals.add_column(column, justify="left" if not column else "right")
    totals.add_row("bytes moved", human_bytes(before.total_bytes), human_bytes(after.total_bytes),
                   f"{human_bytes(saved)} ({_pct(saved, before.total_bytes)})")
    totals.add_row("bytes read", human_bytes(before.bytes_read), human_bytes(after.bytes_read),
                   human_bytes(before.bytes_read - after.bytes_read))
    totals.add_row("bytes written", human_bytes(before.bytes_written),
                   human_bytes(after.bytes_written),
                   human_bytes(before.bytes_written - after.bytes_written))
    if before.workspace_bytes or after.workspace_bytes:
        totals.add_row(f"{report.conv_algo} buffers", human_bytes(before.workspace_bytes),
                       human_bytes(after.workspace_bytes), "")
    totals.add_row("kernels", str(before.kernel_count), str(after.kernel_count),
                   str(before.kernel_count - after.kernel_count))
    totals.add_row("FLOPs", human_count(before.flops), human_count(after.flops),
                   human_count(before.flops - after.flops))
    totals.add_row("MACs", human_count(before.macs), human_count(after.macs), "")
    totals.add_row("parameters", human_bytes(before.param_bytes), human_bytes(after.param_bytes),
                   "")
    totals.add_row("FLOP/B",
                   _intensity(before.flops / before.total_bytes if before.total_bytes else None),
                   _intensity(after.flops / after.total_bytes if after.total_bytes else None), "")
    speedup = f" ({rb.seconds / ra.seconds:.2f}x)" if ra.seconds else ""
    totals.add_row("roofline time", human_seconds(rb.seconds), human_seconds(ra.seconds),
                   human_seconds(rb.seconds - ra.seconds) + speedup)
    totals.add_row("memory-bound", f"{rb.count('memory')} of {len(rb.nodes)}",
                   f"{ra.count('memory')} of {len(ra.nodes)}", "")
    console.print(totals)
    if before.unknown_nodes:
        console.print(f"[yellow]{before.unknown_nodes} nodes have unknown shapes; their cost is "
                      "a lower bound (bind symbolic dims with --dim)[/yellow]")
    not_counted = sorted(set(before.not_counted) | set(after.not_counted))
    if not_counted:
        console.print(f"FLOPs not modelled for: {', '.join(not_counted)}", markup=False)

    fused, _made = report.rule_of_node()
    top = report.top_nodes()
    if top:
        console.print(_table(f"Top {len(top)} kernels by traffic (before)", _NODE_COLUMNS,
                             _node_rows(top, fused), right=_NODE_RIGHT))
    summaries = report.rules
    if summaries:
        console.print(_table(
            "Rules that would fire (dry run)",
            ("rule", "applications", "bytes saved", "kernels saved", "where"),
            ([r.rule_id, str(r.applications), human_bytes(r.bytes_saved), str(r.kernels_saved),
              _where(r.where)] for r in summaries),
            right=("applications", "bytes saved", "kernels saved"),
        ))
    else:
        console.print("no rule would fire")
    opt_in = report.opt_in
    if opt_in is not None and opt_in.rules:
        columns = ("rule", "applications", "bytes saved", *(("why it is off",) if verbose else ()))
        console.print(_table(
            f"Opt-in rules that would also fire (--opt-in ID): {human_bytes(opt_in.bytes_saved)} "
            f"and {opt_in.kernels_saved} kernels more"
            + ("" if verbose else " (--verbose says why they are off)"),
            columns,
            ([r.rule_id, str(r.applications), human_bytes(r.bytes_saved),
              *((opt_in.reasons[r.rule_id],) if verbose else ())] for r in opt_in.rules),
            right=("applications", "bytes saved"),
        ))
    skipped = report.dry_run.rewrite.skipped
    if verbose:
        console.print(_table("All kernels (before)", _NODE_COLUMNS,
                             _node_rows(rb.nodes, fused), right=_NODE_RIGHT))
        if skipped:
            console.print(_table("Rules skipped", ("rule", "reason"), skipped))
    elif skipped:
        console.print(f"{len(skipped)} rules skipped for this model (--verbose lists why)")


# --------------------------------------------------------------------------- diff


def _signature_rows(kind: str, diff: SignatureDiff) -> Iterable[list[str]]:
    for sig in diff.removed:
        yield [kind, sig.name, sig.text(), "(absent)"]
    for sig in diff.added:
        yield [kind, sig.name, "(absent)", sig.text()]
    for a, b in diff.changed:
        yield [kind, a.name, a.text(), b.text()]


def _limited(rows: list[list[str]], verbose: bool) -> tuple[list[list[str]], int]:
    if verbose or len(rows) <= _LIST_LIMIT:
        return rows, 0
    return rows[:_LIST_LIMIT], len(rows) - _LIST_LIMIT


def _print_limited(console: Console, title: str, columns: Sequence[str],
                   rows: list[list[str]], verbose: bool) -> None:
    if not rows:
        return
    shown, hidden = _limited(rows, verbose)
    console.print(_table(title, columns, shown))
    if hidden:
        console.print(f"... and {hidden} more (--verbose or --json lists them all)")


def _validation_table(validation: ValidationResult) -> Table:
    rows = []
    for out in validation.outputs:
        status = Text("ok", style="green") if out.passed else Text("DIFFERS", style="red")
        if out.nondeterministic:
            status = Text("non-deterministic", style="yellow")
        rows.append([out.name, out.dtype, str(list(out.shape)), f"{out.max_abs:.3g}",
                     f"{out.max_rel:.3g}", f"{out.cosine:.6g}", f"{out.pct_out_of_tol:.3g}",
                     status])
    return _table("Outputs on the same inputs (onnxruntime, optimizations disabled)",
                  ("output", "dtype", "shape", "max abs", "max rel", "cosine", "% out",
                   "status"), rows)


def print_diff(result: DiffResult, console: Console, *, verbose: bool = False) -> None:
    """The terminal view of ``fusectl diff``."""
    console.print(Text.assemble(("fusectl diff ", "bold"), (result.a, "cyan"), " -> ",
                                (result.b, "cyan")))
    if result.io_same:
        console.print("IO signature: [green]same[/green]")
    else:
        console.print(_table("IO signature differs", ("", "name", "A", "B"),
                             [*_signature_rows("input", result.inputs),
                              *_signature_rows("output", result.outputs)]))
    if result.opsets_same:
        console.print("opsets: same")
    else:
        domains = sorted(set(result.opsets_a) | set(result.opsets_b))
        console.print(_table("Opsets", ("domain", "A", "B"), (
            [d or "ai.onnx", str(result.opsets_a.get(d, "-")), str(result.opsets_b.get(d, "-"))]
            for d in domains if result.opsets_a.get(d) != result.opsets_b.get(d))))
    if result.ir_version_a != result.ir_version_b:
        console.print(f"IR version: {result.ir_version_a} -> {result.ir_version_b}")

    ops = sorted(set(result.ops_a) | set(result.ops_b))
    count_a, count_b = result.ops_a, result.ops_b
    changed_ops: list[list[Cell]] = [[op, str(count_a.get(op, 0)), str(count_b.get(op, 0))]
                                     for op in ops if count_a.get(op, 0) != count_b.get(op, 0)]
    if changed_ops:
        changed_ops.append([Text("nodes", style="bold"), str(sum(result.ops_a.values())),
                            str(sum(result.ops_b.values()))])
        console.print(_table("Ops A -> B (changed counts)", ("op", "A", "B"), changed_ops,
                             right=("A", "B")))
    console.print(
        f"nodes: {result.nodes_unchanged} unchanged, {len(result.nodes_changed)} changed, "
        f"{len(result.nodes_removed)} removed, {len(result.nodes_added)} added"
    )
    _print_limited(console, "Nodes removed (only in A)", ("node", "op"),
                   [[r.name, r.op] for r in result.nodes_removed], verbose)
    _print_limited(console, "Nodes added (only in B)", ("node", "op"),
                   [[r.name, r.op] for r in result.nodes_added], verbose)
    _print_limited(console, "Nodes changed", ("A", "B", "paired by", "changes"),
                   [[c.a.name, c.b.name, c.matched_by, "; ".join(c.changes)]
                    for c in result.nodes_changed], verbose)
    console.print(
        f"initializers: {result.initializers_unchanged} unchanged, "
        f"{len(result.initializers_changed)} changed, {len(result.initializers_removed)} "
        f"removed, {len(result.initializers_added)} added"
    )
    _print_limited(console, "Initializers changed", ("name", "A", "B", "changes", "max |a-b|"), [
        [c.a.name, c.a.text(), c.b.text(), ", ".join(c.changes),
         "-" if c.max_abs_diff is None else f"{c.max_abs_diff:.3g}"]
        for c in result.initializers_changed], verbose)
    _print_limited(console, "Initializers removed / added", ("", "name", "type"), [
        *(["removed", s.name, s.text()] for s in result.initializers_removed),
        *(["added", s.name, s.text()] for s in result.initializers_added)], verbose)

    ta, tb = result.traffic_a, result.traffic_b
    console.print(_table("Traffic and FLOPs (SPEC §6 model)", ("", "A", "B", "B - A"), [
        ["bytes moved", human_bytes(ta.total_bytes), human_bytes(tb.total_bytes),
         f"{human_bytes(tb.total_bytes - ta.total_bytes)} "
         f"({_pct(tb.total_bytes - ta.total_bytes, ta.total_bytes)})"],
        ["kernels", str(ta.kernel_count), str(tb.kernel_count),
         f"{tb.kernel_count - ta.kernel_count:+d}"],
        ["FLOPs", f"{ta.flops:,}", f"{tb.flops:,}", f"{tb.flops - ta.flops:+,}"],
        ["MACs", f"{ta.macs:,}", f"{tb.macs:,}", f"{tb.macs - ta.macs:+,}"],
        ["parameters", human_bytes(ta.param_bytes), human_bytes(tb.param_bytes),
         human_bytes(tb.param_bytes - ta.param_bytes)],
    ], right=("A", "B", "B - A")))

    if result.validation is not None:
        console.print(_validation_table(result.validation))
        if result.validation.error:
            console.print(result.validation.error, style="red", markup=False)
        verdict = ("[green]outputs match[/green]" if result.validation.passed
                   else "[red]outputs differ[/red]")
        console.print(f"numerics: {verdict}")
    else:
        console.print(f"numerics: not compared ({result.validation_skipped})", markup=False)
    if result.passed:
        same = "identical" if result.structurally_identical else "compatible"
        console.print(f"diff: [green]{same}[/green]")
    else:
        reasons = []
        if not result.io_same:
            reasons.append("IO signature differs")
        if not result.numerics_passed:
            reasons.append("outputs differ")
        console.print(f"diff: [red]{' and '.join(reasons)}[/red]")
