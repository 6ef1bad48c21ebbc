"""Three gloo ranks with a Prometheus endpoint each: scraped over HTTP during and after a run with a weight bit flip."""

from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sdc_telemetry.sinks.metrics import GPU, IDENTITY_LABELS, SDC, Family
from sdc_telemetry.testing import spawn_ranks

from . import _metrics_scenario as scenario

WORLD = 3
BAD = scenario.FAULT["rank"]
PAUSES = ("before_fault", "after_run")


def _free_base(n: int) -> int:
    """A base port with ``n`` consecutive free ports on 127.0.0.1."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = [socket.create_server(("127.0.0.1", base + i)) for i in range(n)]
        except OSError:
            continue
        for s in socks:
            s.close()
        return base
    raise RuntimeError("no free port range")


def _wait_for(paths: list[Path], timeout: float, job: threading.Thread) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if not job.is_alive() or time.monotonic() > deadline:
            raise AssertionError(f"ranks did not reach {paths[0].name.rsplit('-', 1)[0]}")
        time.sleep(0.05)


def _scraped_run(sync: Path, world: int, pauses: tuple[str, ...], args: tuple[Any, ...] = ()) -> dict[str, Any]:
    """Run the job once; at each pause scrape every rank's endpoint over HTTP."""
    base = _free_base(world)
    out: dict[str, Any] = {"texts": {p: {} for p in pauses}}

    def job() -> None:
        try:
            out["results"] = spawn_ranks(scenario.run, world, args=(base, str(sync), *args), timeout=180,
                                         rank_env=lambda r: {"LOCAL_RANK": str(r), "SDC_HOST_NAME": "node-a"})
        except BaseException as e:  # reported by the test thread
            out["error"] = e

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    try:
        for pause in pauses:
            _wait_for([sync / f"ready-{pause}-{r}" for r in range(world)], 180, thread)
            for r in range(world):
                with urllib.request.urlopen(f"http://127.0.0.1:{base + r}/metrics", timeout=10) as resp:
                    out["texts"][pause][r] = resp.read().decode()
            (sync / f"go-{pause}").touch()
    finally:
        for pause in pauses:
            (sync / f"go-{pause}").touch()
        thread.join(timeout=120)
    if "error" in out:
        raise out["error"]
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three ranks, a weight bit flip on one, scraped before the fault and after the run."""
    return _scraped_run(tmp_path_factory.mktemp("sync"), WORLD, PAUSES)


def test_series_count_is_fixed_however_many_audits_ran(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Replay every step: a rank exports the same sdc_ series after audit 2 as after audit 24 (at most 200)."""
    pauses = {1: "audit_2", 23: "audit_24"}
    out = _scraped_run(tmp_path_factory.mktemp("audits"), 2, (*pauses.values(), "after_run"),
                       (25, pauses, 1, False))
    for r in range(2):
        before, after = ({(n, tuple(sorted(lab.items()))) for n, lab, _ in _samples(out["texts"][p][r])
                          if n.startswith("sdc_")} for p in pauses.values())
        assert before == after and len(after) <= 200, (len(before), len(after), before ^ after)
        assert _value(out["texts"]["audit_24"][r], "sdc_checks_total", check="replay", result="pass") == 24


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def _series(text: str, f: Family) -> list[tuple[dict[str, str], float]]:
    """The samples of family ``f`` (for a histogram, its ``_count`` series)."""
    want = f.name + "_count" if f.kind == "histogram" else f.name
    return [(labels, value) for name, labels, value in _samples(text) if name == want]


def _value(text: str, name: str, **labels: str) -> float:
    fam = next(f for f in SDC + GPU if f.name == name)
    hits = [v for lab, v in _series(text, fam) if all(lab.get(k) == v2 for k, v2 in labels.items())]
    assert len(hits) == 1, f"{name}{labels}: {len(hits)} series"
    return hits[0]


