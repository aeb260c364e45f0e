"""onnxruntime sessions in a child process, so that a crash inside onnxruntime is an error.

A kernel of onnxruntime that faults (SIGFPE, SIGSEGV) kills the process it runs in; run in
fusectl's own, it ended fusectl without a word. Sessions live in one long-lived child
(:mod:`fusectl.ortchild`, started on first use or ahead of it by :func:`warm_up`); when it
dies, the request in flight raises :class:`OrtError` saying how, and the next session starts
a new child. Where no child can be started (no Python executable to start it with) sessions
run in this process instead.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import ortchild

__all__ = ["OrtError", "Session", "open_session", "peak_rss", "warm_up"]

_CHILD = str(Path(ortchild.__file__).resolve())


class OrtError(Exception):
    """onnxruntime refused a request, or its process died (``crashed``)."""

    def __init__(self, message: str, crashed: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.crashed = crashed


_READY_SECONDS = 60.0
"""How long a new child may take to say it runs (it imports onnxruntime first)."""


class _Child:
    """The child process and its pipes."""

    def __init__(self) -> None:
        env = {**os.environ, ortchild.PATH_VARIABLE: os.pathsep.join(
            p for p in sys.path if isinstance(p, str) and p)}
        self.process = subprocess.Popen(
            [sys.executable, _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            close_fds=True, env=env,
            start_new_session=os.name == "posix")  # Ctrl-C reaches fusectl only
        self.ready = False

    def wait_ready(self) -> bool:
        """Skip what the interpreter printed before the child's first words (a
        sitecustomize's output) up to :data:`ortchild.READY`; False when they do not come (the
        executable is not a Python that can run the script: a frozen or embedded one)."""
        stdout = self.process.stdout
        assert stdout is not None
        seen: list[bool] = []

        def read() -> None:
            skipped = 0
            marker = ortchild.READY.lstrip(b"\n")
            while skipped < (1 << 20):
                line = stdout.readline()
                if not line:
                    return
                if line == marker:
                    seen.append(True)
                    return
                skipped += len(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(_READY_SECONDS)
        self.ready = bool(seen)
        return self.ready

    def request(self, message: tuple[Any, ...]) -> tuple[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            pickle.dump(message, self.process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.process.stdin.flush()
            return pickle.load(self.process.stdout)
        except (BrokenPipeError, EOFError, pickle.UnpicklingError, OSError):
            raise OrtError(_death(self.process), crashed=True) from None

    def stop(self, kill: bool = False) -> None:
        if kill:
            self.process.kill()
        with contextlib.suppress(OSError):
            if self.process.stdin is not None:
                self.process.stdin.close()  # the child ends at the end of its input
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


class _InProcess:
    """Sessions in this process: where no child can be started."""

    def __init__(self) -> None:
        self.server = ortchild.Server()

    def request(self, message: tuple[Any, ...]) -> tuple[str, Any]:
        return self.server.handle(message)

    def stop(self, kill: bool = False) -> None:
        self.server.session = None


_lock = threading.Lock()
_worker: _Child | _InProcess | None = None


def _death(process: subprocess.Popen) -> str:
    """How the child ended, in words."""
    try:
        code = process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        code = process.wait()
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"onnxruntime crashed ({name})"
    return f"onnxruntime's process ended unexpectedly (exit code {code})"


def _current() -> _Child | _InProcess:
    global _worker
    if isinstance(_worker, _Child) and _worker.process.poll() is not None:
        _worker.stop()  # it died between requests (killed from outside): start another
        _worker = None
    if _worker is None:
        try:
            _worker = _Child() if sys.executable else _InProcess()
        except OSError:
            _worker = _InProcess()
    return _worker


def _request(message: tuple[Any, ...], owner: _Child | _InProcess | None = None) -> Any:
    """Send one request (to ``owner``, the process holding a session, when given); raise
    OrtError with the reply's message, or when the child died (which is then forgotten, so
    the next request starts another)."""
    global _worker
    with _lock:
        if owner is not None and owner is not _worker:
            raise OrtError("onnxruntime's process holding the session has ended", crashed=True)
        if isinstance(owner, _Child) and owner.process.poll() is not None:
            owner.stop()  # its pipes closed
            _worker = None
            raise OrtError(_death(owner.process), crashed=True)
        worker = _current()
        if isinstance(worker, _Child) and not worker.ready and not worker.wait_ready():
            worker.stop(kill=True)  # no child can run here: sessions in this process
            worker = _worker = _InProcess()
        try:
            status, value = worker.request(message)
        except OrtError:
            worker.stop()
            _worker = None
            raise
        except BaseException:  # Ctrl-C mid-request: the reply would answer the next one
            worker.stop(kill=True)
            _worker = None
            raise
    if status != "ok":
        raise OrtError(value)
    return value


def warm_up() -> None:
    """Start the child now, so that it has imported onnxruntime when validation needs it
    (it does so while fusectl loads and rewrites the model)."""
    with _lock:
        _current()


def peak_rss() -> int | None:
    """The peak resident memory of onnxruntime's process so far, in bytes (Linux's VmHWM;
    None elsewhere or without a child): benchmarks add it to fusectl's own."""
    worker = _worker
    if not isinstance(worker, _Child):
        return None
    try:
        status = Path(f"/proc/{worker.process.pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


@atexit.register
def _stop() -> None:
    global _worker
    with _lock:
        if _worker is not None:
            _worker.stop()
            _worker = None


_session_lock = threading.RLock()
"""Held from a session's opening to its closing: one session at a time, and another thread's
waits for it (the same thread opening a second one gets the child's refusal instead)."""


class Session:
    """An open onnxruntime CPU session (optimizations off) in the child; one at a time.
    It belongs to the thread that opened it, which must close it."""

    def __init__(self, source: str | bytes | os.PathLike[str]) -> None:
        if not isinstance(source, bytes):
            source = os.path.abspath(os.fspath(source))  # the child's cwd is fixed at start
        self._open = False
        _session_lock.acquire()
        try:
            self.input_names, self.output_names = _request(("open", source))
        except BaseException:
            _session_lock.release()
            raise
        self._owner = _worker  # the process holding it: a new one after a crash holds none
        self._open = True

    def run(self, feeds: Mapping[str, Any]) -> tuple[list[Any], float]:
        """The outputs in ``output_names`` order, and the seconds onnxruntime ran."""
        if not self._open:
            raise OrtError("the session is closed")
        values, seconds = _request(("run", dict(feeds)), self._owner)
        return values, seconds

    def close(self) -> None:
        """Release the session (nothing to release when its process died)."""
        if self._open:
            self._open = False
            try:
                with contextlib.suppress(OrtError):
                    _request(("close",), self._owner)
            finally:
                _session_lock.release()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_session(source: str | bytes | os.PathLike[str]) -> Session:
    """A session of the model in ``source`` (its bytes, or a path to it)."""
    return Session(source)
