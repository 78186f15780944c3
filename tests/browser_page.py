"""Headless Chromium driven from pytest, with the standard library only: a loopback http.server serves a folder (a
secure context, as WebGPU wants), Chromium runs with WebGPU on (SwiftShader where there is no GPU) and is driven
through the DevTools protocol over --remote-debugging-pipe (fds 3 and 4, NUL-separated JSON). Every wait has a
timeout; the browser is killed on close."""

from __future__ import annotations

import base64
import fcntl
import functools
import http.server
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless=new", "--no-sandbox", "--enable-unsafe-webgpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-pipe"]


class PageError(Exception):
    """A script that threw in the page, or the browser not answering in time."""


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def end_headers(self) -> None:
        self.send_header("Cache-Control", "no-store")
        super().end_headers()


class Browser:
    """One Chromium with one page, serving ``root`` at :attr:`base` (http://127.0.0.1:PORT/)."""

    def __init__(self, root: str | os.PathLike, timeout: float = 120.0) -> None:
        self.timeout = timeout
        handler = functools.partial(_Quiet, directory=os.fspath(root))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.profile = tempfile.mkdtemp(prefix="leafpy-chromium-")
        to_child, self._out = os.pipe()
        self._in, from_child = os.pipe()

        def fds() -> None:  # in the child: the protocol's pipes as fds 3 (read) and 4 (write)
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_child, from_child)]
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        self.log = open(os.path.join(self.profile, "chromium.log"), "wb")  # noqa: SIM115
        self.proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     preexec_fn=fds, pass_fds=(3, 4))
        os.close(to_child)
        os.close(from_child)
        self._next = 0
        self._replies: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            target = self.send("Target.createTarget", url="about:blank")["targetId"]
            self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            self.send("Page.enable", session=True)
            self.send("Runtime.enable", session=True)
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._in, 1 << 16)
            except OSError:
                return
            if not chunk:
                return
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "id" in msg:
                    with self._lock:
                        q = self._replies.get(msg["id"])
                    if q is not None:
                        q.put(msg)

    def send(self, method: str, session: bool = False, timeout: float | None = None, **params: Any) -> dict:
        """One DevTools command (to the page's session with ``session``); its result, or PageError."""
        with self._lock:
            self._next += 1
            n = self._next
            q: queue.Queue = queue.Queue()
            self._replies[n] = q
        msg: dict[str, Any] = {"id": n, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._out, json.dumps(msg).encode() + b"\0")
        try:
            reply = q.get(timeout=timeout or self.timeout)
        except queue.Empty:
            raise PageError(f"chromium did not answer {method} within {timeout or self.timeout} s") from None
        finally:
            with self._lock:
                self._replies.pop(n, None)
        if "error" in reply:
            raise PageError(f"{method}: {reply['error']}")
        return reply["result"]

    def goto(self, path: str) -> None:
        """Open ``path`` (relative to the served folder) and wait until its document has loaded."""
        self.send("Page.navigate", session=True, url=self.base + path)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    def evaluate(self, expression: str, timeout: float | None = None) -> Any:
        """The value of a JavaScript expression in the page (a promise is awaited); PageError if it throws."""
        r = self.send("Runtime.evaluate", session=True, timeout=timeout, expression=expression, awaitPromise=True,
                      returnByValue=True)
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            raise PageError(d.get("exception", {}).get("description") or d.get("text", "script error"))
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float | None = None) -> Any:
        """Poll ``expression`` until it is truthy; its value."""
        end = time.monotonic() + (timeout or self.timeout)
        while time.monotonic() < end:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.1)
        raise PageError(f"timed out waiting for {expression}")

    def screenshot(self, path: str | os.PathLike) -> None:
        data = self.send("Page.captureScreenshot", session=True, format="png", captureBeyondViewport=True)["data"]
        Path(path).write_bytes(base64.b64decode(data))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        for fd in (self._out, self._in):
            try:
                os.close(fd)
            except OSError:
                pass
        self.server.shutdown()
        self.server.server_close()
        self.log.close()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
