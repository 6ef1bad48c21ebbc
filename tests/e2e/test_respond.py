"""End to end: ``sdc-telemetry respond`` as a real process over HTTP(S), and a real Alertmanager delivering to it.

The responder runs as the CLI would in production (a subprocess, stopped with SIGTERM); its commands are recorder
scripts that write their arguments to files. Alertmanager gets a config written here, its webhook pointing at the
responder with the bearer token in ``http_config.authorization.credentials_file``, and alerts posted to its v2 API as
Prometheus would post them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from sdc_telemetry.ops.stack import ALERTMANAGER_NAMES
from tests._responder import TOKEN, alert, metric, notification, post, recorder_template, request, runs, self_signed

pytestmark = pytest.mark.e2e

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


@contextmanager
def responder_process(tmp_path: Path, *extra: str, template: str | None = None,
                      token: bool = True) -> Iterator[tuple[str, Path]]:
    """``sdc-telemetry respond`` on a free port with a recorder command, its ledger and state in ``tmp_path``:
    yields (its URL, the recorder's file); asserts a clean exit on SIGTERM."""
    if template is None:
        template, out = recorder_template(tmp_path, "runs", ' {host_name} "{alertname} rank {rank} {hw_id}"')
    else:
        out = tmp_path / "runs.jsonl"
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "token").chmod(0o600)
    auth = ["--bearer-token-file", str(tmp_path / "token")] if token else ["--insecure-no-auth"]
    log_path = tmp_path / "respond.log"
    log = open(log_path, "a")
    proc = subprocess.Popen([sys.executable, "-m", "sdc_telemetry.ops.cli", "respond", "--listen", "127.0.0.1:0",
                             "--command", template, *auth, "--ledger", f"sqlite:///{tmp_path / 'ledger.sqlite3'}",
                             *extra], stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "SDC_STATE_DIR": str(tmp_path / "state")})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "sdc-telemetry respond: listening on http://127.0.0.1:PORT (...)"
        assert "listening on" in line, line + log_path.read_text()
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
        assert rc == 0, f"responder exited with {rc}: {log_path.read_text()}"


