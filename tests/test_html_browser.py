"""The HTML report in a real headless Chromium (Debian's, installed by .ci/run).

Chromium is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
JSON messages ending in NUL on fds 3 and 4), so the test sees every console message,
uncaught exception, log entry (CSP violations, failed loads) and network request,
without a driver package. The page is an optimize report of samples/cnn.onnx whose
first Conv is named ``<script>alert(1)</script>``. Skipped when Chromium is missing,
unless CI=true, where a missing browser fails the test.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import struct
import subprocess
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

import fusectl
from fusectl import formats
from fusectl.formats import html as html_format
from fusectl.report import optimize_json

HOSTILE = "<script>alert(1)</script>"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                  "--remote-debugging-pipe"]


def _chromium() -> str:
    found = shutil.which("chromium") or (
        "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
    if found is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("chromium is missing on CI (.ci/run installs it with apt-get)")
        pytest.skip("chromium not installed (apt-get install chromium)")
    return found


class DevTools:
    """A minimal DevTools-protocol client over Chromium's pipe transport."""

    def __init__(self, executable: str, profile: Path):
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def wire_pipes() -> None:  # in the child: the protocol wants exactly fds 3 and 4
            os.dup2(to_browser_r, 3)
            os.dup2(from_browser_w, 4)

        self.process = subprocess.Popen(  # noqa: PLW1509 - preexec_fn needed for the fds
            [executable, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=False, preexec_fn=wire_pipes)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def send(self, method: str, params: dict[str, Any] | None = None,
             session: str | None = None, timeout: float = 30.0) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method,
                                   "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read(timeout)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def wait_for(self, method: str, timeout: float = 30.0) -> dict[str, Any]:
        for event in self.events:
            if event.get("method") == method:
                return event
        while True:
            event = self._read(timeout)
            if event.get("method") == method:
                return event

    def _read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise TimeoutError("chromium did not answer")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buffer += chunk
        raw, _, self._buffer = self._buffer.partition(b"\0")
        message = json.loads(raw)
        if "method" in message:
            self.events.append(message)
        return message

    def close(self) -> None:
        with contextlib.suppress(OSError, RuntimeError, TimeoutError):
            self.send("Browser.close", timeout=5)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)


