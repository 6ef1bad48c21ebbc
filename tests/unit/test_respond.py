"""The responder: an in-process Alertmanager webhook receiver over real HTTP, running a recorder command."""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sdc_telemetry.ops.cli import main
from sdc_telemetry.ops.ledger import Ledger
from sdc_telemetry.ops.respond import (
    LISTEN_BACKLOG,
    Responder,
    TemplateError,
    parse_duration,
    parse_listen,
    parse_template,
    render,
    validate_labels,
)
from tests._responder import TOKEN, alert, metric, notification, recorder_template, request, runs, self_signed
from tests._responder import post as _post


class Clock:
    """A wall clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def recorder(tmp_path: Path) -> tuple[str, Path]:
    """A template that records (host, rank, hw_id, alertname) per run, and the file it writes."""
    return recorder_template(tmp_path, "runs")


@pytest.fixture
def responder(recorder: tuple[str, Path]) -> Iterator[Responder]:
    with Responder(recorder[0], port=0, max_actions_per_hour=3, bearer_token=TOKEN) as r:
        yield r


def post(r: Responder, doc: Any, **kw: Any) -> tuple[int, Any]:
    return _post(r.url, doc, **kw)


def health(r: Responder) -> dict[str, Any]:
    code, doc = request(r.url, "GET", "/healthz")
    assert code == 200
    return dict(doc)


def test_critical_page_runs_the_command_once_with_the_labels(responder: Responder,
                                                              recorder: tuple[str, Path]) -> None:
    """A firing critical SDC alert runs the template once, its placeholders replaced by the alert's labels."""
    code, outcome = post(responder, notification(alert("node-b")))
    assert code == 200 and outcome["acted"] == ["node-b"]
    assert runs(recorder[1]) == [["node-b", "rank=2", "GPU-2", "SDCWeightFingerprintMismatch"]]
    h = health(responder)
    assert (h["actions"], h["refusals"], h["hosts_acted_on"], h["hosts"]) == (1, 0, 1, ["node-b"])


def test_root_path_is_accepted_like_alerts(responder: Responder, recorder: tuple[str, Path]) -> None:
    """POST / is the same endpoint as POST /alerts."""
    assert post(responder, notification(alert("node-c")), path="/")[0] == 200
    assert [r[0] for r in runs(recorder[1])] == ["node-c"]


@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {TOKEN}", f"Bearer {TOKEN}x", "Bearer ",
                                    f"Bearer {TOKEN[:-1]}"])
