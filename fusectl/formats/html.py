"""One self-contained HTML page: the traffic of every layer before and after as a chart,
fused regions marked in the colour of their rule, then the numbers.

Self-contained means viewable offline from a CI artifact: inline CSS, an SVG drawn here
(so the picture needs no script), a few lines of inline script for the detail panel,
and a Content-Security-Policy that forbids every fetch. Node names are hostile input:
every model-provided string goes through ``html.escape`` (or into the JSON blob with
``<``, ``>`` and ``&`` as ``\\u`` escapes, read by the script with ``textContent``).
"""

from __future__ import annotations

import html
import json
import math
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
from .regions import Layer, layers

MAX_SLOTS = 300          # more layers than this are drawn in bins of consecutive layers
MAX_LABELLED_SLOTS = 60  # layer names under the axis only when they fit
MAX_TABLE_ROWS = 200
MAX_NODES_PER_SLOT = 24  # in the detail panel

BEFORE = "#c3cbd5"       # bars of the original graph
UNCHANGED = "#34495e"    # bars of layers no rule touched, after
PALETTE = ("#e8702a", "#2a9d8f", "#8e44ad", "#d62839", "#3a86ff", "#6a994e", "#b5838d",
           "#f4a261", "#1d3557", "#c9a227")

CSP = ("default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
       "img-src data:")

CSS = """
:root { --fg:#1f2933; --muted:#5f6c7b; --line:#e4e7eb; --ok:#1e8e3e; --bad:#c5221f; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--fg);
       margin: 0; padding: 24px 32px; background: #fff; }
h1 { font-size: 20px; margin: 0 0 4px; word-break: break-all; }
h2 { font-size: 16px; margin: 28px 0 8px; }
.sub { color: var(--muted); margin: 0 0 16px; word-break: break-all; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; }
.card { border: 1px solid var(--line); border-radius: 8px; padding: 10px 16px; min-width: 170px; }
.card .k { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
.card .v { font-size: 22px; font-weight: 600; }
.card .d { color: var(--muted); }
.ok { color: var(--ok); } .bad { color: var(--bad); } .warn { color: #b26a00; }
.chart { overflow-x: auto; border: 1px solid var(--line); border-radius: 8px; padding: 8px; }
.chart svg { display: block; }
.chart text { font: 11px system-ui, sans-serif; fill: var(--muted); }
.slot:hover .hit, .slot.sel .hit { fill: rgba(0,0,0,.06); }
.scale-log .lin, .scale-lin .log { display: none; }
.legend { display: flex; flex-wrap: wrap; gap: 6px 16px; margin: 8px 0; color: var(--muted); }
.sw { display: inline-block; width: 12px; height: 12px; border-radius: 2px;
      vertical-align: -1px; margin-right: 5px; }
.chip { display: inline-block; border-radius: 10px; padding: 0 8px; color: #fff;
        font-size: 12px; margin: 1px 2px; white-space: nowrap; }
table { border-collapse: collapse; margin: 4px 0; }
th, td { border-bottom: 1px solid var(--line); padding: 4px 10px; text-align: left;
         vertical-align: top; }
th { font-weight: 600; color: var(--muted); font-size: 12px; }
td.n { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.nodes { max-width: 420px; word-break: break-all; }
.bar { height: 10px; border-radius: 2px; min-width: 1px; }
#detail { border: 1px dashed var(--line); border-radius: 8px; padding: 8px 12px; margin-top: 8px;
          min-height: 48px; color: var(--muted); word-break: break-all; }
#detail b { color: var(--fg); }
label.toggle { color: var(--muted); cursor: pointer; }
footer { margin-top: 32px; color: var(--muted); font-size: 12px; }
"""

