"""Rendering of a benchmark run (the dict bench/benchmark.py builds): rich tables for the
terminal and the Markdown of bench/RESULTS.md. Every table is built once as plain rows and
rendered twice, so the terminal and the committed summary cannot disagree."""

from __future__ import annotations

from dataclasses import dataclass

import stats
from rich.console import Console
from rich.table import Table as RichTable

PEERS = ("ort-basic", "ort-extended", "onnxsim", "onnxoptimizer")
FUSECTL = ("fusectl", "fusectl+validate", "fusectl-ort")
VARIANTS = ("fusectl", "fusectl-ort", *PEERS)
"""Optimized models timed on onnxruntime (fusectl+validate writes the same model as fusectl)."""
NOISE = 0.03
"""Latency ratios within 3% of 1.0 are called a tie: the spread between identical runs on
this shared machine is of that order."""
MIB = 2**20
FINDINGS_START = "<!-- findings: written by hand, kept when the tables are regenerated -->"
FINDINGS_END = "<!-- /findings -->"


@dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[str]]
    note: str = ""


def _speed(record: dict, tool: str, key: str = "run_s") -> dict | None:
    return (record.get("speed", {}).get(tool) or {}).get(key)


def _tool_cell(record: dict, tool: str) -> str:
    found = record.get("speed", {}).get(tool)
    if not found:
        return "—"
    if found.get("run_s"):
        cell = stats.fmt_spread(found["run_s"])
        return cell + (" !" if found.get("errors") else "")
    return "failed: " + "; ".join(found.get("errors", []))[:60]


def speed_table(data: dict) -> Table:
    tools = [t for t in (*FUSECTL, *PEERS) if t in data["meta"]["config"]["tools"]]
    peers = [t for t in PEERS if t in tools]
    rows = []
    for record in data["models"]:
        row = [record["model"], str(record.get("nodes", "?"))]
        row += [_tool_cell(record, t) for t in tools]
        row += [stats.fmt_ratio(stats.ratio(_speed(record, "fusectl"), _speed(record, p)))
                for p in peers]
        rows.append(row)
    return Table("Tool speed: seconds per run, median (min–max), imports excluded",
                 ["model", "nodes", *tools, *(f"fusectl ÷ {p}" for p in peers)], rows,
                 "fusectl = `fusectl optimize --no-validate`, fusectl+validate = the default "
                 "(validation on onnxruntime), fusectl-ort = `--target onnxruntime "
                 "--no-validate`. Ratios: fusectl's median over the peer's (below 1: fusectl "
                 "is faster). `!`: some runs failed.")


def process_table(data: dict) -> Table:
    tools = [t for t in (*FUSECTL, *PEERS) if t in data["meta"]["config"]["tools"]]
    rows = []
    for record in data["models"]:
        row = [record["model"]]
        for tool in tools:
            wall, rss = _speed(record, tool, "wall_s"), _speed(record, tool, "peak_rss")
            row.append(f"{wall['median']:.1f} s, {rss['median'] / MIB:.0f} MiB"
                       if wall and rss else "—")
        rows.append(row)
    return Table("Whole process: wall time (start-up + imports + run) and peak RSS, medians",
                 ["model", *tools], rows,
                 "Each run is a fresh `python` process; peak RSS is its VmHWM, imports "
                 "included (python + onnxruntime alone: ~60 MiB).")


def scale_table(data: dict) -> Table:
    tools = data["meta"]["config"].get("scale_tools", [])
    rows = []
    for row in data.get("scale", []):
        cells = [f"{row['nodes']:,}"]
        for tool in tools:
            found = row["tools"].get(tool, {})
            if found.get("skipped"):
                cells.append(found["skipped"])
            elif found.get("run_s"):
                per_node = found["run_s"]["median"] / row["nodes"] * 1e6
                rss = found["peak_rss"]["median"] / MIB
                cells.append(f"{stats.fmt_spread(found['run_s'], digits=1)} s, "
                             f"{per_node:.0f} µs/node, {rss:.0f} MiB")
            else:
                cells.append("failed: " + "; ".join(found.get("errors", []))[:60])
        rows.append(cells)
    return Table("Scaling: Conv+BatchNormalization+Relu chains (bench/scale.py)",
                 ["nodes", *tools], rows,
                 "Seconds per run (imports excluded), time per node, peak RSS. Linear "
                 "scaling keeps µs/node flat.")


