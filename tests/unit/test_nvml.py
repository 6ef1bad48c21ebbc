"""NVML access: unit conversions, unsupported fields left out, XID counting, identity labels; real NVML on a GPU."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sdc_telemetry.core.config import SDCConfig
from sdc_telemetry.core.identity import RankIdentity
from sdc_telemetry.sinks import gpu as gpu_mod
from sdc_telemetry.sinks import nvml
from sdc_telemetry.sinks.gpu import XidWatcher, read, snapshot
from sdc_telemetry.sinks.metrics import GPU
from sdc_telemetry.sinks.nvml import FakeNVML, NotSupported
from sdc_telemetry.sinks.telemetry import Telemetry

UUID = "GPU-0f3c5a2e-1111-2222-3333-444455556666"
IDENT = RankIdentity(rank=5, local_rank=1, host_name="gpu-node-7", hw_id=UUID)


def gpu_text(device: Any, identity: RankIdentity = IDENT) -> str:
    t = Telemetry(SDCConfig(metrics_port=None, nvml=False), identity, nvml=device)
    try:
        return generate_latest(t.registry).decode()
    finally:
        t.close()


def gpu_series(text: str) -> list[tuple[str, dict[str, str], float]]:
    names = {f.name for f in GPU}
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name in names]


def wait_until(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_unit_conversions() -> None:
    """mW -> W, MHz -> Hz, percent -> 0-1; temperature in Celsius and memory in bytes pass through."""
    gpu = FakeNVML(UUID, values={"power_usage": 312_500, "sm_clock": 1410, "utilization": 55,
                                 "temperature": 71, "memory_used": 3 * 2**30})
    assert read(gpu, "hw_power_watts") == 312.5
    assert read(gpu, "gpu_clock_sm_hertz") == 1.41e9
    assert read(gpu, "hw_gpu_utilization") == 0.55
    assert read(gpu, "hw_temperature_celsius") == 71.0
    assert read(gpu, "hw_gpu_memory_usage_bytes") == 3 * 2**30


def test_labelled_fields() -> None:
    """ECC by error_type, retired pages by cause, remapped rows by kind, NVLink summed over links by type."""
    gpu = FakeNVML(UUID, values={"ecc_corrected": 7, "ecc_uncorrected": 1, "retired_pages_double": 2,
                                 "remapped_rows": (4, 1, 1, 0),
                                 "nvlink_errors": [{"replay": 1, "crc_flit": 2}, {"replay": 3, "recovery": 1}]})
    assert read(gpu, "hw_errors_total") == {"corrected": 7.0, "uncorrected": 1.0}
    assert read(gpu, "gpu_retired_pages") == {"single_bit_ecc": 0.0, "double_bit_ecc": 2.0}
    assert read(gpu, "gpu_remapped_rows") == {"correctable": 4.0, "uncorrectable": 1.0, "pending": 1.0,
                                              "failure": 0.0}
    assert read(gpu, "gpu_nvlink_errors_total") == {"replay": 4.0, "crc_flit": 2.0, "recovery": 1.0}


def test_clock_event_reasons_decode_the_bit_mask() -> None:
    """Each reason bit becomes a 0/1 series: 0x4|0x40 is sw_power_cap and hw_thermal_slowdown."""
    reasons = read(FakeNVML(UUID, values={"clock_event_reasons": 0x4 | 0x40}), "gpu_clock_event_reasons")
    assert isinstance(reasons, dict)
    assert {k for k, v in reasons.items() if v} == {"sw_power_cap", "hw_thermal_slowdown"}
    assert set(reasons) == set(gpu_mod.CLOCK_EVENT_REASONS.values())


def test_readers_cover_every_gpu_family() -> None:
    """Every GPU family of the table has a reader (XID through the watcher)."""
    assert set(gpu_mod.READ) | {"gpu_xid_errors_total"} == {f.name for f in GPU}


def test_unsupported_fields_are_omitted_not_faked() -> None:
    """Unsupported fields raise NotSupported, are missing from the snapshot and from the scrape."""
    gpu = FakeNVML(UUID, unsupported={"retired_pages", "nvlink_errors", "pcie_replays", "xid"})
    with pytest.raises(NotSupported):
        read(gpu, "gpu_retired_pages")
    snap = snapshot(gpu)
    assert "gpu_retired_pages" not in snap and "gpu_nvlink_errors_total" not in snap
    assert snap["hw_power_watts"] == 250.0
    names = {n for n, _, _ in gpu_series(gpu_text(gpu))}
    assert not names & {"gpu_retired_pages", "gpu_nvlink_errors_total", "gpu_pcie_replays_total",
                        "gpu_xid_errors_total"}
    assert {"hw_power_watts", "hw_errors_total", "gpu_remapped_rows"} <= names


def test_no_active_nvlink_is_unsupported() -> None:
    """A GPU without active NVLinks exposes no NVLink series (rather than zeros)."""
    with pytest.raises(NotSupported):
        read(FakeNVML(UUID, values={"nvlink_errors": []}), "gpu_nvlink_errors_total")


def test_xid_events_are_counted_per_code() -> None:
    """Injected XID events are counted per code by the watcher thread and scraped as gpu_xid_errors_total{xid}."""
    gpu = FakeNVML(UUID)
    t = Telemetry(SDCConfig(metrics_port=None, nvml=False), IDENT, nvml=gpu)
    try:
        for code in (79, 79, 48):
            gpu.inject_xid(code)
        assert t._gpu is not None
        wait_until(lambda: sum(t._gpu.xid.counts().values()) == 3)  # type: ignore[union-attr]
        xids = {lab["xid"]: v for n, lab, v in gpu_series(generate_latest(t.registry).decode())
                if n == "gpu_xid_errors_total"}
        assert xids == {"79": 2.0, "48": 1.0}
        assert t.gpu_snapshot()["gpu_xid_errors_total"] == {"48": 1, "79": 2}
    finally:
        t.close()


def test_xid_unsupported_stops_the_watcher() -> None:
    """A device without XID events ends the watcher thread and marks XID unsupported."""
    w = XidWatcher(FakeNVML(UUID, unsupported={"xid"}), on_error=lambda e: None)
    w.start()
    wait_until(lambda: not w.supported)
    w.stop()
    assert not w._thread.is_alive()


def test_xid_errors_are_reported_once_and_the_watcher_stops_cleanly() -> None:
    """A failing event wait is reported once per run of failures; stop() joins the thread."""
    errors: list[BaseException] = []
    w = XidWatcher(FakeNVML(UUID, errors={"xid": RuntimeError("event set broken")}), on_error=errors.append)
    w.start()
    wait_until(lambda: bool(errors))
    w.stop()
    assert len(errors) == 1 and not w._thread.is_alive()


def test_gpu_series_carry_uuid_and_host_labels() -> None:
    """Every GPU series has hw_id = the GPU UUID, host_name, and ECC series hw_type="gpu"."""
    series = gpu_series(gpu_text(FakeNVML(UUID)))
    assert series
    for name, labels, _ in series:
        assert labels["hw_id"] == UUID and labels["host_name"] == "gpu-node-7", (name, labels)
        assert labels["rank"] == "5" and labels["local_rank"] == "1"
        if name == "hw_errors_total":
            assert labels["hw_type"] == "gpu" and labels["error_type"] in ("corrected", "uncorrected")


def test_scraped_gpu_values_are_converted() -> None:
    """The scrape shows watts, hertz and 0-1 utilisation from the fake's NVML units."""
    values = {(n, tuple(sorted(lab.items()))): v for n, lab, v in gpu_series(
        gpu_text(FakeNVML(UUID, values={"power_usage": 100_000, "sm_clock": 1000, "utilization": 25})))}
    flat = {n: v for (n, _), v in values.items()}
    assert flat["hw_power_watts"] == 100.0 and flat["gpu_clock_sm_hertz"] == 1e9 and flat["hw_gpu_utilization"] == 0.25


