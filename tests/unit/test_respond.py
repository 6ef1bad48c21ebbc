"""The responder: an in-process Alertmanager webhook receiver over real HTTP, running a recorder command."""

from __future__ import annotations

import http.client
import json
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sdc_telemetry.ops.cli import main
from sdc_telemetry.ops.respond import Responder, TemplateError, parse_listen, parse_template, render

# Writes its arguments as one JSON line to the file named by its first argument.
RECORDER = "import json, sys\nwith open(sys.argv[1], 'a') as f:\n    f.write(json.dumps(sys.argv[2:]) + '\\n')\n"


class Clock:
    """A wall clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def recorder(tmp_path: Path) -> tuple[str, Path]:
    """A template that records (host, rank, hw_id, alertname) per run, and the file it writes."""
    script, out = tmp_path / "record.py", tmp_path / "runs.jsonl"
    script.write_text(RECORDER)
    template = " ".join(shlex.quote(a) for a in (sys.executable, str(script), str(out)))
    return template + " {host_name} rank={rank} {hw_id} {alertname}", out


@pytest.fixture
def responder(recorder: tuple[str, Path]) -> Iterator[Responder]:
    with Responder(recorder[0], port=0, max_actions_per_hour=3) as r:
        yield r


def runs(out: Path) -> list[list[str]]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def alert(host: str, *, status: str = "firing", severity: str = "critical", name: str = "SDCWeightFingerprintMismatch",
          rank: str = "2") -> dict[str, Any]:
    return {"status": status, "labels": {"alertname": name, "severity": severity, "host_name": host, "rank": rank,
                                         "hw_id": f"GPU-{rank}", "service_name": "job"},
            "annotations": {"summary": "weights differ"}, "startsAt": "2024-01-01T00:00:00Z"}


def notification(*alerts: dict[str, Any]) -> dict[str, Any]:
    return {"version": "4", "status": "firing", "receiver": "pager", "groupKey": "{}:{}", "alerts": list(alerts)}


def request(r: Responder, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def post(r: Responder, doc: Any, path: str = "/alerts") -> tuple[int, dict[str, Any]]:
    return request(r, "POST", path, json.dumps(doc).encode(), {"Content-Type": "application/json"})


def test_critical_page_runs_the_command_once_with_the_labels(responder: Responder,
                                                              recorder: tuple[str, Path]) -> None:
    """A firing critical alert runs the template once, its placeholders replaced by the alert's labels."""
    code, outcome = post(responder, notification(alert("node-b")))
    assert code == 200 and outcome["acted"] == ["node-b"]
    assert runs(recorder[1]) == [["node-b", "rank=2", "GPU-2", "SDCWeightFingerprintMismatch"]]
    health = request(responder, "GET", "/healthz")[1]
    assert (health["actions"], health["refusals"], health["hosts_acted_on"], health["hosts"]) == (1, 0, 1, ["node-b"])


def test_root_path_is_accepted_like_alerts(responder: Responder, recorder: tuple[str, Path]) -> None:
    """POST / is the same endpoint as POST /alerts."""
    assert post(responder, notification(alert("node-c")), path="/")[0] == 200
    assert [r[0] for r in runs(recorder[1])] == ["node-c"]


def test_repeat_resolved_and_warning_do_nothing(responder: Responder, recorder: tuple[str, Path]) -> None:
    """A host already acted on, a resolved alert and a warning run nothing more."""
    post(responder, notification(alert("node-b")))
    code, outcome = post(responder, notification(alert("node-b", name="SDCReplayMismatch"),
                                                 alert("node-c", status="resolved"),
                                                 alert("node-d", severity="warning", name="GPUXidErrors")))
    assert code == 200 and outcome["already"] == ["node-b"] and outcome["acted"] == []
    assert len(runs(recorder[1])) == 1


def test_two_alerts_for_one_host_act_once(responder: Responder, recorder: tuple[str, Path]) -> None:
    """Two critical alerts naming one host in one notification run the command once, with the first alert."""
    post(responder, notification(alert("node-b", rank="2"), alert("node-b", rank="3", name="SDCReplayMismatch")))
    assert runs(recorder[1]) == [["node-b", "rank=2", "GPU-2", "SDCWeightFingerprintMismatch"]]


