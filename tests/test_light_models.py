"""Real architectures shipped in the onnx wheel: every BatchNormalization after a Conv is
folded, the graph signature is kept, and the outputs are equal on onnxruntime."""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest

import fusectl
from fusectl.modelio import load_model
from fusectl.prepare import detach_legacy_initializer_inputs, prepare

LIGHT = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"

MODELS = ["resnet50", "densenet121", "inception_v1", "inception_v2", "squeezenet",
          "shufflenet", "bvlc_alexnet", "zfnet512", "vgg19"]


def _bn_after_conv(model: ir.Model) -> int:
    return sum(
        1 for node in model.graph
        if node.op_type == "BatchNormalization"
        and node.inputs[0] is not None
        and node.inputs[0].producer() is not None
        and node.inputs[0].producer().op_type == "Conv"
        and len(node.inputs[0].uses()) == 1
    )


@pytest.mark.parametrize("name", MODELS)
def test_light_model(name: str) -> None:
    path = LIGHT / f"light_{name}.onnx"
    if not path.exists():
        pytest.skip(f"{path} is not shipped with this onnx wheel")
    original = load_model(path)
    result = fusectl.optimize(path)
    assert result.validation is not None and result.validation.passed, result.validation
    assert result.rewrite.capped == ()
    assert _bn_after_conv(result.model) == 0
    folds = result.rewrite.counts().get("conv-bn-fold", 0)
    # Counted after preparation: it merges convolutions that compute the same value
    # (inception_v2's equal ConstantOfShape weights), whose BatchNormalizations then
    # read a shared output and stay.
    prepared = load_model(path)
    detach_legacy_initializer_inputs(prepared)
    prepare(prepared)
    assert folds >= _bn_after_conv(prepared)
    if folds:
        assert result.traffic_after.total_bytes < result.traffic_before.total_bytes
    before = [(v.name, str(v.type), str(v.shape)) for v in original.graph.inputs
              if not v.is_initializer()]
    after = [(v.name, str(v.type), str(v.shape)) for v in result.model.graph.inputs
             if not v.is_initializer()]
    assert before == after
    assert [v.name for v in original.graph.outputs] == [v.name for v in result.model.graph.outputs]

