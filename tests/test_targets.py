"""Targets (SPEC §4): built-in names, target files and fused kernels as local functions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from fusectl import api
from fusectl.cli import main
from fusectl.errors import BadInputError, RuleFileError
from fusectl.rulefile import load_rule_text, load_target_file
from fusectl.targets import resolve_target

ROOT = Path(__file__).resolve().parent.parent
NPU = ROOT / "samples" / "npu-target.yaml"

HEADER = """\
version: 1
target:
  name: tiny-npu
  domain: tiny.npu
  opset: 3
  kernels:
    ConvRelu: conv and relu
rules:
  - id: tiny-conv-relu
    summary: Conv and Relu as one kernel.
    match:
      - z = Relu(Conv(x, W))
    fuse: tiny.npu.{kernel}
"""


def test_target_file_rules_default_to_the_target_and_import_its_domain() -> None:
    spec, rules = load_target_file(NPU)
    assert (spec.name, spec.domain, spec.base) == ("example-npu", "npu.example", "onnx")
    assert {r.when.targets for r in rules} == {("example-npu",)}
    assert all(("npu.example", 1) in r.when.imports for r in rules)
    assert all(r.fuse is not None and r.fuse.domain == "npu.example" for r in rules)


def test_resolve_builtin_and_file_targets(tmp_path: Path) -> None:
    assert resolve_target("onnxruntime").names == ("onnxruntime",)
    target = resolve_target(NPU)
    assert target.names == ("example-npu", "onnx")
    with pytest.raises(BadInputError, match="unknown target"):
        resolve_target("tensorrt")
    with pytest.raises(BadInputError, match="not found"):
        resolve_target(tmp_path / "missing.yaml")


def test_undeclared_kernel_is_a_load_error() -> None:
    with pytest.raises(RuleFileError) as info:
        load_rule_text(HEADER.format(kernel="ConvReluPool"), "t.yaml", [])
    assert "kernel 'ConvReluPool' is not declared" in str(info.value)
    assert "t.yaml:13:" in str(info.value)


def test_rule_file_without_header_is_not_a_target(tmp_path: Path) -> None:
    path = tmp_path / "plain.yaml"
    path.write_text((ROOT / "rules" / "25-siblings.yaml").read_text())
    with pytest.raises(RuleFileError, match="no 'target:' header"):
        load_target_file(path)


def test_fused_kernels_carry_their_function_and_validate(samples: Path, tmp_path: Path) -> None:
    result = api.optimize(samples / "cnn.onnx", target=NPU)
    assert result.passed
    ops = result.ops_after
    assert ops["npu.example.ConvReluPool"] == 1
    assert ops["npu.example.ConvRelu"] == 2
    functions = {(f.domain, f.name, f.overload) for f in result.model.functions.values()}
    assert ("npu.example", "ConvReluPool", "") in functions
    assert result.model.opset_imports["npu.example"] == 1
    # a fused kernel moves only its external inputs and outputs
    assert result.traffic_after.total_bytes < result.traffic_before.total_bytes


def test_two_bodies_of_one_kernel_become_overloads(tmp_path: Path) -> None:
    """Relu and Clip bodies of ConvRelu: one function each, the second an overload."""
    rules = api.load_rule_set(builtin=False, target=NPU, include=["npu-conv-relu"])
    model_text = """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1,3,8,8] x, float[4,3,3,3] W, float[4,3,3,3] V)
          => (float[1,4,6,6] a, float[1,4,6,6] b)
        <float lo = {0.0}, float hi = {6.0}>
        { c = Conv(x, W)  a = Relu(c)  d = Conv(x, V)  b = Clip(d, lo, hi) }
    """
    proto = onnx.parser.parse_model(model_text)
    path = tmp_path / "m.onnx"
    onnx.save(proto, path)
    # weights are graph inputs here, so the rules refuse; make them constants
    result = api.optimize(path, rules=rules, target=NPU, check=False)
    assert result.rewrite.applications == ()
    proto.graph.input.pop()
    proto.graph.input.pop()
    for name, value in (("W", 1.0), ("V", 0.5)):
        proto.graph.initializer.append(onnx.numpy_helper.from_array(
            np.full((4, 3, 3, 3), value, dtype=np.float32), name))
    onnx.save(proto, path)
    result = api.optimize(path, rules=rules, target=NPU)
    assert result.passed
    overloads = sorted(f.overload for f in result.model.functions.values())
    assert overloads == ["", "v2"]
    assert result.model.ir_version >= 10


def test_cli_target_file_end_to_end(capsys, samples: Path, tmp_path: Path) -> None:
    out = tmp_path / "cnn.npu.onnx"
    code = main(["optimize", str(samples / "cnn.onnx"), "--target", str(NPU), "-o", str(out),
                 "-q"])
    assert code == 0, capsys.readouterr().err
    saved = onnx.load(out)
    onnx.checker.check_model(saved, full_check=True)
    assert any(f.domain == "npu.example" for f in saved.functions)
    assert any(n.domain == "npu.example" for n in saved.graph.node)


@pytest.mark.parametrize("target", ["tensorrt", "missing.yaml"])
def test_cli_bad_target_is_exit_2(capsys, samples: Path, tmp_path: Path, target: str) -> None:
    out = tmp_path / "x.onnx"
    code = main(["optimize", str(samples / "cnn.onnx"), "--target", target, "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


def test_sample_target_rules_pass_their_embedded_tests() -> None:
    from fusectl.ruletest import lint_tests, run_tests

    rules = api.load_rule_set(builtin=False, target=NPU)
    assert not lint_tests(rules)
    outcomes = run_tests(rules)
    assert outcomes and all(o.passed for o in outcomes), [o.problems for o in outcomes]