def _goal(ratio: float | None) -> str:
    """A latency ratio read against the noise band: faster, tie or SLOWER."""
    if ratio is None:
        return "—"
    if ratio < 1.0 - NOISE:
        return "faster"
    return "tie (noise)" if ratio <= 1.0 + NOISE else "SLOWER"


def latency_table(data: dict, level: str) -> Table:
    rows = []
    for record in data["models"]:
        found = record.get("latency", {}).get(level)
        if not found:
            continue
        variants = found["variants"]
        original = variants.get("original") or {}
        row = [record["model"], stats.fmt_spread(original, 1e3, 2) if "median" in original
               else original.get("error", "—")]
        for name in VARIANTS:
            timing = variants.get(name)
            if timing is None:
                row.append("—")
            elif "error" in timing:
                row.append("error")
            else:
                row.append(stats.fmt_ratio(stats.ratio(timing, original)))
        row.append(_goal(stats.ratio(variants.get("fusectl"), original)))
        row.append(_goal(stats.ratio(variants.get("fusectl-ort"), original)))
        row.append(str(found["runs"]))
        rows.append(row)
    goal = ("fusectl faster than the original" if level == "disabled"
            else "fusectl never slower than the original")
    return Table(f"Model latency, onnxruntime {level.upper()} optimizations ({goal})",
                 ["model", "original ms", *(f"{v} ×" for v in VARIANTS), "goal fusectl",
                  "goal fusectl-ort", "runs"], rows,
                 "Original: milliseconds per run, median (min–max); the others: their median "
                 "over the original's (below 1: faster). One thread, interleaved rounds. "
                 f"'tie (noise)': within ±{NOISE:.0%} of the original.")


def traffic_table(data: dict) -> Table:
    rows = []
    for record in data["models"]:
        traffic = record.get("traffic", {})
        original = traffic.get("original") or {}
        if "bytes" not in original:
            rows.append([record["model"], original.get("error", "—")])
            continue
        row = [record["model"], f"{original['nodes']}", f"{original['bytes'] / MIB:.1f}"]
        for name in VARIANTS:
            found = traffic.get(name) or {}
            if "bytes" in found:
                change = 100.0 * (found["bytes"] - original["bytes"]) / max(original["bytes"], 1)
                row.append(f"{found['nodes']}, {found['bytes'] / MIB:.1f} ({change:+.1f}%)")
            else:
                row.append("—")
        rows.append(row)
    return Table("Memory traffic under fusectl's model (bench/compare.py's measure)",
                 ["model", "nodes", "MiB", *VARIANTS], rows,
                 "Per optimizer: nodes, traffic in MiB (change vs the original).")


def _min_ratio(timing: dict | None, original: dict | None) -> str:
    if not timing or not original or "min" not in timing or not original.get("min"):
        return "—"
    return f"{timing['min'] / original['min']:.2f}"


def why_table(why: dict) -> Table:
    if "error" in why:  # the leave-one-out run itself failed: say so, keep the other tables
        return Table(f"Why slower: {why['model']}, target {why['target']}, onnxruntime "
                     f"{why['level'].upper()}", ["error"], [[why["error"]]],
                     "bench/why_slower.py could not run its leave-one-out.")
    variants = why["latency"]["variants"]
    original = variants.get("original")
    rows = []
    for name, timing in variants.items():
        label = f"fusectl --skip-rule {name[5:]}" if name.startswith("skip ") else name
        rows.append([label, stats.fmt_spread(timing, 1e3, 3),
                     stats.fmt_ratio(stats.ratio(timing, original)),
                     _min_ratio(timing, original), str(why["fired"].get(name[5:], ""))])
    return Table(f"Why slower: {why['name']}, target {why['target']}, onnxruntime "
                 f"{why['level'].upper()}", ["model", "ms median (min–max)", "× original",
                                             "× original (min)", "rule fired"], rows,
                 f"Leave-one-out over the fired rules (bench/why_slower.py), "
                 f"{why['latency']['runs']} interleaved runs (in the benchmark: "
                 f"{why.get('ratio_in_run', 0):.2f}×). The ratio of the fastest runs is "
                 "less sensitive to load from other processes.")


