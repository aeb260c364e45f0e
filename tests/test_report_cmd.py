"""``fusectl report``: per-node traffic, FLOPs and roofline worked out by hand, device
profiles, the rules' dry run, and the JSON document against its schema."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import jsonschema
import onnx
import onnx.parser
import pytest

import fusectl
from fusectl.cli import main
from fusectl.roofline import Device, builtin_devices, load_device, roofline
from fusectl.traffic import NodeTraffic, TrafficReport

SCHEMA = json.loads(
    (Path(fusectl.__file__).parent / "schemas" / "report.schema.json").read_text()
)


def run(capsys, *args: object) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def zeros(n: int) -> str:
    return ", ".join(["0"] * n)


def filled(n: int, value: int) -> str:
    return ", ".join([str(value)] * n)


# Conv -> Flatten -> Gemm -> LayerNormalization, every size small enough to add up by hand.
# b2, gamma and beta differ: equal constants would be merged into one initializer.
HAND_MODEL = f"""<ir_version: 10, opset_import: ["" : 18]>
g (float[1,3,8,8] x) => (float[1,10] out)
<float[4,3,3,3] W = {{{zeros(108)}}}, float[4] B = {{{zeros(4)}}},
 float[144,10] W2 = {{{zeros(1440)}}}, float[10] b2 = {{{filled(10, 2)}}},
 float[10] gamma = {{{filled(10, 1)}}}, float[10] beta = {{{zeros(10)}}}>
{{
  y = Conv(x, W, B)
  f = Flatten(y)
  h = Gemm(f, W2, b2)
  out = LayerNormalization(h, gamma, beta)
}}"""

# One small rule file instead of the built-in library, where the rules do not matter (it does
# not fire on HAND_MODEL): compiling the library costs seconds.
LIGHT_RULES = ("--no-builtin-rules", "--rules",
               Path(__file__).parent / "data" / "wrong_bn_fold.yaml")

# 1 GB/s and 1 GFLOP/s: a byte costs 1 ns and so does a FLOP (ridge at 1 FLOP/byte).
SLOW_DEVICE = """name: slow
description: one byte or one FLOP per nanosecond
bandwidth_gb_s: 1
peak_gflop_s: 1
"""


@pytest.fixture
def hand_model(tmp_path: Path) -> Path:
    path = tmp_path / "hand.onnx"
    onnx.save(onnx.parser.parse_model(HAND_MODEL), path)
    return path


@pytest.fixture
def slow_device(tmp_path: Path) -> Path:
    path = tmp_path / "slow.yaml"
    path.write_text(SLOW_DEVICE)
    return path


def report_json(capsys, tmp_path: Path, model: Path, *args: object) -> dict:
    out = tmp_path / "report.json"
    code, _, err = run(capsys, "report", model, "--json", out, "-q", *args)
    assert code == 0, err
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, SCHEMA)
    return doc


def by_name(nodes: list[dict]) -> dict[str, dict]:
    return {n["op"]: n for n in nodes}


def test_conv_gemm_layernorm_by_hand(capsys, tmp_path: Path, hand_model: Path,
                                     slow_device: Path) -> None:
    doc = report_json(capsys, tmp_path, hand_model, "--device", slow_device, *LIGHT_RULES)
    nodes = by_name(doc["nodes"])
    conv, flat, gemm, ln = (nodes[op] for op in
                            ("Conv", "Flatten", "Gemm", "LayerNormalization"))
    # Conv: x 1*3*8*8 = 192, W 4*3*3*3 = 108, B 4 floats read; y 1*4*6*6 = 144 written
    assert (conv["bytes_read"], conv["bytes_written"]) == ((192 + 108 + 4) * 4, 144 * 4)
    # MACs = 144 outputs * (3 channels * 3*3 kernel) = 3888; FLOPs 2*3888 + 144 bias adds
    assert (conv["macs"], conv["flops"]) == (3888, 2 * 3888 + 144)
    assert conv["param_bytes"] == (108 + 4) * 4
    # Flatten is a view: a kernel that moves nothing
    assert (flat["bytes"], flat["flops"], flat["bound"]) == (0, 0, "none")
    # Gemm: A [1,144], B [144,10], C [10] read; [1,10] written
    assert (gemm["bytes_read"], gemm["bytes_written"]) == ((144 + 1440 + 10) * 4, 10 * 4)
    # M=1, N=10, K=144: MACs 1440; FLOPs 2*1440 + 10 for C
    assert (gemm["macs"], gemm["flops"]) == (1440, 2890)
    # LayerNormalization: h, gamma, beta 10 floats each read, 10 written; 8 FLOPs/element
    assert (ln["bytes_read"], ln["bytes_written"], ln["flops"]) == (120, 40, 80)

    before = doc["totals"]["before"]
    assert before["bytes"] == 1216 + 576 + 6376 + 40 + 120 + 40 == 8368
    assert before["flops"] == 7920 + 2890 + 80 == 10890
    assert before["macs"] == 3888 + 1440
    assert before["param_bytes"] == (108 + 4 + 1440 + 10 + 10 + 10) * 4
    assert before["kernels"] == 4

    # roofline at 1 ns per byte and per FLOP: Conv 1792 bytes < 7920 FLOPs -> compute-bound
    assert conv["bound"] == "compute" and conv["seconds"] == pytest.approx(7920e-9)
    assert conv["intensity"] == pytest.approx(7920 / 1792, rel=1e-5)
    # Gemm 6416 bytes > 2890 FLOPs -> memory-bound, 6.416 us
    assert gemm["bound"] == "memory" and gemm["seconds"] == pytest.approx(6416e-9)
    assert ln["bound"] == "memory" and ln["seconds"] == pytest.approx(160e-9)
    assert before["seconds"] == pytest.approx((7920 + 6416 + 160) * 1e-9)
    assert (before["memory_bound_kernels"], before["compute_bound_kernels"]) == (2, 1)
    assert doc["device"] == {"name": "slow", "description": "one byte or one FLOP per nanosecond",
                             "source": str(slow_device), "bandwidth_gb_s": 1.0,
                             "peak_gflop_s": 1.0, "ridge_flop_per_byte": 1.0}
    # the rule file given does not fire here: after == before
    assert doc["rules"]["would_fire"] == [] and doc["saved"]["bytes"] == 0
    assert doc["totals"]["after"] == before


def test_conv_algo_adds_buffers_to_the_conv(capsys, tmp_path: Path, hand_model: Path) -> None:
    im2col = report_json(capsys, tmp_path, hand_model, "--conv-algo", "im2col", *LIGHT_RULES)
    conv = by_name(im2col["nodes"])["Conv"]
    # column buffer N*OH*OW*KH*KW*C = 36*9*3 = 972 floats, written and read
    assert conv["workspace_bytes"] == 2 * 972 * 4
    assert conv["bytes"] == 1792 + 7776
    assert im2col["conv_algo"] == "im2col"
    indirect = report_json(capsys, tmp_path, hand_model, "--conv-algo", "indirect", *LIGHT_RULES)
    # 36*9 = 324 pointers of 8 bytes
    assert by_name(indirect["nodes"])["Conv"]["workspace_bytes"] == 324 * 8


def test_roofline_of_one_known_node() -> None:
    device = Device("toy", bandwidth=100e9, peak_flops=1e12)  # ridge 10 FLOP/byte
    node = NodeTraffic("n", "Add", "", 600, 400, 2000, 0, is_kernel=True, known=True)
    folded = NodeTraffic("c", "Mul", "", 0, 0, 0, 0, is_kernel=False, known=True)
    line = roofline(TrafficReport((node, folded)), device)
    (row,) = line.nodes  # folded nodes are not kernels
    # 1000 bytes / 100 GB/s = 10 ns > 2000 FLOPs / 1 TFLOP/s = 2 ns
    assert row.memory_seconds == pytest.approx(10e-9)
    assert row.compute_seconds == pytest.approx(2e-9)
    assert row.bound == "memory" and row.seconds == pytest.approx(10e-9)
    assert row.intensity == 2.0 and device.ridge == 10.0
    assert line.seconds == pytest.approx(10e-9) and line.count("memory") == 1


def test_builtin_devices_are_the_datasheet_numbers() -> None:
    assert set(builtin_devices()) == {"cpu", "a100", "h100"}
    a100, h100, cpu = load_device("a100"), load_device("h100"), load_device("cpu")
    assert (a100.bandwidth, a100.peak_flops) == (2039e9, 19.5e12)
    assert (h100.bandwidth, h100.peak_flops) == (3350e9, 67e12)
    # 8 cores * 2 FMA * 8 lanes * 2 FLOPs * 3 GHz; 2 channels * 8 bytes * 3.2 GT/s
    assert cpu.peak_flops == pytest.approx(8 * 2 * 8 * 2 * 3.0e9)
    assert cpu.bandwidth == pytest.approx(2 * 8 * 3.2e9)
    assert a100.source == "builtin"


@pytest.mark.parametrize(("text", "message"), [
    ("bandwidth_gb_s: 1\n", "peak_gflop_s must be a positive number"),
    ("bandwidth_gb_s: -1\npeak_gflop_s: 1\n", "bandwidth_gb_s must be a positive number"),
    ("bandwidth_gb_s: 1\npeak_gflop_s: 1\nlatency: 3\n", "unknown key 'latency'"),
    ("bandwidth_gb_s: [1\n", "invalid YAML"),
    ("- 1\n", "a device profile is a mapping"),
])
def test_bad_device_file_is_one_line_and_exit_2(capsys, tmp_path: Path, hand_model: Path,
                                                text: str, message: str) -> None:
    device = tmp_path / "bad.yaml"
    device.write_text(text)
    out = tmp_path / "r.json"
    code, stdout, err = run(capsys, "report", hand_model, "--device", device, "--json", out)
    assert code == 2
    assert message in err and str(device) in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists() and stdout == ""


def test_unknown_device_name(capsys, hand_model: Path) -> None:
    code, _, err = run(capsys, "report", hand_model, "--device", "tpu9")
    assert code == 2 and "not a built-in device (a100, cpu, h100)" in err


def test_dry_run_on_the_cnn_sample_writes_nothing(capsys, tmp_path: Path, samples: Path) -> None:
    model = tmp_path / "cnn.onnx"
    shutil.copy(samples / "cnn.onnx", model)
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    doc = report_json(capsys, tmp_path, model, "--top", "3", "--device", "a100",
                      "--markdown", tmp_path / "report.md")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cnn.onnx", "report.json", "report.md"]
    assert "conv-bn-fold" in (tmp_path / "report.md").read_text()
    assert hashlib.sha256(model.read_bytes()).hexdigest() == digest

    fired = {r["id"]: r for r in doc["rules"]["would_fire"]}
    assert fired["conv-bn-fold"]["applications"] == 2
    assert sorted(sorted(m) for m in fired["conv-bn-fold"]["where"]) == [
        ["bn1", "conv1"], ["bn3", "conv3"]]
    # per-rule savings add up to the total (direct convolution, as the rewriter measures)
    assert doc["saved"]["bytes"] == sum(r["bytes_saved"] for r in fired.values())
    assert doc["saved"]["bytes"] == (doc["totals"]["before"]["bytes"]
                                     - doc["totals"]["after"]["bytes"]) > 0
    assert doc["saved"]["kernels"] == sum(r["kernels_saved"] for r in fired.values()) == 4
    rules = {n["name"]: n["rule"] for n in doc["nodes"]}
    assert rules["bn1"] == rules["conv1"] == "conv-bn-fold" and rules["relu1"] is None
    assert {n["rule"] for n in doc["nodes_after"]} >= {"conv-bn-fold", "conv-add-fold"}
    assert doc["saved"]["seconds"] > 0 and doc["saved"]["speedup"] > 1
    # top 3 by bytes, heaviest first, and nothing outside the list is heavier
    top = doc["top_nodes"]
    assert len(top) == 3 and top[0]["bytes"] >= top[1]["bytes"] >= top[2]["bytes"]
    assert max(n["bytes"] for n in doc["nodes"]) == top[0]["bytes"]
    assert top[0]["percent"] == pytest.approx(
        100 * top[0]["bytes"] / doc["totals"]["before"]["bytes"], abs=1e-3)


def test_terminal_report(capsys, samples: Path) -> None:
    code, out, err = run(capsys, "report", samples / "cnn.onnx", "--top", "2")
    assert code == 0, err
    assert "conv-bn-fold" in out and "roofline time" in out and "memory-bound" in out
    assert "Top 2 kernels by traffic" in out
    code, out, _ = run(capsys, "report", samples / "cnn.onnx", "-q", *LIGHT_RULES)
    assert code == 0 and out == ""


def test_skip_rule_applies_after_rule_names_a_rule(capsys, samples: Path) -> None:
    """As in optimize: --rule X --skip-rule X runs nothing; it is not "X matches no rule"."""
    code, out, err = run(capsys, "report", samples / "cnn.onnx", "--rule", "conv-bn-fold",
                         "--skip-rule", "conv-bn-fold")
    assert code == 0, err
    assert "conv-bn-fold" not in out
    code, out, err = run(capsys, "report", samples / "cnn.onnx", "--skip-rule", "conv-bn-fold")
    assert code == 0 and "conv-bn-fold" not in out


def test_api_report_model(samples: Path) -> None:
    rules = fusectl.load_rule_set(include=["matmul-add-to-gemm"])
    report = fusectl.report_model(samples / "mlp.onnx", rules=rules, device="h100", top=2)
    assert [(r.rule_id, r.applications) for r in report.rules] == [("matmul-add-to-gemm", 3)]
    assert len(report.top_nodes()) == 2
    assert report.roofline_before.seconds > report.roofline_after.seconds


@pytest.mark.parametrize("args", [
    ("--conv-algo", "winograd"),
    ("--dim", "N=x"),
    ("--rule", "no-such-rule*"),
])
def test_bad_options_exit_2(capsys, hand_model: Path, args: tuple[str, ...]) -> None:
    code, out, err = run(capsys, "report", hand_model, *args, *LIGHT_RULES[:1],
                         "--rules", LIGHT_RULES[2])
    assert code == 2 and out == "" and "Traceback" not in err


def test_unreadable_model_exit_2(capsys, tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    code, _, err = run(capsys, "report", bad, *LIGHT_RULES)
    assert code == 2 and len(err.strip().splitlines()) == 1


def test_dim_binds_the_batch(capsys, tmp_path: Path, samples: Path) -> None:
    one = report_json(capsys, tmp_path, samples / "cnn.onnx", *LIGHT_RULES)
    two = report_json(capsys, tmp_path, samples / "cnn.onnx", "--dim", "N=2", *LIGHT_RULES)
    relu = [{n["name"]: n for n in doc["nodes"]}["relu1"] for doc in (one, two)]
    # Relu on [N,16,32,32] floats reads and writes N*65536 bytes; unbound N counts as 1
    assert [r["bytes"] for r in relu] == [2 * 65536, 2 * 2 * 65536]
    assert (one["dims"], two["dims"]) == ({}, {"N": 2})


def test_table_cells_are_literal_text() -> None:
    """Node names and reasons may hold '[': rich must not read them as markup."""
    from rich.console import Console

    from fusectl.report import text_table

    console = Console(record=True, width=80, color_system=None)
    console.print(text_table("t", ("node", "reason"), [("conv[red]1[/red]", "pads [1, 1]")]))
    shown = console.export_text()
    assert "conv[red]1[/red]" in shown and "pads [1, 1]" in shown


SKIP_NORM_MODEL = """<ir_version: 9, opset_import: ["" : 17]>
g (float[2,8,16] a, float[2,8,16] b) => (float[2,8,16] z)
<float[16] gamma = {1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7,
                    1.8, 1.9, 2.0, 2.1, 2.2, 2.3, 2.4, 2.5}>
{ s = Add(a, b)  z = LayerNormalization<axis=-1, epsilon=1e-5>(s, gamma) }"""


@pytest.mark.parametrize(("args", "off_fires", "on_fires"), [
    (("--target", "onnxruntime"), True, False),  # off by default: the report says so
    (("--target", "onnxruntime", "--opt-in", "ort-skip-layernorm"), False, True),
    (("--target", "onnx"), False, False),  # not a rule of this target
])
def test_report_names_opt_in_rules_that_would_fire(capsys, tmp_path: Path, args, off_fires,
                                                   on_fires) -> None:
    """An opt-in rule left out is dry-run too, so the report says what it would add and
    why it is off instead of staying silent about a fusion the user may want."""
    path = tmp_path / "skip.onnx"
    onnx.save(onnx.parser.parse_model(SKIP_NORM_MODEL), path)
    doc_path = tmp_path / "r.json"
    code, out, err = run(capsys, "report", path, "--json", doc_path, "--markdown",
                         tmp_path / "r.md", "--html", tmp_path / "r.html", "--verbose", *args)
    assert code == 0, err
    doc = json.loads(doc_path.read_text())
    jsonschema.validate(doc, SCHEMA)
    off = doc["rules"]["opt_in_would_fire"]
    fired = {r["id"] for r in doc["rules"]["would_fire"]}
    assert ("ort-skip-layernorm" in fired) is on_fires
    if off_fires:
        assert [(r["id"], r["applications"], r["kernels_saved"]) for r in off] == [
            ("ort-skip-layernorm", 1, 1)]
        assert off[0]["bytes_saved"] == 2 * 2 * 8 * 16 * 4  # the sum, written and read
        assert "bench/kernels.py" in off[0]["why_off"]
        assert "Opt-in rules that would also fire" in out
        assert "`ort-skip-layernorm`" in (tmp_path / "r.md").read_text()
        assert "Opt-in rules that would also fire" in (tmp_path / "r.html").read_text()
    else:
        assert off == [] and "Opt-in rules" not in out
        assert "Opt-in rules" not in (tmp_path / "r.html").read_text()


def test_no_second_dry_run_when_no_opt_in_rule_can_match(tmp_path: Path, monkeypatch) -> None:
    """The ort target's opt-in rules root at (Simplified)LayerNormalization: a model with
    none is dry-run once, and the report has no opt-in section (None, not an empty one)."""
    from fusectl import analysis

    path = tmp_path / "relu.onnx"
    onnx.save(onnx.parser.parse_model("""<ir_version: 9, opset_import: ["" : 17]>
        g (float[2,8] a) => (float[2,8] z) { r = Relu(a)  z = Sigmoid(r) }"""), path)
    calls = []
    real = analysis.optimize
    monkeypatch.setattr(analysis, "optimize",
                        lambda *a, **k: calls.append(k.get("rules")) or real(*a, **k))
    every = fusectl.load_rule_set(target="onnxruntime", opt_in=True)
    rules = [r for r in every if not r.rule.opt_in]
    report = analysis.report_model(path, rules=rules, with_opt_in=every, target="onnxruntime")
    assert len(calls) == 1 and report.opt_in is None
    skip = tmp_path / "skip.onnx"
    onnx.save(onnx.parser.parse_model(SKIP_NORM_MODEL), skip)
    report = analysis.report_model(skip, rules=rules, with_opt_in=every, target="onnxruntime")
    assert len(calls) == 3 and report.opt_in is not None  # a LayerNormalization: dry-run again
