"""The direct push of a suspect's page to Alertmanager's v2 API: same alert as the rule, never raising, bounded."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from sdc_telemetry.core.config import SDCConfig
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
        self.script: list[int] = []  # statuses of the next requests, then `status`
        self.posts: list[tuple[str, Any]] = []
        self.times: list[float] = []  # monotonic arrival of each post
        self.got = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: _Recorder

    def do_POST(self) -> None:
        self.server.times.append(time.monotonic())
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(self.server.delay_s)
        self.server.posts.append((self.path, body))
        status = self.server.script.pop(0) if self.server.script else self.server.status
        self.send_response(status)
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


def _wait(done: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_failures_call_on_error_log_once_and_give_up_after_max_attempts(recorder: _Recorder,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """An HTTP error never raises: each failed attempt calls on_error (only the first logs a warning), each page is
    tried max_attempts times in order, then given up with an error line."""
    recorder.status = 500
    errors: list[int] = []
    pusher = AlertmanagerPusher(recorder.url, "llm", on_error=lambda: errors.append(1), retry_initial_s=0.01,
                                retry_max_s=0.02, max_attempts=3)
    with caplog.at_level(logging.WARNING, logger="sdc_telemetry"):
        pusher.page(_incident())
        pusher.page(_incident("grad_reduced"))
        _wait(lambda: pusher.given_up == 2)
        pusher.close(timeout_s=5)
    assert len(recorder.posts) == 6 and len(errors) == 6 and pusher.failures == 6 and pusher.delivered == 0
    checks = [body[0]["labels"]["check"] for _, body in recorder.posts]
    assert checks == ["weights"] * 3 + ["grad_reduced"] * 3
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "HTTP 500" in warnings[0].getMessage()
    gave_up = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(gave_up) == 2 and "after 3 attempts" in gave_up[0].getMessage()


def test_a_failed_push_is_retried_with_backoff_until_accepted(recorder: _Recorder) -> None:
    """Alertmanager answers 500 three times, then accepts: the same alert is posted four times (startsAt kept,
    endsAt renewed), each wait about twice the last, three failures counted, the page delivered."""
    recorder.script = [500, 500, 500]
    errors: list[int] = []
    pusher = AlertmanagerPusher(recorder.url, "llm", on_error=lambda: errors.append(1), retry_initial_s=0.1)
    pusher.page(_incident())
    _wait(lambda: pusher.delivered == 1)
    assert len(recorder.posts) == 4 and len(errors) == 3 and pusher.failures == 3 and pusher.pending == 0
    bodies = [body for _, body in recorder.posts]
    assert all(b[0]["labels"] == bodies[0][0]["labels"] for b in bodies)
    assert len({b[0]["startsAt"] for b in bodies}) == 1
    assert bodies[-1][0]["endsAt"] > bodies[0][0]["endsAt"]
    gaps = [b - a for a, b in zip(recorder.times, recorder.times[1:], strict=False)]
    assert gaps[0] == pytest.approx(0.1, abs=0.08)
    assert gaps[1] == pytest.approx(0.2, abs=0.08) and gaps[2] == pytest.approx(0.4, abs=0.1)
    pusher.close()
    assert len(errors) == 3


def test_backoff_is_capped_and_retries_stop_after_retry_for_s(recorder: _Recorder) -> None:
    """The wait doubles up to retry_max_s; a page failing for retry_for_s is given up."""
    recorder.status = 503
    pusher = AlertmanagerPusher(recorder.url, "llm", retry_initial_s=0.05, retry_max_s=0.1, retry_for_s=0.6)
    started = time.monotonic()
    pusher.page(_incident())
    _wait(lambda: pusher.given_up == 1)
    assert 0.6 <= time.monotonic() - started < 1.5
    gaps = [b - a for a, b in zip(recorder.times, recorder.times[1:], strict=False)]
    assert max(gaps) < 0.2 and len(recorder.posts) >= 6
    pusher.close()


def test_page_never_blocks_while_a_page_is_retried(recorder: _Recorder) -> None:
    """While Alertmanager keeps failing, page() still returns at once and the new page goes out after the first."""
    recorder.script = [500, 500]
    pusher = AlertmanagerPusher(recorder.url, "llm", retry_initial_s=0.2)
    pusher.page(_incident())
    _wait(lambda: len(recorder.posts) == 1)
    t0 = time.perf_counter()
    pusher.page(_incident("replay"))
    assert time.perf_counter() - t0 < 0.05
    _wait(lambda: pusher.delivered == 2)
    assert [body[0]["labels"]["check"] for _, body in recorder.posts] == ["weights"] * 3 + ["replay"]
    pusher.close()


def test_refused_connection_and_timeout_are_retried(recorder: _Recorder) -> None:
    """A refused connection and a request that times out are failures like an HTTP error: counted and retried."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    errors: list[int] = []
    refused = AlertmanagerPusher(f"http://127.0.0.1:{port}", "llm", timeout_s=0.5, retry_initial_s=0.01,
                                 max_attempts=3, on_error=lambda: errors.append(1))
    refused.page(_incident())
    _wait(lambda: refused.given_up == 1)
    refused.close()
    assert errors == [1, 1, 1]
    recorder.delay_s = 0.4
    slow = AlertmanagerPusher(recorder.url, "llm", timeout_s=0.1, retry_initial_s=0.01, max_attempts=2)
    slow.page(_incident())
    _wait(lambda: slow.given_up == 1)
    slow.close()
    assert slow.failures == 2