@pytest.fixture
def responder(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    with responder_process(tmp_path) as r:
        yield r


@pytest.fixture
def alertmanager(tmp_path: Path, responder: tuple[str, Path]) -> Iterator[str]:
    """A real Alertmanager routing SDC criticals to the responder with the bearer token: yields its URL."""
    binary = _alertmanager_bin()
    config = {
        "route": {"receiver": "ticket", "group_by": ["service_name", "host_name"], "group_wait": "1s",
                  "group_interval": "1s", "repeat_interval": "1h",
                  "routes": [{"matchers": ['severity="critical"'], "receiver": "responder"}]},
        "receivers": [{"name": "responder", "webhook_configs": [{
                           "url": f"{responder[0]}/alerts", "send_resolved": False,
                           "http_config": {"authorization": {"credentials_file": str(tmp_path / "token")}}}]},
                      # Warnings reach the responder too here, without the token: they must get 401.
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


def test_alertmanager_page_with_credentials_file_drains_the_named_host_once(
        alertmanager: str, responder: tuple[str, Path]) -> None:
    """A critical alert posted to a real Alertmanager reaches the responder with the bearer token from its
    credentials file and runs the command for that host once; a warning sent without the token gets 401."""
    url, out = responder
    labels = {"service_name": "drill", "rank": "2", "hw_id": "GPU-2"}
    _post_alerts(alertmanager, [
        {"labels": {**labels, "alertname": "SDCWeightFingerprintMismatch", "severity": "critical",
                    "host_name": "node-b"}, "annotations": {"summary": "weights differ"}},
        {"labels": {**labels, "alertname": "GPUXidErrors", "severity": "warning", "host_name": "node-c",
                    "xid": "79"}},
    ])
    _wait(lambda: runs(out), "the responder to run the command")
    assert runs(out) == [["node-b", "SDCWeightFingerprintMismatch rank 2 GPU-2"]]
    _wait(lambda: _get(f"{url}/healthz")["unauthorized"] >= 1, "the unauthenticated notification to get 401")
    time.sleep(2)  # several group intervals: a second run would have happened by now
    health = _get(f"{url}/healthz")
    assert runs(out) == [["node-b", "SDCWeightFingerprintMismatch rank 2 GPU-2"]]
    assert (health["actions"], health["refusals"], health["hosts"]) == (1, 0, ["node-b"])


def test_process_refuses_unauthenticated_non_json_and_malformed(responder: tuple[str, Path]) -> None:
    """Against the real process: no token 401, text/plain 415, malformed JSON 400, each running nothing; then a
    valid page still works."""
    url, out = responder
    page = notification(alert("node-b"))
    assert post(url, page, token=None)[0] == 401
    assert post(url, page, token="wrong")[0] == 401
    assert post(url, page, content_type="text/plain")[0] == 415
    assert post(url, b'{"alerts": [', token=TOKEN)[0] == 400
    assert runs(out) == []
    assert post(url, page)[1]["acted"] == ["node-b"]
    assert len(runs(out)) == 1


def test_process_refused_labels_use_no_cap_slot_and_foreign_alerts_are_ignored(tmp_path: Path) -> None:
    """With a cap of 1: host lists, ranges, keywords and option-like hw_ids are refused, ambiguous and foreign
    criticals ignored, and the one slot still drains the real host; /metrics counts each."""
    with responder_process(tmp_path, "--max-actions-per-hour", "1") as (url, out):
        bad = [alert("gpu[001-512]"), alert("n1,n2,n3"), alert("ALL"), alert("node-x", hw_id="--all"),
               alert("node-y", rank="1;2")]
        outcome = post(url, notification(*bad))[1]
        assert len(outcome["rejected"]) == 5 and outcome["acted"] == []
        outcome = post(url, notification(alert("node-a", ambiguous="true"), alert("node-f", name="NodeDown")))[1]
        assert outcome["ignored"] == ["SDCWeightFingerprintMismatch", "NodeDown"] and outcome["acted"] == []
        assert post(url, notification(alert("node-ok")))[1]["acted"] == ["node-ok"]
        text = request(url, "GET", "/metrics")[1]
    assert runs(out) == [["node-ok", "SDCWeightFingerprintMismatch rank 2 GPU-2"]]
    assert metric(text, "sdc_responder_refusals_total", reason="invalid_label") == 5
    assert metric(text, "sdc_responder_ignored_alerts_total", reason="ambiguous") == 1
    assert metric(text, "sdc_responder_ignored_alerts_total", reason="foreign") == 1
    assert metric(text, "sdc_responder_refusals_total", reason="cap") == 0


def test_reacquire_restart_second_strike_and_fleet(tmp_path: Path) -> None:
    """--reacquire-after 2s: a host is not acted on again within 2 s, even across a restart (state on disk, in the
    file named after the ledger); after it, the GPU's next alert (it fails again: a new startsAt) is its second strike
    in the window and runs --replace-command; `fleet` then lists the GPU with 2 strikes."""
    replace, replaced = recorder_template(tmp_path, "replaced", " replace {host_name} {hw_id}")
    screen, screened = recorder_template(tmp_path, "screened", " screen {host_name}")
    args = ("--reacquire-after", "2s", "--replace-command", replace, "--screen-command", screen)
    page = notification(alert("node-b", hw_id="GPU-9", check="weights", step="40"))
    with responder_process(tmp_path, *args) as (url, out):
        assert post(url, page)[1]["acted"] == ["node-b"]
        started = time.monotonic()
    state = tmp_path / "ledger.sqlite3.respond-state.json"  # default: named after the SQLite ledger, beside it
    assert json.loads(state.read_text())["hosts"]["node-b"]["hw_id"] == "GPU-9"
    with responder_process(tmp_path, *args) as (url, out):
        if time.monotonic() - started < 1.5:
            assert post(url, page)[1]["already"] == ["node-b"]  # restart kept the state
        time.sleep(max(0.0, 2.2 - (time.monotonic() - started)))
        again = notification(alert("node-b", hw_id="GPU-9", check="weights", step="40",
                                   starts_at="2024-01-01T00:10:00Z"))
        outcome = post(url, again)[1]
        assert outcome["acted"] == ["node-b"] and outcome["replaced"] == ["node-b"]
        text = request(url, "GET", "/metrics")[1]
        _wait(lambda: len(runs(screened)) == 2, "the screens after both actions")
    assert runs(out) == [["node-b", "SDCWeightFingerprintMismatch rank 2 GPU-9"]]
    assert runs(replaced) == [["replace", "node-b", "GPU-9"]]
    assert metric(text, "sdc_fleet_gpu_strikes", hw_id="GPU-9", host_name="node-b") == 2
    assert metric(text, "sdc_responder_actions_total", action="replace") == 1
    fleet = subprocess.run([sys.executable, "-m", "sdc_telemetry.ops.cli", "fleet", "--ledger",
                            f"sqlite:///{tmp_path / 'ledger.sqlite3'}"], capture_output=True, text=True, check=True)
    row = fleet.stdout.splitlines()[1].split()
    assert row[:4] == ["GPU-9", "node-b", "2", "2"] and "REPLACE" in row


def test_process_refuses_to_start_without_auth(tmp_path: Path) -> None:
    """Without --bearer-token-file or --insecure-no-auth the process exits 2 at start with a clear message."""
    proc = subprocess.run([sys.executable, "-m", "sdc_telemetry.ops.cli", "respond", "--listen", "127.0.0.1:0",
                           "--command", "echo {host_name}"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SDC_STATE_DIR": str(tmp_path)})
    assert proc.returncode == 2
    assert "refusing to start without authentication" in proc.stderr and "--insecure-no-auth" in proc.stderr


def test_process_serves_https(tmp_path: Path) -> None:
    """With --tls-cert/--tls-key the process serves HTTPS; a client verifying the certificate drains the host."""
    cert, key = self_signed(tmp_path)
    with responder_process(tmp_path, "--tls-cert", str(cert), "--tls-key", str(key)) as (url, out):
        assert url.startswith("https://")
        assert post(url, notification(alert("node-b")), cafile=cert)[1]["acted"] == ["node-b"]
        assert post(url, notification(alert("node-c")), cafile=cert, token=None)[0] == 401
    assert [r[0] for r in runs(out)] == ["node-b"]
