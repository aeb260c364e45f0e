"""The process onnxruntime runs in during validation (started by :mod:`fusectl.ortprocess`).

onnxruntime is native code: a kernel that divides by zero (SIGFPE: onnx-asr's wespeaker
feature extractor on a short waveform) or reads out of bounds kills the process it runs in.
Run here, such a crash ends this process only, and fusectl reports it as one line.

This file runs as a script (``python ortchild.py``), not as part of the package: it imports
only the standard library, numpy and onnxruntime, so it starts in a fraction of a second.
It holds at most one session at a time. Requests and replies are pickled tuples on
stdin/stdout (its own stdout goes to stderr, so nothing onnxruntime prints can garble them):

* ``("open", source)``: a CPU session of a model given as bytes or a path, optimizations
  off; replies its input and output names.
* ``("run", feeds)``: run the open session once on ``feeds``; replies ``(outputs, seconds)``.
* ``("close",)``: release the session.

Before the first reply it writes :data:`READY`. Every reply is ``("ok", value)`` or
``("error", message)``. Element types numpy lacks
(bfloat16, float8, 4-bit) travel as :data:`RAW` tuples the parent packs and unpacks.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and sys.path and (
        os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__))):
    del sys.path[0]  # this folder holds fusectl's modules: its bisect.py would shadow bisect

import contextlib  # noqa: E402
import ctypes  # noqa: E402
import pickle  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from typing import Any, BinaryIO  # noqa: E402

READY = b"\nfusectl-onnxruntime-ready\n"
"""Written before the first reply: the parent skips what came before it (a sitecustomize or
.pth file that prints while the interpreter starts) and knows the script runs."""

RAW = "fusectl-raw-tensor"
"""``(RAW, element_type, shape, data)``: a tensor numpy cannot hold, as ONNX packs it."""

NATIVE_TYPES = frozenset({
    "float", "float16", "double", "int8", "int16", "int32", "int64", "uint8", "uint16",
    "uint32", "uint64", "bool", "string",
})
"""Element types onnxruntime's Python binding converts to and from numpy by itself."""

PATH_VARIABLE = "FUSECTL_ORT_SYS_PATH"


def session_options() -> Any:
    """Optimizations off (a fusion onnxruntime would do anyway must not hide a difference),
    fatal messages only (a failed run becomes fusectl's one-line error)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4
    return options


def open_session(source: str | bytes) -> Any:
    import onnxruntime as ort

    return ort.InferenceSession(source, session_options(), providers=["CPUExecutionProvider"])


def run_session(session: Any, feeds: dict[str, Any]) -> tuple[list[Any], float]:
    """The outputs of one run, in the session's output order, and its seconds."""

    meta = session.get_outputs()
    names = [o.name for o in meta]
    raw_in = any(_is_raw(v) for v in feeds.values())
    raw_out = any(_element_type_name(o.type) not in (None, *NATIVE_TYPES) for o in meta)
    start = time.perf_counter()
    if raw_in or raw_out:
        ort_feeds = {k: _to_ortvalue(v) for k, v in feeds.items()}
        values = [_from_ortvalue(v) for v in session.run_with_ort_values(names, ort_feeds)]
    else:
        values = session.run(names, dict(feeds))
    return values, time.perf_counter() - start


def _is_raw(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 4 and value[0] == RAW


def _element_type_name(ort_type: str) -> str | None:
    if ort_type.startswith("tensor(") and ort_type.endswith(")"):
        return ort_type[len("tensor("):-1]
    return None


def _to_ortvalue(value: Any) -> Any:
    import numpy as np
    import onnxruntime as ort

    if not _is_raw(value):
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value))
    _, element_type, shape, data = value
    tensor = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), element_type, "cpu", 0)
    if len(data) != tensor.tensor_size_in_bytes():
        raise ValueError(f"cannot feed {len(data)} bytes to a tensor of shape {list(shape)}")
    if data:
        ctypes.memmove(tensor.data_ptr(), data, len(data))
    return tensor


def _from_ortvalue(value: Any) -> Any:
    type_name = _element_type_name(value.data_type())
    if type_name is None or type_name in NATIVE_TYPES:
        return value.numpy()
    size = value.tensor_size_in_bytes()
    data = ctypes.string_at(value.data_ptr(), size) if size else b""
    return (RAW, value.element_type(), tuple(value.shape()), data)


class Server:
    """The session slot and the requests on it (``handle``), in this process or the child."""

    def __init__(self) -> None:
        self.session: Any = None

    def handle(self, request: tuple[Any, ...]) -> tuple[str, Any]:
        try:
            if request[0] == "open":
                if self.session is not None:
                    raise RuntimeError("a session is open already")
                session = open_session(request[1])
                self.session = session
                return ("ok", ([i.name for i in session.get_inputs()],
                               [o.name for o in session.get_outputs()]))
            if request[0] == "run":
                if self.session is None:
                    raise RuntimeError("no session is open")
                return ("ok", run_session(self.session, request[1]))
            if request[0] == "close":
                self.session = None
                return ("ok", None)
            raise RuntimeError(f"unknown request {request[0]!r}")
        except Exception as e:  # noqa: BLE001 - every failure is the parent's to report
            return ("error", str(e) or type(e).__name__)


def serve(requests: BinaryIO, replies: BinaryIO) -> None:
    """Answer requests until the parent closes the pipe."""
    server = Server()
    while True:
        try:
            request = pickle.load(requests)
        except EOFError:
            return
        pickle.dump(server.handle(request), replies, protocol=pickle.HIGHEST_PROTOCOL)
        replies.flush()


def main() -> None:
    # Ctrl-C is the parent's to handle: it stops this process (here it would print a
    # traceback and leave the parent a reply short)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    extra = os.environ.get(PATH_VARIABLE)
    if extra:  # the parent's sys.path: the same onnxruntime and numpy, however it found them
        sys.path[:0] = [p for p in extra.split(os.pathsep) if p not in sys.path]
    # at once: the parent starts this process early, to have it ready when needed (without
    # onnxruntime each request replies the import error)
    with contextlib.suppress(ImportError):
        import onnxruntime  # noqa: F401
    sys.stdout.flush()
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # onnxruntime's prints go to stderr
    replies.write(READY)
    replies.flush()
    serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
