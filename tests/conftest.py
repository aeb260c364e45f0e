"""Shared fixtures: paths to bundled samples and to the real models shipped in the onnx wheel."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"

# The rule cache of this test session lives in its own folder, not the user's ~/.cache
# (the CLI tests' child processes inherit it), removed when the session ends.
if "FUSECTL_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="fusectl-test-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["FUSECTL_CACHE_DIR"] = _cache


@pytest.fixture
def samples() -> Path:
    return SAMPLES

