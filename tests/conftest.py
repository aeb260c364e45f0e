"""Shared fixtures: paths to bundled samples and to the real models shipped in the onnx wheel."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"

# The rule cache of this test session lives in its own folder, not the user's ~/.cache
# (the CLI tests' child processes inherit it).
os.environ.setdefault("FUSECTL_CACHE_DIR", tempfile.mkdtemp(prefix="fusectl-test-cache-"))


@pytest.fixture
def samples() -> Path:
    return SAMPLES

