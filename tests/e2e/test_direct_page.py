"""End to end: with alertmanager_url set, a raising job pages through a real Alertmanager without any scrape, and
every rank is done within seconds."""

from __future__ import annotations

import time

import pytest

from sdc_telemetry.ops.alerts import SUSPECT_ALERTS
from sdc_telemetry.ops.stack import LocalStack
from sdc_telemetry.testing import spawn_ranks

from ._trainer import host_of, raise_and_page
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