def test_fake_rejects_unknown_fields_and_demo_is_labelled() -> None:
    """Typos in a fake's field names fail loudly; the demo fake says it is simulated."""
    with pytest.raises(ValueError, match="unknown fields"):
        FakeNVML(UUID, unsupported={"temprature"})
    with pytest.raises(ValueError, match="unknown values"):
        FakeNVML(UUID, values={"power": 1})
    demo = FakeNVML.for_demo(UUID)
    assert "simulated" in demo.source and demo.uuid == UUID
    assert isinstance(demo, nvml.NVMLDevice)


def test_snapshot_reports_failing_fields() -> None:
    """A failing field appears under `errors` in the snapshot instead of a value; the rest is JSON."""
    snap = snapshot(FakeNVML(UUID, errors={"power_usage": RuntimeError("Unknown Error")}))
    assert "hw_power_watts" not in snap and "Unknown Error" in snap["errors"]["hw_power_watts"]
    json.dumps(snap)


def test_real_nvml_over_a_stubbed_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """RealNVML makes existing pynvml calls with the right constants; NOT_SUPPORTED becomes an omitted field."""
    import pynvml

    def fail(code: int) -> Any:
        def raise_(*_: Any) -> Any:
            raise pynvml.NVMLError(code)
        return raise_

    events = [SimpleNamespace(eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=79)]
    released: list[str] = []
    stub: dict[str, Any] = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: released.append("nvml"),
        "nvmlDeviceGetHandleByUUID": lambda uuid: ("handle", uuid),
        "nvmlDeviceGetTotalEccErrors": lambda h, kind, counter: (
            {pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED: 5, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: 1}[kind]
            if counter == pynvml.NVML_VOLATILE_ECC else -1),
        "nvmlDeviceGetTemperature": lambda h, sensor: 61 if sensor == pynvml.NVML_TEMPERATURE_GPU else -1,
        "nvmlDeviceGetPowerUsage": lambda h: 301_000,
        "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=80, memory=10),
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(used=123, free=1, total=124),
        "nvmlDeviceGetRetiredPages": fail(pynvml.NVML_ERROR_NOT_SUPPORTED),
        "nvmlDeviceGetRemappedRows": lambda h: (2, 1, 0, 0),
        "nvmlDeviceGetPcieReplayCounter": lambda h: 4,
        "nvmlDeviceGetNvLinkState": lambda h, link: (1 if link < 2 else fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)()),
        "nvmlDeviceGetNvLinkErrorCounter": lambda h, link, counter: (
            fail(pynvml.NVML_ERROR_NOT_SUPPORTED)() if counter == pynvml.NVML_NVLINK_ERROR_DL_ECC_DATA
            else 10 * link + counter),
        "nvmlDeviceGetClockInfo": lambda h, clock: 1500 if clock == pynvml.NVML_CLOCK_SM else -1,
        "nvmlDeviceGetCurrentClocksEventReasons": lambda h: 0x4,
        "nvmlEventSetCreate": lambda: "event-set",
        "nvmlDeviceRegisterEvents": lambda h, kinds, es: None,
        "nvmlEventSetWait_v2": lambda es, ms: events.pop() if events else fail(pynvml.NVML_ERROR_TIMEOUT)(),
        "nvmlEventSetFree": lambda es: released.append(es),
    }
    for name, fn in stub.items():
        monkeypatch.setattr(pynvml, name, fn)  # raises if pynvml has no such call
    dev = nvml.RealNVML(UUID)
    snap = snapshot(dev)
    assert snap["hw_errors_total"] == {"corrected": 5.0, "uncorrected": 1.0}
    assert snap["hw_temperature_celsius"] == 61.0 and snap["hw_power_watts"] == 301.0
    assert snap["hw_gpu_utilization"] == 0.8 and snap["hw_gpu_memory_usage_bytes"] == 123.0
    assert "gpu_retired_pages" not in snap and "errors" not in snap
    assert snap["gpu_remapped_rows"]["correctable"] == 2.0 and snap["gpu_pcie_replays_total"] == 4.0
    assert snap["gpu_nvlink_errors_total"] == {"replay": 10.0, "recovery": 12.0, "crc_flit": 14.0, "crc_data": 16.0}
    assert snap["gpu_clock_sm_hertz"] == 1.5e9 and snap["gpu_clock_event_reasons"]["sw_power_cap"] == 1.0
    assert dev.wait_xid(0.01) == 79 and dev.wait_xid(0.01) is None
    dev.close()
    dev.close()
    assert released == ["event-set", "nvml"]


