"""Headless Chromium for the tests: a folder served on loopback, a page driven over the DevTools protocol.

``Browser(folder)`` starts an ``http.server`` on 127.0.0.1 (a secure context, so WebGPU is exposed) in a thread and
Debian's ``chromium`` headless with ``--remote-debugging-pipe``: DevTools messages are NUL-terminated JSON on file
descriptors 3 (to the browser) and 4 (from it). WebGPU runs on SwiftShader, Chromium's CPU Vulkan, where no GPU is
reachable. Standard library only; every wait has a timeout (a hung page raises BrowserError, never hangs the test)
and the browser's process group is killed on close, at the latest at interpreter exit.

    with Browser(folder) as b:
        b.goto("index.html")
        b.evaluate("navigator.gpu.requestAdapter().then(a => a.info.vendor)")
        b.screenshot(folder / "page.png")
"""

from __future__ import annotations

import atexit
import base64
import fcntl
import functools
import http.server
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--enable-unsafe-webgpu", "--disable-gpu-sandbox",
                  "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-default-apps", "--mute-audio", "--enable-features=Vulkan",
                  "--use-webgpu-adapter=swiftshader")
"""WebGPU on SwiftShader in a headless, quiet browser that reaches nothing but the loopback server (``flags``:
others, e.g. without --enable-unsafe-webgpu for a page that must cope with no WebGPU)."""


class BrowserError(RuntimeError):
    """The browser could not start, a DevTools call failed or timed out, or page code threw."""