def test_every_sdc_family_with_its_labels_on_every_rank(run: dict[str, Any]) -> None:
    """After the run every rank exposes all SDC contract families, each series with identity and family labels."""
    for r, text in run["texts"]["after_run"].items():
        ident = run["results"][r]["identity"]
        for f in SDC:
            series = _series(text, f)
            assert series, f"rank {r}: no {f.name}"
            for labels, _ in series:
                assert set(labels) == set(IDENTITY_LABELS) | set(f.labels), (r, f.name, labels)
                assert labels["rank"] == str(r) and labels["local_rank"] == str(r)
                assert labels["host_name"] == "node-a" and labels["hw_id"] == ident["hw_id"]
                assert labels["service_name"] == "scrape-test"
                assert labels["service_instance_id"] == f"node-a-rank{r}"


def test_gpu_families_carry_the_gpu_uuid_and_host(run: dict[str, Any]) -> None:
    """The (fake) GPU families are scraped with hw_id = the GPU's UUID and the rank's host_name."""
    for r, text in run["texts"]["after_run"].items():
        uuid = run["results"][r]["identity"]["hw_id"]
        for f in GPU:
            if f.name == "gpu_xid_errors_total":  # no XID event in this run: no series, nothing faked
                assert not _series(text, f)
                continue
            series = _series(text, f)
            assert series, f"rank {r}: no {f.name}"
            assert all(lab["hw_id"] == uuid and lab["host_name"] == "node-a" for lab, _ in series)


def test_counters_move_on_the_injected_rank_only(run: dict[str, Any]) -> None:
    """Before the flip nothing is suspect; after it only the flipped rank mismatches and is latched suspect."""
    for text in run["texts"]["before_fault"].values():
        assert _value(text, "sdc_weight_fingerprint_mismatches_total") == 0
        assert _value(text, "sdc_suspect", check="weights") == 0
        assert _value(text, "sdc_steps_total") == 3
        assert _value(text, "sdc_checks_total", check="replay", result="fail") == 0
    for r, text in run["texts"]["after_run"].items():
        bad = r == BAD
        assert _value(text, "sdc_weight_fingerprint_mismatches_total") == (1 if bad else 0), r
        assert _value(text, "sdc_suspect", check="weights") == (1 if bad else 0), r
        assert _value(text, "sdc_weight_fingerprint_agreement") == (0 if bad else 1), r
        assert _value(text, "sdc_incidents_total", check="weights") == 1, r  # every rank counts the incident
        assert _value(text, "sdc_checks_total", check="weights", result="fail") == 1, r
        assert _value(text, "sdc_checks_total", check="weights", result="pass") == scenario.STEPS - 1, r
        assert _value(text, "sdc_steps_total") == scenario.STEPS
        assert _value(text, "sdc_grad_nonfinite_total", phase="local") == 0
        assert math.isfinite(_value(text, "sdc_grad_norm", phase="reduced"))
        assert _value(text, "sdc_check_duration_seconds", check="weights") == scenario.STEPS
        assert _value(text, "sdc_check_last_run_timestamp_seconds", check="weights") > time.time() - 600
    assert all(res["incidents"] == [(scenario.FAULT["step"], "weights", (BAD,))] for res in run["results"])


def test_incident_evidence_carries_the_suspect_gpu_counters(run: dict[str, Any]) -> None:
    """Every rank's incident holds the suspect's GPU snapshot: its UUID, simulated source, counters in W."""
    uuid = run["results"][BAD]["identity"]["hw_id"]
    for res in run["results"]:
        (evidence,) = res["gpu_evidence"]
        assert set(evidence) == {str(BAD)}
        snap = evidence[str(BAD)]
        assert snap["hw_id"] == uuid and "simulated" in snap["source"] and snap["hw_power_watts"] == 412.0


@pytest.mark.skipif(shutil.which("promtool") is None and os.environ.get("CI") != "true",
                    reason="promtool is not installed (CI=true makes this a failure)")
def test_promtool_accepts_every_scrape(run: dict[str, Any]) -> None:
    """`promtool check metrics` accepts every rank's exposition, during and after the run."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool is required under CI=true"
    for pause in PAUSES:
        for r, text in run["texts"][pause].items():
            proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                                  timeout=60, check=False)
            assert proc.returncode == 0, f"rank {r} at {pause}: {proc.stdout}{proc.stderr}"
