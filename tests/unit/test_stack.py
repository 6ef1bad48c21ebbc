"""LocalStack without real binaries: failures are loud and leave nothing running; the responder route's bearer
credentials file."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import yaml

from sdc_telemetry.ops.stack import LocalStack, StackError, prometheus_config


def test_failed_start_raises_and_leaves_nothing_running(tmp_path: Path) -> None:
    """A binary that exits at once makes start() raise StackError naming it; the webhook thread is stopped."""
    false = shutil.which("false")
    if false is None:
        pytest.skip("no `false` binary")
    before = {t.name for t in threading.enumerate()}
    stack = LocalStack(workdir=tmp_path, prometheus_bin=false, alertmanager_bin=false)
    with pytest.raises(StackError, match="alertmanager exited"):
        stack.start()
    assert not stack.running
    assert {t.name for t in threading.enumerate()} <= before
    stack.stop()  # a second stop is harmless


def test_missing_binaries_are_reported_before_anything_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without binaries, available() is False and start() says what to install."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert LocalStack.available() is False
    with pytest.raises(StackError, match="prometheus and alertmanager binaries"):
        LocalStack(workdir=tmp_path).start()


def test_prometheus_config_names_the_scrape_job_sdc() -> None:
    """The generated config scrapes the targets as job sdc, loads the rules and alerts the Alertmanager."""
    doc = prometheus_config(["127.0.0.1:9860"], ["/r.yml"], ["127.0.0.1:9093"], scrape_interval="1s")
    assert doc["scrape_configs"] == [{"job_name": "sdc", "static_configs": [{"targets": ["127.0.0.1:9860"]}]}]
    assert doc["rule_files"] == ["/r.yml"]
    assert doc["global"]["scrape_timeout"] == "1s"


def test_responder_credentials_file_is_sent_as_the_bearer_token(tmp_path: Path) -> None:
    """With responder_url and responder_credentials_file, the Alertmanager config LocalStack writes routes SDC
    criticals to that URL with http_config.authorization.credentials_file naming the file (absolute)."""
    false = shutil.which("false")
    if false is None:
        pytest.skip("no `false` binary")
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    stack = LocalStack(workdir=tmp_path, prometheus_bin=false, alertmanager_bin=false,
                       responder_url="http://127.0.0.1:9/alerts", responder_credentials_file=token)
    with pytest.raises(StackError):
        stack.start()  # the binaries exit at once; the config is written before they start
    doc = yaml.safe_load((tmp_path / "localstack" / "alertmanager.yml").read_text())
    responder = next(r for r in doc["receivers"] if r["name"] == "responder")["webhook_configs"][0]
    assert responder["url"] == "http://127.0.0.1:9/alerts"
    assert responder["http_config"] == {"authorization": {"type": "Bearer", "credentials_file": str(token.resolve())}}


def test_responder_credentials_file_must_exist_and_needs_a_responder_route(tmp_path: Path) -> None:
    """A credentials file that does not exist, or one without a responder route, is refused at construction,
    naming the problem."""
    with pytest.raises(StackError, match="no such file"):
        LocalStack(workdir=tmp_path, responder_url="http://127.0.0.1:9/alerts",
                   responder_credentials_file=tmp_path / "missing")
    (tmp_path / "token").write_text("s3cret")
    with pytest.raises(StackError, match="needs a responder route"):
        LocalStack(workdir=tmp_path, responder_credentials_file=tmp_path / "token")