def find_chromium() -> str | None:
    """The Chromium executable (Debian's /usr/bin/chromium, or one named by LEAFPY_CHROMIUM), None where absent."""
    named = os.environ.get("LEAFPY_CHROMIUM")
    if named:
        return shutil.which(named)
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _high(fd: int) -> int:
    """``fd`` moved to a number of 10 or more (close-on-exec), clear of the 3 and 4 the browser is given."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved


class _Quiet(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".js": "text/javascript",
                      ".mjs": "text/javascript", ".wgsl": "text/plain", ".json": "application/json"}

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def end_headers(self) -> None:
        self.send_header("Cache-Control", "no-store")
        super().end_headers()


class Browser:
    """Headless Chromium showing ``folder`` (served on loopback) in one page; see the module docstring."""

    def __init__(self, folder: str | os.PathLike, timeout: float = 30.0, executable: str | None = None,
                 flags: tuple[str, ...] = CHROMIUM_FLAGS) -> None:
        self.folder = Path(folder)
        self.timeout = timeout
        self.events: list[dict] = []  # DevTools events (console messages, exceptions), in arrival order
        self._lock = threading.Condition()
        self._replies: dict[int, dict] = {}
        self._next = 0
        self._closed = False
        self.log: list[str] = []  # the browser's stderr lines
        self._out: Any = None
        exe = executable or find_chromium()
        if exe is None:
            raise BrowserError("no Chromium: install Debian's chromium (apt-get install chromium) or set "
                               "LEAFPY_CHROMIUM")
        handler = functools.partial(_Quiet, directory=str(self.folder))
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/"
        self._profile = tempfile.mkdtemp(prefix="leafpy-chromium-")
        self._proc: subprocess.Popen | None = None
        atexit.register(self.close)
        started = time.monotonic()
        try:
            self._launch(exe, flags)
            target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            self._session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            self.call("Runtime.enable", session=True)
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.monotonic() - started
        """How long the browser took to start and open its page."""

    def _launch(self, exe: str, flags: tuple[str, ...]) -> None:
        to_browser_r, to_browser_w = map(_high, os.pipe())
        from_browser_r, from_browser_w = map(_high, os.pipe())
        # the browser reads fd 3 and writes fd 4: bash (dash takes one-digit fds only) moves the pipes there
        argv = [exe, *flags, "--remote-debugging-pipe", f"--user-data-dir={self._profile}", "about:blank"]
        shell = f'exec "$@" 3<&{to_browser_r} 4>&{from_browser_w} {to_browser_r}<&- {from_browser_w}>&-'
        self._proc = subprocess.Popen(["/bin/bash", "-c", shell, "chromium", *argv], pass_fds=(to_browser_r,
                                      from_browser_w), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, start_new_session=True)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._out = os.fdopen(to_browser_w, "wb", buffering=0)
        self._in = from_browser_r
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._drain_stderr, daemon=True).start()

    def _drain_stderr(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        for line in self._proc.stderr:
            self.log.append(line.decode(errors="replace").rstrip())

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = os.read(self._in, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for raw in messages:
                message = json.loads(raw)
                with self._lock:
                    if "id" in message:
                        self._replies[message["id"]] = message
                    else:
                        self.events.append(message)
                    self._lock.notify_all()
        os.close(self._in)  # here, not in close(): no read may meet a closed (or reused) descriptor
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    def call(self, method: str, params: dict | None = None, session: bool = False,
             timeout: float | None = None) -> dict:
        """One DevTools command (on the page with ``session``), its result; BrowserError on an error or timeout."""
        with self._lock:
            self._next += 1
            ident = self._next
        message: dict[str, Any] = {"id": ident, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self._session
        try:
            self._out.write(json.dumps(message).encode() + b"\0")
        except OSError as e:
            raise BrowserError(f"{method}: the browser is gone ({e}); its log: {self._tail()}") from e
        deadline = time.monotonic() + (timeout or self.timeout)
        with self._lock:
            while ident not in self._replies:
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    why = "the browser closed its pipe" if self._closed else f"no reply in {timeout or self.timeout} s"
                    raise BrowserError(f"{method}: {why}; its log: {self._tail()}")
                self._lock.wait(left)
            reply = self._replies.pop(ident)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error'].get('message')} {reply['error'].get('data', '')}")
        return reply.get("result", {})

    def _tail(self) -> str:
        return " | ".join(self.log[-5:]) or "(empty)"

    def goto(self, path: str = "index.html", timeout: float | None = None) -> None:
        """Open ``path`` (relative to the served folder) and wait until the document has loaded."""
        self.call("Page.navigate", {"url": self.url + path}, session=True, timeout=timeout)
        deadline = time.monotonic() + (timeout or self.timeout)
        while self.evaluate("document.readyState", timeout=timeout) != "complete":
            if time.monotonic() > deadline:
                raise BrowserError(f"{path}: not loaded after {timeout or self.timeout} s")
            time.sleep(0.05)

    def evaluate(self, expression: str, timeout: float | None = None) -> Any:
        """The value of a JavaScript expression in the page (a promise awaited), as JSON; BrowserError where it
        throws or rejects (with the message) or takes longer than ``timeout`` seconds."""
        result = self.call("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                "returnByValue": True}, session=True, timeout=timeout)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            thrown = details.get("exception", {})
            text = thrown.get("description") or thrown.get("value") or details.get("text")
            raise BrowserError(f"the page threw: {text}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float | None = None) -> Any:
        """Poll ``expression`` until it is truthy; its value (BrowserError after ``timeout`` seconds)."""
        end = time.monotonic() + (timeout or self.timeout)
        while time.monotonic() < end:
            value = self.evaluate(expression, timeout=timeout)
            if value:
                return value
            time.sleep(0.1)
        raise BrowserError(f"timed out waiting for {expression}")

    def screenshot(self, path: str | os.PathLike | None = None) -> bytes:
        """A PNG of the page (written to ``path`` where given)."""
        data = base64.b64decode(self.call("Page.captureScreenshot", {"format": "png"}, session=True)["data"])
        if path is not None:
            Path(path).write_bytes(data)
        return data

    def console(self) -> list[str]:
        """The page's console messages and uncaught exceptions so far."""
        lines = []
        for event in list(self.events):
            params = event.get("params", {})
            if event.get("method") == "Runtime.consoleAPICalled":
                lines.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", [])))
            elif event.get("method") == "Runtime.exceptionThrown":
                lines.append(params.get("exceptionDetails", {}).get("exception", {}).get("description", "exception"))
        return lines

    def close(self) -> None:
        """Stop the browser (its whole process group) and the server; remove the profile folder."""
        atexit.unregister(self.close)
        proc, self._proc = self._proc, None
        if proc is not None:
            for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            self._out.close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