SCRIPT = """
(function () {
  "use strict";
  var layers = JSON.parse(document.getElementById("fusectl-layers").textContent);
  var panel = document.getElementById("detail");
  var chart = document.getElementById("chart");
  var selected = null;
  function add(parent, tag, text, cls) {
    var el = document.createElement(tag);
    if (text !== undefined) { el.textContent = text; }
    if (cls) { el.className = cls; }
    parent.appendChild(el);
    return el;
  }
  function nodeList(parent, title, nodes, more) {
    var p = add(parent, "div");
    add(p, "b", title + ": ");
    if (!nodes.length) { add(p, "span", "none"); }
    nodes.forEach(function (n, i) {
      add(p, "span", (i ? ", " : "") + n[0] + " (" + n[1] + ", " + n[2] + ")");
    });
    if (more) { add(p, "span", " and " + more + " more"); }
  }
  function show(i) {
    var layer = layers[i];
    if (!layer) { return; }
    panel.textContent = "";
    var head = add(panel, "div");
    add(head, "b", layer.label);
    add(head, "span", "  before " + layer.before_text + ", after " + layer.after_text);
    if (layer.rules.length) {
      var r = add(panel, "div");
      add(r, "b", "fused by: ");
      layer.rules.forEach(function (rule) {
        var chip = add(r, "span", rule[0], "chip");
        chip.style.background = rule[1];
      });
    }
    if (layer.before.length || layer.after.length) {
      nodeList(panel, "before", layer.before, layer.before_more);
      nodeList(panel, "after", layer.after, layer.after_more);
    }
  }
  Array.prototype.forEach.call(document.querySelectorAll(".slot"), function (g) {
    var i = Number(g.getAttribute("data-i"));
    g.addEventListener("mouseenter", function () { if (selected === null) { show(i); } });
    g.addEventListener("click", function () {
      if (selected !== null) { selected.classList.remove("sel"); }
      selected = selected === g ? null : g;
      if (selected !== null) { g.classList.add("sel"); }
      show(i);
    });
  });
  var log = document.getElementById("log-scale");
  function scale() { chart.className = "chart " + (log.checked ? "scale-log" : "scale-lin"); }
  log.addEventListener("change", scale);
  scale();
  var fused = layers.findIndex(function (l) { return l.rules.length > 0; });
  show(fused >= 0 ? fused : 0);
  document.documentElement.setAttribute("data-fusectl-ready", "1");
})();
"""


def esc(value: object) -> str:
    """Text or attribute value, escaped (quotes too)."""
    return html.escape(str(value), quote=True)


