"""onnxscript's rewriter test models (a peer's own test suite, shipped in the onnxscript
wheel fusectl depends on) through fusectl on both targets: every one validates and the
fusions onnxscript's own fusions aim at happen here too."""

from __future__ import annotations

import importlib
from collections import Counter

import pytest

import fusectl

# module, factory, {target: ops that must appear (at least this many)}
MODELS = [
    ("_rotary_embedding_models", "test_case_1",
     {"onnxruntime": {"RotaryEmbedding": 1}, "onnx": {"RotaryEmbedding": 1}}),
    ("_rotary_embedding_models", "test_case_2",
     {"onnxruntime": {"RotaryEmbedding": 1}, "onnx": {"RotaryEmbedding": 1}}),
    ("_rotary_embedding_models", "partial_rotary_test_case",
     {"onnxruntime": {"RotaryEmbedding": 1}, "onnx": {"RotaryEmbedding": 1}}),
    ("_bart_encoder", "bart_encoder_test",
     {"onnxruntime": {"MultiHeadAttention": 2, "LayerNormalization": 5},
      "onnx": {"Attention": 2, "LayerNormalization": 5}}),
    ("_whisper_encoder", "whisper_encoder_test",
     {"onnxruntime": {"MultiHeadAttention": 1}, "onnx": {"Attention": 1}}),
]
GONE = {"Softmax", "Neg", "ReduceMean", "Sqrt"}
"""Ops of the written-out attentions, rotations and norms: none may be left."""


def _peer_model(module: str, factory: str):
    try:
        found = importlib.import_module(f"onnxscript.rewriter.models.{module}")
    except ImportError:
        pytest.skip(f"this onnxscript has no rewriter test model {module}")
    return getattr(found, factory)().get_onnx_model()


@pytest.mark.parametrize(("target", "opset"), [("onnxruntime", None), ("onnx", 23)])
@pytest.mark.parametrize(("module", "factory", "expected"), MODELS,
                         ids=[factory for _, factory, _ in MODELS])
def test_peer_model_fuses_and_validates(module, factory, expected, target, opset) -> None:
    result = fusectl.optimize(_peer_model(module, factory), target=target, opset=opset)
    ops = Counter(n.op_type for n in result.model.graph)
    assert result.validation.passed, result.validation
    for op, count in expected[target].items():
        assert ops[op] >= count, (op, dict(ops))
    assert not GONE & set(ops), dict(ops)
    assert len(list(result.model.graph)) < 0.6 * result.nodes_before
