"""Tests for the committed sample models in ``samples/``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx
import onnxruntime as ort
import pytest

SAMPLES_DIR = Path(__file__).resolve().parent.parent / "samples"
SAMPLE_NAMES = ["cnn", "mlp", "transformer_block"]


def _load_builder() -> ModuleType:
    """Import ``samples/build_samples.py`` (not a package) as a module."""
    spec = importlib.util.spec_from_file_location("build_samples", SAMPLES_DIR / "build_samples.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def builder() -> ModuleType:
    """The sample builder module."""
    return _load_builder()


def test_samples_up_to_date(builder: ModuleType, tmp_path: Path) -> None:
    """Rebuilding into a temp dir reproduces the committed files byte for byte."""
    paths = builder.build_all(tmp_path)
    assert sorted(p.name for p in paths) == sorted(f"{n}.onnx" for n in SAMPLE_NAMES)
    for path in paths:
        committed = SAMPLES_DIR / path.name
        assert committed.exists(), f"{path.name} missing; run python samples/build_samples.py"
        assert path.read_bytes() == committed.read_bytes(), (
            f"{path.name} is stale; run python samples/build_samples.py"
        )


def test_build_is_deterministic(builder: ModuleType, tmp_path: Path) -> None:
    """Two builds produce identical bytes."""
    first = [p.read_bytes() for p in builder.build_all(tmp_path / "a")]
    second = [p.read_bytes() for p in builder.build_all(tmp_path / "b")]
    assert first == second


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_sample_is_valid_model(name: str) -> None:
    """Each sample passes the full checker and carries the expected metadata."""
    path = SAMPLES_DIR / f"{name}.onnx"
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert model.producer_name == "fusectl-samples"
    assert model.doc_string
    assert {p.key: p.value for p in model.metadata_props} == {"sample": name}
    node_names = [n.name for n in model.graph.node]
    assert all(node_names) and len(set(node_names)) == len(node_names)
    for value in model.graph.input:
        assert value.type.tensor_type.shape.dim[0].dim_param == "N"
    assert path.stat().st_size < 1_000_000


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_sample_runs_on_onnxruntime(name: str) -> None:
    """Each sample runs on onnxruntime CPU with batch 2 and gives finite, non-zero outputs."""
    sess = ort.InferenceSession(
        str(SAMPLES_DIR / f"{name}.onnx"), providers=["CPUExecutionProvider"]
    )
    rng = np.random.default_rng(0)
    feeds = {
        i.name: rng.standard_normal([2, *i.shape[1:]]).astype(np.float32) for i in sess.get_inputs()
    }
    outputs = sess.run(None, feeds)
    for meta, value in zip(sess.get_outputs(), outputs, strict=True):
        assert value.shape[0] == 2
        assert list(value.shape[1:]) == list(meta.shape[1:])
        assert np.all(np.isfinite(value)), meta.name
        assert float(np.abs(value).max()) > 1e-6, meta.name
