"""End to end: with alertmanager_url set, a raising job pages through a real Alertmanager without any scrape, and
every rank is done within seconds; a page Alertmanager refuses at first is retried until it arrives, and the failed
pushes are counted."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import prometheus_client
import pytest
import torch
import torch.distributed as dist
from prometheus_client.parser import text_string_to_metric_families
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sdc_telemetry as sdc
from sdc_telemetry.faults import FaultInjector
from sdc_telemetry.ops.alerts import SUSPECT_ALERTS, suspect_alert
from sdc_telemetry.ops.stack import LocalStack
from sdc_telemetry.testing import spawn_ranks

from ._trainer import host_of, loss_fn, raise_and_page
from .test_stack import _free_base, _require_binaries

pytestmark = pytest.mark.e2e


def test_direct_push_pages_within_seconds_and_every_rank_stops(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """3 ranks, weight flip on rank 2, no Prometheus target: the webhook gets the page for node-b / rank 2 within
    15 s of the incident, and every rank has closed its monitor and returned within 10 s of it."""
    _require_binaries()
    with LocalStack(targets=[], workdir=tmp_path) as stack:
        results = spawn_ranks(raise_and_page, 3, (stack.alertmanager_url, _free_base(3)), timeout=120,
                              rank_env=lambda r: {"SDC_HOST_NAME": host_of(r), "LOCAL_RANK": str(r)})
        raised = min(r["raised_at"] for r in results)
        page = stack.wait_for_alert(SUSPECT_ALERTS["weights"], timeout=max(1.0, raised + 15 - time.time()),
                                    labels={"host_name": "node-b", "rank": "2"})
        assert page is not None, stack.notifications
        assert page["received_at"] - raised <= 15
        assert page["labels"]["severity"] == "critical" and page["labels"]["check"] == "weights"
    assert all(r["step"] == 4 and r["exit_code"] == 75 for r in results)
    assert all(r["returned_at"] - r["raised_at"] <= 10 for r in results)


class _FlakyAlertmanager(ThreadingHTTPServer):
    """A real HTTP server in Alertmanager's place: the first ``failures`` posts to /api/v2/alerts get HTTP 500, the
    later ones 200. ``GET /accepted`` answers how many posts it accepted."""

    daemon_threads = True

    def __init__(self, failures: int) -> None:
        super().__init__(("127.0.0.1", 0), _FlakyHandler)
        self.failures = failures
        self.posts: list[tuple[float, int, list[dict[str, Any]]]] = []  # (time, status answered, alerts)
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _FlakyHandler(BaseHTTPRequestHandler):
    server: _FlakyAlertmanager

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            failed = sum(1 for _, status, _ in self.server.posts if status != 200)
            status = 500 if self.path == "/api/v2/alerts" and failed < self.server.failures else 200
            self.server.posts.append((time.time(), status, body))
        self.send_response(status)
        self.end_headers()
        self.wfile.write(b"injected failure" if status == 500 else b"")

    def do_GET(self) -> None:
        with self.server.lock:
            accepted = sum(1 for _, status, _ in self.server.posts if status == 200)
        data = json.dumps({"accepted": accepted}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _pager_failures(registry: prometheus_client.CollectorRegistry) -> float | None:
    for family in text_string_to_metric_families(prometheus_client.generate_latest(registry).decode()):
        for sample in family.samples:
            if sample.name == "sdc_pager_failures_total":
                return float(sample.value)
    return None


def _train(ddp: torch.nn.Module, opt: torch.optim.Optimizer, monitor: sdc.SDCMonitor, rank: int, *, steps: int,
           pause_s: float = 0.0) -> None:
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        batch = (torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen))
        with monitor.step(batch) as st:
            st.backward(loss_fn(ddp, batch))
        opt.step()
        opt.zero_grad()
        time.sleep(pause_s)


def _wait_accepted(alertmanager_url: str, wait_s: float) -> None:
    """Until the stand-in Alertmanager accepted a post (bounded)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{alertmanager_url}/accepted", timeout=5) as r:
            if json.loads(r.read())["accepted"] >= 1:
                return
        time.sleep(0.05)