def _json_for_script(data: object) -> str:
    """JSON that cannot end its <script> element or start markup inside it."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def rule_colours(doc: Mapping[str, Any], extra: Iterable[str] = ()) -> dict[str, str]:
    """A colour per rule, the biggest savers first so they get the clearest colours."""
    rules = doc.get("rules") or {}
    applied = sorted(rules.get("applied") or rules.get("would_fire") or [],
                     key=lambda r: -int(r.get("bytes_saved", 0)))
    ids = [str(r.get("id")) for r in applied]
    ids += [r for r in extra if r not in ids]
    colours = {}
    for i, rule_id in enumerate(ids):
        colours[rule_id] = (PALETTE[i] if i < len(PALETTE)
                            else f"hsl({(i * 137.5) % 360:.0f}, 55%, 45%)")
    return colours


# ---------------------------------------------------------------------------- chart


class _Slot:
    """One drawn position: a layer, or a bin of consecutive layers on a big graph."""

    def __init__(self, members: Sequence[Layer]):
        self.members = members
        self.before = sum(m.bytes_before for m in members)
        self.after = sum(m.bytes_after for m in members)
        self.rules: list[str] = []
        for member in members:
            self.rules += [r for r in member.rules if r not in self.rules]

    @property
    def label(self) -> str:
        if len(self.members) == 1:
            return self.members[0].label
        first, last = self.members[0].label, self.members[-1].label
        return f"{len(self.members)} layers: {first} … {last}"


def _slots(all_layers: Sequence[Layer]) -> list[_Slot]:
    size = max(1, math.ceil(len(all_layers) / MAX_SLOTS))
    return [_Slot(all_layers[i:i + size]) for i in range(0, len(all_layers), size)]


def _nice_step(span: float) -> float:
    raw = span / 4
    magnitude = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for factor in (1, 2, 2.5, 5, 10):
        if factor * magnitude >= raw:
            return factor * magnitude
    return 10 * magnitude


def _linear_ticks(top: float) -> tuple[float, list[tuple[float, str]]]:
    unit, name = 1, "B"
    for candidate, cname in ((1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if top >= candidate:
            unit, name = candidate, cname
            break
    step = _nice_step(top / unit)
    count = max(1, math.ceil(top / unit / step))
    ticks = [(k * step * unit, f"{k * step:g} {name}") for k in range(count + 1)]
    return count * step * unit, ticks


def _log_ticks(low: float, top: float) -> list[tuple[float, str]]:
    ticks, value = [], 1
    while value <= top:
        if value >= low:
            ticks.append((float(value), human_bytes(value)))
        value *= 32
    return ticks


def _count_ticks(top: float) -> tuple[float, list[tuple[float, str]]]:
    step = max(1.0, _nice_step(top))
    count = max(1, math.ceil(top / step))
    return count * step, [(k * step, f"{k * step:g}") for k in range(count + 1)]


def chart_svg(slots: Sequence[_Slot], colours: Mapping[str, str], *, counts: bool = False
              ) -> str:
    """Grouped bars per slot (before, after), fused slots banded in their rule's colour,
    drawn twice (linear and log scale; CSS shows one). ``counts``: the values are counts,
    not bytes."""
    n = max(1, len(slots))
    slot_w = min(80.0, max(5.0, 960.0 / n))
    labelled = len(slots) <= MAX_LABELLED_SLOTS
    left, top_pad, plot_h = 78.0, 12.0, 260.0
    bottom = 110.0 if labelled else 28.0
    width = left + slot_w * n + 16
    height = top_pad + plot_h + bottom
    base = top_pad + plot_h
    peak = max([max(s.before, s.after) for s in slots] + [1])
    lin_top, lin_ticks = _count_ticks(peak) if counts else _linear_ticks(peak)
    positive = [v for s in slots for v in (s.before, s.after) if v > 0] or [1]
    log_low = max(1.0, min(positive) / 2)
    log_top = max(peak, log_low * 2)

    def y_lin(v: float) -> float:
        return plot_h * v / lin_top

    def y_log(v: float) -> float:
        if v <= log_low:
            return 0.0
        return plot_h * math.log(v / log_low) / math.log(log_top / log_low)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" '
           'aria-label="memory traffic per layer, before and after">']
    log_ticks = _log_ticks(log_low, log_top)
    if counts:
        log_ticks = [(10.0 ** k, f"{10 ** k:g}") for k in range(0, 10)
                     if log_low <= 10 ** k <= log_top]
    for cls, ticks, scale in (("lin", lin_ticks, y_lin), ("log", log_ticks, y_log)):
        out.append(f'<g class="{cls}">')
        for value, text in ticks:
            y = base - scale(value)
            out.append(f'<line x1="{left - 4:.1f}" x2="{width - 8:.1f}" y1="{y:.1f}" '
                       f'y2="{y:.1f}" stroke="#e4e7eb"/>')
            out.append(f'<text x="{left - 8:.1f}" y="{y + 4:.1f}" text-anchor="end">'
                       f'{esc(text)}</text>')
        out.append("</g>")
    out.append(f'<line x1="{left:.1f}" x2="{width - 8:.1f}" y1="{base:.1f}" y2="{base:.1f}" '
               'stroke="#9aa5b1"/>')
    bar_w = max(1.5, slot_w * 0.38)
    for i, slot in enumerate(slots):
        x0 = left + i * slot_w
        colour = colours.get(slot.rules[0], PALETTE[0]) if slot.rules else UNCHANGED
        show = str if counts else human_bytes
        tip = (f"{slot.label}\nbefore: {show(slot.before)}\n"
               f"after: {show(slot.after)}"
               + (f"\nfused by: {', '.join(slot.rules)}" if slot.rules else ""))
        out.append(f'<g class="slot" data-i="{i}"><title>{esc(tip)}</title>')
        out.append(f'<rect class="hit" x="{x0:.1f}" y="{top_pad:.1f}" width="{slot_w:.1f}" '
                   f'height="{plot_h:.1f}" fill="transparent"/>')
        if slot.rules:
            out.append(f'<rect x="{x0:.1f}" y="{top_pad:.1f}" width="{slot_w:.1f}" '
                       f'height="{plot_h:.1f}" fill="{colour}" fill-opacity="0.12"/>')
            part = slot_w / len(slot.rules)  # the region's marker, a segment per rule
            for k, rule in enumerate(slot.rules):
                out.append(f'<rect x="{x0 + k * part:.1f}" y="{base + 2:.1f}" '
                           f'width="{part:.1f}" height="5" fill="{colours.get(rule, colour)}"/>')
        gap = (slot_w - 2 * bar_w) / 2
        for cls, scale in (("lin", y_lin), ("log", y_log)):
            out.append(f'<g class="{cls}">')
            for value, fill, x in ((slot.before, BEFORE, x0 + gap),
                                   (slot.after, colour, x0 + gap + bar_w)):
                h = scale(value)
                if h > 0:
                    out.append(f'<rect x="{x:.1f}" y="{base - h:.1f}" width="{bar_w:.1f}" '
                               f'height="{h:.1f}" fill="{fill}"/>')
            out.append("</g>")
        if labelled:
            name = slot.label if len(slot.label) <= 22 else slot.label[:21] + "…"
            cx = x0 + slot_w / 2
            out.append(f'<text x="{cx:.1f}" y="{base + 16:.1f}" text-anchor="end" '
                       f'transform="rotate(-45 {cx:.1f} {base + 16:.1f})">{esc(name)}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def _panel_data(slots: Sequence[_Slot], colours: Mapping[str, str]) -> list[dict[str, Any]]:
    """What the detail panel shows per slot (read by the inline script)."""

    def nodes(rows: list[Mapping[str, Any]]) -> tuple[list[list[str]], int]:
        shown = [[str(r.get("name", "")), str(r.get("op", "")),
                  human_bytes(int(r.get("bytes_read", 0)) + int(r.get("bytes_written", 0)))]
                 for r in rows[:MAX_NODES_PER_SLOT]]
        return shown, max(0, len(rows) - MAX_NODES_PER_SLOT)

    data = []
    for slot in slots:
        before, before_more = nodes([r for m in slot.members for r in m.before])
        after, after_more = nodes([r for m in slot.members for r in m.after])
        data.append({
            "label": slot.label,
            "before_text": human_bytes(slot.before),
            "after_text": human_bytes(slot.after),
            "rules": [[r, colours.get(r, PALETTE[0])] for r in slot.rules],
            "before": before, "before_more": before_more,
            "after": after, "after_more": after_more,
        })
    return data


# ---------------------------------------------------------------------------- page


def _table(header: Sequence[str], rows: Iterable[Sequence[str]], numeric: Iterable[int] = ()
           ) -> str:
    """Rows of already-escaped cells."""
    numeric = set(numeric)
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f'<td class="n">{c}</td>' if i in numeric else f"<td>{c}</td>"
                         for i, c in enumerate(row)) + "</tr>"
        for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _chip(rule: str, colours: Mapping[str, str]) -> str:
    colour = colours.get(rule, PALETTE[0])
    return f'<span class="chip" style="background:{colour}">{esc(rule)}</span>'


def _card(key: str, value: str, detail: str = "", cls: str = "") -> str:
    return (f'<div class="card"><div class="k">{esc(key)}</div>'
            f'<div class="v {cls}">{value}</div><div class="d">{detail}</div></div>')


def _validation_html(validation: Mapping[str, Any] | None) -> str:
    if validation is None:
        return '<p class="warn">Validation skipped (--no-validate).</p>'
    outputs = sorted(validation.get("outputs") or [], key=lambda o: output_status(o) == "ok")
    samples = sample_count(outputs)
    parts = []
    if validation.get("error"):
        parts.append(f'<p class="bad">{esc(validation["error"])}</p>')
    status_cls = {"ok": "ok", "MISMATCH": "bad"}
    rows = [(esc(output_label(o, samples)), esc(o.get("dtype", "")), esc(o.get("shape", "")),
             fmt_float(o.get("max_abs")), fmt_float(o.get("max_rel")),
             fmt_float(o.get("mean_abs")), fmt_float(o.get("cosine")),
             fmt_float(o.get("pct_out_of_tol")),
             f'<span class="{status_cls.get(output_status(o), "warn")}">'
             f'{esc(output_status(o))}</span>')
            for o in outputs[:MAX_TABLE_ROWS]]
    if rows:
        parts.append(_table(("output", "dtype", "shape", "max abs", "max rel", "mean abs",
                             "cosine", "% out", "status"), rows, numeric=(3, 4, 5, 6, 7)))
    if len(outputs) > MAX_TABLE_ROWS:
        parts.append(f"<p>… and {len(outputs) - MAX_TABLE_ROWS} more outputs (see the JSON)</p>")
    return "\n".join(parts)


def _page(title: str, subtitle: str, body: Sequence[str], panel_data: object) -> str:
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(title)}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        f'<p class="sub">{subtitle}</p>',
        *body,
        f'<script type="application/json" id="fusectl-layers">{_json_for_script(panel_data)}'
        "</script>",
        f"<script>{SCRIPT}</script>",
        "</body></html>",
        "",
    ])


def _layer_chart(slots: Sequence[_Slot], colours: Mapping[str, str], before: str, after: str,
                 ) -> list[str]:
    """The traffic-per-layer chart with its legend and detail panel."""
    legend = [f'<span><span class="sw" style="background:{BEFORE}"></span>{esc(before)}</span>',
              f'<span><span class="sw" style="background:{UNCHANGED}"></span>'
              f"{esc(after)}, not fused</span>"]
    legend += [f'<span><span class="sw" style="background:{c}"></span>{esc(after)}, fused by '
               f"{esc(r)}</span>" for r, c in colours.items()]
    binned = (f" Each bar is a bin of about {len(slots[0].members)} consecutive layers."
              if slots and len(slots[0].members) > 1 else "")
    return [
        f"<h2>Memory traffic per layer, {esc(before)} and {esc(after)}</h2>",
        f'<p class="sub">One slot per layer in graph order; a fused region (the nodes a rule '
        f"replaces) is one slot, banded in its rule's colour.{esc(binned)} "
        '<label class="toggle"><input type="checkbox" id="log-scale"> log scale</label></p>',
        f'<div class="legend">{"".join(legend)}</div>',
        f'<div class="chart scale-lin" id="chart">{chart_svg(slots, colours)}</div>',
        '<div id="detail">Point at a slot to see its nodes.</div>',
    ]


def _optimize(doc: Mapping[str, Any]) -> str:
    traffic = doc.get("traffic") or {}
    before, after = int(traffic.get("bytes_before", 0)), int(traffic.get("bytes_after", 0))
    saved = before - after
    validation = doc.get("validation")
    all_layers = layers(doc)
    bisection = doc.get("bisection") or {}
    reverted = list(bisection.get("reverted") or [])
    colours = rule_colours(doc, [*(r for layer in all_layers for r in layer.rules),
                                 *(str(a.get("rule")) for a in reverted)])
    slots = _slots(all_layers)
    gates = list(doc.get("gates") or [])

    if validation is None:
        verdict = ('<span class="warn">not run</span>', "--no-validate")
    elif reverted and validation.get("passed"):
        verdict = ('<span class="warn">match after revert</span>',
                   f"{len(reverted)} rule application(s) changed outputs")
    elif validation.get("passed"):
        verdict = ('<span class="ok">outputs match</span>', "onnxruntime, optimizations off")
    else:
        verdict = ('<span class="bad">outputs differ</span>', "onnxruntime, optimizations off")
    cards = [
        _card("memory traffic saved", f"{percent(saved, before):.1f}%",
              f"{esc(human_bytes(before))} → {esc(human_bytes(after))}"),
        _card("kernels", f"{esc(traffic.get('kernels_before', '?'))} → "
                         f"{esc(traffic.get('kernels_after', '?'))}",
              f"{len(doc.get('applications') or [])} rule applications"),
        _card("FLOPs", f"{int(traffic.get('flops_after', 0)):,}",
              f"before {int(traffic.get('flops_before', 0)):,}"),
        _card("validation", verdict[0], esc(verdict[1])),
    ]
    if gates:
        failed = [g for g in gates if not g.get("passed")]
        cards.append(_card("CI gates", f'<span class="{"bad" if failed else "ok"}">'
                                       f'{len(gates) - len(failed)}/{len(gates)} met</span>'))

    body = [f'<div class="cards">{"".join(cards)}</div>',
            *_layer_chart(slots, colours, "before", "after")]

    applied = sorted((doc.get("rules") or {}).get("applied") or [],
                     key=lambda r: -int(r.get("bytes_saved", 0)))
    body.append("<h2>Rules applied</h2>")
    if applied:
        most = max([int(r.get("bytes_saved", 0)) for r in applied] + [1])
        rows = []
        for r in applied:
            rule_id, rule_saved = str(r.get("id")), int(r.get("bytes_saved", 0))
            bar = max(0, 240 * rule_saved // most)
            rows.append((_chip(rule_id, colours), esc(r.get("applications", 0)),
                         esc(human_bytes(rule_saved)),
                         f'<div class="bar" style="width:{bar}px;'
                         f'background:{colours.get(rule_id, PALETTE[0])}"></div>'))
        body.append(_table(("rule", "applications", "bytes saved", ""), rows, numeric=(1, 2)))
    else:
        body.append("<p>No rule fired.</p>")

    body += ["<h2>Validation</h2>", _validation_html(validation)]
    if reverted:
        rows = [(_chip(str(a.get("rule")), colours),
                 f'<span class="nodes">{esc(", ".join(str(n) for n in a.get("matched") or []))}'
                 "</span>") for a in reverted[:MAX_TABLE_ROWS]]
        body += [f'<p class="bad">{len(reverted)} rule application(s) changed outputs and were '
                 "reverted; the table above checks the model that was kept. With every rule "
                 "applied:</p>",
                 _validation_html(bisection.get("initial_validation")),
                 _table(("reverted rule", "matched nodes"), rows)]
    if gates:
        rows = [(esc(g.get("gate", "")), esc(g.get("threshold", "")), esc(g.get("actual", "")),
                 '<span class="ok">met</span>' if g.get("passed")
                 else '<span class="bad">NOT MET</span>') for g in gates]
        body += ["<h2>CI gates</h2>", _table(("gate", "required", "actual", "status"), rows)]

    fused = [layer for layer in all_layers if layer.fused]
    if fused:
        def names(rows: Sequence[Mapping[str, Any]]) -> str:
            return ", ".join(f"{esc(r.get('name', ''))} <small>({esc(r.get('op', ''))})</small>"
                             for r in rows) or "—"

        rows = [(" ".join(_chip(r, colours) for r in layer.rules),
                 f'<span class="nodes">{names(layer.before)}</span>',
                 f'<span class="nodes">{names(layer.after)}</span>',
                 esc(human_bytes(layer.bytes_before)), esc(human_bytes(layer.bytes_after)),
                 esc(human_bytes(layer.bytes_before - layer.bytes_after)))
                for layer in fused[:MAX_TABLE_ROWS]]
        body += [f"<h2>Fused regions ({len(fused)})</h2>",
                 _table(("rules", "nodes before", "nodes after", "before", "after", "saved"),
                        rows, numeric=(3, 4, 5))]
        if len(fused) > MAX_TABLE_ROWS:
            body.append(f"<p>… and {len(fused) - MAX_TABLE_ROWS} more (see the JSON)</p>")

    top = sorted((doc.get("node_traffic") or {}).get("after") or [],
                 key=lambda r: -(int(r.get("bytes_read", 0)) + int(r.get("bytes_written", 0))))
    if top:
        rows = [(esc(r.get("name", "")), esc(r.get("op", "")),
                 esc(human_bytes(int(r.get("bytes_read", 0)))),
                 esc(human_bytes(int(r.get("bytes_written", 0)))),
                 f"{int(r.get('flops', 0)):,}") for r in top[:10]]
        body += ["<h2>Top nodes by traffic (after)</h2>",
                 _table(("node", "op", "read", "written", "FLOPs"), rows, numeric=(2, 3, 4))]
    body.append(f"<footer>fusectl {esc(doc.get('fusectl_version', ''))} · memory-traffic model: "
                "every node is one kernel that reads its inputs and writes its outputs once; "
                "a fused region keeps its intermediates on chip.</footer>")
    output = doc.get("output")
    subtitle = (f"{esc(doc.get('model') or 'model')} → {esc(output)}" if output
                else f"{esc(doc.get('model') or 'model')} (optimized model not written)")
    return _page(f"fusectl optimize {doc.get('model') or ''}".strip(), subtitle, body,
                 _panel_data(slots, colours))


def _rules_table(rules: Sequence[Mapping[str, Any]], colours: Mapping[str, str],
                 kernels: bool = False) -> str:
    """Rules by bytes saved, with a bar each in the rule's colour."""
    rules = sorted(rules, key=lambda r: -int(r.get("bytes_saved", 0)))
    most = max([int(r.get("bytes_saved", 0)) for r in rules] + [1])
    rows = []
    for r in rules:
        rule_id, rule_saved = str(r.get("id")), int(r.get("bytes_saved", 0))
        bar = max(0, 240 * rule_saved // most)
        row = [_chip(rule_id, colours), esc(r.get("applications", 0)),
               esc(human_bytes(rule_saved))]
        if kernels:
            row.append(esc(r.get("kernels_saved", 0)))
        row.append(f'<div class="bar" style="width:{bar}px;'
                   f'background:{colours.get(rule_id, PALETTE[0])}"></div>')
        rows.append(row)
    header = ["rule", "applications", "bytes saved", *(["kernels saved"] if kernels else []), ""]
    return _table(header, rows, numeric=(1, 2, 3) if kernels else (1, 2))


def _report(doc: Mapping[str, Any]) -> str:
    totals = doc.get("totals") or {}
    before, after = totals.get("before") or {}, totals.get("after") or {}
    saved, device = doc.get("saved") or {}, doc.get("device") or {}
    all_layers = layers(doc)
    colours = rule_colours(doc, (r for layer in all_layers for r in layer.rules))
    slots = _slots(all_layers)
    speedup = saved.get("speedup")
    cards = [
        _card("memory traffic", esc(human_bytes(int(before.get("bytes", 0)))),
              f"{esc(human_bytes(int(after.get('bytes', 0))))} with the rules"),
        _card("the rules would save", f"{float(saved.get('percent', 0)):.1f}%",
              f"{esc(human_bytes(int(saved.get('bytes', 0))))}, "
              f"{esc(saved.get('kernels', 0))} kernels"),
        _card(f"roofline time on {device.get('name', '?')}",
              f"{esc(fmt_seconds(before.get('seconds')))} → "
              f"{esc(fmt_seconds(after.get('seconds')))}",
              f"{speedup:.2f}× faster" if speedup else ""),
        _card("memory-bound kernels",
              f"{esc(before.get('memory_bound_kernels', '?'))} of "
              f"{esc(before.get('kernels', '?'))}",
              f"{esc(after.get('memory_bound_kernels', '?'))} with the rules"),
    ]
    body = [f'<div class="cards">{"".join(cards)}</div>',
            *_layer_chart(slots, colours, "now", "with the rules")]
    fire = list((doc.get("rules") or {}).get("would_fire") or [])
    body.append("<h2>Rules that would fire (dry run)</h2>")
    body.append(_rules_table(fire, colours, kernels=True) if fire else "<p>None.</p>")
    opt_in = list((doc.get("rules") or {}).get("opt_in_would_fire") or [])
    if opt_in:
        body += ["<h2>Opt-in rules that would also fire (--opt-in ID)</h2>",
                 _table(("rule", "applications", "bytes saved", "why it is off"),
                        [(esc(r.get("id", "")), esc(r.get("applications", 0)),
                          esc(human_bytes(int(r.get("bytes_saved", 0)))),
                          esc(r.get("why_off", ""))) for r in opt_in], numeric=(1, 2))]
    rows = []
    for label, key, fmt in (("bytes moved", "bytes", human_bytes),
                            ("FLOPs", "flops", "{:,}".format),
                            ("parameters", "param_bytes", human_bytes), ("kernels", "kernels", str),
                            ("arithmetic intensity (FLOP/byte)", "intensity", fmt_float),
                            ("estimated time", "seconds", fmt_seconds)):
        rows.append((esc(label), esc(fmt(before.get(key) or 0)), esc(fmt(after.get(key) or 0))))
    body += ["<h2>Totals</h2>", _table(("", "now", "with the rules"), rows, numeric=(1, 2))]
    top = list(doc.get("top_nodes") or [])
    if top:
        rows = [(esc(n.get("name", "")), esc(n.get("op", "")),
                 esc(human_bytes(int(n.get("bytes", 0)))), f"{float(n.get('percent', 0)):.1f}%",
                 esc(n.get("bound", ""))) for n in top]
        body += ["<h2>Top nodes by traffic</h2>",
                 _table(("node", "op", "bytes", "share", "bound"), rows, numeric=(2, 3))]
    body.append(f"<footer>fusectl {esc(doc.get('fusectl_version', ''))} · device "
                f"{esc(device.get('description') or device.get('name', ''))}: "
                f"{esc(device.get('bandwidth_gb_s', '?'))} GB/s, "
                f"{esc(device.get('peak_gflop_s', '?'))} GFLOP/s.</footer>")
    return _page(f"fusectl report {doc.get('model') or ''}".strip(),
                 f"target {esc(doc.get('target', 'onnx'))}, convolution "
                 f"{esc(doc.get('conv_algo', 'direct'))}", body, _panel_data(slots, colours))


class _OpBar:
    """A slot of the diff's op chart: how many nodes of one op type in A and in B."""

    def __init__(self, op: str, a: int, b: int):
        self.label, self.before, self.after = op, a, b
        self.rules = ["changed"] if a != b else []


def _diff(doc: Mapping[str, Any]) -> str:
    ops = doc.get("ops") or {}
    ops_a, ops_b = ops.get("a") or {}, ops.get("b") or {}
    bars = [_OpBar(op, int(ops_a.get(op, 0)), int(ops_b.get(op, 0)))
            for op in sorted(set(ops_a) | set(ops_b))]
    colours = {"changed": PALETTE[0]}
    io = doc.get("io") or {}
    validation = doc.get("validation")
    if not io.get("same", True):
        verdict = '<span class="bad">IO signature differs</span>'
    elif validation is not None and not validation.get("passed"):
        verdict = '<span class="bad">outputs differ</span>'
    elif doc.get("identical"):
        verdict = '<span class="ok">identical</span>'
    else:
        verdict = '<span class="ok">same IO, outputs match</span>' if validation else \
            '<span class="ok">same IO signature</span>'
    nodes, traffic = doc.get("nodes") or {}, doc.get("traffic") or {}
    ta, tb = traffic.get("a") or {}, traffic.get("b") or {}
    bytes_a, bytes_b = int(ta.get("bytes", 0)), int(tb.get("bytes", 0))
    cards = [
        _card("verdict", verdict),
        _card("nodes", f"{esc(nodes.get('a', '?'))} → {esc(nodes.get('b', '?'))}",
              f"{esc(nodes.get('unchanged', 0))} unchanged, "
              f"{len(nodes.get('changed') or [])} changed"),
        _card("memory traffic", f"{esc(human_bytes(bytes_a))} → {esc(human_bytes(bytes_b))}",
              f"{percent(bytes_a - bytes_b, bytes_a):.1f}% less in B"),
    ]
    legend = (f'<span><span class="sw" style="background:{BEFORE}"></span>A</span>'
              f'<span><span class="sw" style="background:{UNCHANGED}"></span>B, same count</span>'
              f'<span><span class="sw" style="background:{PALETTE[0]}"></span>B, changed</span>')
    panel = [{"label": b.label, "before_text": f"{b.before} in A", "after_text": f"{b.after} in B",
              "rules": [], "before": [], "before_more": 0, "after": [], "after_more": 0}
             for b in bars]
    body = [f'<div class="cards">{"".join(cards)}</div>',
            "<h2>Nodes per op type, A and B</h2>",
            '<p class="sub"><label class="toggle"><input type="checkbox" id="log-scale"> '
            "log scale</label></p>",
            f'<div class="legend">{legend}</div>',
            '<div class="chart scale-lin" id="chart">'
            f"{chart_svg(bars, colours, counts=True)}</div>",
            '<div id="detail"></div>']
    sig_rows = []
    for side in ("inputs", "outputs"):
        part = io.get(side) or {}
        for kind in ("added", "removed"):
            sig_rows += [(esc(side), esc(kind), esc(x.get("name")),
                          esc(f"{x.get('dtype')} {x.get('shape')}")) for x in part.get(kind) or []]
        sig_rows += [(esc(side), "changed", esc(c.get("name")),
                      esc(f"{(c.get('a') or {}).get('dtype')} {(c.get('a') or {}).get('shape')} → "
                          f"{(c.get('b') or {}).get('dtype')} {(c.get('b') or {}).get('shape')}"))
                     for c in part.get("changed") or []]
    if sig_rows:
        body += ["<h2>IO signature</h2>", _table(("", "", "name", "type"), sig_rows)]
    changed = list(nodes.get("changed") or [])
    if changed:
        rows = [(esc(c.get("a")), esc(c.get("b")), esc(c.get("matched_by", "")),
                 "<br>".join(esc(x) for x in c.get("changes") or []))
                for c in changed[:MAX_TABLE_ROWS]]
        body += [f"<h2>Nodes changed ({len(changed)})</h2>",
                 _table(("in A", "in B", "matched by", "changes"), rows)]
    for kind in ("added", "removed"):
        listed = list(nodes.get(kind) or [])
        if listed:
            text = ", ".join(f"{esc(n.get('name'))} <small>({esc(n.get('op'))})</small>"
                             for n in listed[:MAX_TABLE_ROWS])
            body += [f"<h2>Nodes {kind} ({len(listed)})</h2>", f'<p class="nodes">{text}</p>']
    if ta:
        rows = []
        for label, key, fmt in (("bytes moved", "bytes", human_bytes),
                                ("FLOPs", "flops", "{:,}".format), ("kernels", "kernels", str),
                                ("parameters", "param_bytes", human_bytes)):
            a, b = int(ta.get(key, 0)), int(tb.get(key, 0))
            rows.append((esc(label), esc(fmt(a)), esc(fmt(b)), esc(fmt(b - a))))
        body += ["<h2>Traffic</h2>", _table(("", "A", "B", "Δ"), rows, numeric=(1, 2, 3))]
    body.append("<h2>Numerical comparison</h2>")
    if validation is None:
        skipped = doc.get("validation_skipped") or "not run"
        body.append(f'<p class="warn">Skipped ({esc(skipped)}).</p>')
    else:
        body.append(_validation_html(validation))
    return _page("fusectl diff", f"A = {esc(doc.get('a', ''))}<br>B = {esc(doc.get('b', ''))}",
                 body, panel)


RENDERERS = {"fusectl.optimize": _optimize, "fusectl.report": _report, "fusectl.diff": _diff}


def render(doc: Mapping[str, Any]) -> str:
    """The HTML page of ``doc`` (dispatched on its ``schema``)."""
    return dispatch(doc, RENDERERS, "HTML")
