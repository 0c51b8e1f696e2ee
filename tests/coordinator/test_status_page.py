"""The status page at ``/``, rendered by a real headless Debian chromium."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import GENEROUS_S

from deltarl.services.coordinator.client import CoordinatorClient
from deltarl.services.coordinator.schemas import WorkerHeartbeat, WorkerRegistration

from .conftest import TRAINER_TOKEN, WORKER_TOKEN, LiveServer
from .helpers import group, manifest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_page_and_assets_are_served_without_cdn(server: LiveServer) -> None:
    html = httpx.get(server.url + "/").text
    assert "deltarl coordinator" in html and 'src="app.js"' in html
    js = httpx.get(server.url + "/app.js")
    assert js.status_code == 200 and "EventSource" in js.text
    assert httpx.get(server.url + "/style.css").status_code == 200
    for text in (html, js.text):
        assert not re.search(r"(src|href)=\"https?://", text)  # no CDN, works offline


class HeadlessChromium:
    """Debian's chromium, headless, driven over the DevTools protocol (a websocket)."""

    def __init__(self, profile: Path) -> None:
        assert CHROMIUM is not None
        ws_connect = pytest.importorskip(
            "websockets.sync.client", reason="the DevTools protocol client needs 'websockets'"
        ).connect
        self.proc = subprocess.Popen(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                "--remote-debugging-port=0",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            assert time.monotonic() < deadline and self.proc.poll() is None, (
                "chromium did not start"
            )
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        pages = httpx.get(f"http://127.0.0.1:{port}/json/list").json()
        url = next(p["webSocketDebuggerUrl"] for p in pages if p["type"] == "page")
        self.ws = ws_connect(url, max_size=None).__enter__()
        self._id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=30))
            if msg.get("id") == self._id:
                assert "error" not in msg, msg
                return msg["result"]

    def eval(self, expression: str) -> Any:
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)[
            "result"
        ].get("value")

    def wait_for(self, expression: str, timeout: float = 10) -> float:
        start = time.monotonic()
        while not self.eval(expression):
            assert time.monotonic() - start < timeout, f"timed out waiting for {expression}"
            time.sleep(0.05)
        return time.monotonic() - start

    def close(self) -> None:
        self.ws.close()
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install -y chromium)")
def test_page_renders_live_data_in_headless_chromium(server: LiveServer, tmp_path: Path) -> None:
    trainer = CoordinatorClient(server.url, TRAINER_TOKEN)
    worker = CoordinatorClient(server.url, WORKER_TOKEN)
    trainer.publish_version(manifest(0))
    for v in range(1, 4):
        trainer.publish_version(manifest(v, delta_size=700 * v))
    for i, lag in enumerate([0, 2, 3]):
        wid = f"worker-{i}"
        worker.register(WorkerRegistration(worker_id=wid, engine="vllm", model="m", capacity=2))
        worker.heartbeat(wid, WorkerHeartbeat(applied_version=3 - lag))
    for v in range(4):
        worker.submit(group(f"s{v}", worker="worker-0", vmin=v, reward=0.1 * v))
    browser = HeadlessChromium(tmp_path / "profile")
    try:
        browser.call("Page.enable")
        browser.call("Page.navigate", url=server.url + "/")
        browser.wait_for("Number(document.body.dataset.rendered || 0) >= 1")
        browser.wait_for("document.getElementById('conn').textContent === 'live'")
        dom = browser.eval("document.documentElement.outerHTML")
        assert re.search(r'id="latest-version">3<', dom)
        assert re.search(r'id="workers">3 / 0<', dom)
        assert re.search(r'id="delta-ratio">2\.1 KiB / 48\.8 KiB<', dom)
        # versions chart: one bar per version (the anchor marked), full-size line drawn
        assert sorted(map(int, re.findall(r'data-version="(\d+)"', dom))) == [0, 1, 2, 3]
        assert 'data-kind="anchor"' in dom and 'class="line"' in dom
        # worker lag chart and table
        lags = dict(re.findall(r'data-worker="([\w-]+)" data-lag="(\d+)"', dom))
        assert lags == {"worker-0": "0", "worker-1": "2", "worker-2": "3"}
        assert dom.count('<tr class="active">') == 3
        # staleness histogram (submitted at latest=3 from versions 0..3) and reward curve
        assert sorted(re.findall(r'data-staleness="(\d+)" data-count="(\d+)"', dom)) == [
            ("0", "1"),
            ("1", "1"),
            ("2", "1"),
            ("3", "1"),
        ]
        assert len(re.findall(r'class="point" data-x="\d+"', dom)) >= 4
        # live: a new version reaches the page through the event stream (only the stream's
        # listener sets lastEvent; the 2 s refresh does not)
        trainer.publish_version(manifest(4))
        browser.wait_for("document.body.dataset.lastEvent === '4'", timeout=GENEROUS_S)
        browser.wait_for("document.getElementById('latest-version').textContent === '4'", 5)
        shot = browser.call("Page.captureScreenshot", format="png")["data"]
        png = base64.b64decode(shot)
        assert len(png) > 10_000  # something was painted
        if os.environ.get("DELTARL_SCREENSHOT"):
            Path(os.environ["DELTARL_SCREENSHOT"]).write_bytes(png)
    finally:
        browser.close()
