"""The benchmark (bench/benchmark.py) on one light model, once, plus its arithmetic.

The smoke run needs the peers of the ``bench`` extra (onnx-simplifier, onnxoptimizer) and is
skipped without them; the unit tests of the helpers run everywhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import latency  # noqa: E402
import results  # noqa: E402
import speed  # noqa: E402
import stats  # noqa: E402

PEERS_INSTALLED = all(importlib.util.find_spec(m) for m in ("onnxsim", "onnxoptimizer"))
needs_peers = pytest.mark.skipif(not PEERS_INSTALLED,
                                 reason="onnxsim/onnxoptimizer not installed (bench extra)")
LIGHT = Path(onnx.__file__).parent / "backend/test/data/light/light_squeezenet.onnx"
TOOLS = ("fusectl", "ort-basic", "onnxsim", "onnxoptimizer")


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench")
    done = _run(str(BENCH / "benchmark.py"), "--quick", "--models", "light_squeezenet",
                "--tools", *TOOLS, "--levels", "all", "--latency-budget", "0.3",
                "--json", str(out / "run.json"), "--markdown", str(out / "run.md"))
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((out / "run.json").read_text()), (out / "run.md").read_text()


# --------------------------------------------------------------------------- smoke run


@needs_peers
def test_every_tool_ran_once_in_its_own_process(quick):
    data, _ = quick
    (record,) = data["models"]
    assert record["model"] == "light_squeezenet"
    assert record["nodes"] == len(onnx.load(str(LIGHT)).graph.node)
    for tool in TOOLS:
        found = record["speed"][tool]
        assert (found["ok"], found["runs"], found["errors"]) == (1, 1, []), tool
        (sample,) = found["samples"]
        # the parent's wall clock covers the child's imports and run, and more
        assert sample["wall_s"] >= sample["import_s"] + sample["run_s"] > 0
        assert sample["import_rss"] <= sample["peak_rss"] < 4 * 2**30


@needs_peers
def test_traffic_and_latency_of_each_output(quick):
    data, _ = quick
    (record,) = data["models"]
    original = record["traffic"]["original"]
    assert original["nodes"] == record["nodes"]
    assert record["traffic"]["fusectl"]["bytes"] <= original["bytes"]
    timed = record["latency"]["all"]
    assert timed["runs"] >= 3
    for name in ("original", "fusectl", "ort-basic", "onnxsim", "onnxoptimizer"):
        found = timed["variants"][name]
        assert found["n"] == timed["runs"], name
        assert found["min"] <= found["median"] <= found["max"]


@needs_peers
def test_markdown_shows_the_ratios_of_the_medians(quick):
    data, text = quick
    speeds = data["models"][0]["speed"]
    for peer in ("ort-basic", "onnxsim", "onnxoptimizer"):
        expected = speeds["fusectl"]["run_s"]["median"] / speeds[peer]["run_s"]["median"]
        assert f"fusectl ÷ {peer}" in text
        assert f" {expected:.2f} |" in text
    assert f"{os.cpu_count()} cores" in text
    again = results.markdown(data, ["- a finding written by hand"])
    assert results.kept_findings(again) == ["- a finding written by hand"]


# --------------------------------------------------------------------------- arithmetic


def test_spread_and_ratio():
    assert stats.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert stats.spread([]) is None
    assert stats.ratio({"median": 3.0}, {"median": 4.0}) == 0.75
    summary = {"median": 0.0123, "min": 0.01, "max": 0.02, "n": 3}
    assert stats.fmt_spread(summary, 1e3, 1) == "12.3 (10.0–20.0)"


def test_latency_plan_fits_the_budget():
    # 0.5 s rounds, 6 s budget: 1.2 s of warm-up holds 2 rounds, 6 s hold 12 timed rounds
    assert latency.plan(0.5, 6.0, warmup=10, min_runs=10, max_runs=200) == (2, 12)
    # 1 ms rounds: capped at 10 warm-ups and 200 runs
    assert latency.plan(0.001, 6.0, warmup=10, min_runs=10, max_runs=200) == (10, 200)
    # 3 s rounds: at least 2 warm-ups and min_runs
    assert latency.plan(3.0, 6.0, warmup=10, min_runs=10, max_runs=200) == (2, 10)


def test_scale_extrapolation():
    # 1 s at 1k nodes, 100 s at 10k: quadratic, so 100k nodes take 100 * 10**2 s
    assert speed.predicted_seconds([(1000, 1.0), (10000, 100.0)], 100000) == pytest.approx(1e4)
    # one point: linear; faster than linear is still extrapolated linearly
    assert speed.predicted_seconds([(1000, 2.0)], 20000) == pytest.approx(40.0)
    assert speed.predicted_seconds([(1000, 4.0), (2000, 5.0)], 4000) == pytest.approx(10.0)


def test_worst_case_is_the_slowest_fusectl_model_beyond_noise():
    def record(model: str, level: str, original: float, fused: float) -> dict:
        return {"model": model, "latency": {level: {"variants": {
            "original": {"median": original}, "fusectl": {"median": fused}}}}}

    records = [record("a", "all", 10.0, 12.0),      # 1.20: missed
               record("b", "all", 10.0, 10.2),      # 1.02: within the 3% noise band
               record("c", "all", 10.0, 13.0),      # 1.30: the worst
               record("d", "disabled", 10.0, 9.0)]  # 0.90: faster, goal met
    assert results.worst_cases(records) == [
        {"model": "c", "level": "all", "target": "onnx", "ratio": 1.3}]
    assert [results._goal(x) for x in (0.96, 0.98, 1.02, 1.04)] == [
        "faster", "tie (noise)", "tie (noise)", "SLOWER"]


def test_why_slower_ranks_the_skipped_rules_by_latency():
    import why_slower

    def ms(median: float) -> dict:
        return {"median": median / 1e3, "min": median / 1e3, "max": median / 1e3, "n": 1}

    result = {"fired": {"a": 2, "b": 1}, "latency": {"runs": 1, "variants": {
        "original": ms(4.0), "fusectl": ms(5.0), why_slower.NO_RULES: ms(4.0),
        "skip a": ms(4.8), "skip b": ms(3.9), "skip c": {"error": "did not load"}}}}
    rows = why_slower.verdict(result)
    assert [(r["rule"], r["fired"]) for r in rows] == [("b", 1), ("a", 2)]
    assert rows[0]["vs_original"] == pytest.approx(3.9 / 4.0)
    assert rows[1]["vs_fusectl"] == pytest.approx(4.8 / 5.0)


def test_child_reports_its_own_peak_memory_not_its_parents():
    ballast = b"x" * (256 * 2**20)  # the parent's RSS grows by 256 MiB
    done = _run("-c", "import sys; sys.path.insert(0, 'bench'); import child; "
                      "print(child._peak_rss())", timeout=60)
    del ballast
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) < 128 * 2**20


@pytest.mark.parametrize("args", [
    ("bench/benchmark.py", "--reps", "0"),
    ("bench/profile_fusectl.py", "no/such/model.onnx"),
])
def test_bad_usage_is_one_line_and_exit_2(args):
    done = _run(*args, timeout=60)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_failed_why_run_is_a_table_not_a_crash():
    """A leave-one-out run that failed is recorded as an error; the tables (printed after
    the results are saved) show it instead of losing the whole benchmark."""
    why = {"model": "bert-ts", "level": "all", "target": "onnx", "ratio": 1.2,
           "error": "RuntimeError: boom"}
    table = results.why_table(why)
    assert table.rows == [["RuntimeError: boom"]]
    assert "bert-ts" in table.title
