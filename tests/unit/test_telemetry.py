"""Telemetry: one StepReport mapped onto exact scraped names and labels, identity on every series, a fixed series
count, the clean-close gauge, and the failure modes that must not stop training (port in use, NVML missing or
failing, OTLP unreachable, a malformed report, close leaving nothing behind)."""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sdc_telemetry.core.config import SDCConfig
from sdc_telemetry.core.findings import CHECKS
from sdc_telemetry.core.identity import RankIdentity
from sdc_telemetry.core.incident import Incident
from sdc_telemetry.sinks import telemetry as telemetry_mod
from sdc_telemetry.sinks.metrics import CHECK_DURATION_BUCKETS, FAMILIES, FLEET, GPU, IDENTITY_LABELS, SDC, family
from sdc_telemetry.sinks.nvml import FakeNVML
from sdc_telemetry.sinks.observer import ReplayDeltas, StepReport
from sdc_telemetry.sinks.telemetry import NONFINITE, Telemetry

AM_URL = "http://127.0.0.1:9"  # an Alertmanager URL (the writer rank would push pages there)
# What a training rank exports: every family but the responder's fleet families.
RANK_FAMILIES = tuple(f for f in FAMILIES if f.source != "fleet")
IDENT = RankIdentity(rank=3, local_rank=1, host_name="node-b", hw_id="GPU-11111111-2222-3333-4444-555555555555")
CPU_IDENT = RankIdentity(rank=0, local_rank=0, host_name="node-a", hw_id="cpu:node-a:0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cfg(**kw: Any) -> SDCConfig:
    return SDCConfig(**{"metrics_port": None, "metrics_host": "127.0.0.1", "nvml": False, "job_name": "job", **kw})


def served(**kw: Any) -> SDCConfig:
    """A config whose rank (local_rank 1 of IDENT) listens on a free port."""
    return cfg(metrics_port=free_port() - IDENT.local_rank, **kw)


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def text_of(t: Telemetry) -> str:
    return generate_latest(t.registry).decode()


def value(text: str, name: str, **labels: str) -> float | None:
    hits = [v for n, lab, v in samples(text) if n == name and all(lab.get(k) == x for k, x in labels.items())]
    assert len(hits) <= 1, f"{name}{labels} is ambiguous"
    return hits[0] if hits else None


def scrape(port: int | None) -> str:
    assert port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


@pytest.fixture
def make() -> Iterator[Any]:
    made: list[Telemetry] = []

    def build(config: SDCConfig | None = None, identity: RankIdentity = IDENT, **deps: Any) -> Telemetry:
        deps.setdefault("close_scrape_wait_s", 0.0)  # tests of the final-scrape wait set it themselves
        t = Telemetry(config or cfg(), identity, **deps)
        made.append(t)
        return t

    yield build
    for t in made:
        if not t._closed:
            t.close()


def full_report(step: int = 0, **kw: Any) -> StepReport:
    """A report touching every SDC family: all four checks, both phases, a replay, weights, an incident."""
    base: dict[str, Any] = {
        "results": dict.fromkeys(CHECKS, "pass") | {"weights": "fail"},
        "durations": dict.fromkeys(CHECKS, 0.0003),
        "grad_norms": {"local": 2.5, "reduced": 2.5},
        "replay": ReplayDeltas(loss_delta=0.0, grad_delta=1e-3, mismatch=True),
        "weights_agree": False,
        "incidents": (Incident(step=step, check="weights", suspect_ranks=(3,), suspects=(IDENT,)),),
        "suspect_checks": ("weights",),
        "errors": ("replay",),
    }
    return StepReport(step=step, **(base | kw))


def run_until(done: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_scraped_names_are_exactly_the_table(make: Any) -> None:
    """Over HTTP, every family of the metric table a rank exports (all but the responder's fleet families) is scraped
    under its `name`, and nothing else but target_info."""
    t = make(served(), nvml=FakeNVML(IDENT.hw_id))
    t.report(full_report())
    assert t._gpu is not None
    t._gpu.device.inject_xid(79)
    run_until(lambda: bool(t._gpu.xid.counts()))
    text = scrape(t.port)
    names = {n for n, _, _ in samples(text)}
    expected = set()
    for f in RANK_FAMILIES:
        expected |= {f.name + s for s in ("_bucket", "_count", "_sum")} if f.kind == "histogram" else {f.name}
    assert names - {"target_info"} == expected
    assert not names & {f.name for f in FLEET}
    types = {fam.name: fam.type for fam in text_string_to_metric_families(text)}
    for f in RANK_FAMILIES:
        assert types[f.name.removesuffix("_total") if f.kind == "counter" else f.name] == f.kind


def test_every_series_carries_identity_and_only_its_family_labels(make: Any) -> None:
    """Each series has service_name, service_instance_id, host_name, rank, local_rank, hw_id plus its own labels."""
    t = make(nvml=FakeNVML(IDENT.hw_id))
    t.report(full_report())
    by_name = {f.name: f for f in RANK_FAMILIES}
    for name, labels, _ in samples(text_of(t)):
        if name == "target_info":
            continue
        f = by_name.get(name) or by_name[name.rsplit("_", 1)[0]]
        extra = {"le"} if name.endswith("_bucket") else set()
        assert set(labels) == set(IDENTITY_LABELS) | set(f.labels) | extra, (name, labels)
        assert labels["service_name"] == "job" and labels["service_instance_id"] == "node-b-rank3"
        assert (labels["host_name"], labels["rank"], labels["local_rank"]) == ("node-b", "3", "1")
        assert labels["hw_id"] == IDENT.hw_id


def test_replay_families_have_no_partner_label() -> None:
    """The replay families carry no per-partner label, so a rank's series count does not grow with world size."""
    for name in ("sdc_replay_loss_delta", "sdc_replay_grad_delta", "sdc_replay_mismatches_total"):
        assert family(name).labels == ()


def test_otel_side_uses_the_private_provider_and_resource(make: Any) -> None:
    """Extra readers see the OTel instrument names, and the resource names job, instance, host, rank and GPU."""
    reader = InMemoryMetricReader()
    t = make(readers=[reader])
    t.report(full_report())
    rm = reader.get_metrics_data().resource_metrics[0]
    attrs = dict(rm.resource.attributes)
    assert {k: attrs[k] for k in ("service.name", "service.instance.id", "host.name", "rank", "local_rank",
                                   "hw.id")} == {"service.name": "job", "service.instance.id": "node-b-rank3",
                                                 "host.name": "node-b", "rank": 3, "local_rank": 1,
                                                 "hw.id": IDENT.hw_id}
    names = {m.name for sm in rm.scope_metrics for m in sm.metrics}
    assert {f.otel_name for f in SDC} <= names


def test_caller_meter_provider_gets_identity_on_points_and_is_not_shut_down(make: Any) -> None:
    """With meter_provider= no endpoint starts, points carry identity labels, and close() leaves the provider."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    t = make(cfg(metrics_port=free_port()), meter_provider=provider)
    t.report(StepReport(step=0))
    t.close()
    assert t.port is None
    points = [p for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
              for m in sm.metrics if m.name == family("sdc_steps_total").otel_name for p in m.data.data_points]
    assert points[0].value == 1 and points[0].attributes["host_name"] == "node-b"
    provider.shutdown()


def test_check_duration_histogram_uses_the_explicit_buckets(make: Any) -> None:
    """sdc_check_duration_seconds has exactly CHECK_DURATION_BUCKETS (+Inf) as bucket bounds."""
    t = make()
    t.report(StepReport(step=0, results={"replay": "pass"}, durations={"replay": 0.0004}))
    text = text_of(t)
    les = [lab["le"] for n, lab, _ in samples(text) if n == "sdc_check_duration_seconds_bucket"]
    assert [float(x) for x in les] == [*CHECK_DURATION_BUCKETS, float("inf")]
    assert value(text, "sdc_check_duration_seconds_bucket", le="0.0005") == 1
    assert value(text, "sdc_check_duration_seconds_bucket", le="0.00025") == 0


def test_first_result_of_a_check_creates_all_four_result_series(make: Any) -> None:
    """A check's first report exposes pass, fail, error and skipped, so the first of each is an increase from 0."""
    t = make()
    t.report(StepReport(step=0, results={"grad_local": "pass"}))
    text = text_of(t)
    assert {r: value(text, "sdc_checks_total", check="grad_local", result=r)
            for r in ("pass", "fail", "error", "skipped")} == {"pass": 1, "fail": 0, "error": 0, "skipped": 0}
    assert value(text, "sdc_checks_total", check="replay", result="pass") is None  # a check never reported
    for step, result in enumerate(("error", "skipped", "skipped", "fail"), start=1):
        t.report(StepReport(step=step, results={"grad_local": result}))
    text = text_of(t)
    assert {r: value(text, "sdc_checks_total", check="grad_local", result=r)
            for r in ("pass", "fail", "error", "skipped")} == {"pass": 1, "fail": 1, "error": 1, "skipped": 2}


def test_last_run_timestamp_moves_only_when_the_check_ran(make: Any) -> None:
    """pass and fail set sdc_check_last_run_timestamp_seconds; error and skipped leave it, so it goes stale."""
    t = make()
    t.report(StepReport(step=0, results={"replay": "error"}))
    assert value(text_of(t), "sdc_check_last_run_timestamp_seconds", check="replay") is None
    before = time.time()
    t.report(StepReport(step=1, results={"replay": "fail"}))
    ran = value(text_of(t), "sdc_check_last_run_timestamp_seconds", check="replay")
    assert ran is not None and ran >= before
    t.report(StepReport(step=2, results={"replay": "skipped"}))
    t.report(StepReport(step=3, results={"replay": "error"}))
    assert value(text_of(t), "sdc_check_last_run_timestamp_seconds", check="replay") == ran


def test_series_alerts_need_exist_at_zero_from_the_start(make: Any) -> None:
    """Steps, incidents and suspect per check, non-finite per phase, mismatches, closed and errors start at 0."""
    text = text_of(make(cfg(grad_checks=True, weights_every=1, replay_every=10)))
    assert value(text, "sdc_steps_total") == 0
    for check in CHECKS:
        assert value(text, "sdc_incidents_total", check=check) == 0
        assert value(text, "sdc_suspect", check=check) == 0
    for phase in ("local", "reduced"):
        assert value(text, "sdc_grad_nonfinite_total", phase=phase) == 0
    assert value(text, "sdc_weight_fingerprint_mismatches_total") == 0
    assert value(text, "sdc_replay_mismatches_total") == 0
    assert value(text, "sdc_monitor_closed") == 0
    for component in ("exporter", "nvml", "telemetry"):
        assert value(text, "sdc_internal_errors_total", component=component) == 0


def test_report_records_every_family(make: Any) -> None:
    """One report lands in steps, checks, gradient, replay, weight, incident, suspect and internal-error families."""
    t = make()
    t.report(full_report())
    text = text_of(t)
    assert value(text, "sdc_steps_total") == 1
    assert value(text, "sdc_checks_total", check="weights", result="fail") == 1
    assert value(text, "sdc_checks_total", check="replay", result="pass") == 1
    assert value(text, "sdc_check_duration_seconds_count", check="grad_reduced") == 1
    assert value(text, "sdc_grad_norm", phase="local") == 2.5
    assert value(text, "sdc_grad_nonfinite_total", phase="local") == 0
    assert value(text, "sdc_replay_grad_delta") == 1e-3
    assert value(text, "sdc_replay_loss_delta") == 0
    assert value(text, "sdc_replay_mismatches_total") == 1
    assert value(text, "sdc_weight_fingerprint_agreement") == 0
    assert value(text, "sdc_weight_fingerprint_mismatches_total") == 1
    assert value(text, "sdc_incidents_total", check="weights") == 1
    assert value(text, "sdc_suspect", check="weights") == 1
    assert value(text, "sdc_internal_errors_total", component="replay") == 1


def test_on_demand_report_counts_no_step_and_agreement_counts_no_mismatch(make: Any) -> None:
    """counts_step=False (verify_weights, certificate) adds no step; weights that agree set 1 and add no mismatch."""
    t = make(cfg(weights_every=1))
    t.report(StepReport(step=5, counts_step=False, results={"weights": "pass"}, weights_agree=True,
                        replay=ReplayDeltas(loss_delta=0.0, grad_delta=0.0, mismatch=False)))
    text = text_of(t)
    assert value(text, "sdc_steps_total") == 0
    assert value(text, "sdc_weight_fingerprint_agreement") == 1
    assert value(text, "sdc_weight_fingerprint_mismatches_total") == 0
    assert value(text, "sdc_replay_mismatches_total") == 0


def test_suspect_latches_and_incidents_count_on_every_rank(make: Any) -> None:
    """sdc_suspect{check} stays 1 once this rank was suspected; a bystander counts the incident but stays 0."""
    suspect, bystander = make(), make(identity=CPU_IDENT)
    inc = Incident(step=4, check="replay", suspect_ranks=(3,), suspects=(IDENT,))
    suspect.report(StepReport(step=4, incidents=(inc,), suspect_checks=("replay",)))
    bystander.report(StepReport(step=4, incidents=(inc,)))
    suspect.report(StepReport(step=5, results={"replay": "pass"}, weights_agree=True))
    text = text_of(suspect)
    assert value(text, "sdc_suspect", check="replay") == 1
    assert value(text, "sdc_suspect", check="weights") == 0
    assert value(text, "sdc_incidents_total", check="replay") == 1
    assert value(text_of(bystander), "sdc_suspect", check="replay") == 0
    assert value(text_of(bystander), "sdc_incidents_total", check="replay") == 1


def test_numerics_event_is_counted_as_an_incident_without_a_suspect(make: Any) -> None:
    """A numerics event (every rank non-finite) increments sdc_incidents_total and leaves sdc_suspect at 0."""
    t = make()
    event = Incident(step=2, check="grad_local", suspect_ranks=(), suspects=(), evidence={"verdict": "numerics"})
    assert event.numerics
    t.report(StepReport(step=2, results={"grad_local": "fail"}, incidents=(event,)))
    text = text_of(t)
    assert value(text, "sdc_incidents_total", check="grad_local") == 1
    assert value(text, "sdc_suspect", check="grad_local") == 0


def test_nonfinite_values_scrape_as_inf_without_warnings(make: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A NaN/Inf norm or replay delta is scraped as +Inf each step (not frozen, no SDK warning) and counted."""
    reader = InMemoryMetricReader()
    t = make(served(), readers=[reader])
    t.report(StepReport(step=0, grad_norms={"local": 1.5, "reduced": 1.5}))
    with caplog.at_level(logging.WARNING):
        for step in (1, 2):
            t.report(StepReport(step=step, grad_norms={"local": float("nan"), "reduced": float("inf")},
                                replay=ReplayDeltas(loss_delta=float("nan"), grad_delta=0.5, mismatch=True)))
        text = scrape(t.port)
    assert caplog.records == []
    assert value(text, "sdc_grad_norm", phase="local") == math.inf
    assert value(text, "sdc_grad_norm", phase="reduced") == math.inf
    assert value(text, "sdc_replay_loss_delta") == math.inf
    assert value(text, "sdc_grad_nonfinite_total", phase="local") == 2
    assert any(line.startswith("sdc_grad_norm{") and 'phase="local"' in line and line.endswith(" +Inf")
               for line in text.splitlines())
    norms = [p.value for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
             for m in sm.metrics if m.name == family("sdc_grad_norm").otel_name for p in m.data.data_points]
    assert norms == [NONFINITE, NONFINITE]  # other readers (OTLP) get the largest float
    t.report(StepReport(step=3, grad_norms={"local": 0.5}))
    assert value(scrape(t.port), "sdc_grad_norm", phase="local") == 0.5


def test_sample_count_is_bounded_and_fixed(make: Any) -> None:
    """A rank serves at most 200 sdc_ samples, and the same series after 2 audits as after 24 more (ambiguous
    suspects and pager failures included)."""
    t = make(served(grad_checks=True, weights_every=1, replay_every=1, alertmanager_url=AM_URL))

    def series() -> set[tuple[str, tuple[tuple[str, str], ...]]]:
        return {(n, tuple(sorted(lab.items()))) for n, lab, _ in samples(scrape(t.port)) if n.startswith("sdc_")}

    for step in range(2):
        t.report(full_report(step, replay=ReplayDeltas(loss_delta=1e-6 * step, grad_delta=1e-5, mismatch=False)))
    after_two = series()
    for step in range(2, 26):
        t.report(full_report(step, replay=ReplayDeltas(loss_delta=1e-6 * step, grad_delta=1e-5, mismatch=step == 7),
                             suspect_checks=tuple(CHECKS), ambiguous_checks=("replay",)))
        t.internal_error("alertmanager")
    after_more = series()
    assert len(after_two) <= 200
    assert after_more == after_two


def test_malformed_report_is_logged_once_counted_and_never_raises(make: Any,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """An unknown result, check or phase raises nothing: logged once (naming it), counted as telemetry."""
    t = make()
    with caplog.at_level(logging.WARNING, logger="sdc_telemetry"):
        t.report(StepReport(step=0, results={"weights": "ok"}))
        t.report(StepReport(step=1, results={"gradient": "pass"}))
        t.report(StepReport(step=2, grad_norms={"global": 1.0}))
        t.report("step 3")  # type: ignore[arg-type]
    assert "'ok'" in caplog.text and "pass|fail|error|skipped" in caplog.text
    assert caplog.text.count("recording a step report failed") == 1
    t.report(StepReport(step=4, results={"weights": "pass"}))
    text = text_of(t)
    assert value(text, "sdc_internal_errors_total", component="telemetry") == 4
    assert value(text, "sdc_steps_total") == 1
    assert value(text, "sdc_checks_total", check="weights", result="pass") == 1
    assert value(text, "sdc_checks_total", check="gradient", result="pass") is None


def test_close_keeps_the_endpoint_until_the_closed_gauge_is_scraped(make: Any) -> None:
    """Once scraped, close() sets sdc_monitor_closed to 1 and serves until a scrape has read it, then stops."""
    reader = InMemoryMetricReader()
    t = make(served(), readers=[reader], close_scrape_wait_s=8.0)
    assert value(scrape(t.port), "sdc_monitor_closed") == 0  # Prometheus is watching

    def closed() -> float:
        return next(p.value for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                    for m in sm.metrics if m.name == family("sdc_monitor_closed").otel_name
                    for p in m.data.data_points)

    closer = threading.Thread(target=t.close)
    closer.start()
    run_until(lambda: closed() == 1)
    assert closer.is_alive()  # held open by the missing final scrape (the bound here is 8 s)
    assert value(scrape(t.port), "sdc_monitor_closed") == 1
    closer.join(timeout=10)
    assert not closer.is_alive()
    with pytest.raises(urllib.error.URLError):
        scrape(t.port)


def test_close_never_scraped_does_not_wait(make: Any) -> None:
    """An endpoint nobody ever scraped closes at once, even with a huge close_scrape_wait_s."""
    t = make(served(), close_scrape_wait_s=3600)
    closer = threading.Thread(target=t.close)
    closer.start()
    closer.join(timeout=30)
    assert not closer.is_alive()


def test_close_wait_is_bounded_by_the_scrape_interval_and_the_cap(make: Any) -> None:
    """Without a final scrape, close() gives up after 1.5 observed scrape intervals, or close_scrape_wait_s."""
    by_interval = make(served(), close_scrape_wait_s=3600)
    scrape(by_interval.port)
    scrape(by_interval.port)  # an interval of milliseconds
    by_cap = make(served(), close_scrape_wait_s=0.1)
    scrape(by_cap.port)  # one scrape: interval unknown, the cap applies
    for t in (by_interval, by_cap):
        closer = threading.Thread(target=t.close)
        closer.start()
        closer.join(timeout=30)
        assert not closer.is_alive()


def test_close_scrape_wait_must_be_a_finite_non_negative_number() -> None:
    """close_scrape_wait_s=-1 or NaN is a ValueError naming the argument."""
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="close_scrape_wait_s"):
            Telemetry(cfg(), IDENT, close_scrape_wait_s=bad)


def test_port_in_use_logs_the_port_counts_and_training_continues(make: Any,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A taken port is logged with the port and a free base to use, counted as exporter error, recording goes on."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="sdc_telemetry"):
            t = make(cfg(metrics_port=port - IDENT.local_rank))
        assert t.port is None
        t.report(StepReport(step=0))
        text = text_of(t)
    assert value(text, "sdc_internal_errors_total", component="exporter") == 1
    assert value(text, "sdc_steps_total") == 1
    message = caplog.text
    assert f"127.0.0.1:{port}" in message and "in use" in message and "for example" in message


def test_metrics_port_none_serves_nothing(make: Any) -> None:
    """metrics_port=None starts no HTTP server thread."""
    before = set(threading.enumerate())
    t = make(cfg(metrics_port=None))
    assert t.port is None and t._server is None
    assert set(threading.enumerate()) - before == set()


def test_close_stops_server_and_threads(make: Any) -> None:
    """close() stops the endpoint, the XID watcher and the OTLP reader: no thread is left, the port is free again."""
    time.sleep(0.05)
    before = set(threading.enumerate())
    config = served(otlp_endpoint=f"http://127.0.0.1:{free_port()}/v1/metrics")
    t = make(config, nvml=FakeNVML(IDENT.hw_id), otlp_interval_s=60, otlp_timeout_s=0.5)
    t.report(full_report())
    port = t.port
    assert "sdc_steps_total" in scrape(port)
    assert set(threading.enumerate()) - before
    t.close()
    run_until(lambda: not set(threading.enumerate()) - before)  # the last request's worker finishes on its own
    with pytest.raises(urllib.error.URLError):
        scrape(port)
    with socket.create_server(("127.0.0.1", port)):
        pass
    assert "sdc_steps_total" not in text_of(t)  # the served registry is left empty


def test_second_close_only_warns(make: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A second close() logs a warning and raises nothing."""
    t = make()
    t.close()
    with caplog.at_level(logging.WARNING, logger="sdc_telemetry"):
        t.close()
    assert "already closed" in caplog.text


def test_otlp_unreachable_is_counted_and_close_returns(make: Any) -> None:
    """With a refused OTLP endpoint failures are counted as otlp, and close() returns and leaves no thread."""
    before = set(threading.enumerate())
    t = make(cfg(otlp_endpoint=f"http://127.0.0.1:{free_port()}/v1/metrics"), otlp_interval_s=0.05,
             otlp_timeout_s=0.5)
    for step in range(50):
        t.report(StepReport(step=step, results={"weights": "pass"}, durations={"weights": 1e-4}))
    run_until(lambda: bool(value(text_of(t), "sdc_internal_errors_total", component="otlp")))
    closer = threading.Thread(target=t.close)
    closer.start()
    closer.join(timeout=30)
    assert not closer.is_alive()
    assert set(threading.enumerate()) - before == set()


def test_otlp_endpoint_that_never_answers_bounds_close(make: Any) -> None:
    """A collector that accepts connections but never replies does not hold close() forever."""
    with socket.create_server(("127.0.0.1", 0)) as blackhole:
        port = blackhole.getsockname()[1]
        t = make(cfg(otlp_endpoint=f"http://127.0.0.1:{port}/v1/metrics"), otlp_interval_s=60, otlp_timeout_s=0.5)
        t.report(StepReport(step=0))
        closer = threading.Thread(target=t.close)
        closer.start()
        closer.join(timeout=30)
        assert not closer.is_alive()


def test_internal_error_counts_by_component(make: Any) -> None:
    """internal_error(component) outside a report increments sdc_internal_errors_total{component}."""
    t = make()
    t.internal_error("alertmanager")
    t.internal_error("alertmanager")
    t.internal_error("otlp")
    text = text_of(t)
    assert value(text, "sdc_internal_errors_total", component="alertmanager") == 2
    assert value(text, "sdc_internal_errors_total", component="otlp") == 1


def test_pager_failures_count_each_failed_push_from_zero(make: Any) -> None:
    """sdc_pager_failures_total exists at 0 (with alertmanager_url, so does the alertmanager error component); each
    failure of the direct push (the pager's on_error: internal_error("alertmanager"), or an "alertmanager" error in
    a report) adds 1; other components do not."""
    t = make(cfg(alertmanager_url=AM_URL))
    text = text_of(t)
    assert value(text, "sdc_pager_failures_total") == 0
    assert value(text, "sdc_internal_errors_total", component="alertmanager") == 0
    for _ in range(3):
        t.internal_error(telemetry_mod.PAGER_COMPONENT)
    t.internal_error("otlp")
    t.report(StepReport(step=1, errors=("alertmanager", "replay")))
    text = text_of(t)
    assert value(text, "sdc_pager_failures_total") == 4
    assert value(text, "sdc_internal_errors_total", component="alertmanager") == 4
    bare = text_of(make())  # no Alertmanager configured: the counter is there at 0, the component is not
    assert value(bare, "sdc_pager_failures_total") == 0
    assert value(bare, "sdc_internal_errors_total", component="alertmanager") is None


def test_ambiguous_suspect_latches_the_ambiguous_gauge_not_sdc_suspect(make: Any) -> None:
    """A check in ambiguous_checks (or an incident naming this rank whose evidence says ambiguous) latches
    sdc_suspect_ambiguous{check}, never sdc_suspect{check}; an unambiguous suspect in the same report still latches
    sdc_suspect. Both start at 0 for every check."""
    t = make()
    text = text_of(t)
    for check in CHECKS:
        assert value(text, "sdc_suspect_ambiguous", check=check) == 0
    replay = Incident(step=4, check="replay", suspect_ranks=(3,), suspects=(IDENT,), evidence={"ambiguous": True})
    weights = Incident(step=4, check="weights", suspect_ranks=(3,), suspects=(IDENT,), evidence={"ambiguous": False})
    t.report(StepReport(step=4, incidents=(replay, weights), suspect_checks=("replay", "weights"),
                        ambiguous_checks=("replay",)))
    # Evidence alone (a report that does not fill ambiguous_checks) is enough.
    grad = Incident(step=5, check="grad_local", suspect_ranks=(3,), suspects=(IDENT,), evidence={"ambiguous": True})
    t.report(StepReport(step=5, incidents=(grad,), suspect_checks=("grad_local",)))
    t.report(StepReport(step=6, results={"replay": "pass"}))
    text = text_of(t)
    assert value(text, "sdc_suspect", check="replay") == 0
    assert value(text, "sdc_suspect_ambiguous", check="replay") == 1
    assert value(text, "sdc_suspect", check="grad_local") == 0
    assert value(text, "sdc_suspect_ambiguous", check="grad_local") == 1
    assert value(text, "sdc_suspect", check="weights") == 1
    assert value(text, "sdc_suspect_ambiguous", check="weights") == 0
    # A bystander of an ambiguous incident latches nothing.
    bystander = make(identity=CPU_IDENT)
    bystander.report(StepReport(step=4, incidents=(replay,)))
    assert value(text_of(bystander), "sdc_suspect_ambiguous", check="replay") == 0


def test_unknown_ambiguous_check_is_a_malformed_report(make: Any) -> None:
    """An ambiguous_checks entry that is not a check is refused like any unknown check (counted as telemetry)."""
    t = make()
    t.report(StepReport(step=1, ambiguous_checks=("gradient",)))
    assert value(text_of(t), "sdc_internal_errors_total", component="telemetry") == 1


def test_nvml_missing_warns_once_and_exports_no_gpu_series(make: Any, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """When NVML cannot start, one warning, internal_errors{nvml}=1, no GPU family, SDC recording continues."""
    def missing(uuid: str) -> None:
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(telemetry_mod._nvml, "RealNVML", missing)
    with caplog.at_level(logging.WARNING, logger="sdc_telemetry"):
        t = make(cfg(nvml=True))
    t.report(StepReport(step=0))
    text = text_of(t)
    assert value(text, "sdc_internal_errors_total", component="nvml") == 1
    assert value(text, "sdc_steps_total") == 1
    assert not {n for n, _, _ in samples(text)} & {f.name for f in GPU}
    assert caplog.text.count("NVML is unavailable") == 1
    assert t.gpu_snapshot() == {}


def test_nvml_not_used_without_a_cuda_device(make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank on CPU (hw_id cpu:...) never opens NVML even with config.nvml."""
    def forbidden(uuid: str) -> None:
        raise AssertionError("NVML opened for a CPU rank")

    monkeypatch.setattr(telemetry_mod._nvml, "RealNVML", forbidden)
    t = make(cfg(nvml=True), identity=CPU_IDENT)
    assert t._gpu is None and t.gpu_snapshot() == {}


def test_nvml_erroring_field_is_left_out_warned_once_and_counted(make: Any,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A failing NVML call drops its series only; repeated scrapes warn once and count once."""
    gpu = FakeNVML(IDENT.hw_id, errors={"temperature": RuntimeError("GPU is lost")})
    t = make(nvml=gpu)
    with caplog.at_level(logging.WARNING, logger="sdc_telemetry"):
        text_of(t)
        text = text_of(t)
    names = {n for n, _, _ in samples(text)}
    assert "hw_temperature_celsius" not in names and "hw_power_watts" in names
    assert value(text, "sdc_internal_errors_total", component="nvml") == 1
    assert caplog.text.count("GPU is lost") == 1


def test_gpu_series_carry_the_gpu_uuid_even_when_identity_differs(make: Any) -> None:
    """GPU series are labelled with the NVML device's UUID; SDC series keep the rank's hw_id."""
    t = make(identity=CPU_IDENT, nvml=FakeNVML("GPU-aaaa"))
    text = text_of(t)
    assert {lab["hw_id"] for n, lab, _ in samples(text) if n == "hw_power_watts"} == {"GPU-aaaa"}
    assert {lab["hw_id"] for n, lab, _ in samples(text) if n == "sdc_steps_total"} == {"cpu:node-a:0"}


def test_gpu_snapshot_is_json_and_names_the_source(make: Any) -> None:
    """gpu_snapshot() is JSON-serialisable, in exported units, and says the values come from a fake."""
    t = make(nvml=FakeNVML.for_demo(IDENT.hw_id))
    snap = json.loads(json.dumps(t.gpu_snapshot()))
    assert snap["hw_id"] == IDENT.hw_id and "simulated" in snap["source"]
    assert snap["hw_power_watts"] == 412.0 and snap["hw_errors_total"]["corrected"] == 3


def test_unknown_dependency_is_a_type_error() -> None:
    """A misspelt keyword (registy=) or the removed scrape_grace_s= is a TypeError, which the monitor logs."""
    with pytest.raises(TypeError):
        Telemetry(cfg(), IDENT, registy=None)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Telemetry(cfg(), IDENT, scrape_grace_s=60)  # type: ignore[call-arg]


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_metrics_endpoint_serves_https_and_closes_idle_connections(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With metrics_tls_cert/key the endpoint serves HTTPS only (a plain-HTTP request gets no metrics); it queues
    128 connections, and one that connects and says nothing is closed after the idle timeout, while scrapes go on."""
    import socket
    import ssl
    import time
    import urllib.request

    from sdc_telemetry.sinks import telemetry as telemetry_module
    from tests._responder import self_signed

    cert, key = self_signed(tmp_path)
    monkeypatch.setattr(telemetry_module._QuietHandler, "timeout", 0.5)
    port = _port()
    t = Telemetry(SDCConfig(metrics_port=port, metrics_host="127.0.0.1", nvml=False, metrics_tls_cert=str(cert),
                            metrics_tls_key=str(key)), RankIdentity(0, 0, "node-t", "cpu:node-t:0"))
    try:
        assert t.port == port and t._server is not None and t._server.request_queue_size == 128
        idle = socket.create_connection(("127.0.0.1", port), timeout=5)  # says nothing, not even a TLS hello
        ctx = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", timeout=5, context=ctx) as r:
            assert b"sdc_monitor_closed" in r.read()
        with pytest.raises(Exception):  # noqa: B017 - plain HTTP to a TLS endpoint: refused one way or another
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                assert b"sdc_monitor_closed" not in r.read()
                raise RuntimeError("not refused")
        start = time.monotonic()
        assert idle.recv(1) == b""  # closed by the server after its idle timeout
        assert time.monotonic() - start < 4
        idle.close()
    finally:
        t.close()


def test_bad_tls_files_are_refused_at_set_up_naming_the_fields(tmp_path: Path) -> None:
    """A certificate without its key is refused by the config; files that cannot be loaded by the monitor at set-up,
    naming both fields."""
    import torch

    import sdc_telemetry as sdc

    with pytest.raises(ValueError, match=r"metrics_tls_cert and SDCConfig\.metrics_tls_key go together"):
        SDCConfig(metrics_tls_cert="/x/cert.pem")
    model = torch.nn.Linear(2, 2)
    bad = tmp_path / "not-a-cert.pem"
    bad.write_text("garbage")
    with pytest.raises(ValueError, match=r"metrics_tls_cert=.* cannot be loaded"):
        sdc.SDCMonitor(model, torch.optim.SGD(model.parameters(), lr=0.1),
                       config=SDCConfig(metrics_port=_port(), metrics_host="127.0.0.1", nvml=False,
                                        metrics_tls_cert=str(bad), metrics_tls_key=str(bad)))