def test_close_flushes_a_failing_push_promptly(recorder: _Recorder) -> None:
    """close() right after page() retries at once (not after the backoff) and returns as soon as the page is
    accepted; with an Alertmanager that never accepts it returns after its timeout and counts the dropped page."""
    recorder.script = [500, 500]
    pusher = AlertmanagerPusher(recorder.url, "llm", retry_initial_s=0.1, retry_max_s=30)
    pusher.page(_incident())
    t0 = time.monotonic()
    pusher.close(timeout_s=3)
    assert time.monotonic() - t0 < 1.0
    assert pusher.delivered == 1 and len(recorder.posts) == 3
    recorder.status = 500
    errors: list[int] = []
    stuck = AlertmanagerPusher(recorder.url, "llm", retry_initial_s=0.1, retry_max_s=30,
                               on_error=lambda: errors.append(1))
    stuck.page(_incident())
    _wait(lambda: stuck.failures == 1)
    t0 = time.monotonic()
    stuck.close(timeout_s=0.5)
    assert 0.4 <= time.monotonic() - t0 < 0.9
    assert stuck.given_up == 1 and stuck.pending == 0
    assert len(errors) == stuck.failures + 1  # every failed attempt, and the page dropped at close


def test_ambiguous_incident_is_pushed_as_the_warning_never_critical(recorder: _Recorder) -> None:
    """An incident whose evidence says ambiguous is pushed with suspect_alert(ambiguous=True): same alert name,
    severity warning, ambiguous="true"."""
    pusher = AlertmanagerPusher(recorder.url, "llm")
    incident = Incident(step=7, check="replay", suspect_ranks=(2,), suspects=(SUSPECT,),
                        evidence={"ambiguous": True, "verdict": "persistent"})
    pusher.page(incident)
    pusher.close(timeout_s=5)
    (alert,) = recorder.posts[0][1]
    expected = alerts.suspect_alert("replay", {"host_name": "node-b", "rank": 2, "local_rank": 2, "hw_id": "GPU-2"},
                                    "llm", ambiguous=True)
    assert alert["labels"] == expected["labels"] and alert["annotations"] == expected["annotations"]
    assert alert["labels"]["severity"] == "warning" and alert["labels"]["ambiguous"] == "true"
    assert alert["labels"]["alertname"] == "SDCReplayMismatch"


def test_unreachable_alertmanager_and_bad_incident_are_counted_not_raised() -> None:
    """A refused connection and an incident of an unknown check each call on_error; page() never raises."""
    errors: list[int] = []
    pusher = AlertmanagerPusher("http://127.0.0.1:9", "llm", timeout_s=0.5, on_error=lambda: errors.append(1),
                                max_attempts=1)
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
    ({"url": "http://", "job_name": "llm"}, "no host"),
    ({"url": "http://am :9093", "job_name": "llm"}, "whitespace"),
    ({"url": "http://am:9093", "job_name": "llm", "retry_initial_s": 0}, "retry_initial_s"),
    ({"url": "http://am:9093", "job_name": "llm", "retry_initial_s": 2, "retry_max_s": 1}, "retry_max_s"),
    ({"url": "http://am:9093", "job_name": "llm", "retry_for_s": float("inf")}, "retry_for_s"),
    ({"url": "http://am:9093", "job_name": "llm", "max_attempts": 0}, "max_attempts"),
    ({"url": "http://am:9093", "job_name": ""}, "job_name"),
    ({"url": "http://am:9093", "job_name": "llm", "timeout_s": 0}, "timeout_s"),
    ({"url": "http://am:9093", "job_name": "llm", "ttl_s": -1}, "ttl_s"),
])
def test_bad_arguments_name_the_problem(kwargs: dict[str, Any], message: str) -> None:
    """A malformed URL, an empty job name, a non-positive timeout/TTL or a bad retry bound is a ValueError naming
    it."""
    with pytest.raises(ValueError, match=message):
        AlertmanagerPusher(**kwargs)


