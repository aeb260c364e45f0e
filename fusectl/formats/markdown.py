"""Markdown for a pull-request comment or ``$GITHUB_STEP_SUMMARY``: the headline saving
first, then short tables (long ones are cut, failures first, so a comment stays readable
and under GitHub's size limits). Every model-provided string is escaped: a node name
cannot open a link, a table cell or an HTML tag."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .common import (
    dispatch,
    fmt_float,
    fmt_seconds,
    human_bytes,
    output_label,
    output_status,
    percent,
    sample_count,
)

MAX_ROWS = 30
TOP_NODES = 10
# Enough for text inside a line or table cell (names never start a line here): emphasis,
# code, links, tables, strikethrough; < > & become entities so no HTML tag can open.
_SPECIAL = re.compile(r"([\\`*_\[\]|~])")


def escape(text: object) -> str:
    """Plain text for a Markdown table cell or line: no markup, no HTML, one line."""
    s = " ".join(str(text).split())  # newlines would end the table row
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _SPECIAL.sub(r"\\\1", s)


def code(text: object) -> str:
    """Inline code that survives backticks in ``text``; pipes escaped for tables."""
    s = " ".join(str(text).split()).replace("|", "\\|")
    fence = "`" * (max((len(m) for m in re.findall(r"`+", s)), default=0) + 1)
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def table(header: Sequence[str], rows: Iterable[Sequence[str]], *,
          right: Iterable[int] = ()) -> list[str]:
    """Markdown table lines; cells must already be escaped."""
    right = set(right)
    align = ["---:" if i in right else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _cut(rows: list[Sequence[str]], what: str) -> tuple[list[Sequence[str]], list[str]]:
    if len(rows) <= MAX_ROWS:
        return rows, []
    return rows[:MAX_ROWS], ["", f"… and {len(rows) - MAX_ROWS} more {what} (see the JSON "
                                 "or HTML report)"]


def validation_lines(validation: Mapping[str, Any] | None) -> list[str]:
    """The per-output comparison table (mismatches first), or why there is none."""
    if validation is None:
        return ["Validation skipped (`--no-validate`)."]
    outputs = list(validation.get("outputs") or [])
    samples = sample_count(outputs)
    lines = []
    if validation.get("error"):
        lines += [f"**Validation error:** {escape(validation['error'])}", ""]
    outputs.sort(key=lambda o: output_status(o) == "ok")
    rows: list[Sequence[str]] = [
        (code(output_label(o, samples)), escape(o.get("dtype", "")),
         escape(o.get("shape", "")), fmt_float(o.get("max_abs")), fmt_float(o.get("max_rel")),
         fmt_float(o.get("cosine")), fmt_float(o.get("pct_out_of_tol")),
         {"ok": "✅ ok", "MISMATCH": "❌ **MISMATCH**"}.get(output_status(o),
                                                          "⚠️ non-deterministic"))
        for o in outputs
    ]
    rows, more = _cut(rows, "outputs")
    if rows:
        lines += table(("output", "dtype", "shape", "max abs", "max rel", "cosine", "% out",
                        "status"), rows, right=(3, 4, 5, 6)) + more
    return lines


def _bisection_lines(bisection: Mapping[str, Any] | None) -> list[str]:
    """What was reverted because it changed outputs (the table above is the kept model)."""
    if not bisection or not bisection.get("reverted"):
        return []
    reverted = list(bisection["reverted"])
    unverified = {(a.get("rule"), tuple(a.get("matched") or ())) for a in
                  bisection.get("unverified") or []}
    rows, more = _cut([(code(a.get("rule", "")), escape(", ".join(a.get("matched") or [])),
                        "unverified (budget)" if (a.get("rule"), tuple(a.get("matched") or ()))
                        in unverified else "changed outputs")
                       for a in reverted], "reverted applications")
    return ["", f"**❌ {len(reverted)} rule application(s) changed outputs and were reverted** "
                "(the table above checks the model that was kept):", "",
            *table(("rule", "nodes", "why"), rows), *more]


def _gate_lines(gates: Sequence[Mapping[str, Any]]) -> list[str]:
    if not gates:
        return []
    rows = [(code(g.get("gate", "")), escape(g.get("threshold", "")), escape(g.get("actual", "")),
             "✅ met" if g.get("passed") else "❌ **not met**") for g in gates]
    return ["", "### CI gates", "", *table(("gate", "required", "actual", "status"), rows)]


def _optimize(doc: Mapping[str, Any]) -> str:
    traffic = doc.get("traffic") or {}
    before, after = int(traffic.get("bytes_before", 0)), int(traffic.get("bytes_after", 0))
    saved = before - after
    validation = doc.get("validation")
    reverted = len((doc.get("bisection") or {}).get("reverted") or [])
    if validation is None:
        verdict = "⚠️ not validated"
    elif reverted and validation.get("passed"):
        verdict = f"⚠️ outputs match after reverting {reverted} rule application(s)"
    elif validation.get("passed"):
        verdict = "✅ outputs match"
    else:
        verdict = "❌ **outputs differ**"
    gates = list(doc.get("gates") or [])
    failed_gates = [g for g in gates if not g.get("passed")]
    lines = [
        f"## fusectl optimize {code(doc.get('model') or 'model')}",
        "",
        f"**Memory traffic {human_bytes(before)} → {human_bytes(after)}: "
        f"{human_bytes(saved)} saved ({percent(saved, before):.1f}%)** · "
        f"kernels {traffic.get('kernels_before', '?')} → {traffic.get('kernels_after', '?')} · "
        f"validation: {verdict}"
        + (f" · ❌ **{len(failed_gates)} gate(s) not met**" if failed_gates else ""),
        "",
    ]
    applied = list((doc.get("rules") or {}).get("applied") or [])
    applied.sort(key=lambda r: -int(r.get("bytes_saved", 0)))
    if applied:
        rows, more = _cut([(code(r.get("id", "")), str(r.get("applications", 0)),
                            human_bytes(int(r.get("bytes_saved", 0)))) for r in applied],
                          "rules")
        lines += ["### Rules applied", "",
                  *table(("rule", "applications", "bytes saved"), rows, right=(1, 2)), *more]
    else:
        lines += ["No rule fired."]
    lines += ["", "### Validation", "", *validation_lines(validation)]
    lines += _bisection_lines(doc.get("bisection"))
    lines += _gate_lines(gates)
    nodes = list((doc.get("node_traffic") or {}).get("after") or [])
    nodes.sort(key=lambda n: -(int(n.get("bytes_read", 0)) + int(n.get("bytes_written", 0))))
    if nodes:
        rows = [(code(n.get("name", "")), escape(n.get("op", "")),
                 human_bytes(int(n.get("bytes_read", 0))),
                 human_bytes(int(n.get("bytes_written", 0))))
                for n in nodes[:TOP_NODES]]
        lines += ["", f"### Top {len(rows)} nodes by traffic (after)", "",
                  *table(("node", "op", "read", "written"), rows, right=(2, 3))]
    lines += ["", f"<sub>fusectl {escape(doc.get('fusectl_version', ''))} · memory-traffic "
                  "model: every node is one kernel reading its inputs and writing its outputs "
                  "once</sub>"]
    return "\n".join(lines) + "\n"


def _rule_tests(doc: Mapping[str, Any]) -> str:
    tests = list(doc.get("tests") or [])
    failed = [t for t in tests if not t.get("passed")]
    lines = ["## fusectl rules test", "",
             f"**{len(tests) - len(failed)} passed, {len(failed)} failed**", ""]
    rows, more = _cut([(code(t.get("rule", "")), escape(t.get("test", "")),
                        escape("; ".join(t.get("problems") or [])),
                        escape(t.get("location", ""))) for t in failed], "failures")
    if rows:
        lines += table(("rule", "test", "problem", "where"), rows) + more
    return "\n".join(lines) + "\n"


def _report(doc: Mapping[str, Any]) -> str:
    totals = doc.get("totals") or {}
    before, after = totals.get("before") or {}, totals.get("after") or {}
    saved, device = doc.get("saved") or {}, doc.get("device") or {}
    speedup = saved.get("speedup")
    lines = [
        f"## fusectl report {code(doc.get('model') or 'model')}",
        "",
        f"**Memory traffic {human_bytes(int(before.get('bytes', 0)))}; the rules would save "
        f"{human_bytes(int(saved.get('bytes', 0)))} ({float(saved.get('percent', 0)):.1f}%)** · "
        f"kernels {before.get('kernels', '?')} → {after.get('kernels', '?')} · "
        f"roofline on {escape(device.get('name', '?'))}: {fmt_seconds(before.get('seconds'))} → "
        f"{fmt_seconds(after.get('seconds'))}" + (f" ({speedup:.2f}×)" if speedup else ""),
        "",
        "| | now | with the rules |",
        "| --- | ---: | ---: |",
    ]
    for label, key, fmt in (("bytes moved", "bytes", human_bytes),
                            ("FLOPs", "flops", "{:,}".format),
                            ("parameters", "param_bytes", human_bytes),
                            ("kernels", "kernels", str),
                            ("memory-bound kernels", "memory_bound_kernels", str),
                            ("estimated time", "seconds", fmt_seconds)):
        lines.append(f"| {label} | {fmt(before.get(key, 0))} | {fmt(after.get(key, 0))} |")
    fire = sorted((doc.get("rules") or {}).get("would_fire") or [],
                  key=lambda r: -int(r.get("bytes_saved", 0)))
    lines += ["", "### Rules that would fire", ""]
    if fire:
        rows, more = _cut([(code(r.get("id", "")), str(r.get("applications", 0)),
                            human_bytes(int(r.get("bytes_saved", 0))),
                            str(r.get("kernels_saved", 0))) for r in fire], "rules")
        lines += table(("rule", "applications", "bytes saved", "kernels saved"), rows,
                       right=(1, 2, 3)) + more
    else:
        lines.append("None.")
    opt_in = (doc.get("rules") or {}).get("opt_in_would_fire") or []
    if opt_in:
        rows, more = _cut([(code(r.get("id", "")), str(r.get("applications", 0)),
                            human_bytes(int(r.get("bytes_saved", 0))),
                            escape(r.get("why_off", ""))) for r in opt_in], "rules")
        lines += ["", "### Opt-in rules that would also fire (`--opt-in ID`)", "",
                  *table(("rule", "applications", "bytes saved", "why it is off"), rows,
                         right=(1, 2)), *more]
    top = list(doc.get("top_nodes") or [])
    if top:
        rows = [(code(n.get("name", "")), escape(n.get("op", "")),
                 human_bytes(int(n.get("bytes", 0))), f"{float(n.get('percent', 0)):.1f}%",
                 escape(n.get("bound", ""))) for n in top[:TOP_NODES]]
        lines += ["", f"### Top {len(rows)} nodes by traffic", "",
                  *table(("node", "op", "bytes", "share", "bound"), rows, right=(2, 3))]
    lines += ["", f"<sub>fusectl {escape(doc.get('fusectl_version', ''))} · device "
                  f"{escape(device.get('description') or device.get('name', ''))}</sub>"]
    return "\n".join(lines) + "\n"


def diff_verdict(doc: Mapping[str, Any]) -> str:
    """The one-line outcome of a diff, for headlines."""
    io_same = (doc.get("io") or {}).get("same", True)
    validation = doc.get("validation")
    if not io_same:
        return "❌ **IO signature differs**"
    if validation is not None and not validation.get("passed"):
        return "❌ **outputs differ**"
    if doc.get("identical"):
        return "✅ identical"
    numerics = ("numerics not compared" if validation is None else "outputs match")
    return f"✅ same IO signature, {numerics}; structure differs"


def _diff(doc: Mapping[str, Any]) -> str:
    lines = [f"## fusectl diff {code(doc.get('a', 'A'))} → {code(doc.get('b', 'B'))}", "",
             f"**{diff_verdict(doc)}**", ""]
    io = doc.get("io") or {}
    rows = []
    for side in ("inputs", "outputs"):
        part = io.get(side) or {}
        rows += [(side, "added", code(s.get("name")), escape(f"{s.get('dtype')}{s.get('shape')}"))
                 for s in part.get("added") or []]
        rows += [(side, "removed", code(s.get("name")), escape(f"{s.get('dtype')}{s.get('shape')}"))
                 for s in part.get("removed") or []]
        rows += [(side, "changed", code(c.get("name")),
                  escape(f"{(c.get('a') or {}).get('dtype')}{(c.get('a') or {}).get('shape')} → "
                         f"{(c.get('b') or {}).get('dtype')}{(c.get('b') or {}).get('shape')}"))
                 for c in part.get("changed") or []]
    if rows:
        lines += ["### IO signature", "", *table(("", "", "name", "type"), rows), ""]
    opsets = (doc.get("opsets") or {}).get("changed") or []
    if opsets:
        lines += ["### Opsets", "", *table(("domain", "A", "B"), [
            (code(o.get("domain") or "ai.onnx"), escape(o.get("a")), escape(o.get("b")))
            for o in opsets]), ""]
    ops = (doc.get("ops") or {}).get("changed") or []
    nodes = doc.get("nodes") or {}
    counts = {k: len(nodes.get(k) or []) for k in ("changed", "added", "removed")}
    lines += [f"### Nodes {nodes.get('a', '?')} → {nodes.get('b', '?')}", "",
              f"{nodes.get('unchanged', 0)} unchanged, {counts['changed']} changed, "
              f"{counts['added']} added, {counts['removed']} removed", ""]
    if ops:
        rows, more = _cut([(code(o.get("op")), str(o.get("a")), str(o.get("b")),
                            f"{int(o.get('b', 0)) - int(o.get('a', 0)):+d}") for o in ops], "ops")
        lines += [*table(("op", "A", "B", "Δ"), rows, right=(1, 2, 3)), *more, ""]
    inits = doc.get("initializers") or {}
    lines += [f"Initializers: {inits.get('unchanged', 0)} unchanged, "
              f"{len(inits.get('changed') or [])} changed, {len(inits.get('added') or [])} added, "
              f"{len(inits.get('removed') or [])} removed.", ""]
    traffic = doc.get("traffic") or {}
    ta, tb = traffic.get("a") or {}, traffic.get("b") or {}
    if ta:
        lines += ["### Traffic", "", "| | A | B | Δ |", "| --- | ---: | ---: | ---: |"]
        for label, key, fmt in (("bytes moved", "bytes", human_bytes),
                                ("FLOPs", "flops", "{:,}".format), ("kernels", "kernels", str),
                                ("parameters", "param_bytes", human_bytes)):
            a, b = int(ta.get(key, 0)), int(tb.get(key, 0))
            delta = fmt(b - a) if key != "kernels" else f"{b - a:+d}"
            lines.append(f"| {label} | {fmt(a)} | {fmt(b)} | {delta} |")
        lines.append("")
    lines += ["### Numerical comparison", ""]
    if doc.get("validation") is None:
        skipped = doc.get("validation_skipped")
        lines.append(f"Skipped ({skipped})." if skipped else "Not run.")
    else:
        lines += validation_lines(doc.get("validation"))
    return "\n".join(lines) + "\n"


RENDERERS = {"fusectl.optimize": _optimize, "fusectl.rules-test": _rule_tests,
              "fusectl.report": _report, "fusectl.diff": _diff}


def render(doc: Mapping[str, Any]) -> str:
    """The Markdown report of ``doc`` (dispatched on its ``schema``)."""
    return dispatch(doc, RENDERERS, "Markdown")
