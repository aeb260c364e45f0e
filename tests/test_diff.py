"""``fusectl diff A B``: structural and numerical differences, exit codes, the JSON schema."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import pytest
from onnx import numpy_helper

import fusectl
from fusectl import validate
from fusectl.cli import main

SCHEMA = json.loads((Path(fusectl.__file__).parent / "schemas" / "diff.schema.json").read_text())


def run(capsys, *args: object) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def diff_json(capsys, tmp_path: Path, a: Path, b: Path, *args: object) -> tuple[int, dict, str]:
    out = tmp_path / "diff.json"
    code, _, err = run(capsys, "diff", a, b, "--json", out, "-q", *args)
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, SCHEMA)
    return code, doc, err


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The cnn sample, its optimized version, one with a perturbed bias, one with a
    renamed input (built once: optimizing costs seconds)."""
    root = tmp_path_factory.mktemp("diff")
    base = root / "cnn.onnx"
    shutil.copy(Path(__file__).parent.parent / "samples" / "cnn.onnx", base)

    result = fusectl.optimize(base, check=False)
    optimized = root / "cnn.opt.onnx"
    fusectl.save_model(result.model, optimized)

    proto = onnx.load(base)
    bias = next(t for t in proto.graph.initializer if t.name == "fc.bias")
    values = numpy_helper.to_array(bias).copy()
    values[0] += np.float32(1.0)
    bias.CopyFrom(numpy_helper.from_array(values, "fc.bias"))
    perturbed = root / "perturbed.onnx"
    onnx.save(proto, perturbed)

    proto = onnx.load(base)
    proto.graph.input[0].name = "pixels"
    for node in proto.graph.node:
        node.input[:] = ["pixels" if name == "image" else name for name in node.input]
    renamed = root / "renamed.onnx"
    onnx.save(proto, renamed)
    return {"base": base, "optimized": optimized, "perturbed": perturbed, "renamed": renamed,
            "saved": result.bytes_saved}


def test_model_against_itself(capsys, tmp_path: Path, models) -> None:
    code, doc, err = diff_json(capsys, tmp_path, models["base"], models["base"])
    assert code == 0, err
    assert doc["identical"] is True and doc["passed"] is True
    nodes, inits = doc["nodes"], doc["initializers"]
    # cnn.onnx: 14 nodes and 17 initializers, all equal
    assert (nodes["unchanged"], nodes["added"], nodes["removed"], nodes["changed"]) == (
        14, [], [], [])
    assert (inits["unchanged"], inits["added"], inits["removed"], inits["changed"]) == (
        17, [], [], [])
    assert doc["ops"]["changed"] == [] and doc["opsets"]["changed"] == []
    assert set(doc["traffic"]["delta"].values()) == {0}
    assert doc["validation"]["passed"] is True and doc["validation_skipped"] is None
    assert doc["validation"]["outputs"][0]["max_abs"] == 0.0


def test_model_against_its_optimized_version(capsys, tmp_path: Path, models) -> None:
    code, doc, err = diff_json(capsys, tmp_path, models["base"], models["optimized"])
    assert code == 0, err
    assert doc["passed"] is True and doc["identical"] is False and doc["io"]["same"] is True
    changed_ops = {c["op"]: (c["a"], c["b"]) for c in doc["ops"]["changed"]}
    # conv-bn-fold x2, conv-mul-fold and conv-add-fold: 4 nodes fewer
    assert changed_ops["BatchNormalization"] == (2, 0)
    assert changed_ops["Mul"] == (1, 0) and changed_ops["Add"] == (1, 0)
    assert doc["nodes"]["a"] - doc["nodes"]["b"] == 4
    assert doc["nodes"]["removed"] or doc["nodes"]["changed"]
    # the folded weights are new tensors: BN statistics are gone
    removed = {s["name"] for s in doc["initializers"]["removed"]}
    assert {"bn1.mean", "bn1.var", "bn3.mean"} <= removed and doc["initializers"]["added"]
    # the traffic delta is what optimize reported as saved
    assert doc["traffic"]["delta"]["bytes"] == -models["saved"] < 0
    assert doc["traffic"]["delta"]["kernels"] == -4
    assert doc["validation"]["passed"] is True


