"""End-to-end tests of the ``fusectl`` command: exit codes, outputs, reports, bad input."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

import fusectl
from fusectl.cli import default_output, main

DATA = Path(__file__).parent / "data"


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def cnn(tmp_path: Path, samples: Path) -> Path:
    target = tmp_path / "cnn.onnx"
    shutil.copy(samples / "cnn.onnx", target)
    return target


def test_optimize_sample_writes_default_output_and_json(capsys, cnn: Path, tmp_path: Path):
    before = digest(cnn)
    report = tmp_path / "report.json"
    code, out, err = run(capsys, "optimize", cnn, "--json", report)
    assert code == 0, err
    written = tmp_path / "cnn.opt.onnx"
    assert written.exists() and default_output(cnn) == written
    assert digest(cnn) == before, "the input model must never change"
    model = onnx.load(written)
    onnx.checker.check_model(model, full_check=True)
    ops = [n.op_type for n in model.graph.node]
    assert "BatchNormalization" not in ops and "Mul" not in ops
    doc = json.loads(report.read_text())
    assert doc["schema"] == "fusectl.optimize/1"
    assert doc["passed"] is True
    applied = {r["id"]: r["applications"] for r in doc["rules"]["applied"]}
    assert applied["conv-bn-fold"] == 2
    assert doc["traffic"]["bytes_after"] < doc["traffic"]["bytes_before"]
    assert doc["traffic"]["bytes_saved"] == sum(r["bytes_saved"] for r in doc["rules"]["applied"])
    assert doc["validation"]["outputs"][0]["passed"] is True
    assert "conv-bn-fold" in out and "outputs match" in out


def test_signature_metadata_and_opsets_preserved(capsys, cnn: Path, tmp_path: Path):
    out_path = tmp_path / "o.onnx"
    assert run(capsys, "optimize", cnn, "-o", out_path, "-q")[0] == 0
    a, b = onnx.load(cnn), onnx.load(out_path)
    assert a.graph.input == b.graph.input and a.graph.output == b.graph.output
    assert a.opset_import == b.opset_import and a.ir_version == b.ir_version
    assert a.metadata_props == b.metadata_props and a.doc_string == b.doc_string
    assert a.producer_name == b.producer_name


def test_wrong_rule_is_caught_reverted_and_exits_1(capsys, cnn: Path, tmp_path: Path):
    """Bisection reverts both wrong folds; the model that keeps every verified fusion (here
    none) is written, and the run still fails unless --allow-revert."""
    out_path = tmp_path / "o.onnx"
    code, _, err = run(capsys, "optimize", cnn, "-o", out_path, "--no-builtin-rules",
                       "--rules", DATA / "wrong_bn_fold.yaml")
    assert code == 1
    assert "2 rule application(s) changed outputs and were reverted" in err
    assert "wrong-conv-bn-fold on bn1, conv1" in err
    assert out_path.exists()
    written = onnx.load(out_path)
    assert [n.op_type for n in written.graph.node].count("BatchNormalization") == 2
    code, _, _ = run(capsys, "optimize", cnn, "-o", out_path, "--no-builtin-rules",
                     "--rules", DATA / "wrong_bn_fold.yaml", "--allow-revert", "-q")
    assert code == 0


def test_wrong_rule_fails_its_own_embedded_test(capsys):
    code, out, _ = run(capsys, "rules", "test", DATA / "wrong_bn_fold.yaml")
    assert code == 1
    assert "outputs changed" in out and "1 passed, 1 failed" in out


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"", "empty"),
        (b"\x00\x01garbage\xff" * 10, ""),
        (b"hello, I am a text file\n", ""),
    ],
    ids=["empty", "random-bytes", "text"],
)
def test_bad_model_files_exit_2_one_line(capsys, tmp_path: Path, content: bytes, needle: str):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(content)
    code, out, err = run(capsys, "optimize", bad)
    assert code == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert needle in err
    assert bad.read_bytes() == content
    assert not (tmp_path / "bad.opt.onnx").exists()


def test_truncated_and_missing_models(capsys, cnn: Path, tmp_path: Path):
    truncated = tmp_path / "t.onnx"
    truncated.write_bytes(cnn.read_bytes()[: 3000])
    for path in (truncated, tmp_path / "missing.onnx"):
        code, _, err = run(capsys, "optimize", path)
        assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bad_rule_file_reports_every_problem_with_lines(capsys, cnn: Path):
    code, _, err = run(capsys, "optimize", cnn, "--rules", DATA / "bad_rule.yaml")
    assert code == 2 and "Traceback" not in err
    assert "bad_rule.yaml:6:" in err  # the statement
    assert "bad_rule.yaml:8:" in err  # the hostile expression
    assert "bad_rule.yaml:11:" in err  # the unknown key
    assert not (cnn.parent / "cnn.opt.onnx").exists()


def test_output_over_input_is_refused_in_place_is_atomic(capsys, cnn: Path):
    before = digest(cnn)
    code, _, err = run(capsys, "optimize", cnn, "-o", cnn)
    assert code == 2 and digest(cnn) == before
    code, _, _ = run(capsys, "optimize", cnn, "--in-place", "-q")
    assert code == 0 and digest(cnn) != before
    assert [p.name for p in cnn.parent.iterdir()] == ["cnn.onnx"]
    assert "BatchNormalization" not in {n.op_type for n in onnx.load(cnn).graph.node}


def test_rule_selection_and_no_validate(capsys, cnn: Path, tmp_path: Path):
    report = tmp_path / "r.json"
    code, _, _ = run(capsys, "optimize", cnn, "--rule", "conv-bn-*", "--no-validate",
                     "--json", report, "-q")
    assert code == 0
    doc = json.loads(report.read_text())
    assert [r["id"] for r in doc["rules"]["applied"]] == ["conv-bn-fold"]
    assert doc["validation"] is None
    code, _, err = run(capsys, "optimize", cnn, "--rule", "no-such-rule")
    assert code == 2 and "matches no rule" in err


def test_bad_options_exit_2(capsys, cnn: Path):
    for args in (["--dim", "N"], ["--dim", "N=0"], ["--input-range", "x=3:1"],
                 ["--target", "tpu"], ["--input", "nope=missing.npy"]):
        code, _, err = run(capsys, "optimize", cnn, *args)
        assert code == 2, args
        assert "Traceback" not in err


def test_rules_commands(capsys):
    code, out, _ = run(capsys, "rules", "list")
    assert code == 0 and "conv-bn-fold" in out and "gelu-erf" in out
    code, out, _ = run(capsys, "rules", "show", "conv-bn-fold")
    assert code == 0 and "BatchNormalization" in out
    assert run(capsys, "rules", "show", "nope")[0] == 2
    code, out, _ = run(capsys, "rules", "test")
    assert code == 0 and " 0 failed" in out
    code, out, _ = run(capsys, "rules", "lint", Path(__file__).parent.parent / "rules")
    assert code == 0 and "rules OK" in out
    code, _, err = run(capsys, "rules", "lint", DATA / "bad_rule.yaml")
    assert code == 2 and "bad_rule.yaml:6:" in err


def test_opt_in_rule_listed_shown_and_run_only_when_named(capsys, tmp_path: Path):
    code, out, _ = run(capsys, "rules", "list")  # a narrow table: cells wrap
    opt_in = {r.id for r in fusectl.load_rule_set(target="onnxruntime", opt_in=True)
              if r.rule.opt_in}
    assert opt_in == {"ort-skip-rmsnorm", "ort-skip-layernorm", "ort-skip-layernorm-decomposed",
                      "ort-skip-layernorm-decomposed-scale", "ort-skip-layernorm-decomposed-plain"}
    assert code == 0 and out.count("(--opt-in") == len(opt_in) and "ort-skip-rmsn" in out
    code, out, _ = run(capsys, "rules", "show", "ort-skip-rmsnorm")
    assert code == 0 and "opt-in" in out and "bench/kernels.py" in " ".join(out.split())
    model = onnx.parser.parse_model("""
        <ir_version: 9, opset_import: ["" : 23]>
        g (float[2,8,16] a, float[2,8,16] b) => (float[2,8,16] z)
        <float[16] scale = {1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7,
                            1.8, 1.9, 2.0, 2.1, 2.2, 2.3, 2.4, 2.5}>
        { s = Add(a, b)  z = RMSNormalization<axis=-1, epsilon=1e-5>(s, scale) }
    """)
    path = tmp_path / "rms.onnx"
    onnx.save(model, path)
    for extra, fired in (((), False), (("--rule", "*"), True)):
        applied = _applied_on_onnxruntime(capsys, tmp_path, path, *extra)
        assert ("ort-skip-rmsnorm" in applied) is fired, (extra, applied)


def _applied_on_onnxruntime(capsys, tmp_path: Path, path: Path, *extra: str) -> set[str]:
    """The rules an optimize run with the onnxruntime target applied (from its JSON)."""
    report = tmp_path / "r.json"
    code, _, err = run(capsys, "optimize", path, "-o", tmp_path / "o.onnx", "--target",
                       "onnxruntime", "--json", report, *extra)
    assert code == 0, err
    return {a["rule"] for a in json.loads(report.read_text())["applications"]}


def test_opt_in_adds_to_the_default_rules(capsys, tmp_path: Path):
    """--opt-in runs the named opt-in rules and the default library alike (--rule would run
    only the rules it names); a glob naming no opt-in rule is refused."""
    model = onnx.parser.parse_model("""
        <ir_version: 9, opset_import: ["" : 17]>
        g (float[2,8,16] a, float[2,8,16] b) => (float[2,8,16] z)
        <float[16] gamma = {1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7,
                            1.8, 1.9, 2.0, 2.1, 2.2, 2.3, 2.4, 2.5}, float[16] beta = {
                            0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7,
                            0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5},
         float sqrt2 = {1.4142135}, float one = {1.0}, float half = {0.5}>
        { s = Add(a, b)
          n = LayerNormalization<axis=-1, epsilon=1e-5>(s, gamma, beta)
          r = Div(n, sqrt2)  e = Erf(r)  p = Add(e, one)  q = Mul(n, p)  z = Mul(q, half) }
    """)
    path = tmp_path / "block.onnx"
    onnx.save(model, path)
    for extra, skip_fused in (((), False), (("--opt-in", "ort-skip-layernorm*"), True)):
        applied = _applied_on_onnxruntime(capsys, tmp_path, path, *extra)
        assert "ort-gelu-erf" in applied, (extra, applied)
        assert ("ort-skip-layernorm" in applied) is skip_fused, (extra, applied)
    code, _, err = run(capsys, "optimize", path, "-o", tmp_path / "o2.onnx", "--opt-in",
                       "conv-bn-*")
    assert code == 2 and "matches no opt-in rule" in err and not (tmp_path / "o2.onnx").exists()


def test_version_and_help(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and "fusectl" in out
    code, out, _ = run(capsys, "optimize", "--help")
    assert code == 0 and "--no-validate" in out


def test_verbose_lists_skipped_rules_refusals_and_top_nodes(capsys, samples: Path, tmp_path):
    code, out, _ = run(capsys, "optimize", samples / "cnn.onnx", "-o", tmp_path / "o.onnx",
                       "--verbose")
    assert code == 0
    assert "Rules skipped" in out and "gelu-erf" in out and "needs ai.onnx opset" in out
    assert "Top nodes by traffic" in out


def _past_and_new_tokens(path: Path) -> Path:
    """dynamo's shapes of a decoder step: the mask is as long as the past and the new
    tokens (``s16 + s62``); ``seq-len`` is a name (no input dims seq and len)."""
    from onnx import helper

    tensor = onnx.TensorProto.FLOAT
    graph = helper.make_graph(
        [helper.make_node("Concat", ["past", "new"], ["joined"], axis=1),
         helper.make_node("Mul", ["joined", "mask"], ["y"]),
         helper.make_node("Relu", ["h"], ["z"])], "g",
        [helper.make_tensor_value_info("past", tensor, ["B", "s16"]),
         helper.make_tensor_value_info("new", tensor, ["B", "s62"]),
         helper.make_tensor_value_info("mask", tensor, ["B", "s16 + s62"]),
         helper.make_tensor_value_info("h", tensor, ["B", "seq-len"])],
        [helper.make_tensor_value_info("y", tensor, ["B", "s16 + s62"]),
         helper.make_tensor_value_info("z", tensor, ["B", "seq-len"])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                ir_version=8), path)
    return path


def test_dim_computed_from_other_dims_cannot_be_bound(capfd, tmp_path: Path):
    """--dim 's16 + s62=5' beside s16 = 3 and s62 = 4 would generate a mask of 5 for 7
    tokens: refused in one line naming the dims to bind; those, and a hyphenated name,
    are bound."""
    path = _past_and_new_tokens(tmp_path / "step.onnx")
    for command in (["optimize", path, "--check-only"], ["report", path]):
        code, _, err = run(capfd, *command, "--dim", "s16 + s62=5", "--dim", "s16=3")
        assert code == 2
        assert err.strip() == ("error: dimension 's16 + s62' is computed from s16 and s62: "
                               "bind those instead"), err
    code, _, err = run(capfd, "optimize", path, "--check-only", "--dim", "s16=3",
                       "--dim", "s62=4", "--dim", "seq-len=2")
    assert code == 0, err


def test_reference_failing_on_generated_dims_says_which_and_how(capfd, tmp_path: Path):
    """A model that needs W = 40 fails on the generated 8 (and on the fallbacks): one line
    that names the generated shapes and --dim, no onnxruntime log line before it (capfd:
    onnxruntime writes to the process's stderr directly); --dim W=40 then works."""
    from onnx import helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "c"], ["y"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 3, "H", 40])],
        [numpy_helper.from_array(np.ones(40, np.float32), "c")])
    path = tmp_path / "needs_w.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                ir_version=8), path)
    code, _, err = run(capfd, "optimize", path, "-o", tmp_path / "o.onnx")
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert "generated inputs: x [2, 3, 8, 8]" in err and "--dim NAME=VALUE" in err
    assert not (tmp_path / "o.onnx").exists()
    code, _, err = run(capfd, "optimize", path, "-o", tmp_path / "o.onnx", "--dim", "W=40")
    assert code == 0, err


