"""Telemetry: exact scraped names and labels, identity on every series, and the failure modes that must not stop
training (port in use, NVML missing or failing, OTLP unreachable, close leaving nothing behind)."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sdc_telemetry import telemetry as telemetry_mod
from sdc_telemetry.config import SDCConfig
from sdc_telemetry.identity import RankIdentity
from sdc_telemetry.metrics import CHECK_DURATION_BUCKETS, FAMILIES, GPU, IDENTITY_LABELS, SDC, family
from sdc_telemetry.nvml import FakeNVML
from sdc_telemetry.response import Incident
from sdc_telemetry.telemetry import Telemetry

IDENT = RankIdentity(rank=3, local_rank=1, host_name="node-b", hw_id="GPU-11111111-2222-3333-4444-555555555555")
CPU_IDENT = RankIdentity(rank=0, local_rank=0, host_name="node-a", hw_id="cpu:node-a:0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cfg(**kw: Any) -> SDCConfig:
    return SDCConfig(**{"metrics_port": None, "metrics_host": "127.0.0.1", "nvml": False, "job_name": "job", **kw})


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def text_of(t: Telemetry) -> str:
    return generate_latest(t.registry).decode()


def value(text: str, name: str, **labels: str) -> float | None:
    hits = [v for n, lab, v in samples(text) if n == name and all(lab.get(k) == x for k, x in labels.items())]
    assert len(hits) <= 1, f"{name}{labels} is ambiguous"
    return hits[0] if hits else None


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


@pytest.fixture
def make() -> Iterator[Any]:
    made: list[Telemetry] = []

    def build(config: SDCConfig | None = None, identity: RankIdentity = IDENT, **deps: Any) -> Telemetry:
        t = Telemetry(config or cfg(), identity, **deps)
        made.append(t)
        return t

    yield build
    for t in made:
        if not t._closed:
            t.close()


def exercise(t: Telemetry) -> None:
    """Call every Observer method once."""
    t.step_done(0)
    t.check_done("weights", True, 0.0003)
    t.grad_measured("local", 2.5, False)
    t.grad_measured("reduced", float("nan"), True)
    t.replay_measured(1, 0.0, 1e-3, True)
    t.weights_measured(False)
    t.incident(Incident(step=0, check="weights", suspect_ranks=(3,), suspects=(IDENT,)), True)
    t.internal_error("replay")


def test_scraped_names_are_exactly_the_table(make: Any) -> None:
    """Over HTTP, every family of the metric table is scraped under its `name`, and nothing else but target_info."""
    port = free_port()
    t = make(cfg(metrics_port=port - IDENT.local_rank), nvml=FakeNVML(IDENT.hw_id))
    exercise(t)
    t._gpu.device.inject_xid(79)
    deadline = time.monotonic() + 5
    while not t._gpu.xid.counts() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert t.port == port
    text = scrape(port)
    names = {n for n, _, _ in samples(text)}
    expected = set()
    for f in FAMILIES:
        expected |= {f.name + s for s in ("_bucket", "_count", "_sum")} if f.kind == "histogram" else {f.name}
    assert names - {"target_info"} == expected
    types = {fam.name: fam.type for fam in text_string_to_metric_families(text)}
    for f in FAMILIES:
        assert types[f.name.removesuffix("_total") if f.kind == "counter" else f.name] == f.kind


def test_every_series_carries_identity_and_only_its_family_labels(make: Any) -> None:
    """Each series has service_name, service_instance_id, host_name, rank, local_rank, hw_id plus its own labels."""
    t = make(nvml=FakeNVML(IDENT.hw_id))
    exercise(t)
    by_name = {f.name: f for f in FAMILIES}
    for name, labels, _ in samples(text_of(t)):
        if name == "target_info":
            continue
        f = by_name.get(name) or by_name[name.rsplit("_", 1)[0]]
        extra = {"le"} if name.endswith("_bucket") else set()
        assert set(labels) == set(IDENTITY_LABELS) | set(f.labels) | extra, (name, labels)
        assert labels["service_name"] == "job" and labels["service_instance_id"] == "node-b-rank3"
        assert (labels["host_name"], labels["rank"], labels["local_rank"]) == ("node-b", "3", "1")
        assert labels["hw_id"] == IDENT.hw_id


def test_identity_recorded_on_points_when_exporter_cannot_copy_resource(make: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """With an exporter lacking resource_attribute_filter the identity labels are still on every series."""
    monkeypatch.setattr(telemetry_mod, "_READER_PARAMS", telemetry_mod._READER_PARAMS - {"resource_attribute_filter"})
    t = make()
    exercise(t)
    rows = [(n, lab) for n, lab, _ in samples(text_of(t)) if n != "target_info"]
    assert rows and all(set(IDENTITY_LABELS) <= set(lab) for _, lab in rows)
    assert value(text_of(t), "sdc_steps_total", rank="3", service_name="job") == 1


def test_otel_side_uses_the_private_provider_and_resource(make: Any) -> None:
    """Extra readers see the OTel instrument names, and the resource of DESIGN.md section 4."""
    reader = InMemoryMetricReader()
    t = make(readers=[reader])
    exercise(t)
    data = reader.get_metrics_data()
    rm = data.resource_metrics[0]
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
    t.step_done(0)
    t.close()
    assert t.port is None
    points = [p for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
              for m in sm.metrics if m.name == family("sdc_steps_total").otel_name for p in m.data.data_points]
    assert points[0].value == 1 and points[0].attributes["host_name"] == "node-b"
    provider.shutdown()


def test_check_duration_histogram_uses_the_explicit_buckets(make: Any) -> None:
    """sdc_check_duration_seconds has exactly CHECK_DURATION_BUCKETS (+Inf) as bucket bounds."""
    t = make()
    t.check_done("replay", True, 0.0004)
    les = [lab["le"] for n, lab, _ in samples(text_of(t)) if n == "sdc_check_duration_seconds_bucket"]
    assert [float(x) for x in les] == [*CHECK_DURATION_BUCKETS, float("inf")]
    assert value(text_of(t), "sdc_check_duration_seconds_bucket", le="0.0005") == 1
    assert value(text_of(t), "sdc_check_duration_seconds_bucket", le="0.00025") == 0


def test_check_done_counts_results_and_creates_the_fail_series_at_zero(make: Any) -> None:
    """The first pass of a check also exposes its fail counter at 0, so the first failure is an increase."""
    t = make()
    before = time.time()
    t.check_done("grad_local", True, 0.001)
    t.check_done("grad_local", True, 0.001)
    text = text_of(t)
    assert value(text, "sdc_checks_total", check="grad_local", result="pass") == 2
    assert value(text, "sdc_checks_total", check="grad_local", result="fail") == 0
    assert (value(text, "sdc_check_last_run_timestamp_seconds", check="grad_local") or 0) >= before
    t.check_done("grad_local", False, 0.001)
    assert value(text_of(t), "sdc_checks_total", check="grad_local", result="fail") == 1


def test_series_alerts_need_exist_at_zero_from_the_start(make: Any) -> None:
    """Steps, incidents and suspect per check, non-finite per phase, weight mismatches start at 0."""
    text = text_of(make(cfg(grad_checks=True, weights_every=1)))
    assert value(text, "sdc_steps_total") == 0
    for check in ("grad_local", "grad_reduced", "replay", "weights"):
        assert value(text, "sdc_incidents_total", check=check) == 0
        assert value(text, "sdc_suspect", check=check) == 0
    for phase in ("local", "reduced"):
        assert value(text, "sdc_grad_nonfinite_total", phase=phase) == 0
    assert value(text, "sdc_weight_fingerprint_mismatches_total") == 0
    assert value(text, "sdc_internal_errors_total", component="exporter") == 0


def test_observer_methods_record_their_families(make: Any) -> None:
    """Gradient, replay, weight and internal-error calls land in their families with the right labels."""
    t = make()
    exercise(t)
    text = text_of(t)
    assert value(text, "sdc_steps_total") == 1
    assert value(text, "sdc_grad_norm", phase="local") == 2.5
    assert value(text, "sdc_grad_nonfinite_total", phase="reduced") == 1
    assert value(text, "sdc_grad_nonfinite_total", phase="local") == 0
    assert value(text, "sdc_replay_grad_delta", origin_rank="1") == 1e-3
    assert value(text, "sdc_replay_loss_delta", origin_rank="1") == 0
    assert value(text, "sdc_replay_mismatches_total", origin_rank="1") == 1
    assert value(text, "sdc_weight_fingerprint_agreement") == 0
    assert value(text, "sdc_weight_fingerprint_mismatches_total") == 1
    assert value(text, "sdc_internal_errors_total", component="replay") == 1


def test_suspect_latches_and_incidents_count_on_every_rank(make: Any) -> None:
    """sdc_suspect{check} stays 1 once this rank was suspected; a bystander counts the incident but stays 0."""
    suspect, bystander = make(), make(identity=CPU_IDENT)
    inc = Incident(step=4, check="replay", suspect_ranks=(3,), suspects=(IDENT,))
    suspect.incident(inc, True)
    bystander.incident(inc, False)
    suspect.weights_measured(True)
    suspect.incident(Incident(step=9, check="weights", suspect_ranks=(0,), suspects=(CPU_IDENT,)), False)
    text = text_of(suspect)
    assert value(text, "sdc_suspect", check="replay") == 1
    assert value(text, "sdc_suspect", check="weights") == 0
    assert value(text, "sdc_incidents_total", check="replay") == 1
    assert value(text_of(bystander), "sdc_suspect", check="replay") == 0
    assert value(text_of(bystander), "sdc_incidents_total", check="replay") == 1


def test_port_in_use_logs_the_port_counts_and_training_continues(make: Any,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A taken port is logged with the port and a free base to use, counted as exporter error, recording goes on."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="sdc_telemetry"):
            t = make(cfg(metrics_port=port - IDENT.local_rank))
        assert t.port is None
        t.step_done(0)
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
    port = free_port()
    t = make(cfg(metrics_port=port - IDENT.local_rank, otlp_endpoint=f"http://127.0.0.1:{free_port()}/v1/metrics"),
             nvml=FakeNVML(IDENT.hw_id), otlp_interval_s=60, otlp_timeout_s=0.5)
    exercise(t)
    assert "sdc_steps_total" in scrape(port)
    assert set(threading.enumerate()) - before
    t.close()
    deadline = time.monotonic() + 5
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.02)  # the last request's worker thread finishes on its own
    assert set(threading.enumerate()) - before == set()
    with pytest.raises(urllib.error.URLError):
        scrape(port)
    with socket.create_server(("127.0.0.1", port)):
        pass


def test_second_close_only_warns(make: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A second close() logs a warning and raises nothing."""
    t = make()
    t.close()
    with caplog.at_level(logging.WARNING, logger="sdc_telemetry"):
        t.close()
    assert "already closed" in caplog.text