def test_missing_or_wrong_token_gets_401_and_runs_nothing(header: str | None, responder: Responder,
                                                          recorder: tuple[str, Path]) -> None:
    """A POST without the right bearer token gets 401 and runs nothing; the right one then still works."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": header} if header is not None else {})
    code, doc = request(responder.url, "POST", "/alerts", json.dumps(notification(alert("node-b"))).encode(), headers)
    assert code == 401 and "Bearer" in doc["error"]
    assert runs(recorder[1]) == []
    assert health(responder)["unauthorized"] == 1
    assert post(responder, notification(alert("node-b")))[1]["acted"] == ["node-b"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          "", "application/jsonx"])
def test_body_that_is_not_json_media_type_gets_415(content_type: str, responder: Responder,
                                                   recorder: tuple[str, Path]) -> None:
    """A body sent as anything but application/json (what a browser form can send) gets 415 and runs nothing."""
    code, doc = post(responder, notification(alert("node-b")), content_type=content_type)
    assert code == 415 and "application/json" in doc["error"]
    assert runs(recorder[1]) == []
    code, _ = post(responder, notification(alert("node-b")), content_type="application/json; charset=utf-8")
    assert code == 200 and len(runs(recorder[1])) == 1


def test_start_without_a_token_needs_insecure_no_auth(recorder: tuple[str, Path]) -> None:
    """Constructing a responder with neither a token nor insecure_no_auth=True is an error naming both options."""
    with pytest.raises(ValueError, match="--insecure-no-auth"):
        Responder(recorder[0])
    with Responder(recorder[0], insecure_no_auth=True) as r:
        assert post(r, notification(alert("node-b")), token=None)[0] == 200


def test_repeat_resolved_and_warning_do_nothing(responder: Responder, recorder: tuple[str, Path]) -> None:
    """A host already acted on, a resolved alert and a warning run nothing more."""
    post(responder, notification(alert("node-b")))
    code, outcome = post(responder, notification(alert("node-b", name="SDCReplayMismatch"),
                                                 alert("node-c", status="resolved"),
                                                 alert("node-d", severity="warning", name="GPUXidErrors")))
    assert code == 200 and outcome["already"] == ["node-b"] and outcome["acted"] == []
    assert len(runs(recorder[1])) == 1


def test_ambiguous_and_foreign_critical_alerts_are_ignored(responder: Responder, recorder: tuple[str, Path]) -> None:
    """An ambiguous SDC verdict and critical alerts of other projects run nothing and use no cap slot."""
    code, outcome = post(responder, notification(
        alert("node-a", ambiguous="true"),
        alert("node-b", name="NodeDown"), alert("node-c", name="GPUXidErrors"),
        alert("node-d", name="KubeNodeNotReady", severity="critical")))
    assert code == 200 and outcome["acted"] == [] and len(outcome["ignored"]) == 4
    assert runs(recorder[1]) == []
    assert health(responder)["actions_last_hour"] == 0
    text = request(responder.url, "GET", "/metrics")[1]
    assert metric(text, "sdc_responder_ignored_alerts_total", reason="ambiguous") == 1
    assert metric(text, "sdc_responder_ignored_alerts_total", reason="foreign") == 3


def test_every_sdc_critical_alert_is_acted_on(responder: Responder, recorder: tuple[str, Path]) -> None:
    """Each of the project's critical SDC alertnames is acted on."""
    from sdc_telemetry.sinks.alert_table import SUSPECT_ALERTS

    names = sorted(SUSPECT_ALERTS.values())
    with Responder(recorder[0], max_actions_per_hour=len(names), bearer_token=TOKEN) as r:
        outcome = post(r, notification(*(alert(f"n{i}", name=n) for i, n in enumerate(names))))[1]
    assert outcome["acted"] == [f"n{i}" for i in range(len(names))]
    assert sorted(x[3] for x in runs(recorder[1])) == names


def test_two_alerts_for_one_host_act_once(responder: Responder, recorder: tuple[str, Path]) -> None:
    """Two critical alerts naming one host in one notification run the command once, with the first alert."""
    post(responder, notification(alert("node-b", rank="2"), alert("node-b", rank="3", name="SDCReplayMismatch")))
    assert runs(recorder[1]) == [["node-b", "rank=2", "GPU-2", "SDCWeightFingerprintMismatch"]]


BAD_LABELS = [
    {"host_name": "gpu[001-512]"}, {"host_name": "n1,n2,n3"}, {"host_name": "ALL"}, {"host_name": "all"},
    {"host_name": "node*"}, {"host_name": "node?"}, {"host_name": "two words"}, {"host_name": "-x"},
    {"host_name": "--kubeconfig=/tmp/evil"}, {"host_name": "a;rm -rf /"}, {"host_name": "$(touch PWNED)"},
    {"host_name": "`touch PWNED`"}, {"host_name": "{rank}{hw_id}"}, {"host_name": "a\nb"}, {"host_name": "a\x00b"},
    {"host_name": "n\u00e9ud"}, {"host_name": "\ud800"}, {"host_name": "node\u200b"}, {"host_name": "x" * 300},
    {"hw_id": "--all"}, {"hw_id": "GPU 1"}, {"hw_id": "GPU-1;reboot"}, {"hw_id": "GPU-\udcff"}, {"hw_id": ""},
    {"rank": "2a"}, {"rank": "-1"}, {"rank": ""}, {"rank": "\u0663"},
]


