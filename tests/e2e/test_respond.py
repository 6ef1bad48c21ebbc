"""End to end: a real Alertmanager delivers a page to ``sdc-telemetry respond``, which runs the drain command.

The responder runs as the CLI would in production (a subprocess, stopped with SIGTERM); its command is a recorder
script that writes its arguments to a file. Alertmanager gets a config written here, its webhook pointing at the
responder, and alerts posted to its v2 API as Prometheus would post them.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sdc_telemetry.ops.stack import ALERTMANAGER_NAMES

pytestmark = pytest.mark.e2e

RECORDER = "import json, sys\nwith open(sys.argv[1], 'a') as f:\n    f.write(json.dumps(sys.argv[2:]) + '\\n')\n"
TIMEOUT_S = 30.0


def _alertmanager_bin() -> str:
    for name in ALERTMANAGER_NAMES:
        path = shutil.which(name)
        if path:
            return path
    reason = f"no Alertmanager binary on PATH (looked for {', '.join(ALERTMANAGER_NAMES)})"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: a missing binary is a failure)")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read()) if r.headers.get("Content-Type", "").startswith("application/json") else None


def _wait(predicate: Any, what: str, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


@pytest.fixture
def responder(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """``sdc-telemetry respond`` on a free port with a recorder command: yields (its URL, the recorder's file)."""
    script, out = tmp_path / "record.py", tmp_path / "runs.jsonl"
    script.write_text(RECORDER)
    template = " ".join(shlex.quote(a) for a in (sys.executable, str(script), str(out))) + \
        ' {host_name} "{alertname} rank {rank} {hw_id}"'
    log = open(tmp_path / "respond.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "sdc_telemetry.ops.cli", "respond", "--listen", "127.0.0.1:0",
                             "--command", template], stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "sdc-telemetry respond: listening on http://127.0.0.1:PORT (...)"
        assert "listening on" in line, line + (tmp_path / "respond.log").read_text()
        yield line.split("listening on ", 1)[1].split()[0], out
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        finally:
            log.close()
        assert rc == 0, f"responder exited with {rc}: {(tmp_path / 'respond.log').read_text()}"


@pytest.fixture
def alertmanager(tmp_path: Path, responder: tuple[str, Path]) -> Iterator[str]:
    """A real Alertmanager whose only receiver is the responder's webhook: yields its URL."""
    binary = _alertmanager_bin()
    config = {
        "route": {"receiver": "pager", "group_by": ["service_name", "host_name"], "group_wait": "1s",
                  "group_interval": "1s", "repeat_interval": "1h",
                  "routes": [{"matchers": ['severity="critical"'], "receiver": "pager"},
                             {"matchers": ['severity="warning"'], "receiver": "ticket"}]},
        "receivers": [{"name": "pager", "webhook_configs": [{"url": f"{responder[0]}/alerts",
                                                             "send_resolved": True}]},
                      # Warnings reach the responder too here, to show it ignores them.
                      {"name": "ticket", "webhook_configs": [{"url": f"{responder[0]}/"}]}],
    }
    (tmp_path / "am.yml").write_text(yaml.safe_dump(config))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "am.log", "wb") as log:
        proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'am.yml'}",
                                 f"--storage.path={tmp_path / 'am-data'}", f"--web.listen-address=127.0.0.1:{port}",
                                 "--cluster.listen-address=", "--log.level=warn"], stdout=log, stderr=log,
                                stdin=subprocess.DEVNULL)
        try:
            def ready() -> bool:
                assert proc.poll() is None, (tmp_path / "am.log").read_text()
                try:
                    _get(f"{url}/-/ready")
                    return True
                except (urllib.error.URLError, OSError):
                    return False
            _wait(ready, "Alertmanager to be ready")
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _post_alerts(alertmanager: str, alerts: list[dict[str, Any]]) -> None:
    req = urllib.request.Request(f"{alertmanager}/api/v2/alerts", data=json.dumps(alerts).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


def _runs(out: Path) -> list[list[str]]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def test_alertmanager_page_drains_the_named_host_once(alertmanager: str, responder: tuple[str, Path]) -> None:
    """A critical alert posted to a real Alertmanager reaches the responder, which runs the command for that host
    once; a warning for another host, delivered too, runs nothing."""
    url, out = responder
    labels = {"service_name": "drill", "rank": "2", "hw_id": "GPU-2"}
    _post_alerts(alertmanager, [
        {"labels": {**labels, "alertname": "SDCWeightFingerprintMismatch", "severity": "critical",
                    "host_name": "node-b"}, "annotations": {"summary": "weights differ"}},
        {"labels": {**labels, "alertname": "GPUXidErrors", "severity": "warning", "host_name": "node-c",
                    "xid": "79"}},
    ])
    _wait(lambda: _runs(out), "the responder to run the command")
    assert _runs(out) == [["node-b", "SDCWeightFingerprintMismatch rank 2 GPU-2"]]
    # The warning's notification (a group of its own) reaches the responder too, and must be ignored.
    _wait(lambda: _get(f"{url}/healthz")["notifications"] >= 2, "both notifications to arrive")
    time.sleep(3)  # several group intervals: a second run would have happened by now
    health = _get(f"{url}/healthz")
    assert _runs(out) == [["node-b", "SDCWeightFingerprintMismatch rank 2 GPU-2"]]
    assert (health["actions"], health["refusals"], health["hosts"]) == (1, 0, ["node-b"])