def test_otlp_unreachable_never_stalls_training(make: Any) -> None:
    """With a refused OTLP endpoint recording stays fast, failures are counted, and close() is bounded."""
    before = set(threading.enumerate())
    t = make(cfg(otlp_endpoint=f"http://127.0.0.1:{free_port()}/v1/metrics"), otlp_interval_s=0.05,
             otlp_timeout_s=0.5)
    start = time.perf_counter()
    for step in range(500):
        t.step_done(step)
        t.check_done("weights", True, 1e-4)
    assert time.perf_counter() - start < 2.0
    deadline = time.monotonic() + 10
    while not value(text_of(t), "sdc_internal_errors_total", component="otlp") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (value(text_of(t), "sdc_internal_errors_total", component="otlp") or 0) >= 1
    start = time.perf_counter()
    t.close()
    assert time.perf_counter() - start < 5.0
    assert set(threading.enumerate()) - before == set()


def test_otlp_endpoint_that_never_answers_bounds_close(make: Any) -> None:
    """A collector that accepts connections but never replies holds close() for at most the export timeout."""
    with socket.create_server(("127.0.0.1", 0)) as blackhole:
        port = blackhole.getsockname()[1]
        t = make(cfg(otlp_endpoint=f"http://127.0.0.1:{port}/v1/metrics"), otlp_interval_s=60, otlp_timeout_s=0.5)
        start = time.perf_counter()
        for step in range(200):
            t.step_done(step)
        assert time.perf_counter() - start < 1.0
        start = time.perf_counter()
        t.close()
        assert time.perf_counter() - start < 4.0


