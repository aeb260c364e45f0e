"""The command line both transformers corpora share (``decoders.py``, ``encoders.py``):
where to write, which models, float16 or not, and one clear line when torch or
transformers is missing."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parser(doc: str, folder: str, models: list[str]) -> argparse.ArgumentParser:
    """``--out`` (default ``bench/.models/FOLDER``), ``--models`` and ``--half``."""
    result = argparse.ArgumentParser(description=doc.splitlines()[0])
    result.add_argument("--out", type=Path, default=HERE / ".models" / folder)
    result.add_argument("--models", nargs="+", choices=models, default=models)
    result.add_argument("--half", action="store_true", help="export in float16")
    return result


def missing() -> bool:
    """True (after saying how to install it) when torch or transformers is missing."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"{e.name} is missing: pip install torch==2.13.0 transformers", file=sys.stderr)
        return True
    return False
