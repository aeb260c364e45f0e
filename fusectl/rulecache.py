"""A cache of parsed rule files: a run reads the pickled rules instead of parsing YAML.

Parsing and checking the built-in library (260 rules, 1,400 embedded tests) is the largest
fixed cost of `fusectl optimize` on a small model. An entry is keyed by the rule file's
path and bytes, by the source of the code that turns YAML into rules (a changed parser
invalidates every entry) and by the Python version, so a stale entry is never read.

A pickle runs code when loaded, so entries live in a folder only this user may write
(created 0700; ``FUSECTL_CACHE_DIR``, else ``$XDG_CACHE_HOME/fusectl``, else
``~/.cache/fusectl``) and an entry is read only if it is a regular file owned by this user
that nobody else may write. ``FUSECTL_NO_CACHE=1`` turns the cache off. Any problem with
the cache (unwritable folder, corrupt entry) means parsing as if there were none.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import stat
import sys
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

CACHE_ENV = "FUSECTL_CACHE_DIR"
DISABLE_ENV = "FUSECTL_NO_CACHE"
MAX_ENTRIES = 256
"""Entries kept; the oldest go first (every edit of a rule file makes a new one)."""
_PARSER_MODULES = ("rulefile", "statements", "expr", "errors", "targets")


def cached(path: Path, data: bytes, parse: Callable[[], Any],
           valid: Callable[[Any], bool] = lambda value: True) -> Any:
    """``parse()``'s result for the rule file ``path`` holding ``data``, from the cache
    when an entry exists (and ``valid`` accepts what it holds), else parsed and stored.
    Errors raised by ``parse`` are not cached (a broken rule file is reported every time)."""
    folder = cache_dir()
    if folder is None:
        return parse()
    entry = folder / f"{_key(path, data)}.pickle"
    loaded = _read(entry)
    if loaded is not None and valid(loaded):
        return loaded
    result = parse()
    _write(folder, entry, result)
    return result


def cache_dir() -> Path | None:
    """The cache folder (created, private), or None when the cache is off or unusable."""
    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        return None
    configured = os.environ.get(CACHE_ENV)
    if configured:
        folder = Path(configured)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        folder = Path(base) / "fusectl"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _private(folder.stat(), directory=True):
            return None
    except OSError:
        return None
    return folder


def _key(path: Path, data: bytes) -> str:
    digest = hashlib.sha256()
    digest.update(_parser_fingerprint().encode())
    # The path as given too: rules remember it for their messages (file:line).
    for name in (str(path.resolve()), str(path)):
        digest.update(name.encode("utf-8", "surrogateescape") + b"\0")
    digest.update(data)
    return digest.hexdigest()[:40]


@cache
def _parser_fingerprint() -> str:
    """What the parsed rules depend on besides the file: parser sources, Python version."""
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256(sys.version.encode())
    for module in _PARSER_MODULES:
        try:
            digest.update((here / f"{module}.py").read_bytes())
        except OSError:  # an unusual installation (zip): no fingerprint, no cache hits
            digest.update(os.urandom(16))
    return digest.hexdigest()


def _private(info: os.stat_result, *, directory: bool = False) -> bool:
    kind_ok = stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)
    owner_ok = not hasattr(os, "getuid") or info.st_uid == os.getuid()
    return kind_ok and owner_ok and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _read(entry: Path) -> Any:
    """The entry's value, or None. The checks are made on the opened file (no symlink
    followed), so the file cannot be swapped between the check and the read."""
    try:
        fd = os.open(entry, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as handle:
            if not _private(os.fstat(handle.fileno())):
                return None
            return pickle.load(handle)
    except Exception:  # noqa: BLE001 - a corrupt entry is a cache miss
        return None


def _write(folder: Path, entry: Path, value: Any) -> None:
    try:
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        fd, temp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".pickle")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(temp, entry)
        finally:
            if os.path.exists(temp):
                os.unlink(temp)
        _prune(folder)
    except Exception:  # noqa: BLE001 - no cache is slower, never wrong
        return


def _prune(folder: Path) -> None:
    entries = sorted(folder.glob("*.pickle"), key=lambda p: p.stat().st_mtime)
    for old in entries[:-MAX_ENTRIES]:
        old.unlink(missing_ok=True)
