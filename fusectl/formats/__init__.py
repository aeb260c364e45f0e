"""Report files for people and pipelines: Markdown, JUnit XML, HTML (and JSON).

Every renderer takes a plain JSON document (the one ``--json`` writes, with its
``schema`` key) rather than result objects, so the formats cannot drift from the
JSON and a saved report can be rendered again later. ``write`` replaces the file
atomically: a CI step never reads half a report.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ..errors import BadInputError
from ..modelio import _fsync_dir, _make_temp
from . import html, junit, markdown
from .common import UnsupportedDocument, rule_tests_document

__all__ = ["KINDS", "UnsupportedDocument", "check_paths", "render", "rule_tests_document",
           "supports", "write"]


def _json(doc: Mapping[str, Any]) -> str:
    return json.dumps(doc, indent=2, allow_nan=False) + "\n"


_RENDERERS: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "json": _json,
    "markdown": markdown.render,
    "junit": junit.render,
    "html": html.render,
}
KINDS = tuple(_RENDERERS)


def supports(schema: str, kind: str) -> bool:
    """Whether ``kind`` can render documents of ``schema`` (e.g. "fusectl.report/1"), so a
    command can refuse an option before doing any work."""
    if kind == "json":
        return True
    module = {"markdown": markdown, "junit": junit, "html": html}.get(kind)
    return module is not None and schema.partition("/")[0] in module.RENDERERS


def render(doc: Mapping[str, Any], kind: str) -> str:
    """``doc`` as text of the given kind (one of ``KINDS``)."""
    try:
        renderer = _RENDERERS[kind]
    except KeyError:
        raise ValueError(f"unknown report kind {kind!r}; expected one of {KINDS}") from None
    return renderer(doc)


def write(doc: Mapping[str, Any], path: str | os.PathLike[str], kind: str) -> None:
    """Render ``doc`` and replace ``path`` with it atomically (temp file + rename)."""
    text = render(doc, kind)
    final = Path(path)
    tmp = _make_temp(final)
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        tmp = None
        _fsync_dir(final.parent)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()


def check_paths(reports: Iterable[tuple[str, str | os.PathLike[str] | None]],
                protected: Iterable[str | os.PathLike[str] | None] = ()) -> None:
    """Refuse, before any work is done, report paths that cannot be written or would
    overwrite a model (``protected``) or another report; ``reports`` is (option, path).

    Raises ``BadInputError`` naming the option, so the user gets one clear line.
    """
    taken = {os.path.realpath(p): "an input or output" for p in protected if p is not None}
    for option, path in reports:
        if path is None:
            continue
        where = Path(path)
        real = os.path.realpath(where)
        if real in taken:
            raise BadInputError(f"{option} {path}: would overwrite {taken[real]}")
        taken[real] = option
        if where.is_dir():
            raise BadInputError(f"{option} {path}: is a directory")
        parent = where.parent if str(where.parent) else Path(".")
        if not parent.is_dir():
            raise BadInputError(f"{option} {path}: folder {parent} does not exist")
        if not os.access(parent, os.W_OK):
            raise BadInputError(f"{option} {path}: folder {parent} is not writable")
