"""Side-by-side fusion comparison: every corpus model through every optimizer of peers.py.

``python bench/compare.py [--models GLOB ...] [--reuse-peers]`` measures, for the original and
each optimized model: node count, kernels (nodes not folded at load time), op histogram and
memory traffic under fusectl's model (``fusectl.traffic.measure``), and whether the outputs
still match the original on onnxruntime (``fusectl.validate.validate``: same seeded inputs,
token ids in range, masks all ones, fusectl's per-dtype tolerances). It prints a rich table and
writes ``bench/.models/compare.json`` and ``bench/FUSIONS.md``.

Shapes for the traffic model come from onnx's shape inference; values it cannot fully type
(outputs of onnxruntime's com.microsoft contrib ops and what follows them, dims it leaves
symbolic) get their shape and dtype from one onnxruntime run of the model with those values
added as outputs. Contrib ops are then costed as fused kernels (their inputs plus outputs).
``--reuse-peers`` keeps the peers' results from the last compare.json (fusectl runs again).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from collections import Counter
from pathlib import Path

import models
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import peers
from onnx_ir.passes.common import ShapeInferencePass
from rich.console import Console
from rich.table import Table

from fusectl import traffic
from fusectl.prepare import detach_legacy_initializer_inputs
from fusectl.ruletest import op_histogram
from fusectl.validate import ValidationOptions, generate_inputs, validate

OUT_DIR = models.MODELS_DIR / "optimized"
RESULTS = models.MODELS_DIR / "compare.json"
MARKDOWN = models.HERE / "FUSIONS.md"


# --------------------------------------------------------------------------- measuring


def _options(entry: models.Entry) -> ValidationOptions:
    ranges = {k: (v[0], v[1]) for k, v in entry.input_ranges.items()}
    return ValidationOptions(seed=0, input_ranges=ranges)


def _complete_shapes(model: ir.Model, feeds: dict[str, np.ndarray]) -> int:
    """Give every node output without a dtype or a fully known shape the ones onnxruntime
    computes for it (all corpus inputs have fixed shapes)."""
    missing = {v.name: v for node in model.graph for v in node.outputs
               if v.name and (v.dtype is None or v.shape is None
                              or not all(isinstance(d, int) for d in v.shape))}
    if not missing:
        return 0
    proto = ir.to_proto(model)
    known = {o.name for o in proto.graph.output}
    names = [n for n in missing if n not in known]
    proto.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(proto.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    arrays = session.run(names, {k: v for k, v in feeds.items() if k in wanted})
    for name, arr in zip(names, arrays, strict=True):
        arr = np.asarray(arr)
        missing[name].dtype = ir.DataType.from_numpy(arr.dtype)
        missing[name].shape = ir.Shape(arr.shape)
    return len(names)


def measure(path: str, entry: models.Entry) -> dict:
    """Nodes, kernels, op histogram and traffic of the model at ``path``."""
    model = ir.load(path)
    ops = op_histogram(model.graph)
    detach_legacy_initializer_inputs(model)  # IR < 4: initializers listed as inputs are weights
    ShapeInferencePass()(model)
    filled = _complete_shapes(model, generate_inputs(model, _options(entry)))
    report = traffic.measure(model)
    return {
        "nodes": sum(ops.values()),
        "kernels": report.kernel_count,
        "bytes": report.total_bytes,
        "unknown_shape_nodes": report.unknown_nodes,
        "shapes_from_ort": filled,
        "ops": dict(sorted(ops.items())),
    }


def check_outputs(original: str, optimized: str, entry: models.Entry) -> dict:
    """Do both models compute the same outputs on onnxruntime (optimizations off)?"""
    try:
        result = validate(original, optimized, _options(entry))
    except Exception as e:  # noqa: BLE001 - recorded as a result
        return {"match": False, "detail": peers.one_line(e)}
    if result.error:
        return {"match": False, "detail": peers.one_line(result.error)}
    worst = max((o.max_abs for o in result.outputs if np.isfinite(o.max_abs)), default=0.0)
    failed = [f"{o.name}: {o.reason}, max abs error {o.max_abs:.2g}"
              for o in result.outputs if not o.passed]
    return {"match": result.passed, "max_abs": float(worst),
            "detail": "; ".join(failed)[:240] or None}


# --------------------------------------------------------------------------- running


def _load_previous() -> dict:
    try:
        return {m["model"]: m for m in json.loads(RESULTS.read_text())["models"]}
    except (OSError, ValueError, KeyError):
        return {}


def compare_model(entry: models.Entry, previous: dict | None, say) -> dict:
    """One corpus model through every optimizer."""
    record = {"model": entry.name, "source": entry.source, "path": entry.path,
              "original": None, "optimizers": {}, "error": None}
    try:
        record["original"] = measure(entry.path, entry)
    except Exception as e:  # noqa: BLE001 - a model we cannot measure is reported, not fatal
        record["error"] = f"failed: measuring the original: {peers.one_line(e)}"
        return record
    for name in peers.OPTIMIZERS:
        if previous and name in peers.PEERS and name in previous.get("optimizers", {}):
            record["optimizers"][name] = previous["optimizers"][name]
            continue
        say(f"{entry.name}: {name}")
        dst = OUT_DIR / f"{entry.name}.{name}.onnx"
        dst.unlink(missing_ok=True)
        run = peers.run_isolated(name, entry.path, str(dst))
        if not run["error"]:
            try:
                run.update(measure(str(dst), entry))
                run.update(check_outputs(entry.path, str(dst), entry))
            except Exception as e:  # noqa: BLE001
                run["error"] = f"failed: measuring the result: {peers.one_line(e)}"
        record["optimizers"][name] = run
    record["verdict"] = verdict(record)
    return record


def _key(result: dict) -> tuple[int, int]:
    return result["bytes"], result["nodes"]


def best_peer(record: dict, standard_only: bool = False) -> str | None:
    """The peer with the least traffic (then fewest nodes) whose outputs still match."""
    candidates = [
        (n, r) for n, r in record["optimizers"].items()
        if n in peers.PEERS and not r.get("error") and r.get("match")
        and (not standard_only or all("." not in op for op in r["ops"]))
    ]
    return min(candidates, key=lambda c: _key(c[1]))[0] if candidates else None


def judge(mine: dict, theirs: dict | None) -> str | None:
    """"yes" when ``mine`` has at most the nodes and traffic of ``theirs`` and matching outputs;
    else "no: <what is worse>" ("kernels <=" when only Constant-like nodes make the difference)."""
    if theirs is None:
        return None
    if mine.get("error"):
        return "no: fusectl failed"
    worse = [what for what, bad in (
        ("nodes", mine["nodes"] > theirs["nodes"]),
        ("traffic", mine["bytes"] > theirs["bytes"]),
        ("outputs differ", not mine.get("match")),
    ) if bad]
    if not worse:
        return "yes"
    kernels = " (kernels <=)" if "nodes" in worse and mine["kernels"] <= theirs["kernels"] else ""
    return "no: " + ", ".join(worse) + kernels


def verdict(record: dict) -> dict:
    """The best peers, and for each fusectl target its judgement against them."""
    result = {"best_peer": best_peer(record), "best_standard_peer": best_peer(record, True)}
    opt = record["optimizers"]
    for target in peers.FUSECTL:
        for label, peer in (("", result["best_peer"]),
                            ("_vs_standard", result["best_standard_peer"])):
            result[f"{target}{label}"] = judge(opt[target], opt.get(peer) if peer else None)
    return result


def ahead_of(record: dict, target: str) -> list[str]:
    """Peers with less traffic than ``target``, least traffic first (whatever their outputs)."""
    opt = record["optimizers"]
    if opt[target].get("error"):
        return []
    mine = opt[target]["bytes"]
    better = [n for n in peers.PEERS if not opt[n].get("error") and opt[n]["bytes"] < mine]
    return sorted(better, key=lambda n: _key(opt[n]))


def histogram_gap(record: dict, target: str, peer: str) -> dict[str, int]:
    """Op counts ``target`` minus ``peer`` (positive: fusectl keeps more of that op)."""
    mine = Counter(record["optimizers"][target].get("ops", {}))
    theirs = Counter(record["optimizers"][peer].get("ops", {}))
    gap = {op: mine[op] - theirs[op] for op in sorted(set(mine) | set(theirs))}
    return {op: d for op, d in sorted(gap.items(), key=lambda kv: -abs(kv[1])) if d}


# --------------------------------------------------------------------------- reporting


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _cell(result: dict, original: dict) -> tuple[str, str, str, str, str]:
    if result.get("error"):
        return (result["error"], "", "", "", f"{result['seconds']:.1f}")
    saved = 100.0 * (original["bytes"] - result["bytes"]) / max(original["bytes"], 1)
    match = "yes" if result.get("match") else f"NO ({result.get('detail') or ''})"[:90]
    if result.get("unknown_shape_nodes"):
        match += f"; {result['unknown_shape_nodes']} nodes of unknown shape"
    return (f"{original['nodes']} → {result['nodes']}",
            f"{original['kernels']} → {result['kernels']}",
            f"{_mib(original['bytes'])} → {_mib(result['bytes'])} ({saved:.1f}%)",
            match, f"{result['seconds']:.1f}")


def print_table(records: list[dict], console: Console) -> None:
    table = Table(title="Fusion comparison (traffic in MiB under fusectl's model)")
    for column in ("model", "optimizer", "nodes", "kernels", "traffic", "outputs match", "s"):
        table.add_column(column)
    for record in records:
        if record.get("error"):
            table.add_row(record["model"], "—", record["error"])
            table.add_section()
            continue
        for i, (name, result) in enumerate(record["optimizers"].items()):
            best = name == record["verdict"]["best_peer"]
            label = f"{name} *" if best else name
            table.add_row(record["model"] if i == 0 else "", label,
                          *_cell(result, record["original"]), end_section=False)
        table.add_section()
    console.print(table)
    console.print("* best peer (least traffic, then fewest nodes, outputs matching)")
    summary = Table(title="fusectl against the best peer (nodes and traffic at most theirs)")
    for column in ("model", "best peer", "best std peer", "fusectl-onnx vs best",
                   "fusectl-onnx vs best std", "fusectl-ort vs best"):
        summary.add_column(column)
    for record in records:
        v = record.get("verdict")
        if v:
            summary.add_row(record["model"], v["best_peer"] or "—",
                            v["best_standard_peer"] or "—",
                            *(v[k] or "—" for k in ("fusectl-onnx", "fusectl-onnx_vs_standard",
                                                    "fusectl-ort")))
    console.print(summary)


def _verdict_text(value: str | None) -> str:
    if value is None:
        return "—"
    return value if value == "yes" else f"**{value}**"


def _gap_lines(record: dict) -> list[str]:
    """For each fusectl target, the op-count differences with every peer moving less traffic."""
    lines = []
    opt = record["optimizers"]
    for target in peers.FUSECTL:
        for peer in ahead_of(record, target):
            gap = histogram_gap(record, target, peer)
            note = "" if opt[peer].get("match") else ", its outputs do not match"
            text = ", ".join(f"{op} {d:+d}" for op, d in gap.items()) or "same ops"
            lines.append(f"- {target} {_mib(opt[target]['bytes'])} MiB vs {peer} "
                         f"{_mib(opt[peer]['bytes'])} MiB{note}; op counts fusectl minus "
                         f"peer: {text}")
    return lines


HEADER = """# Fusion comparison: fusectl and its peers