@pytest.mark.parametrize(("url", "problem"), [
    ("http://", "no host"),
    ("https://:9093", "no host"),
    ("ftp://am:9093", "scheme is ftp"),
    ("alertmanager:9093", "scheme is alertmanager"),
    ("http://am:9093 ", "whitespace"),
    (" http://am:9093", "whitespace"),
    ("http://am\n:9093", "whitespace or control"),
    ("http://am:99999", "malformed"),
    ("http://am:port", "malformed"),
    ("http://am:9093/?x=1", "query or fragment"),
    ("", "empty"),
])
def test_config_refuses_an_alertmanager_url_the_pager_cannot_use(url: str, problem: str) -> None:
    """SDCConfig(alertmanager_url=...) refuses a URL without a host, of another scheme, with whitespace or control
    characters, a bad port or a query, naming the field and the problem (the pager would never start)."""
    with pytest.raises(ValueError, match=r"SDCConfig\.alertmanager_url") as err:
        SDCConfig(alertmanager_url=url)
    assert problem in str(err.value)


@pytest.mark.parametrize("url", ["http://am:9093", "https://alertmanager.example.com/prefix/",
                                 "http://127.0.0.1:9093", "http://[::1]:9093"])
def test_config_accepts_alertmanager_base_urls(url: str) -> None:
    """Base URLs with a host, an optional port and an optional path prefix pass, and the pager accepts them too."""
    assert SDCConfig(alertmanager_url=url).alertmanager_url == url
    AlertmanagerPusher(url, "llm").close()


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


def test_page_carries_each_suspects_mesh_coordinate(recorder: _Recorder) -> None:
    """N-D layouts: each suspect's alert says where it sits in the mesh (an annotation: the labels stay the rule's)."""
    other = RankIdentity(rank=5, local_rank=1, host_name="node-c", hw_id="GPU-5")
    incident = Incident(step=7, check="replay", suspect_ranks=(2, 5), suspects=(SUSPECT, other),
                        evidence={"coordinates": {"2": {"pp": 1, "dp_replicate": 0, "tp": 0},
                                                  "5": {"pp": 1, "dp_replicate": 0, "tp": 1}}})
    pusher = AlertmanagerPusher(recorder.url, "llm")
    pusher.page(incident)
    pusher.close()
    body = recorder.posts[0][1]
    assert [a["annotations"]["coordinate"] for a in body] == ["pp=1 dp_replicate=0 tp=0", "pp=1 dp_replicate=0 tp=1"]
    expected = alerts.suspect_alert("replay", {"host_name": "node-b", "rank": 2, "local_rank": 2, "hw_id": "GPU-2"},
                                    "llm")
    assert body[0]["labels"] == expected["labels"]