def decode_png(data: bytes) -> np.ndarray:
    """RGB(A) 8-bit non-interlaced PNG -> (height, width, channels) uint8 array."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, header
    channels = 4 if colour == 6 else 3
    stride = width * channels
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, stride + 1)
    image = np.zeros((height, stride), dtype=np.uint8)
    previous = np.zeros(stride, dtype=np.int32)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        if kind == 0:
            row = line
        elif kind == 2:
            row = (line + previous) & 0xFF
        elif kind == 1:  # Sub: a running sum per channel
            row = np.cumsum(line.reshape(width, channels), axis=0).reshape(-1) & 0xFF
        else:  # Average and Paeth depend on the decoded left neighbour: byte by byte
            row = np.zeros(stride, dtype=np.int32)
            up = previous.tolist()
            values = line.tolist()
            out = [0] * stride
            for i in range(stride):
                left = out[i - channels] if i >= channels else 0
                if kind == 3:
                    out[i] = (values[i] + (left + up[i]) // 2) & 0xFF
                else:
                    upper_left = up[i - channels] if i >= channels else 0
                    p = left + up[i] - upper_left
                    pa, pb, pc = abs(p - left), abs(p - up[i]), abs(p - upper_left)
                    pred = left if pa <= pb and pa <= pc else (up[i] if pb <= pc else upper_left)
                    out[i] = (values[i] + pred) & 0xFF
            row = np.array(out, dtype=np.int32)
        image[y] = row
        previous = row
    return image.reshape(height, width, channels)


def count_colour(image: np.ndarray, hex_colour: str, tolerance: int = 3) -> int:
    want = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(image[..., :3].astype(int) - want).max(axis=-1) <= tolerance).sum())


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> dict[str, Any]:
    """Open the report of a hostile-named cnn.onnx in chromium; collect what happened."""
    executable = _chromium()
    tmp = tmp_path_factory.mktemp("browser")
    model = onnx.load(str(Path(__file__).parent.parent / "samples" / "cnn.onnx"))
    model.graph.node[0].name = HOSTILE
    model_path = tmp / "hostile.onnx"
    onnx.save(model, model_path)
    doc = optimize_json(fusectl.optimize(model_path), output=None)
    report = tmp / "report.html"
    formats.write(doc, report, "html")

    browser = DevTools(executable, tmp / "profile")
    try:
        target = next(t for t in browser.send("Target.getTargets")["targetInfos"]
                      if t["type"] == "page")
        session = browser.send("Target.attachToTarget",
                               {"targetId": target["targetId"], "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Page", "Network"):
            browser.send(f"{domain}.enable", session=session)
        browser.send("Emulation.setDeviceMetricsOverride",
                     {"width": 1280, "height": 1000, "deviceScaleFactor": 1, "mobile": False},
                     session=session)
        browser.send("Page.navigate", {"url": report.as_uri()}, session=session)
        browser.wait_for("Page.loadEventFired")

        def evaluate(expression: str) -> Any:
            result = browser.send("Runtime.evaluate",
                                  {"expression": expression, "returnByValue": True},
                                  session=session)
            return result["result"].get("value")

        state = {
            "ready": evaluate("document.documentElement.getAttribute('data-fusectl-ready')"),
            "scripts": evaluate("document.scripts.length"),
            "text": evaluate("document.body.innerText"),
            "slots": evaluate("document.querySelectorAll('#chart .slot').length"),
        }
        # clicking the slot of the second fused region shows its nodes in the detail panel
        state["detail"] = evaluate(
            "(function(){var s=document.querySelectorAll('#chart .slot');"
            "var fused=Array.prototype.filter.call(s,function(g){"
            "return g.querySelector('title').textContent.indexOf('fused by')>=0;});"
            "fused[1].dispatchEvent(new MouseEvent('click',{bubbles:true}));"
            "return document.getElementById('detail').textContent;})()")
        box = evaluate("(function(){var r=document.getElementById('chart')"
                       ".getBoundingClientRect();return [r.x,r.y,r.width,r.height];})()")
        shot = browser.send("Page.captureScreenshot", {
            "format": "png",
            "clip": {"x": box[0], "y": box[1], "width": box[2], "height": box[3], "scale": 1},
        }, session=session)
        state["chart_png"] = base64.b64decode(shot["data"])
        state["full_png"] = base64.b64decode(
            browser.send("Page.captureScreenshot", {"format": "png"}, session=session)["data"])
        time.sleep(0.2)  # let late console messages arrive with the next reply
        browser.send("Runtime.evaluate", {"expression": "1"}, session=session)
    finally:
        browser.close()
    state["events"] = browser.events
    state["url"] = report.as_uri()
    state["doc"] = doc
    (tmp / "chart.png").write_bytes(state["chart_png"])
    return state


def test_no_console_errors_exceptions_or_fetches(page):
    events = page["events"]
    exceptions = [e for e in events if e["method"] == "Runtime.exceptionThrown"]
    console = [e["params"] for e in events if e["method"] == "Runtime.consoleAPICalled"
               and e["params"]["type"] in ("error", "warning", "assert")]
    logged = [e["params"]["entry"] for e in events if e["method"] == "Log.entryAdded"
              and e["params"]["entry"]["level"] in ("error", "warning")]
    dialogs = [e for e in events if e["method"] == "Page.javascriptDialogOpening"]
    requests = {e["params"]["request"]["url"] for e in events
                if e["method"] == "Network.requestWillBeSent"}
    assert exceptions == []
    assert console == []
    assert logged == []
    assert dialogs == [], "a node name ran as script"
    assert requests == {page["url"]}, "the page must not fetch anything"


def test_script_ran_and_hostile_name_is_text(page):
    assert page["ready"] == "1"
    assert page["scripts"] == 2  # the JSON blob and the page's own script, nothing injected
    assert HOSTILE in page["text"]
    assert "conv-bn-fold" in page["text"]


def test_detail_panel_lists_nodes_of_the_clicked_region(page):
    # the second fused region of cnn.onnx: conv2 -> Mul -> Add folded into one Conv
    detail = page["detail"]
    assert "conv-mul-fold" in detail and "conv-add-fold" in detail
    assert "conv2 (Conv" in detail and "scale2 (Mul" in detail and "shift2 (Add" in detail


def test_chart_is_drawn_with_bars_of_each_kind(page):
    # cnn.onnx has 10 layers: 3 fused regions, 7 layers no rule touched
    assert page["slots"] == 10
    chart = decode_png(page["chart_png"])
    full = decode_png(page["full_png"])
    assert full.shape[1] == 1280
    height, width = chart.shape[:2]
    assert width > 600 and height > 250
    colours = html_format.rule_colours(page["doc"])
    before = count_colour(chart, html_format.BEFORE)
    unchanged = count_colour(chart, html_format.UNCHANGED)
    bn_fold = count_colour(chart, colours["conv-bn-fold"])
    # bars are tens of pixels wide and up to 260 px tall: thousands of pixels each
    assert before > 20_000, before
    assert unchanged > 5_000, unchanged
    assert bn_fold > 3_000, bn_fold
    # before bars only exist in the chart: none of that colour outside it
    assert count_colour(full, html_format.BEFORE) - before < 400  # the legend swatch