@pytest.mark.parametrize("host", ["a;rm -rf /", "$(touch PWNED)", "`touch PWNED`", "two words", "it's \"quoted\"",
                                  "x && touch PWNED", "{rank}{hw_id}", "a\nb"])
def test_shell_characters_in_host_name_arrive_as_one_literal_argument(
        host: str, responder: Responder, recorder: tuple[str, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A host name with shell syntax or placeholders is passed verbatim as one argument and runs nothing else."""
    monkeypatch.chdir(tmp_path)  # where a shell would create PWNED
    post(responder, notification(alert(host)))
    assert runs(recorder[1]) == [[host, "rank=2", "GPU-2", "SDCWeightFingerprintMismatch"]]
    assert not (tmp_path / "PWNED").exists()


def test_host_name_that_looks_like_an_option_is_refused(responder: Responder, recorder: tuple[str, Path]) -> None:
    """A host name starting with '-' is not acted on (a program could read it as an option) and is counted."""
    code, outcome = post(responder, notification(alert("--kubeconfig=/tmp/evil")))
    assert code == 200 and outcome["rejected"] == ["--kubeconfig=/tmp/evil"]
    assert runs(recorder[1]) == []
    assert request(responder, "GET", "/healthz")[1]["rejected_hosts"] == 1


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"status": "firing"}', b'{"alerts": {}}',
                                  b'{"alerts": [1]}', b'{"alerts": [{"status": "firing", "labels": {"a": 1}}]}',
                                  b'{"alerts": [{"status": "maybe", "labels": {}}]}',
                                  b'{"status": 3, "alerts": []}', b"[" * 100_000])
def test_malformed_body_gets_400_and_the_server_goes_on(body: bytes, responder: Responder,
                                                        recorder: tuple[str, Path]) -> None:
    """Not JSON, the wrong shape or the wrong types: 400 with a reason, nothing runs, the next page still works."""
    code, doc = request(responder, "POST", "/alerts", body, {"Content-Type": "application/json"})
    assert code == 400 and doc["error"]
    assert runs(recorder[1]) == []
    assert post(responder, notification(alert("node-b")))[0] == 200
    assert len(runs(recorder[1])) == 1
    assert request(responder, "GET", "/healthz")[1]["rejected_bodies"] == 1


def test_half_malformed_body_runs_nothing(responder: Responder, recorder: tuple[str, Path]) -> None:
    """A valid critical alert next to a malformed one gets 400 and runs nothing."""
    assert post(responder, notification(alert("node-b"), {"status": "firing"}))[0] == 400
    assert runs(recorder[1]) == []


def test_oversized_body_gets_413(responder: Responder) -> None:
    """A body over 1 MiB is refused with 413 before it is read."""
    conn = http.client.HTTPConnection("127.0.0.1", responder.port, timeout=30)
    conn.putrequest("POST", "/alerts")
    conn.putheader("Content-Length", str((1 << 20) + 1))
    conn.endheaders()  # no body sent: the answer must not wait for it
    assert conn.getresponse().status == 413
    conn.close()
    assert request(responder, "GET", "/healthz")[0] == 200


def test_unknown_path_gets_404(responder: Responder) -> None:
    """Paths other than /, /alerts and /healthz are 404 for GET and POST."""
    assert request(responder, "GET", "/metrics")[0] == 404
    assert post(responder, notification(alert("node-b")), path="/other")[0] == 404


def test_hourly_cap_refuses_and_counts_then_reopens(recorder: tuple[str, Path]) -> None:
    """Past N actions in an hour further hosts are refused and counted; an hour later they are acted on."""
    clock = Clock()
    with Responder(recorder[0], max_actions_per_hour=2, clock=clock) as r:
        code, outcome = post(r, notification(*(alert(f"node-{i}") for i in range(4))))
        assert code == 200 and outcome["acted"] == ["node-0", "node-1"]
        assert outcome["refused"] == ["node-2", "node-3"]
        health = request(r, "GET", "/healthz")[1]
        assert (health["actions"], health["refusals"]) == (2, 2)
        assert [x["host_name"] for x in health["recent_refusals"]] == ["node-2", "node-3"]
        clock.now += 3599
        assert post(r, notification(alert("node-2")))[1]["refused"] == ["node-2"]
        clock.now += 1
        assert post(r, notification(alert("node-2")))[1]["acted"] == ["node-2"]
    assert [x[0] for x in runs(recorder[1])] == ["node-0", "node-1", "node-2"]


def test_dry_run_runs_nothing_but_counts(recorder: tuple[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    """--dry-run logs the argv it would run, runs nothing, and still remembers the host."""
    with Responder(recorder[0], dry_run=True) as r:
        with caplog.at_level("WARNING", logger="sdc_telemetry"):
            assert post(r, notification(alert("node-b")))[1]["acted"] == ["node-b"]
        assert post(r, notification(alert("node-b")))[1]["already"] == ["node-b"]
    assert runs(recorder[1]) == []
    assert "DRY RUN" in caplog.text and "'node-b'" in caplog.text


def test_failed_command_is_retried_on_the_next_notification(tmp_path: Path) -> None:
    """A command exiting non-zero is counted as a failure and leaves the host to be tried again."""
    flag = tmp_path / "ok"
    code = f"import sys, os; sys.exit(0 if os.path.exists({str(flag)!r}) else 3)"
    template = f"{shlex.quote(sys.executable)} -c {shlex.quote(code)} {{host_name}}"
    with Responder(template) as r:
        assert post(r, notification(alert("node-b")))[1]["failed"] == ["node-b"]
        flag.touch()
        assert post(r, notification(alert("node-b")))[1]["acted"] == ["node-b"]
        health = request(r, "GET", "/healthz")[1]
    assert (health["failures"], health["actions"], health["hosts"]) == (1, 2, ["node-b"])


def test_state_file_remembers_hosts_across_restarts(recorder: tuple[str, Path], tmp_path: Path) -> None:
    """With a state file, a restarted responder does not act on a host again."""
    state = tmp_path / "state.json"
    with Responder(recorder[0], state_file=state) as r:
        post(r, notification(alert("node-b")))
    with Responder(recorder[0], state_file=state) as r:
        assert post(r, notification(alert("node-b")))[1]["already"] == ["node-b"]
    assert len(runs(recorder[1])) == 1


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
    """A program that is not on PATH is refused at start; a dry run (a drill on a laptop) accepts it."""
    with pytest.raises(TemplateError, match="not found"):
        Responder("no-such-scontrol-xyz update NodeName={host_name}")
    Responder("no-such-scontrol-xyz update NodeName={host_name}", dry_run=True).close()


def test_template_keeps_quoted_reason_as_one_argument() -> None:
    """The Slurm template's quoted reason is one argument with every placeholder replaced."""
    argv = parse_template('scontrol update NodeName={host_name} State=DRAIN Reason="SDC {alertname} rank {rank} '
                          '{hw_id}"')
    values = {"host_name": "n1", "rank": "7", "hw_id": "GPU-9", "alertname": "SDCReplayMismatch"}
    assert render(argv, values) == ["scontrol", "update", "NodeName=n1", "State=DRAIN",
                                    "Reason=SDC SDCReplayMismatch rank 7 GPU-9"]


def test_parse_listen() -> None:
    """HOST:PORT and [v6]:PORT parse; a missing or bad port is an error."""
    assert parse_listen("0.0.0.0:9095") == ("0.0.0.0", 9095)
    assert parse_listen("[::1]:80") == ("::1", 80)
    for bad in ("9095", "host:", "host:99999", ":80"):
        with pytest.raises(ValueError, match="--listen"):
            parse_listen(bad)


def test_cli_rejects_bad_template_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    """sdc-telemetry respond with an unknown placeholder exits 2 naming it."""
    assert main(["respond", "--listen", "127.0.0.1:0", "--command", "kubectl cordon {node}"]) == 2
    assert "{node}" in capsys.readouterr().err


def test_cli_rejects_negative_cap(capsys: pytest.CaptureFixture[str]) -> None:
    """A negative --max-actions-per-hour exits 2 naming the option."""
    assert main(["respond", "--listen", "127.0.0.1:0", "--command", "echo {host_name}",
                 "--max-actions-per-hour", "-1"]) == 2
    assert "max-actions-per-hour" in capsys.readouterr().err.replace("_", "-")