def test_a_4xx_other_than_429_is_logged_once_and_not_retried(recorder: _Recorder,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Alertmanager refusing a post (400: the same post would be refused again) costs one POST per page and an error
    line, not an outage's retries; a 429 (too many requests) is retried like an outage."""
    recorder.status = 400
    pusher = AlertmanagerPusher(recorder.url, "llm", retry_initial_s=0.01, retry_max_s=0.02)
    with caplog.at_level(logging.ERROR, logger="sdc_telemetry"):
        for step in range(5):
            pusher.page(Incident(step=step, check="weights", suspect_ranks=(2,), suspects=(SUSPECT,)))
        _wait(lambda: pusher.refused == 5)
        time.sleep(0.2)
    pusher.close(timeout_s=2)
    assert len(recorder.posts) == 5 and pusher.given_up == 5 and pusher.delivered == 0
    assert sum("not retried" in r.getMessage() and "HTTP 400" in r.getMessage() for r in caplog.records) == 5
    recorder.posts.clear()
    recorder.script = [429, 429]
    recorder.status = 200
    retried = AlertmanagerPusher(recorder.url, "llm", retry_initial_s=0.01, retry_max_s=0.02)
    retried.page(_incident())
    assert retried.flush(timeout_s=5)
    retried.close()
    assert len(recorder.posts) == 3 and retried.delivered == 1 and retried.refused == 0


def test_an_accepted_page_is_re_sent_until_resolved(recorder: _Recorder) -> None:
    """Every resend_s the incident's alerts are posted again with the same startsAt and a later endsAt; resolve()
    posts them once with endsAt now and stops; close() stops the re-sends of what is still open."""
    pusher = AlertmanagerPusher(recorder.url, "llm", resend_s=0.1, ttl_s=600)
    first, second = _incident(), _incident("grad_local")
    pusher.page(first)
    pusher.page(second)
    _wait(lambda: sum(b[0]["labels"]["check"] == "weights" for _, b in recorder.posts) >= 3)
    weights = [b[0] for _, b in recorder.posts if b[0]["labels"]["check"] == "weights"]
    assert len({a["startsAt"] for a in weights}) == 1
    assert weights[-1]["endsAt"] > weights[0]["endsAt"] and pusher.resent >= 2
    pusher.resolve(first)
    _wait(lambda: any(b[0]["labels"]["check"] == "weights" and _ends_within(b[0], 5.0) for _, b in recorder.posts))
    after_resolve = len([1 for _, b in recorder.posts if b[0]["labels"]["check"] == "weights"])
    time.sleep(0.4)
    assert len([1 for _, b in recorder.posts if b[0]["labels"]["check"] == "weights"]) == after_resolve
    assert len([1 for _, b in recorder.posts if b[0]["labels"]["check"] == "grad_local"]) >= 3  # still open
    pusher.close(timeout_s=2)
    total = len(recorder.posts)
    time.sleep(0.3)
    assert len(recorder.posts) == total


def _ends_within(alert: dict[str, Any], seconds: float) -> bool:
    """The alert's endsAt is at most ``seconds`` from now (a resolving post), not a TTL away."""
    ends = datetime.fromisoformat(alert["endsAt"].replace("Z", "+00:00"))
    return (ends - datetime.now(timezone.utc)).total_seconds() <= seconds


def test_a_real_alertmanager_restarted_empty_gets_the_page_again(tmp_path: Path) -> None:
    """A page accepted by a real Alertmanager that then restarts with an empty store (its data lost) is there
    again within resend_s, firing with the same startsAt; resolve() ends it there."""
    from sdc_telemetry.ops.stack import ALERTMANAGER_NAMES, _which

    binary = _which(ALERTMANAGER_NAMES)
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail("the alertmanager binary is not on PATH (CI=true: a missing binary is a failure)")
        pytest.skip("the alertmanager binary is not on PATH")
    import subprocess
    import urllib.request

    config = tmp_path / "am.yml"
    config.write_text('route: {receiver: "null"}\nreceivers: [{name: "null"}]\n')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"

    def start(data: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.path={tmp_path / data}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
                                 "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait(lambda: _ready(url), timeout=30)
        return proc

    def firing() -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{url}/api/v2/alerts?active=true", timeout=5) as r:
            return [a for a in json.loads(r.read()) if a["labels"].get("alertname") == "SDCWeightFingerprintMismatch"]

    proc = start("data-1")
    pusher = AlertmanagerPusher(url, "restart-drill", resend_s=1.0)
    try:
        pusher.page(_incident())
        assert pusher.flush(timeout_s=10)
        [before] = firing()
        proc.terminate()
        proc.wait(10)
        proc = start("data-2")  # a new, empty store: the page is gone until the pager re-sends it
        assert firing() == []
        _wait(lambda: len(firing()) == 1, timeout=15)
        [after] = firing()
        assert after["startsAt"] == before["startsAt"] and after["labels"]["rank"] == "2"
        pusher.resolve(_incident())
        _wait(lambda: firing() == [], timeout=15)
    finally:
        pusher.close(timeout_s=2)
        proc.terminate()
        proc.wait(10)


def _ready(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False