def test_one_perturbed_weight_fails(capsys, tmp_path: Path, models) -> None:
    code, doc, err = diff_json(capsys, tmp_path, models["base"], models["perturbed"])
    assert code == 1
    assert "outputs differ" in err and len(err.strip().splitlines()) == 1
    assert doc["passed"] is False and doc["io"]["same"] is True
    (change,) = doc["initializers"]["changed"]
    assert (change["name"], change["changes"]) == ("fc.bias", ["values"])
    before = numpy_helper.to_array(
        next(t for t in onnx.load(models["base"]).graph.initializer if t.name == "fc.bias"))
    # float32(b + 1) - b, computed exactly in float64
    assert change["max_abs_diff"] == float(np.float32(before[0] + np.float32(1))) - float(
        before[0])
    assert doc["initializers"]["unchanged"] == 16 and doc["nodes"]["unchanged"] == 14
    (out,) = doc["validation"]["outputs"]
    # logits[0] moved by the bias change: about 1.0
    assert out["passed"] is False and out["max_abs"] == pytest.approx(1.0, abs=1e-5)


def test_renamed_input_is_an_io_difference(capsys, tmp_path: Path, models) -> None:
    code, doc, err = diff_json(capsys, tmp_path, models["base"], models["renamed"])
    assert code == 1 and "IO signatures differ" in err
    inputs = doc["io"]["inputs"]
    assert inputs["added"] == [{"name": "pixels", "dtype": "float", "shape": ["N", 3, 32, 32]}]
    assert inputs["removed"] == [{"name": "image", "dtype": "float", "shape": ["N", 3, 32, 32]}]
    assert doc["io"]["outputs"]["same"] is True
    assert doc["validation"] is None and "input signatures differ" in doc["validation_skipped"]
    (conv,) = doc["nodes"]["changed"]
    assert conv["a"] == conv["b"] == "conv1" and conv["matched_by"] == "name"
    assert conv["changes"] == [
        "inputs ['image', 'conv1.weight', 'conv1.bias'] -> ['pixels', 'conv1.weight', 'conv1.bias']"
    ]


