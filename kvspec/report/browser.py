"""Headless Chromium over the DevTools protocol, with the standard library only.

``Browser`` starts ``chromium --headless --remote-debugging-pipe``: the protocol's JSON messages,
each ended by a NUL byte, go to the browser on file descriptor 3 and come back on 4, so nothing
listens on any port. ``open(path)`` loads a local file in a fresh tab and waits for its load
event; the tab records console messages, uncaught exceptions, log entries and every network
request made. ``evaluate`` runs a JavaScript expression in the page and returns its value;
``screenshot`` returns a PNG of the page or of a clipped rectangle. ``decode_png`` reads the
8-bit, non-interlaced PNGs Chromium writes, so a test can look at the pixels that were drawn.

Run as a script it saves a screenshot of a page: ``python -m kvspec.report.browser PAGE.html OUT.png``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

COMMAND_FD, REPLY_FD = 3, 4  # the descriptors --remote-debugging-pipe reads and writes
CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")
READ_CHUNK = 1 << 16
VIEWPORT = (1400, 1000)


class BrowserError(RuntimeError):
    """The browser could not be started, answered with an error, or did not answer in time."""


def find_chromium() -> str | None:
    """The path of a Chromium-like browser on PATH, or None."""
    for name in CANDIDATES:
        path = shutil.which(name)
        if path is not None:
            return path
    return None


@dataclass
class PageLog:
    """What a tab reported while it was open: console messages (type, text), uncaught exceptions,
    log entries (level, text) and the URLs of the network requests it made."""

    console: list[tuple[str, str]] = field(default_factory=list)
    exceptions: list[str] = field(default_factory=list)
    entries: list[tuple[str, str]] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)

    def errors(self) -> list[str]:
        """Console errors and warnings, uncaught exceptions and error log entries, as text."""
        out = [f"console.{kind}: {text}" for kind, text in self.console if kind in ("error", "warning", "assert")]
        out += [f"exception: {text}" for text in self.exceptions]
        out += [f"log {level}: {text}" for level, text in self.entries if level in ("error", "warning")]
        return out

    def record(self, method: str, params: dict[str, Any]) -> None:
        """File one protocol event under what it reports."""
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.console.append((str(params.get("type")), text))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.exceptions.append(str(details.get("exception", {}).get("description", details.get("text"))))
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            self.entries.append((str(entry.get("level")), str(entry.get("text"))))
        elif method == "Network.requestWillBeSent":
            self.requests.append(str(params.get("request", {}).get("url")))


@dataclass(frozen=True)
class PageLoad:
    """A loaded tab: its protocol session, what it logged, and the seconds from navigation to the
    load event as measured here (the page's own ``performance`` timing is in ``evaluate``)."""

    session: str
    log: PageLog
    seconds: float


class Browser:
    """One headless Chromium process; a context manager that closes it (and its profile) on exit."""

    def __init__(self, executable: str | None = None, timeout: float = 60.0) -> None:
        path = executable or find_chromium()
        if path is None:
            raise BrowserError(f"no Chromium on PATH (looked for {', '.join(CANDIDATES)})")
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="kvspec-chromium-")
        self._next_id = 0
        self._buffer = b""
        self._logs: dict[str, PageLog] = {}
        self._process, self._send, self._receive = self._start(path)

    def _start(self, path: str) -> tuple[subprocess.Popen[bytes], IO[bytes], IO[bytes]]:
        to_browser_r, to_browser_w = os.pipe()
        from_browser_r, from_browser_w = os.pipe()

        def wire() -> None:  # in the child: the pipe ends on the descriptors the browser expects
            command, reply = os.dup(to_browser_r), os.dup(from_browser_w)
            os.dup2(command, COMMAND_FD)
            os.dup2(reply, REPLY_FD)

        args = [path, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
                "--remote-debugging-pipe", f"--user-data-dir={self.profile}",
                f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}", "about:blank"]
        process = subprocess.Popen(args, preexec_fn=wire, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, close_fds=False)
        os.close(to_browser_r)
        os.close(from_browser_w)
        return process, os.fdopen(to_browser_w, "wb", buffering=0), os.fdopen(from_browser_r, "rb", buffering=0)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Ask the browser to quit, wait for it (kill it if it will not), remove the profile."""
        try:
            self._write({"id": self._new_id(), "method": "Browser.close", "params": {}})
        except OSError:
            pass  # already gone
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._send.close()
        self._receive.close()
        shutil.rmtree(self.profile, ignore_errors=True)

    # -- the protocol ----------------------------------------------------------------------

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _write(self, message: dict[str, Any]) -> None:
        self._send.write(json.dumps(message).encode() + b"\0")

    def _read(self, deadline: float) -> dict[str, Any]:
        """The next message; ``BrowserError`` when the browser exits or the deadline passes."""
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise BrowserError(f"no answer from the browser within {self.timeout:.0f} s")
            chunk = self._receive.read(READ_CHUNK)
            if not chunk:
                raise BrowserError(f"the browser exited (status {self._process.poll()})")
            self._buffer += chunk
        raw, _, self._buffer = self._buffer.partition(b"\0")
        message: dict[str, Any] = json.loads(raw)
        return message

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        """Send one command and return its result, filing the events that arrive meanwhile."""
        ident = self._new_id()
        message: dict[str, Any] = {"id": ident, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        self._write(message)
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == ident:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error'].get('message', reply['error'])}")
                result: dict[str, Any] = reply.get("result", {})
                return result
            self._file_event(reply)

    def _file_event(self, message: dict[str, Any]) -> None:
        log = self._logs.get(str(message.get("sessionId")))
        if log is not None and "method" in message:
            log.record(str(message["method"]), message.get("params", {}))

    def _wait_for(self, method: str, session: str) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            message = self._read(deadline)
            self._file_event(message)
            if message.get("method") == method and message.get("sessionId") == session:
                return

    # -- pages -----------------------------------------------------------------------------

    def open(self, path: str | Path) -> PageLoad:
        """Load the local file ``path`` in a new tab and wait for its load event."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = str(self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"])
        log = self._logs[session] = PageLog()
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=session)
        self.call("Emulation.setDeviceMetricsOverride", {"width": VIEWPORT[0], "height": VIEWPORT[1],
                                                         "deviceScaleFactor": 1, "mobile": False}, session)
        start = time.monotonic()
        self.call("Page.navigate", {"url": Path(path).resolve().as_uri()}, session)
        self._wait_for("Page.loadEventFired", session)
        return PageLoad(session, log, time.monotonic() - start)

    def evaluate(self, page: PageLoad, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-serialisable values only)."""
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, page.session)
        if "exceptionDetails" in result:
            raise BrowserError(f"evaluating {expression[:80]!r}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def screenshot(self, page: PageLoad, clip: dict[str, float] | None = None, full_page: bool = False) -> bytes:
        """A PNG of the viewport, of ``clip`` (x, y, width, height in page pixels) or of the whole page."""
        params: dict[str, Any] = {"format": "png", "captureBeyondViewport": full_page or clip is not None}
        if clip is not None:
            params["clip"] = {**clip, "scale": 1}
        elif full_page:
            size = self.evaluate(page, "[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
            params["clip"] = {"x": 0, "y": 0, "width": size[0], "height": size[1], "scale": 1}
        return base64.b64decode(self.call("Page.captureScreenshot", params, page.session)["data"])


# -- PNG ---------------------------------------------------------------------------------------

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CHANNELS = {2: 3, 6: 4}  # PNG colour type -> samples per pixel (RGB, RGBA)


@dataclass(frozen=True)
class Image:
    """Decoded pixels: ``rows[y][x]`` is an (r, g, b) triple."""

    width: int
    height: int
    rows: list[list[tuple[int, int, int]]]


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


def _unfilter(kind: int, line: bytearray, prior: bytes, bpp: int) -> None:
    """Undo one scanline's PNG filter in place (types 0-4). O(line)."""
    for i in range(len(line)):
        left = line[i - bpp] if i >= bpp else 0
        up = prior[i]
        corner = prior[i - bpp] if i >= bpp else 0
        if kind == 1:
            line[i] = (line[i] + left) & 0xFF
        elif kind == 2:
            line[i] = (line[i] + up) & 0xFF
        elif kind == 3:
            line[i] = (line[i] + (left + up) // 2) & 0xFF
        elif kind == 4:
            line[i] = (line[i] + _paeth(left, up, corner)) & 0xFF


def decode_png(data: bytes) -> Image:
    """Pixels of an 8-bit RGB or RGBA, non-interlaced PNG (what Chromium writes); ``ValueError``
    for anything else. O(pixels)."""
    if not data.startswith(PNG_SIGNATURE):
        raise ValueError("not a PNG")
    pos, chunks, header = len(PNG_SIGNATURE), [], b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            chunks.append(body)
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header)
    if depth != 8 or colour not in CHANNELS or interlace:
        raise ValueError(f"unsupported PNG: depth {depth}, colour type {colour}, interlace {interlace}")
    bpp = CHANNELS[colour]
    raw = zlib.decompress(b"".join(chunks))
    stride = width * bpp
    rows, prior = [], bytes(stride)
    for y in range(height):
        start = y * (stride + 1)
        line = bytearray(raw[start + 1:start + 1 + stride])
        _unfilter(raw[start], line, prior, bpp)
        rows.append([(line[x * bpp], line[x * bpp + 1], line[x * bpp + 2]) for x in range(width)])
        prior = bytes(line)
    return Image(width, height, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="save a screenshot of a local HTML page (headless Chromium)")
    parser.add_argument("page", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--full-page", action="store_true", help="the whole page, not only the first screen")
    args = parser.parse_args(argv)
    with Browser() as browser:
        page = browser.open(args.page)
        args.out.write_bytes(browser.screenshot(page, full_page=args.full_page))
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
