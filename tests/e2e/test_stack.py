"""End to end: real Prometheus and Alertmanager (LocalStack) scrape a 3-rank CPU training and page on-call.

Ranks 0-1 look like host node-a and rank 2 like node-b (SDC_HOST_NAME); LOCAL_RANK is the rank, so each serves
metrics on base + rank. Every process a test starts is stopped in a ``finally``.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from sdc_telemetry.ops.dashboards import panel_queries
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