def test_real_nvml_raises_for_a_missing_gpu() -> None:
    """RealNVML raises (rather than returning an empty device) when NVML or the UUID is missing."""
    with pytest.raises(Exception):  # noqa: B017 - ImportError, library missing or NotFound depending on host
        nvml.RealNVML("GPU-00000000-dead-beef-0000-000000000000")


def _cuda_uuid() -> str:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    hw_id = RankIdentity.local(torch.device("cuda", 0)).hw_id
    assert hw_id.startswith("GPU-")
    return hw_id


@pytest.mark.gpu
def test_real_nvml_reads_plausible_counters() -> None:
    """On a real GPU the collector reads plausible values in exported units; unsupported fields are just absent."""
    dev = nvml.RealNVML(_cuda_uuid())
    try:
        snap = snapshot(dev)
        json.dumps(snap)
        assert 0 < snap["hw_temperature_celsius"] < 120
        assert 0 <= snap["hw_gpu_utilization"] <= 1
        assert snap["hw_gpu_memory_usage_bytes"] >= 0
        if "hw_power_watts" in snap:
            assert 1 < snap["hw_power_watts"] < 2000
        if "gpu_clock_sm_hertz" in snap:
            assert 1e8 < snap["gpu_clock_sm_hertz"] < 5e9
    finally:
        dev.close()


@pytest.mark.gpu
def test_real_nvml_through_telemetry() -> None:
    """Telemetry on a CUDA rank opens NVML itself and scrapes GPU families labelled with the GPU UUID."""
    uuid = _cuda_uuid()
    ident = RankIdentity(rank=0, local_rank=0, host_name="gpu-host", hw_id=uuid)
    t = Telemetry(SDCConfig(metrics_port=None, nvml=True), ident)
    try:
        series = gpu_series(generate_latest(t.registry).decode())
        names = {n for n, _, _ in series}
        assert {"hw_temperature_celsius", "hw_gpu_memory_usage_bytes"} <= names
        assert all(lab["hw_id"] == uuid for _, lab, _ in series)
    finally:
        t.close()
