"""Shared fixtures: paths to bundled samples and to the real models shipped in the onnx wheel."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"


@pytest.fixture
def samples() -> Path:
    return SAMPLES