@pytest.mark.parametrize("bad", BAD_LABELS, ids=[ascii(b) for b in BAD_LABELS])
def test_bad_labels_refuse_the_alert_and_use_no_cap_slot(bad: dict[str, str], recorder: tuple[str, Path],
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host list, range, glob, keyword, option, shell syntax, odd unicode or a bad rank/hw_id refuses the alert:
    HTTP 200, nothing runs, a counter and a log line, and no cap slot is used."""
    monkeypatch.chdir(tmp_path)  # where a shell would create PWNED
    with Responder(recorder[0], max_actions_per_hour=1, bearer_token=TOKEN) as r:
        labels = alert("node-b")["labels"] | bad
        for _ in range(3):
            code, outcome = post(r, notification({"status": "firing", "labels": labels}))
            assert code == 200 and len(outcome["rejected"]) == 1 and outcome["acted"] == []
        assert runs(recorder[1]) == []
        h = health(r)
        assert (h["rejected_hosts"], h["actions_last_hour"], h["refusals"]) == (3, 0, 0)
        assert metric(request(r.url, "GET", "/metrics")[1], "sdc_responder_refusals_total",
                      reason="invalid_label") == 3
        assert post(r, notification(alert("node-ok")))[1]["acted"] == ["node-ok"]  # the one slot is still there
    assert not (tmp_path / "PWNED").exists()


def test_missing_rank_or_hw_id_refuses_the_alert(responder: Responder, recorder: tuple[str, Path]) -> None:
    """An SDC alert without rank or hw_id is refused: a strike needs the GPU."""
    labels = alert("node-b")["labels"]
    for key in ("rank", "hw_id"):
        doc = notification({"status": "firing", "labels": {k: v for k, v in labels.items() if k != key}})
        assert post(responder, doc)[1]["rejected"] == ["node-b"]
    assert runs(recorder[1]) == []


def test_lone_surrogate_body_does_not_give_500(responder: Responder, recorder: tuple[str, Path]) -> None:
    """A raw JSON body holding lone surrogates in labels and keys gets 200 (refused) and the host works after."""
    body = (b'{"alerts": [{"status": "firing", "labels": {"alertname": "SDCReplayMismatch", "severity": "critical", '
            b'"host_name": "node-b\\ud800", "rank": "1", "hw_id": "GPU-\\udfff", "\\ud83d": "\\ud83d"}}]}')
    code, outcome = post(responder, body)
    assert code == 200 and len(outcome["rejected"]) == 1
    assert post(responder, notification(alert("node-b")))[1]["acted"] == ["node-b"]
    assert request(responder.url, "GET", "/healthz")[0] == 200
    with socket.create_connection(("127.0.0.1", responder.port), timeout=10) as s:  # a non-ASCII path, raw
        s.sendall(b"GET /\xed\xa0\x80 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert s.recv(100)[:12] in (b"HTTP/1.1 400", b"HTTP/1.1 404")  # a client error, never a 500


def test_invalid_utf8_body_gets_400(responder: Responder) -> None:
    """A body that is not UTF-8 JSON gets 400 and the server goes on."""
    assert post(responder, b'{"alerts": [\xff\xfe]}')[0] == 400
    assert post(responder, notification(alert("node-b")))[0] == 200


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"status": "firing"}', b'{"alerts": {}}',
                                  b'{"alerts": [1]}', b'{"alerts": [{"status": "firing", "labels": {"a": 1}}]}',
                                  b'{"alerts": [{"status": "maybe", "labels": {}}]}',
                                  b'{"status": 3, "alerts": []}', b"[" * 100_000])
def test_malformed_body_gets_400_and_the_server_goes_on(body: bytes, responder: Responder,
                                                        recorder: tuple[str, Path]) -> None:
    """Not JSON, the wrong shape or the wrong types: 400 with a reason, nothing runs, the next page still works."""
    code, doc = post(responder, body)
    assert code == 400 and doc["error"]
    assert runs(recorder[1]) == []
    assert post(responder, notification(alert("node-b")))[0] == 200
    assert len(runs(recorder[1])) == 1
    assert health(responder)["rejected_bodies"] == 1


def test_half_malformed_body_runs_nothing(responder: Responder, recorder: tuple[str, Path]) -> None:
    """A valid critical alert next to a malformed one gets 400 and runs nothing."""
    assert post(responder, notification(alert("node-b"), {"status": "firing"}))[0] == 400
    assert runs(recorder[1]) == []


def test_oversized_body_gets_413(responder: Responder) -> None:
    """A body over 1 MiB is refused with 413 before it is read."""
    conn = http.client.HTTPConnection("127.0.0.1", responder.port, timeout=30)
    conn.putrequest("POST", "/alerts")
    conn.putheader("Content-Length", str((1 << 20) + 1))
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Authorization", f"Bearer {TOKEN}")
    conn.endheaders()  # no body sent: the answer must not wait for it
    assert conn.getresponse().status == 413
    conn.close()
    assert request(responder.url, "GET", "/healthz")[0] == 200


def test_unknown_path_gets_404(responder: Responder) -> None:
    """Paths other than /, /alerts, /healthz and /metrics are 404 for GET and POST."""
    assert request(responder.url, "GET", "/other")[0] == 404
    assert post(responder, notification(alert("node-b")), path="/other")[0] == 404


def test_hourly_cap_refuses_and_counts_then_reopens(recorder: tuple[str, Path]) -> None:
    """Past N actions in an hour further hosts are refused and counted; an hour later they are acted on."""
    clock = Clock()
    with Responder(recorder[0], max_actions_per_hour=2, clock=clock, bearer_token=TOKEN) as r:
        code, outcome = post(r, notification(*(alert(f"node-{i}", rank=str(i)) for i in range(4))))
        assert code == 200 and outcome["acted"] == ["node-0", "node-1"]
        assert outcome["refused"] == ["node-2", "node-3"]
        h = health(r)
        assert (h["actions"], h["refusals"]) == (2, 2)
        assert [x["host_name"] for x in h["recent_refusals"]] == ["node-2", "node-3"]
        clock.now += 3599
        assert post(r, notification(alert("node-2")))[1]["refused"] == ["node-2"]
        clock.now += 1
        assert post(r, notification(alert("node-2")))[1]["acted"] == ["node-2"]
        assert metric(request(r.url, "GET", "/metrics")[1], "sdc_responder_refusals_total", reason="cap") == 3
    assert [x[0] for x in runs(recorder[1])] == ["node-0", "node-1", "node-2"]


def test_host_is_acted_on_again_after_reacquire_time(recorder: tuple[str, Path]) -> None:
    """Within reacquire_after_s a host is 'already' acted on; after it the host is acted on again."""
    clock = Clock()
    with Responder(recorder[0], clock=clock, reacquire_after_s=600, bearer_token=TOKEN) as r:
        assert post(r, notification(alert("node-b")))[1]["acted"] == ["node-b"]
        clock.now += 599
        assert post(r, notification(alert("node-b")))[1]["already"] == ["node-b"]
        clock.now += 1
        assert post(r, notification(alert("node-b")))[1]["acted"] == ["node-b"]
    assert len(runs(recorder[1])) == 2


def test_second_strike_in_the_window_runs_the_replace_command(recorder: tuple[str, Path], tmp_path: Path) -> None:
    """Each action is a strike for the alert's GPU; a second one within the window runs --replace-command, and
    the strike holds the host, job, step, check and alert; outside the window it is a first strike again."""
    replace, replaced = recorder_template(tmp_path, "replaced", " replace {host_name} {hw_id}")
    clock = Clock()
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    with Responder(recorder[0], clock=clock, reacquire_after_s=60, ledger=ledger, replace_command=replace,
                   strike_window_s=86400, max_actions_per_hour=10, bearer_token=TOKEN) as r:
        a = alert("node-b", rank="3", hw_id="GPU-aa", check="weights", step="1200")
        assert post(r, notification(a))[1]["acted"] == ["node-b"]
        clock.now += 61
        again = alert("node-b", rank="3", hw_id="GPU-aa", check="weights", step="1200",
                      starts_at="2024-01-01T00:05:00Z")  # the GPU fails again: a new alert
        outcome = post(r, notification(again))[1]
        assert outcome["acted"] == ["node-b"] and outcome["replaced"] == ["node-b"]
        clock.now += 86400  # the first strike leaves the window; the second is still in it
        assert post(r, notification(alert("node-c", hw_id="GPU-bb")))[1]["replaced"] == []
        clock.now += 86400 + 61
        later = alert("node-b", rank="3", hw_id="GPU-aa", check="weights", step="1200",
                      starts_at="2024-01-02T00:06:00Z")
        assert post(r, notification(later))[1]["replaced"] == []  # both earlier strikes outside the window
        text = request(r.url, "GET", "/metrics")[1]
        assert metric(text, "sdc_responder_actions_total", action="replace") == 1
        assert metric(text, "sdc_responder_actions_total", action="command") == 3
        assert metric(text, "sdc_fleet_gpu_strikes", hw_id="GPU-aa", host_name="node-b") == 1
        # GPU-bb's one strike, a day and a minute old, has left the window too: the gauge counts the window.
        assert metric(text, "sdc_fleet_gpu_strikes", hw_id="GPU-bb", host_name="node-c") is None
    assert runs(recorder[1]) == [["node-b", "rank=3", "GPU-aa", "SDCWeightFingerprintMismatch"],
                                 ["node-c", "rank=2", "GPU-bb", "SDCWeightFingerprintMismatch"],
                                 ["node-b", "rank=3", "GPU-aa", "SDCWeightFingerprintMismatch"]]
    assert runs(replaced) == [["replace", "node-b", "GPU-aa"]]
    strikes = ledger.strikes("GPU-aa")
    assert [(s.host_name, s.job, s.step, s.check, s.alertname) for s in strikes] == \
        [("node-b", "job", 1200, "weights", "SDCWeightFingerprintMismatch")] * 3
    assert [s.at for s in strikes] == [1_000_000.0, 1_000_061.0, 1_000_000.0 + 61 + 86400 * 2 + 61]
    ledger.close()


def test_failed_command_records_no_strike_and_is_retried(tmp_path: Path) -> None:
    """A command exiting non-zero is counted as a failure, records no strike and leaves the host to be retried."""
    flag = tmp_path / "ok"
    code = f"import sys, os; sys.exit(0 if os.path.exists({str(flag)!r}) else 3)"
    template = f"{sys.executable} -c {json.dumps(code)} {{host_name}}"
    with Responder(template, bearer_token=TOKEN) as r:
        assert post(r, notification(alert("node-b")))[1]["failed"] == ["node-b"]
        assert r.ledger.count_strikes("GPU-2") == 0
        flag.touch()
        assert post(r, notification(alert("node-b")))[1]["acted"] == ["node-b"]
        assert r.ledger.count_strikes("GPU-2") == 1
        h = health(r)
        assert metric(request(r.url, "GET", "/metrics")[1], "sdc_responder_failures_total", action="command") == 1
    assert (h["failures"], h["actions"], h["hosts"]) == (1, 2, ["node-b"])


def test_dry_run_runs_nothing_and_records_no_strike(recorder: tuple[str, Path],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """--dry-run logs the argv it would run, runs nothing, records no strike, and still remembers the host."""
    with Responder(recorder[0], dry_run=True, bearer_token=TOKEN) as r:
        with caplog.at_level("WARNING", logger="sdc_telemetry"):
            assert post(r, notification(alert("node-b")))[1]["acted"] == ["node-b"]
        assert post(r, notification(alert("node-b")))[1]["already"] == ["node-b"]
        assert r.ledger.count_strikes("GPU-2") == 0
    assert runs(recorder[1]) == []
    assert "DRY RUN" in caplog.text and "'node-b'" in caplog.text


def test_screen_command_runs_after_a_successful_action(recorder: tuple[str, Path], tmp_path: Path) -> None:
    """--screen-command runs after the drain, in the background; its exit code is counted as pass/fail."""
    screen, screened = recorder_template(tmp_path, "screened", " screen {host_name}")
    with Responder(recorder[0], screen_command=screen, bearer_token=TOKEN) as r:
        post(r, notification(alert("node-b")))
        assert r.wait_screens(30)
        assert metric(request(r.url, "GET", "/metrics")[1], "sdc_responder_screens_total", result="pass") == 1
    assert runs(screened) == [["screen", "node-b"]]


def test_state_file_remembers_hosts_across_restarts(recorder: tuple[str, Path], tmp_path: Path) -> None:
    """With a state file, a restarted responder does not act on a host again within the reacquire time; the file is
    replaced atomically (no temp file left) and private."""
    state = tmp_path / "state.json"
    with Responder(recorder[0], state_file=state, bearer_token=TOKEN) as r:
        post(r, notification(alert("node-b")))
    assert json.loads(state.read_text())["hosts"]["node-b"]["hw_id"] == "GPU-2"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".state")] == []
    assert state.stat().st_mode & 0o077 == 0
    with Responder(recorder[0], state_file=state, bearer_token=TOKEN) as r:
        assert post(r, notification(alert("node-b")))[1]["already"] == ["node-b"]
    assert len(runs(recorder[1])) == 1


def test_metrics_endpoint_serves_prometheus_text(responder: Responder) -> None:
    """GET /metrics serves the responder's counters and sdc_fleet_gpu_strikes in Prometheus text format."""
    post(responder, notification(alert("node-b")))
    code, text = request(responder.url, "GET", "/metrics")
    assert code == 200
    assert metric(text, "sdc_fleet_gpu_strikes", hw_id="GPU-2", host_name="node-b") == 1
    assert metric(text, "sdc_responder_actions_total", action="command") == 1
    assert metric(text, "sdc_responder_notifications_total") == 1
    assert "# TYPE sdc_fleet_gpu_strikes gauge" in text


def test_tls_serves_https(recorder: tuple[str, Path], tmp_path: Path) -> None:
    """With tls_cert/tls_key the responder serves HTTPS (verified against the certificate) and not plain HTTP."""
    cert, key = self_signed(tmp_path)
    with Responder(recorder[0], tls_cert=cert, tls_key=key, bearer_token=TOKEN, idle_timeout_s=2) as r:
        assert r.url.startswith("https://")
        assert post(r, notification(alert("node-b")), cafile=cert)[1]["acted"] == ["node-b"]
        with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
            request(f"http://127.0.0.1:{r.port}", "GET", "/healthz")
        with pytest.raises(ssl.SSLError):  # an unknown certificate is refused by a verifying client
            request(r.url, "GET", "/healthz")
    assert len(runs(recorder[1])) == 1


def test_tls_needs_both_files(recorder: tuple[str, Path], tmp_path: Path) -> None:
    """A certificate without its key, or an unreadable pair, is refused naming the options."""
    with pytest.raises(ValueError, match="--tls-key"):
        Responder(recorder[0], tls_cert=tmp_path / "c.pem", bearer_token=TOKEN)
    with pytest.raises(ValueError, match="--tls-cert"):
        Responder(recorder[0], tls_cert=tmp_path / "c.pem", tls_key=tmp_path / "k.pem", bearer_token=TOKEN)


def test_listen_backlog_and_parallel_posts(responder: Responder) -> None:
    """The listen backlog is 128, and 60 parallel POSTs are all answered (none reset)."""
    assert responder._server.request_queue_size == LISTEN_BACKLOG == 128
    codes: list[int] = []

    def one(i: int) -> None:
        codes.append(post(responder, notification(alert(f"n{i}", severity="warning")))[0])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(60)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert codes == [200] * 60


def test_idle_connection_is_closed(recorder: tuple[str, Path]) -> None:
    """A client that connects and sends nothing is disconnected after the idle timeout; the server goes on."""
    with Responder(recorder[0], bearer_token=TOKEN, idle_timeout_s=0.5) as r:
        with socket.create_connection(("127.0.0.1", r.port), timeout=10) as s:
            start = time.monotonic()
            assert s.recv(100) == b""
            assert time.monotonic() - start < 5
        with socket.create_connection(("127.0.0.1", r.port), timeout=10) as s:
            s.sendall(b"POST /alerts HTTP/1.1\r\nContent-Length: 100\r\n")  # headers never finished
            assert s.recv(100) == b""
        assert request(r.url, "GET", "/healthz")[0] == 200


@pytest.mark.parametrize(("template", "problem"), [
    ("scontrol update NodeName=x", "no placeholder"),
    ("kubectl cordon {host}", "{host}"),
    ("echo {host_name} {}", "{}"),
    ("echo 'unclosed {host_name}", "does not parse"),
    ("", "empty"),
    ("{host_name} --oops", "program"),
])
def test_bad_templates_are_refused_naming_the_problem(template: str, problem: str) -> None:
    """Templates that do not parse, have no or unknown placeholders, or put one in the program are refused."""
    with pytest.raises(TemplateError, match=problem.replace("{", r"\{").replace("}", r"\}")):
        parse_template(template)


def test_missing_program_is_refused_unless_dry_run() -> None:
    """A program that is not on PATH is refused at start (also for the replace and screen commands); a dry run
    accepts it."""
    with pytest.raises(TemplateError, match="not found"):
        Responder("no-such-scontrol-xyz update NodeName={host_name}", bearer_token=TOKEN)
    with pytest.raises(TemplateError, match=r"--replace-command.*not found"):
        Responder("echo {host_name}", replace_command="no-such-replace {hw_id}", bearer_token=TOKEN)
    Responder("no-such-scontrol-xyz update NodeName={host_name}", dry_run=True, bearer_token=TOKEN).close()


def test_template_keeps_quoted_reason_as_one_argument() -> None:
    """The Slurm template's quoted reason is one argument with every placeholder replaced."""
    argv = parse_template('scontrol update NodeName={host_name} State=DRAIN Reason="SDC {alertname} rank {rank} '
                          '{hw_id}"')
    values = {"host_name": "n1", "rank": "7", "hw_id": "GPU-9", "alertname": "SDCReplayMismatch"}
    assert render(argv, values) == ["scontrol", "update", "NodeName=n1", "State=DRAIN",
                                    "Reason=SDC SDCReplayMismatch rank 7 GPU-9"]


def test_validate_labels_accepts_real_names() -> None:
    """Real host names, ranks and GPU UUIDs (and the CPU ids the monitor reports) pass validation."""
    for host, hw in [("node-b", "GPU-8f3a1c2e-1111-2222-3333-444455556666"), ("gpu001.cluster.example", "cpu:n:3"),
                     ("ip-10-0-0-5.ec2.internal", "MIG-abc"), ("n_1", "GPU-1")]:
        assert validate_labels({"host_name": host, "rank": "12", "hw_id": hw}) is None


def test_parse_listen() -> None:
    """HOST:PORT and [v6]:PORT parse; a missing or bad port is an error."""
    assert parse_listen("0.0.0.0:9095") == ("0.0.0.0", 9095)
    assert parse_listen("[::1]:80") == ("::1", 80)
    for bad in ("9095", "host:", "host:99999", ":80"):
        with pytest.raises(ValueError, match="--listen"):
            parse_listen(bad)


def test_parse_duration() -> None:
    """2s, 10m, 24h, 90d, 1w and plain seconds parse; zero, negatives and junk are errors naming the option."""
    assert [parse_duration(t) for t in ("2s", "10m", "24h", "90d", "1w", "30", "1.5h", "500ms")] == \
        [2.0, 600.0, 86400.0, 7776000.0, 604800.0, 30.0, 5400.0, 0.5]
    for bad in ("0s", "-1h", "1y", "h", "", "1 day"):
        with pytest.raises(ValueError, match="--reacquire-after"):
            parse_duration(bad, "--reacquire-after")


def test_cli_refuses_to_start_without_auth(capsys: pytest.CaptureFixture[str]) -> None:
    """sdc-telemetry respond without --bearer-token-file or --insecure-no-auth exits 2 naming both."""
    assert main(["respond", "--listen", "127.0.0.1:0", "--command", "echo {host_name}"]) == 2
    err = capsys.readouterr().err
    assert "--bearer-token-file" in err and "--insecure-no-auth" in err


def test_cli_rejects_empty_or_missing_token_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An empty or unreadable --bearer-token-file exits 2 naming the file."""
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path in (empty, tmp_path / "missing"):
        assert main(["respond", "--listen", "127.0.0.1:0", "--command", "echo {host_name}",
                     "--bearer-token-file", str(path)]) == 2
        assert str(path) in capsys.readouterr().err


def test_cli_rejects_bad_template_with_exit_code_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """sdc-telemetry respond with an unknown placeholder exits 2 naming it."""
    assert main(["respond", "--listen", "127.0.0.1:0", "--command", "kubectl cordon {node}", "--insecure-no-auth",
                 "--ledger", f"sqlite:///{tmp_path / 'l.db'}"]) == 2
    assert "{node}" in capsys.readouterr().err


def test_cli_rejects_negative_cap(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A negative --max-actions-per-hour exits 2 naming the option."""
    assert main(["respond", "--listen", "127.0.0.1:0", "--command", "echo {host_name}", "--insecure-no-auth",
                 "--max-actions-per-hour", "-1", "--ledger", f"sqlite:///{tmp_path / 'l.db'}"]) == 2
    assert "max-actions-per-hour" in capsys.readouterr().err.replace("_", "-")


def test_cli_rejects_bad_durations_and_ledger(capsys: pytest.CaptureFixture[str]) -> None:
    """A bad --reacquire-after is a usage error; a bad --ledger URL exits 2 naming the forms."""
    with pytest.raises(SystemExit) as e:
        main(["respond", "--listen", "127.0.0.1:0", "--command", "echo {host_name}", "--insecure-no-auth",
              "--reacquire-after", "soon"])
    assert e.value.code == 2 and "--reacquire-after" in capsys.readouterr().err
    assert main(["respond", "--listen", "127.0.0.1:0", "--command", "echo {host_name}", "--insecure-no-auth",
                 "--ledger", "mysql://x"]) == 2
    assert "sqlite:///PATH" in capsys.readouterr().err


def test_default_state_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """$SDC_STATE_DIR places the default ledger (and so the default state file next to it)."""
    from sdc_telemetry.ops.ledger import default_ledger_url

    monkeypatch.setenv("SDC_STATE_DIR", str(tmp_path))
    assert default_ledger_url() == f"sqlite:///{tmp_path}/ledger.sqlite3"
    assert os.path.isabs(default_ledger_url()[len("sqlite:///"):])


def test_one_alert_delivered_to_two_responders_on_one_ledger_is_one_strike(recorder: tuple[str, Path],
                                                                          tmp_path: Path) -> None:
    """Alertmanager HA sends the same alert (same fingerprint and startsAt) to both responders sharing one ledger:
    one strike, and neither runs the replace command for it; the GPU's next alert is its second strike."""
    replace, replaced = recorder_template(tmp_path, "replaced", " replace {host_name} {hw_id}")
    url = f"sqlite:///{tmp_path / 'shared.sqlite3'}"
    same = {**alert("node-h", hw_id="GPU-ha"), "fingerprint": "5a1e7c0ffee"}
    with Ledger(url) as ledger_a, Ledger(url) as ledger_b, \
            Responder(recorder[0], ledger=ledger_a, replace_command=replace, bearer_token=TOKEN) as a, \
            Responder(recorder[0], ledger=ledger_b, replace_command=replace, bearer_token=TOKEN) as b:
        assert post(a, notification(same))[1]["acted"] == ["node-h"]
        assert post(b, notification(same))[1]["replaced"] == []
        assert ledger_a.count_strikes("GPU-ha") == 1
        second = {**alert("node-h2", hw_id="GPU-ha", starts_at="2024-01-03T00:00:00Z"), "fingerprint": "beef"}
        assert post(b, notification(second))[1]["replaced"] == ["node-h2"]
        assert ledger_b.count_strikes("GPU-ha") == 2
    assert runs(replaced) == [["replace", "node-h2", "GPU-ha"]]


def test_two_responders_cannot_share_one_state_file(recorder: tuple[str, Path], tmp_path: Path) -> None:
    """The second responder given the state file another one holds is refused at start, naming the file; the
    CLI's default state files are named after the ledger, so ledgers in one directory get their own."""
    import argparse

    from sdc_telemetry.ops.fleet_cli import _state_path

    state = tmp_path / "state.json"
    with Responder(recorder[0], state_file=state, bearer_token=TOKEN):
        with pytest.raises(ValueError, match=r"state\.json is in use by another responder"):
            Responder(recorder[0], state_file=state, bearer_token=TOKEN)
    with Responder(recorder[0], state_file=state, bearer_token=TOKEN):
        pass  # released when the first closed
    none = argparse.Namespace(state=None)
    a = _state_path(none, f"sqlite:///{tmp_path / 'a.sqlite3'}")
    b = _state_path(none, f"sqlite:///{tmp_path / 'b.sqlite3'}")
    assert a != b and a.endswith("a.sqlite3.respond-state.json")
    assert _state_path(none, "postgresql://u@h/db1") != _state_path(none, "postgresql://u@h/db2")