def page_through_failures(rank: int, world: int, alertmanager_url: str, wait_s: float) -> dict[str, Any]:
    """A weight flip on rank 2 at step 4, on_suspect="record", a direct push to an Alertmanager that fails at first.
    The writer rank keeps training, then waits (bounded) until the page was accepted; every rank returns its
    sdc_pager_failures_total read from the monitor's registry before close()."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    faults = FaultInjector(ddp, opt)
    faults.flip_weight_bit(rank=2, step=4, param="0.weight", index=3, bit=10)
    config = sdc.SDCConfig(weights_every=1, replay_every=0, on_suspect="record", metrics_port=None,
                           job_name="pager-retry", alertmanager_url=alertmanager_url, nvml=False)
    registry = prometheus_client.CollectorRegistry()
    monitor = sdc.SDCMonitor(ddp, opt, config=config, registry=registry)
    _train(ddp, opt, monitor, rank, steps=8, pause_s=0.1)
    trained_at = time.time()
    if rank == 0:
        _wait_accepted(alertmanager_url, wait_s)
    failures = _pager_failures(registry)
    dist.barrier()
    monitor.close()
    faults.close()
    return {"failures": failures, "trained_at": trained_at,
            "incidents": [(i.step, i.check, i.suspect_ranks) for i in monitor.incidents]}


def test_a_page_refused_three_times_arrives_and_the_failures_are_counted() -> None:
    """3 ranks, weight flip on rank 2; Alertmanager answers HTTP 500 to the first three posts: the writer rank
    retries in the background while training goes on, the fourth post delivers the critical page for node-b /
    rank 2 (the same alert as the failed posts), and sdc_pager_failures_total is 3 on the writer rank (0 on the
    others)."""
    server = _FlakyAlertmanager(failures=3)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        results = spawn_ranks(page_through_failures, 3, (server.url, 30.0), timeout=150,
                              rank_env=lambda r: {"SDC_HOST_NAME": host_of(r), "LOCAL_RANK": str(r)})
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert all((4, "weights", (2,)) in r["incidents"] for r in results)
    statuses = [status for _, status, _ in server.posts]
    assert statuses[:4] == [500, 500, 500, 200], statuses
    expected = suspect_alert("weights", {"host_name": "node-b", "rank": 2, "local_rank": 2,
                                         "hw_id": "cpu:node-b:2"}, "pager-retry")
    for _, _, body in server.posts[:4]:
        (alert,) = body
        assert alert["labels"] == expected["labels"] and alert["annotations"] == expected["annotations"]
    assert expected["labels"]["severity"] == "critical"
    first, accepted = server.posts[0][0], server.posts[3][0]
    assert accepted - first < 10, "the retries took too long"
    assert [r["failures"] for r in results] == [3, 0, 0]


def two_replicas_persistent(rank: int, world: int, alertmanager_url: str) -> dict[str, Any]:
    """Two replicas, rank 1 computing wrong at every step (a persistent compute fault), replay every step,
    on_suspect="record", pages pushed to a local Alertmanager stand-in; the writer waits (bounded) for the push."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    faults = FaultInjector(ddp, opt)
    faults.perturb_output(rank=1, step=1, module="2", relative=1e-3)
    config = sdc.SDCConfig(weights_every=1, replay_every=1, on_suspect="record", metrics_port=None,
                           job_name="two-replicas", alertmanager_url=alertmanager_url, nvml=False)
    monitor = sdc.SDCMonitor(ddp, opt, loss_fn=loss_fn, config=config)
    _train(ddp, opt, monitor, rank, steps=4)
    if rank == 0:
        _wait_accepted(alertmanager_url, 20.0)
    dist.barrier()
    monitor.close()
    faults.close()
    return {"incidents": [(i.step, i.check, i.suspect_ranks, i.evidence.get("ambiguous"))
                          for i in monitor.incidents]}


def test_a_two_replica_persistent_mismatch_pages_only_warnings_marked_ambiguous() -> None:
    """Two replicas disagree and each reproduces itself: no referee can say which is wrong, so the replay incident
    is ambiguous and the direct push sends, for both ranks, the SDCReplayMismatch alert with severity warning and
    ambiguous="true": no critical, nothing a responder would act on."""
    server = _FlakyAlertmanager(failures=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        results = spawn_ranks(two_replicas_persistent, 2, (server.url,), timeout=150,
                              rank_env=lambda r: {"SDC_HOST_NAME": host_of(r), "LOCAL_RANK": str(r)})
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    first = results[0]["incidents"][0]
    assert first[:3] == (1, "replay", (0, 1)) and first[3] is True, results[0]["incidents"]
    alerts = [a for _, status, body in server.posts if status == 200 for a in body]
    assert alerts, server.posts
    assert {a["labels"]["rank"] for a in alerts} == {"0", "1"}
    for a in alerts:
        assert a["labels"]["alertname"] == "SDCReplayMismatch"
        assert a["labels"]["severity"] == "warning" and a["labels"]["ambiguous"] == "true"