def test_input_shape_sets_anonymous_dims(capfd, tmp_path: Path):
    """x [?, ?] padded by reflection needs more than 64 samples on its anonymous axis 1;
    --input-shape sets it, binds the named dims of the shape for the traffic model, and a
    malformed or contradicted shape is one line and exit 2, nothing written."""
    from onnx import helper

    pads = helper.make_tensor("p", onnx.TensorProto.INT64, [4], [0, 64, 0, 64])
    graph = helper.make_graph(
        [helper.make_node("Pad", ["x", "p"], ["y"], mode="reflect"),
         helper.make_node("Relu", ["y"], ["z"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, None]),
         helper.make_tensor_value_info("h", onnx.TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [None, None]),
         helper.make_tensor_value_info("h2", onnx.TensorProto.FLOAT, ["batch", 4])],
        [pads])
    graph.node.append(helper.make_node("Neg", ["h"], ["h2"]))
    path = tmp_path / "anon.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                ir_version=8), path)
    out = tmp_path / "o.onnx"
    report = tmp_path / "r.json"
    code, _, err = run(capfd, "optimize", path, "-o", out, "--input-shape", "x=1x100",
                       "--input-shape", "h=3,4", "--json", report)
    assert code == 0, err
    document = json.loads(report.read_text())
    assert document["validation"]["outputs"][0]["shape"] == [1, 228]
    # the traffic of Neg's [batch, 4] is measured at batch 3, as --dim batch=3 measures it
    code, _, err = run(capfd, "optimize", path, "-o", out, "--input-shape", "x=1x100",
                       "--dim", "batch=3", "--json", report)
    bound = json.loads(report.read_text())
    assert code == 0 and document["traffic"] == bound["traffic"], err
    code, _, err = run(capfd, "optimize", path, "-o", out, "--input-shape", "x=1x100",
                       "--json", report)
    assert code == 0 and json.loads(report.read_text())["traffic"] != bound["traffic"], err
    code, _, err = run(capfd, "diff", path, path, "--input-shape", "x=1x100")
    assert code == 0, err  # diff takes the same input options
    for bad, message in (("x=1,a", "expected NAME=D0,D1,... with non-negative integers"),
                         ("x", "expected NAME=D0,D1"),
                         ("x=1,\u00b2", "expected NAME=D0,D1"),  # a digit int() refuses
                         ("h=3,5", "axis 1 is 4 in the model"),
                         ("y=1", "unknown input name 'y'")):
        for extra in ([], ["--no-validate"]):  # refused before anything runs or is written
            out.unlink(missing_ok=True)
            code, _, err = run(capfd, "optimize", path, "-o", out, "--input-shape", bad, *extra)
            assert code == 2 and len(err.strip().splitlines()) == 1, err
            assert message in err and not out.exists(), err
    code, _, err = run(capfd, "optimize", path, "-o", out, "--input-shape", "x=1,100",
                       "--input-shape", "x=1,200")
    assert code == 2 and "input 'x' is given twice" in err, err
    code, _, err = run(capfd, "diff", path, path, "--structural-only", "--input-shape", "y=1")
    assert code == 2 and "unknown input name 'y'" in err, err
