"""End to end: real Prometheus and Alertmanager (LocalStack) scrape a 3-rank CPU training and page on-call.

Ranks 0-1 look like host node-a and rank 2 like node-b (SDC_HOST_NAME); LOCAL_RANK is the rank, so each serves
metrics on base + rank. Every process a test starts is stopped in a ``finally``. The last tests send the responder's
bearer token through LocalStack's Alertmanager and run ``sdc-telemetry demo`` (``make demo``) against the real stack.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from sdc_telemetry.ops.dashboards import panel_queries
from sdc_telemetry.ops.respond import Responder
from sdc_telemetry.ops.stack import LocalStack
from sdc_telemetry.testing import spawn_ranks

from ._trainer import Plan, host_of, train

pytestmark = pytest.mark.e2e

WORLD = 3
FAULT_RANK = 2
PAGE_TIMEOUT_S = 60.0


def _require_binaries() -> None:
    if LocalStack.available():
        return
    reason = "prometheus and alertmanager binaries are not on PATH"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: a missing binary is a failure)")
    pytest.skip(reason)


def _free_base(world: int) -> int:
    for _ in range(50):
        base = random.randrange(20000, 60000)
        try:
            for port in range(base, base + world):
                with socket.create_server(("127.0.0.1", port)):
                    pass
        except OSError:
            continue
        return base
    raise RuntimeError("no free block of ports for the ranks")


@contextmanager
def _job(tmp_path: Path, job: str, fault_rank: int | None) -> Iterator[tuple[LocalStack, Plan]]:
    """A LocalStack scraping a WORLD-rank training that runs on a background thread; everything stops on exit."""
    _require_binaries()
    base = _free_base(WORLD)
    plan = Plan(job=job, base_port=base, stop_file=str(tmp_path / "stop"), fault_rank=fault_rank)
    results: list[Any] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            results.extend(spawn_ranks(train, WORLD, (plan,), timeout=150,
                                       rank_env=lambda r: {"LOCAL_RANK": str(r), "SDC_HOST_NAME": host_of(r)}))
        except BaseException as e:  # re-raised by the test thread
            failure.append(e)

    trainer = threading.Thread(target=run, name="e2e-ranks", daemon=True)
    with LocalStack(targets=[f"127.0.0.1:{base + r}" for r in range(WORLD)], workdir=tmp_path) as stack:
        trainer.start()
        try:
            yield stack, plan
        finally:
            Path(plan.stop_file).touch()
            trainer.join(timeout=60)
    assert not trainer.is_alive(), "the ranks did not stop"
    if failure:
        raise failure[0]


def _criticals(stack: LocalStack) -> list[dict[str, Any]]:
    return [a for a in stack.alerts(status="firing") if a["labels"].get("severity") == "critical"]


def test_weight_bit_flip_pages_suspect_and_every_panel_has_data(tmp_path: Path) -> None:
    """A weight bit flip on rank 2 pages SDCWeightFingerprintMismatch naming its host, rank and GPU; every panel
    query of every dashboard, its variables set to that rank, then returns data."""
    with _job(tmp_path, "e2e-fault", FAULT_RANK) as (stack, plan):
        start = time.monotonic()
        page = stack.wait_for_alert("SDCWeightFingerprintMismatch", timeout=PAGE_TIMEOUT_S)
        assert page is not None, (f"no page within {PAGE_TIMEOUT_S:.0f}s; received {stack.notifications}; "
                                  f"targets {stack.targets_up()}\n{stack.log_tail('prometheus')}")
        elapsed = time.monotonic() - start
        host, gpu = host_of(FAULT_RANK), f"cpu:{host_of(FAULT_RANK)}:{FAULT_RANK}"
        labels = page["labels"]
        assert (labels["severity"], labels["host_name"], labels["rank"], labels["hw_id"]) == \
            ("critical", host, str(FAULT_RANK), gpu), labels
        assert page["status"] == "firing" and page["receiver"] == "pager"
        assert labels["service_name"] == plan.job
        assert {a["labels"].get("rank") for a in _criticals(stack)} == {str(FAULT_RANK)}, _criticals(stack)
        assert "runbook.md#sdcweightfingerprintmismatch" in page["annotations"]["runbook_url"]

        queries = panel_queries(job=plan.job, host=host, rank=str(FAULT_RANK), gpu=gpu, rate_interval="30s",
                                interval="1s", range_="10m")
        empty = [q for q in queries if not stack.query(q.expr)]
        if empty:  # the XID or a late series may need one more scrape
            time.sleep(2)
            empty = [q for q in empty if not stack.query(q.expr)]
        assert not empty, "panels without data:\n" + "\n".join(f"{q.dashboard} / {q.panel} [{q.ref}]: {q.expr}"
                                                              for q in empty)
    print(f"page after {elapsed:.1f}s of waiting; {len(queries)} panel queries returned data")


def test_healthy_run_of_the_same_length_pages_nobody(tmp_path: Path) -> None:
    """The same training without a fault, watched until every step was scraped and evaluated, sends no critical
    page."""
    with _job(tmp_path, "e2e-healthy", None) as (stack, plan):
        done = f'min(sdc_steps_total{{service_name="{plan.job}"}}) >= {plan.steps} and ' \
               f'count(sdc_steps_total{{service_name="{plan.job}"}}) == {WORLD}'
        assert stack.wait_for_query(done, timeout=PAGE_TIMEOUT_S), f"training not seen: {stack.targets_up()}"
        time.sleep(4)  # a scrape, a rule evaluation and Alertmanager's group wait after the last step
        assert stack.query(f'sdc_suspect{{service_name="{plan.job}"}} == 1') == []
        assert stack.query('ALERTS{alertstate="firing", severity="critical"}') == []
        assert _criticals(stack) == []


def test_alertmanager_pages_criticals_and_holds_a_paged_hosts_warnings(tmp_path: Path) -> None:
    """Through the real Alertmanager: a critical reaches the pager, a warning of another host the ticket receiver,
    and a warning of the paged host nobody (inhibited)."""
    _require_binaries()
    base = {"service_name": "drill", "rank": "2", "hw_id": "GPU-2"}
    with LocalStack(workdir=tmp_path) as stack:
        stack.send_alerts([
            {"labels": {**base, "alertname": "SDCWeightFingerprintMismatch", "severity": "critical",
                        "host_name": "node-b"}, "annotations": {"summary": "weights differ"}},
            {"labels": {**base, "alertname": "GPUXidErrors", "severity": "warning", "host_name": "node-b",
                        "xid": "79"}},
            {"labels": {**base, "alertname": "GPUXidErrors", "severity": "warning", "host_name": "node-c",
                        "xid": "79"}},
        ])
        page = stack.wait_for_alert("SDCWeightFingerprintMismatch", timeout=30)
        ticket = stack.wait_for_alert("GPUXidErrors", timeout=30, labels={"host_name": "node-c"})
        assert page is not None and page["receiver"] == "pager"
        assert ticket is not None and ticket["receiver"] == "ticket"
        time.sleep(3)  # several group intervals: the inhibited warning would have been sent by now
        assert stack.alerts("GPUXidErrors", labels={"host_name": "node-b"}) == []
        assert stack.wait_for_alert("NoSuchAlert", timeout=0.2) is None


_RECORD = "import sys; open(sys.argv[1], 'a').write(' '.join(sys.argv[2:]) + chr(10))"


def _sdc_page(host: str) -> dict[str, Any]:
    return {"labels": {"alertname": "SDCWeightFingerprintMismatch", "severity": "critical", "check": "weights",
                       "service_name": "drill", "host_name": host, "rank": "2", "local_rank": "2",
                       "hw_id": f"GPU-{host}"}, "annotations": {"summary": "weights differ"}}


def test_localstack_sends_the_responders_bearer_token_from_its_credentials_file(tmp_path: Path) -> None:
    """LocalStack's Alertmanager, given the responder's credentials file, reaches a token-protected responder: the
    SDC critical drains its host and is a strike in the ledger; given a file with another token, the responder
    answers 401 and nothing runs."""
    _require_binaries()
    drains = tmp_path / "drains.txt"
    command = f"{sys.executable} -c \"{_RECORD}\" {drains} drain {{host_name}} {{hw_id}}"
    (tmp_path / "right.token").write_text("right-token\n")
    (tmp_path / "wrong.token").write_text("wrong-token\n")
    with Responder(command, bearer_token="right-token", ledger=f"sqlite:///{tmp_path / 'ledger.sqlite3'}") as r:
        with LocalStack(workdir=tmp_path / "wrong", responder_url=f"{r.url}/alerts",
                        responder_credentials_file=tmp_path / "wrong.token") as stack:
            stack.send_alerts([_sdc_page("node-w")])
            assert stack.wait_for_alert("SDCWeightFingerprintMismatch", timeout=30) is not None  # the pager's copy
            deadline = time.monotonic() + 30
            while r.health()["unauthorized"] == 0 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert r.health()["unauthorized"] >= 1 and r.health()["actions"] == 0
        with LocalStack(workdir=tmp_path / "right", responder_url=f"{r.url}/alerts",
                        responder_credentials_file=tmp_path / "right.token") as stack:
            stack.send_alerts([_sdc_page("node-r")])
            deadline = time.monotonic() + 30
            while not (drains.exists() and drains.read_text()) and time.monotonic() < deadline:
                time.sleep(0.2)
        assert drains.read_text().splitlines() == ["drain node-r GPU-node-r"]
        assert [(s.hw_id, s.host_name, s.alertname) for s in r.ledger.strikes()] == \
            [("GPU-node-r", "node-r", "SDCWeightFingerprintMismatch")]


def test_make_demo_runs_the_whole_loop_through_prometheus_and_alertmanager() -> None:
    """`sdc-telemetry demo` with the real stack: Alertmanager pages, the token-authenticated responder drains the
    suspect's host (a forged page without the token gets 401), the ledger holds the strike, the drill screen names
    the drilled device, and the checkpoint of the last passing audit is chosen; exit 0."""
    _require_binaries()
    out = subprocess.run([sys.executable, "-m", "sdc_telemetry.ops.cli", "demo", "--metrics-port",
                          str(_free_base(4))], capture_output=True, text=True, timeout=400, check=False)
    text = out.stdout
    assert out.returncode == 0, text + out.stderr
    assert "routes SDC criticals to the responder with the token from its credentials_file" in text
    assert "outcome: as predicted (expected check weights at step 20 naming rank 2)" in text
    assert "responder refused a page posted without the bearer token: HTTP 401, nothing ran" in text
    page = next(line for line in text.splitlines() if line.startswith("page received from Alertmanager: "))
    assert "SDCWeightFingerprintMismatch [critical]" in page and " rank=2 " in page
    host = page.split(" host=")[1].split()[0]
    gpu_id = page.split(" gpu=")[1].split(": ", 1)[0]
    assert f"responder (authenticated) drained the node (recorder in place of scontrol): drain {host} rank=2 " \
           f"gpu={gpu_id} alert=SDCWeightFingerprintMismatch" in text
    assert f"strike 1 for GPU {gpu_id} on {host} (SDCWeightFingerprintMismatch, job sdc-demo, check weights)" in text
    assert any(line.startswith(f"{gpu_id} ") and "0 pass / 1 fail" in line for line in text.splitlines()), text
    assert f"screen verdict: odd device cpu-worker:2 ({gpu_id}) named and recorded in the ledger" in text
    assert "checkpoint-15.pt: passed over: step 15 is after the last audit that passed before the incident " \
           "(step 10)" in text
    assert "resume from checkpoint-10.pt (step 10)" in text