def profile_tables(profile: dict) -> list[Table]:
    title = f"Where the time goes: {profile['name']} ({profile['total_s']:.1f} s sampled)"
    stages = Table(title, ["stage", "s", "%"],
                   [[s["stage"], f"{s['seconds']:.2f}", f"{s['percent']:.1f}"]
                    for s in profile["stages"] if s["percent"] >= 0.5])
    hot = Table(f"Hot spots: {profile['name']}", ["fusectl function (inclusive)", "%",
                                                  "self time (any code)", "%"], [])
    left, right = profile["fusectl_inclusive"][:8], profile["self_time"][:8]
    for i in range(max(len(left), len(right))):
        a = left[i] if i < len(left) else None
        b = right[i] if i < len(right) else None
        hot.rows.append([a["where"] if a else "", f"{a['percent']:.1f}" if a else "",
                         b["where"] if b else "", f"{b['percent']:.1f}" if b else ""])
    return [stages, hot]


def goals(data: dict) -> list[str]:
    """The issue's goals, each with how many models meet it (computed, not written)."""
    lines = []
    models = data["models"]
    timed = [r for r in models if _speed(r, "fusectl")]
    for tool in PEERS:
        pairs = [(r["model"], stats.ratio(_speed(r, "fusectl"), _speed(r, tool)))
                 for r in timed if _speed(r, tool)]
        if pairs:
            wins = sum(1 for _, x in pairs if x < 1.0)
            worst = max(pairs, key=lambda p: p[1])
            lines.append(f"- Tool speed, fusectl without validation faster than {tool}: "
                         f"{wins}/{len(pairs)} models (worst: {worst[0]}, "
                         f"{worst[1]:.2f}× its time)")
    scale = [(row["nodes"], row["tools"].get("fusectl", {}).get("run_s"))
             for row in data.get("scale", [])]
    scale = [(n, s["median"] / n * 1e6) for n, s in scale if s]
    if len(scale) > 1:
        per_node = ", ".join(f"{n:,} nodes {us:.0f}" for n, us in scale)
        lines.append(f"- Scaling, fusectl µs per node: {per_node} (linear = flat)")
    for level in ("disabled", "basic", "all"):
        for variant in ("fusectl", "fusectl-ort"):
            pairs = []
            for r in models:
                found = r.get("latency", {}).get(level, {}).get("variants", {})
                x = stats.ratio(found.get(variant), found.get("original"))
                if x is not None:
                    pairs.append((r["model"], x))
            if not pairs:
                continue
            verdicts = [_goal(x) for _, x in pairs]
            worst = max(pairs, key=lambda p: p[1])
            goal = {"disabled": " (goal: faster everywhere)",
                    "all": " (goal: never slower)"}.get(level, "")
            lines.append(f"- Latency at {level.upper()}{goal}: {variant} faster than the "
                         f"original on {verdicts.count('faster')}/{len(pairs)} models, a tie "
                         f"(±{NOISE:.0%}) on {verdicts.count('tie (noise)')}, slower on "
                         f"{verdicts.count('SLOWER')} (worst: {worst[0]}, {worst[1]:.2f}×)")
    return lines


def worst_cases(records: list[dict], limit: float = 1.0 + NOISE) -> list[dict]:
    """Per fusectl target and level (ORT_ENABLE_ALL, ORT_DISABLE_ALL), the model whose latency
    ratio to the original is the highest, when it is slower beyond the noise band."""
    cases = []
    for level, bound in (("all", limit), ("disabled", limit)):
        for variant, target in (("fusectl", "onnx"), ("fusectl-ort", "onnxruntime")):
            ratios = []
            for r in records:
                found = r.get("latency", {}).get(level, {}).get("variants", {})
                x = stats.ratio(found.get(variant), found.get("original"))
                if x is not None:
                    ratios.append((x, r))
            if ratios:
                x, r = max(ratios, key=lambda p: p[0])
                if x > bound:
                    cases.append({"model": r["model"], "level": level, "target": target,
                                  "ratio": x})
    return cases