def test_nvml_missing_warns_once_and_exports_no_gpu_series(make: Any, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """When NVML cannot start, one warning, internal_errors{nvml}=1, no GPU family, SDC recording continues."""
    def missing(uuid: str) -> None:
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(telemetry_mod._nvml, "RealNVML", missing)
    with caplog.at_level(logging.WARNING, logger="sdc_telemetry"):
        t = make(cfg(nvml=True))
    t.step_done(0)
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
    """A misspelt keyword (registy=) is a TypeError, which the monitor logs."""
    with pytest.raises(TypeError):
        Telemetry(cfg(), IDENT, registy=None)  # type: ignore[call-arg]


def test_close_after_an_incident_waits_for_one_scrape(make: Any) -> None:
    """An incident not yet scraped keeps the endpoint up in close() until Prometheus has read it."""
    t = make(cfg(metrics_port=free_port(), on_suspect="raise"), scrape_grace_s=30)
    inc = Incident(step=1, check="weights", suspect_ranks=(3,), suspects=(IDENT,), evidence={})
    t.incident(inc, is_suspect=True)
    closer = threading.Thread(target=t.close)
    closer.start()
    time.sleep(0.3)
    assert closer.is_alive()  # still serving: nobody has scraped the incident yet
    assert value(scrape(t.port), "sdc_suspect", check="weights") == 1
    closer.join(timeout=10)
    assert not closer.is_alive()


def test_close_does_not_wait_without_an_unscraped_incident(make: Any) -> None:
    """No incident, or one already scraped: close() returns at once; the wait is bounded by scrape_grace_s."""
    t = make(cfg(metrics_port=free_port()), scrape_grace_s=30)
    t.incident(Incident(step=1, check="weights", suspect_ranks=(3,), suspects=(IDENT,), evidence={}), True)
    scrape(t.port)
    closer = threading.Thread(target=t.close)
    closer.start()
    closer.join(timeout=5)
    assert not closer.is_alive()
    bounded = make(cfg(metrics_port=free_port()), scrape_grace_s=0.2)
    bounded.incident(Incident(step=1, check="replay", suspect_ranks=(3,), suspects=(IDENT,), evidence={}), True)
    closer = threading.Thread(target=bounded.close)
    closer.start()
    closer.join(timeout=5)
    assert not closer.is_alive()
