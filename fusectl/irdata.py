"""Read-only fast access to onnx-ir's containers.

onnx-ir's initializer and attribute maps are ``UserDict`` subclasses: every item read goes
through a Python-level ``__getitem__``. The hot loops over a 100k-node graph (dead-code
removal, dedupe, the type merge at load) read the plain dict behind them instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


def plain(mapping: Mapping[str, T]) -> Mapping[str, T]:
    """The dict behind an onnx-ir container (read it, never write it), or ``mapping``."""
    data = getattr(mapping, "data", None)
    return data if isinstance(data, dict) else mapping