Generated by `python bench/compare.py`; do not edit by hand. Corpus: `bench/models.py`,
optimizers: `bench/peers.py`, method: `bench/README.md`. Traffic is fusectl's memory-traffic
model in MiB; kernels are the nodes not folded at load time. A verdict is "yes" when fusectl has
fewer or equal nodes **and** less or equal traffic than the best peer (least traffic among the
peers whose outputs match the original), with matching outputs; otherwise it says what is worse
("kernels <=" when fusectl's extra nodes are all folded at load time, e.g. `Constant`). "best std
peer" is the best peer whose output has standard ONNX ops only (no `com.microsoft` contrib ops):
the fair yardstick for fusectl's `onnx` target.
"""


def write_markdown(records: list[dict], versions: dict, path: Path) -> None:
    lines = [HEADER, "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()), "",
             "## Summary", "",
             "| model | best peer | nodes | MiB | best std peer | nodes | MiB "
             "| fusectl onnx nodes | MiB | vs best peer | vs best std peer "
             "| fusectl ort nodes | MiB | vs best peer |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r.get("error"):
            lines.append(f"| {r['model']} | {r['error']} |" + " |" * 12)
            continue
        v, opt = r["verdict"], r["optimizers"]
        row = [r["model"]]
        for key in ("best_peer", "best_standard_peer"):
            best = opt.get(v[key]) if v[key] else None
            row += [v[key], str(best["nodes"]), _mib(best["bytes"])] if best else ["—"] * 3
        for target, keys in (("fusectl-onnx", ("", "_vs_standard")), ("fusectl-ort", ("",))):
            mine = opt[target]
            row += ["failed", "—"] if mine.get("error") else [str(mine["nodes"]),
                                                              _mib(mine["bytes"])]
            row += [_verdict_text(v[f"{target}{key}"]) for key in keys]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "## Per model", ""]
    for r in (r for r in records if not r.get("error")):
        lines += [f"### {r['model']} ({r['source']})", "",
                  "| optimizer | nodes | kernels | traffic MiB | outputs match | seconds |",
                  "|---|---|---|---|---|---|"]
        for name, result in r["optimizers"].items():
            star = " (best peer)" if name == r["verdict"]["best_peer"] else ""
            lines.append(f"| {name}{star} | " + " | ".join(_cell(result, r["original"])) + " |")
        gaps = _gap_lines(r)
        if gaps:
            lines += ["", "Peers that move less traffic than fusectl:", "", *gaps]
        lines.append("")
    path.write_text("\n".join(lines))


def versions() -> dict:
    found = {"onnx": onnx.__version__, "onnxruntime": ort.__version__,
             "onnx-ir": ir.__version__, "numpy": np.__version__}
    for module in ("onnxscript", "onnxsim", "onnxoptimizer", "torch", "fusectl"):
        try:
            found[module] = getattr(__import__(module), "__version__", "?")
        except ImportError:
            found[module] = "not installed"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["*"], help="name globs")
    parser.add_argument("--keep", action="store_true",
                        help=f"keep the optimized models in {OUT_DIR} (they can be large)")
    parser.add_argument("--reuse-peers", action="store_true",
                        help="reuse the peers' results of the last run; rerun fusectl only")
    args = parser.parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    entries = [e for e in models.corpus(log=console.print)
               if e.path and any(fnmatch.fnmatch(e.name, g) for g in args.models)]
    previous = _load_previous() if args.reuse_peers else {}
    records = []
    with console.status("comparing") as status:
        for entry in entries:
            records.append(compare_model(entry, previous.get(entry.name), status.update))
            if not args.keep:
                for path in OUT_DIR.glob(f"{entry.name}.*.onnx"):
                    path.unlink()
    found = versions()
    old = {r["model"]: r for r in _load_previous().values()}
    old.update({r["model"]: r for r in records})  # a partial run keeps the other models
    order = [e.name for e in models.corpus(log=lambda _m: None)]
    merged = sorted(old.values(), key=lambda r: order.index(r["model"])
                    if r["model"] in order else len(order))
    RESULTS.write_text(json.dumps({"versions": found, "models": merged}, indent=1))
    write_markdown(merged, found, MARKDOWN)
    print_table(records, console)
    console.print(f"wrote {RESULTS} and {MARKDOWN}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
