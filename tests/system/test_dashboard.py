"""The /ui dashboard in headless Chromium (Debian's ``chromium``): the page loads against the
embedded service, shows a running batch whose progress advances, and is screenshotted.

Chromium is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: JSON
messages ending in a NUL byte on fds 3 and 4), so the DOM can be read twice and no extra Python
package is needed.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from cli import main as cli
from tests.conftest_services import completion_line, wait_for

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_chromium() -> str | None:
    for name in (os.environ.get("BOXCAR_CHROMIUM"), *CHROMIUM_NAMES):
        if name and (path := shutil.which(name)):
            return path
    return None


class Chromium:
    """A headless browser and one page, over the DevTools protocol on a pipe."""

    def __init__(self, binary: str, profile: Path) -> None:
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run", "--no-default-browser-check",
                "--remote-debugging-pipe", f"--user-data-dir={profile}", "about:blank"]
        # The shell puts our pipe ends on the fds Chromium expects (3: commands in, 4: out).
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{to_browser_r} 4>&{from_browser_w}', binary,
             *args],
            pass_fds=(to_browser_r, from_browser_w), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.session: str | None = None

    def send(self, method: str, params: dict | None = None, *, timeout: float = 60) -> dict:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method,
                                   "params": params or {}}
        if self.session is not None and not method.startswith("Target."):
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline, method)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def _read(self, deadline: float, method: str) -> dict:
        import select

        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise TimeoutError(f"Chromium did not answer {method}")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the pipe")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def open(self, url: str, width: int = 1280, height: int = 1100) -> None:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.send("Target.attachToTarget",
                                 {"targetId": target, "flatten": True})["sessionId"]
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        self.send("Page.enable")
        self.send("Page.navigate", {"url": url})

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", {"expression": expression,
                                                "returnByValue": True})
        return result["result"].get("value")

    def screenshot(self, path: Path) -> None:
        data = self.send("Page.captureScreenshot", {"format": "png"})["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self._to_browser)
        os.close(self._from_browser)


BATCH_ROW = """(() => {
  const row = document.querySelector('tr[data-batch-id="%s"]');
  if (!row) return null;
  return {done: +row.dataset.done, total: +row.dataset.total, status: row.dataset.status,
          updates: +(document.body.dataset.updates || 0),
          running: document.getElementById('t-running').textContent};
})()"""


@pytest.mark.skipif(find_chromium() is None, reason="no headless Chromium: `apt-get install "
                    "-y chromium` (or set BOXCAR_CHROMIUM) to run the dashboard test")
def test_dashboard_shows_a_batch_advancing(embedded, tmp_path) -> None:
    binary = find_chromium()
    assert binary is not None
    headers = {"Authorization": f"Bearer {embedded.api_key}"}
    # Enough tokens that the tiny model takes several seconds: 8 running at a time.
    requests = [{"custom_id": f"r{i}", "body": completion_line(
        f"r{i}", f"Once upon a time {i}", max_tokens=96, ignore_eos=True)["body"]}
        for i in range(160)]
    batch = httpx.post(f"{embedded.base_url}/v1/batches", headers=headers, timeout=30, json={
        "endpoint": "/v1/completions", "completion_window": "24h",
        "requests": requests}).json()

    browser = Chromium(binary, tmp_path / "profile")
    try:
        browser.open(f"{embedded.base_url}/ui?key={embedded.api_key}")
        row = BATCH_ROW % batch["id"]
        first = wait_for(lambda: (r := browser.evaluate(row)) and r["done"] > 0 and r, 60, 0.2,
                         "the batch to show progress")
        assert first["total"] == 160
        later = wait_for(lambda: (r := browser.evaluate(row)) and r["done"] > first["done"]
                         and r["updates"] > first["updates"] and r, 60, 0.2,
                         "the progress to advance")
        assert later["status"] in ("in_progress", "finalizing", "completed")
        # The key moved from the URL into localStorage.
        assert browser.evaluate("location.search") == ""
        assert browser.evaluate("localStorage.getItem('boxcar_api_key')") == embedded.api_key
        # Engine figures arrive with the worker's next snapshot.
        wait_for(lambda: browser.evaluate(
            "document.querySelectorAll('#c-load path').length") >= 2, 30, 0.2,
            "the running/waiting chart")
        shot = tmp_path / "dashboard.png"
        browser.screenshot(shot)
        assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        print(f"dashboard screenshot: {shot}")
        # boxcar doctor on the live service: the API's /metrics carries the worker's engine.
        report = tmp_path / "doctor.json"
        assert cli.main(["doctor", f"{embedded.base_url}/metrics", "--duration", "2",
                         "--interval", "0.5", "--save", str(report)]) == 0
        window = json.loads(report.read_text())
        assert window["counters"]["generation_tokens"] > 0 and window["timeline"]
        assert window["config"]["max_num_seqs"] == 8
    finally:
        browser.close()
        httpx.post(f"{embedded.base_url}/v1/batches/{batch['id']}/cancel", headers=headers,
                   timeout=30)