def all_tables(data: dict) -> list[Table]:
    tables = [speed_table(data), process_table(data)]
    if data.get("scale"):
        tables.append(scale_table(data))
    tables += [latency_table(data, level) for level in ("disabled", "basic", "all")
               if any(level in r.get("latency", {}) for r in data["models"])]
    tables.append(traffic_table(data))
    tables += [why_table(w) for w in data.get("why", [])]
    for profile in data.get("profile", []):
        tables += profile_tables(profile)
    return tables


# --------------------------------------------------------------------------- output


def print_tables(data: dict, console: Console) -> None:
    for table in all_tables(data):
        rich = RichTable(title=table.title, caption=table.note or None)
        for column in table.header:
            rich.add_column(column)
        for row in table.rows:
            rich.add_row(*row)
        console.print(rich)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table(table: Table) -> list[str]:
    lines = [f"### {table.title}", ""]
    if table.note:
        lines += [table.note, ""]
    lines += ["| " + " | ".join(table.header) + " |",
              "|" + "---|" * len(table.header)]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in table.rows]
    return [*lines, ""]


def _code_lines(meta: dict) -> list[str]:
    code, after = meta.get("code"), meta.get("code_after")
    if not code:
        return []
    line = f"- Code: commit {code['commit']}, fusectl/ + rules/ tree {code['tree']}"
    if after and after != code:
        line += (f" at the start, commit {after['commit']} tree {after['tree']} at the end: "
                 "**the code changed during the run; results mix both**")
    return [line]


def machine_lines(meta: dict) -> list[str]:
    machine = meta["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
    config = meta["config"]
    return [
        f"- Date: {meta['date']}; total benchmark time {meta.get('seconds', 0) / 60:.1f} min"
        f"{' (quick mode)' if config.get('quick') else ''}",
        f"- Machine: {machine['cpu']}, {machine['cores']} cores, "
        f"{machine['ram_bytes'] / 2**30:.1f} GiB RAM, {machine['platform']}; load average "
        f"{machine['load_before']:.1f} at the start, {machine.get('load_after', 0):.1f} at the "
        "end (the machine is shared: read medians and min–max, not single runs)",
        f"- Python {meta['python']}; {versions}",
        *_code_lines(meta),
        f"- Tool speed: {config['reps']} runs per tool and model, each a fresh process; "
        f"latency: onnxruntime CPU, intra_op_num_threads=1, inter_op_num_threads=1, "
        f"sequential, {config['latency']['warmup']} warm-up rounds at most and "
        f"{config['latency']['min_runs']}–{config['latency']['max_runs']} timed rounds "
        f"within {config['latency']['budget_s']:.0f} s per model and level (count in the "
        "`runs` column), variants interleaved in shuffled order.",
    ]


def kept_findings(previous: str) -> list[str]:
    """The hand-written findings of an earlier RESULTS.md (between the markers)."""
    if FINDINGS_START not in previous or FINDINGS_END not in previous:
        return []
    text = previous.split(FINDINGS_START, 1)[1].split(FINDINGS_END, 1)[0]
    return text.strip("\n").splitlines()


def markdown(data: dict, findings: list[str] | None = None) -> str:
    lines = ["# Benchmark results", "",
             "Generated by `python bench/benchmark.py` (method: bench/README.md); the "
             "\"Findings\" section is written by hand and kept across runs.", "",
             *machine_lines(data["meta"]), ""]
    lines += ["## Goals (computed)", "", *goals(data), ""]
    if findings:
        lines += ["## Findings", "", FINDINGS_START, *findings, FINDINGS_END, ""]
    lines += ["## Tables", ""]
    for table in all_tables(data):
        lines += markdown_table(table)
    return "\n".join(lines)
