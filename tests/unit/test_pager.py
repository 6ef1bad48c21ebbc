"""The direct push of a suspect's page to Alertmanager's v2 API: same alert as the rule, never raising, bounded."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from sdc_telemetry.core.identity import RankIdentity
from sdc_telemetry.core.incident import Incident
from sdc_telemetry.ops import alerts
from sdc_telemetry.ops.stack import LocalStack
from sdc_telemetry.sinks.pager import AlertmanagerPusher

SUSPECT = RankIdentity(rank=2, local_rank=2, host_name="node-b", hw_id="GPU-2")


def _incident(check: str = "weights", suspects: tuple[RankIdentity, ...] = (SUSPECT,)) -> Incident:
    return Incident(step=7, check=check, suspect_ranks=tuple(s.rank for s in suspects), suspects=suspects)


class _Recorder(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, status: int = 200, delay_s: float = 0.0) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.status, self.delay_s = status, delay_s
        self.posts: list[tuple[str, Any]] = []
        self.got = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: _Recorder

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(self.server.delay_s)
        self.server.posts.append((self.path, body))
        self.send_response(self.server.status)
        self.end_headers()
        self.server.got.set()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[_Recorder]:
    server = _Recorder()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_page_posts_one_alert_per_suspect_with_the_rules_labels(recorder: _Recorder) -> None:
    """Each suspect becomes one alert at /api/v2/alerts with suspect_alert()'s labels and annotations and a TTL."""
    other = RankIdentity(rank=5, local_rank=1, host_name="node-c", hw_id="GPU-5")
    pusher = AlertmanagerPusher(recorder.url + "/", "llm", ttl_s=600)
    before = time.time()
    pusher.page(_incident("replay", (SUSPECT, other)))
    pusher.close()
    assert len(recorder.posts) == 1
    path, body = recorder.posts[0]
    assert path == "/api/v2/alerts" and len(body) == 2
    for alert, who in zip(body, (SUSPECT, other), strict=True):
        expected = alerts.suspect_alert("replay", {"host_name": who.host_name, "rank": who.rank,
                                                   "local_rank": who.local_rank, "hw_id": who.hw_id}, "llm")
        assert alert["labels"] == expected["labels"] and alert["annotations"] == expected["annotations"]
        assert alert["startsAt"].endswith("Z") and alert["endsAt"].endswith("Z")
        starts, ends = (datetime.fromisoformat(alert[k].replace("Z", "+00:00")).timestamp()
                        for k in ("startsAt", "endsAt"))
        assert abs(starts - before) < 60 and ends - starts == pytest.approx(600, abs=0.01)


def test_incident_without_suspects_posts_nothing(recorder: _Recorder) -> None:
    """A numerics event (no suspects) is not paged; no thread is even started."""
    pusher = AlertmanagerPusher(recorder.url, "llm")
    pusher.page(Incident(step=3, check="grad_local", suspect_ranks=(), suspects=(),
                         evidence={"verdict": "numerics"}))
    pusher.close()
    assert recorder.posts == [] and pusher._thread is None


def test_page_returns_before_the_post_completes(recorder: _Recorder) -> None:
    """page() does not wait for a slow Alertmanager; close() flushes the pending post."""
    recorder.delay_s = 0.5
    pusher = AlertmanagerPusher(recorder.url, "llm")
    pusher.page(_incident())
    assert recorder.posts == []  # the handler is still sleeping: page() did not wait for it
    pusher.close(timeout_s=5)
    assert len(recorder.posts) == 1


def test_failures_call_on_error_and_log_once(recorder: _Recorder, caplog: pytest.LogCaptureFixture) -> None:
    """An HTTP error never raises: each failed push calls on_error, and only the first logs a warning."""
    recorder.status = 500
    errors: list[int] = []
    pusher = AlertmanagerPusher(recorder.url, "llm", on_error=lambda: errors.append(1))
    with caplog.at_level(logging.WARNING, logger="sdc_telemetry"):
        pusher.page(_incident())
        pusher.page(_incident("grad_reduced"))
        pusher.close(timeout_s=5)
    assert len(recorder.posts) == 2 and len(errors) == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "HTTP 500" in warnings[0].getMessage()


def test_unreachable_alertmanager_and_bad_incident_are_counted_not_raised() -> None:
    """A refused connection and an incident of an unknown check each call on_error; page() never raises."""
    errors: list[int] = []
    pusher = AlertmanagerPusher("http://127.0.0.1:9", "llm", timeout_s=0.5, on_error=lambda: errors.append(1))
    pusher.page(_incident("not-a-check"))
    assert errors == [1]
    pusher.page(_incident())
    pusher.close(timeout_s=5)
    assert errors == [1, 1]


def test_close_is_bounded_idempotent_and_later_pages_are_dropped(recorder: _Recorder) -> None:
    """close() returns after its timeout with a hung post (counted), a second close() is harmless, and a page
    after close() posts nothing."""
    recorder.delay_s = 3.0
    errors: list[int] = []
    pusher = AlertmanagerPusher(recorder.url, "llm", timeout_s=10, on_error=lambda: errors.append(1))
    pusher.page(_incident())
    pusher.close(timeout_s=0.2)
    assert errors == [1]
    pusher.close()
    pusher.page(_incident())
    assert errors == [1]
    recorder.got.wait(5)
    assert len(recorder.posts) == 1


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"url": "alertmanager:9093", "job_name": "llm"}, "url must be an http"),
    ({"url": "file:///etc/passwd", "job_name": "llm"}, "url must be an http"),
    ({"url": "http://am:9093", "job_name": ""}, "job_name"),
    ({"url": "http://am:9093", "job_name": "llm", "timeout_s": 0}, "timeout_s"),
    ({"url": "http://am:9093", "job_name": "llm", "ttl_s": -1}, "ttl_s"),
])
def test_bad_arguments_name_the_problem(kwargs: dict[str, Any], message: str) -> None:
    """A malformed URL, an empty job name or a non-positive timeout/TTL is a ValueError naming it."""
    with pytest.raises(ValueError, match=message):
        AlertmanagerPusher(**kwargs)


@pytest.mark.e2e
def test_real_alertmanager_delivers_a_pushed_alert_to_the_pager_and_responder(tmp_path: Path) -> None:
    """A pushed alert goes through a real Alertmanager's routing to the pager and responder webhooks, as the rule's
    alert would."""
    if not LocalStack.available():
        reason = "prometheus and alertmanager binaries are not on PATH"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} (CI=true: a missing binary is a failure)")
        pytest.skip(reason)
    with LocalStack(workdir=tmp_path, responder=True) as stack:
        pusher = AlertmanagerPusher(stack.alertmanager_url, "e2e-push")
        pusher.page(_incident())
        pusher.close(timeout_s=10)
        page = stack.wait_for_alert("SDCWeightFingerprintMismatch", timeout=30, labels={"rank": "2"})
        assert page is not None, stack.notifications
        deadline = time.monotonic() + 10
        while len({a["receiver"] for a in stack.alerts("SDCWeightFingerprintMismatch")}) < 2 \
                and time.monotonic() < deadline:
            time.sleep(0.2)
    received = stack.alerts("SDCWeightFingerprintMismatch")
    assert {a["receiver"] for a in received} == {"pager", "responder"}
    expected = alerts.suspect_alert("weights", {"host_name": "node-b", "rank": 2, "local_rank": 2,
                                                "hw_id": "GPU-2"}, "e2e-push")
    for a in received:
        assert a["status"] == "firing" and a["labels"] == expected["labels"]
        assert a["annotations"] == expected["annotations"]