def test_structural_only_runs_nothing(capsys, tmp_path: Path, models,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    sessions = []

    def no_session(*args, **kwargs):
        sessions.append(args)
        raise AssertionError("onnxruntime must not run")

    monkeypatch.setattr(validate, "open_session", no_session)
    code, doc, err = diff_json(capsys, tmp_path, models["base"], models["perturbed"],
                               "--structural-only")
    # the weight change is listed, but nothing ran: same IO signature -> exit 0
    assert code == 0, err
    assert sessions == []
    assert doc["validation"] is None and doc["validation_skipped"] == "--structural-only"
    assert [c["name"] for c in doc["initializers"]["changed"]] == ["fc.bias"]


def test_terminal_diff(capsys, models) -> None:
    code, out, err = run(capsys, "diff", models["base"], models["optimized"], "--structural-only")
    assert code == 0, err
    assert "BatchNormalization" in out and "not compared (--structural-only)" in out
    assert "diff: compatible" in out


def _model(text: str, names: list[str]) -> ir.Model:
    model = ir.serde.deserialize_model(onnx.parser.parse_model(text))
    for node, name in zip(model.graph, names, strict=True):
        node.name = name
    return model


def test_node_pairing_by_name_then_io_then_outputs() -> None:
    header = '<ir_version: 10, opset_import: ["" : 18]>'
    a = _model(f"""{header}
        g (float[4] x) => (float[4] y)
        <float[4] w = {{1, 2, 3, 4}}, float[2] v = {{1, 2}}, float[1] u = {{5}}>
        {{
          a = Relu(x)
          b = LeakyRelu<alpha: float = 0.5>(a)
          y = Neg(b)
        }}""", ["n1", "n2", "n3"])
    b = _model(f"""{header}
        g (float[4] x) => (float[4] y, float[4] z)
        <float[4] w = {{1, 2, 3, 5}}, double[2] v = {{1, 2}}, float[1] t = {{5}}>
        {{
          a = Relu(x)
          b = LeakyRelu<alpha: float = 0.25>(a)
          y = Neg(a)
          z = Identity(b)
        }}""", ["renamed", "n2", "m", "extra"])
    result = fusectl.diff_models(a, b, structural_only=True)
    changed = [(c.a.name, c.b.name, c.matched_by, c.changes) for c in result.nodes_changed]
    assert changed == [
        ("n2", "n2", "name", ("attribute alpha: 0.5 -> 0.25",)),
        ("n1", "renamed", "io", ("name n1 -> renamed",)),
        ("n3", "m", "outputs", ("name n3 -> m", "inputs ['b'] -> ['a']")),
    ]
    assert [(r.name, r.op) for r in result.nodes_added] == [("extra", "Identity")]
    assert result.nodes_removed == () and result.nodes_unchanged == 0
    assert [s.name for s in result.outputs.added] == ["z"] and not result.io_same
    inits = {c.a.name: (c.changes, c.max_abs_diff) for c in result.initializers_changed}
    # w: the last value 4 -> 5; v: float -> double (values not compared)
    assert inits == {"w": (("values",), 1.0), "v": (("dtype float -> double",), None)}
    assert [s.name for s in result.initializers_removed] == ["u"]
    assert [s.name for s in result.initializers_added] == ["t"]
    assert result.validation is None and not result.passed


def test_missing_model_is_exit_2(capsys, tmp_path: Path, models) -> None:
    out = tmp_path / "d.json"
    code, stdout, err = run(capsys, "diff", models["base"], tmp_path / "nope.onnx", "--json", out)
    assert code == 2 and stdout == "" and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_legacy_initializer_inputs_are_not_part_of_the_signature() -> None:
    """Before IR version 4 every initializer is also a graph input; renaming a weight (as an
    optimizer does when it folds one) must not read as a changed signature."""
    text = """<ir_version: 3, opset_import: ["" : 9]>
        g (float[4] x, float[4] {w}) => (float[4] y)
        <float[4] {w} = {{1, 2, 3, 4}}>
        {{ y = Add(x, {w}) }}"""
    a = _model(text.format(w="w"), ["add"])
    b = _model(text.format(w="w_folded"), ["add"])
    result = fusectl.diff_models(a, b, structural_only=True)
    assert result.io_same and result.passed
    assert [s.name for s in result.initializers_added] == ["w_folded"]
    assert result.traffic_a.param_bytes == result.traffic_b.param_bytes == 16


def test_markdown_and_junit_files(capsys, tmp_path: Path, models) -> None:
    import xml.etree.ElementTree as ET

    markdown, junit = tmp_path / "diff.md", tmp_path / "diff.xml"
    code, _, err = run(capsys, "diff", models["base"], models["perturbed"], "-q",
                       "--markdown", markdown, "--junit", junit)
    assert code == 1, err
    assert "perturbed.onnx" in markdown.read_text()
    root = ET.parse(junit).getroot()
    failures = sum(int(s.get("failures", 0)) for s in root.iter("testsuite"))
    assert failures >= 1  # the output that differs


def test_report_path_clash_is_refused_before_work(capsys, tmp_path: Path, models) -> None:
    code, _, err = run(capsys, "diff", models["base"], models["perturbed"],
                       "--json", models["base"])
    assert code == 2 and "would overwrite" in err


def test_validation_options_survive_the_diffs_own_dims() -> None:
    """``dims`` fills the options' dims; the rest of the options (the batch too) stay."""
    from fusectl.diff import diff_models
    from fusectl.validate import ValidationOptions

    text = """<ir_version: 8, opset_import: ["" : 17]>
    g (float[batch, seq] x) => (float[batch, seq] y) { y = Relu(x) }"""
    a = ir.serde.deserialize_model(onnx.parser.parse_model(text))
    b = ir.serde.deserialize_model(onnx.parser.parse_model(text))
    result = diff_models(a, b, validation=ValidationOptions(batch=3, seed=5), dims={"seq": 4})
    assert result.validation is not None and result.validation.input_shapes == {"x": (3, 4)}
