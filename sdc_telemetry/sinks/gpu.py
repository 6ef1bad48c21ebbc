"""GPU counters as metrics: NVML fields read at collection time, in the units of the metric table.

``read(device, name)`` turns NVML's units into the family's (mW -> W, MHz -> Hz, percent -> 0-1); ``XidWatcher``
counts XID events on a daemon thread (an NVML event set blocks); ``GPUCollector`` registers one observable instrument
per GPU family, so NVML is read on the scrape or export thread, never on the training thread. Unsupported fields are
left out, never faked; a failing one is logged once and counted::

    read(FakeNVML("GPU-1", values={"power_usage": 300_000}), "hw_power_watts")   # 300.0
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from sdc_telemetry.sinks.metrics import GPU, Family
from sdc_telemetry.sinks.nvml import NotSupported, NVMLDevice

__all__ = ["read", "snapshot", "READ", "XidWatcher", "GPUCollector", "CLOCK_EVENT_REASONS"]

log = logging.getLogger("sdc_telemetry")

_REMAPPED_KINDS = ("correctable", "uncorrectable", "pending", "failure")
# NVML clock event (throttle) reason bits -> the `reason` label.
CLOCK_EVENT_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap",
                       0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
                       0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}


def _each(readers: Mapping[str, Callable[[], float]]) -> dict[str, float]:
    """Read every labelled field, dropping the unsupported ones; ``NotSupported`` when none is supported."""
    out: dict[str, float] = {}
    for label, fn in readers.items():
        try:
            out[label] = float(fn())
        except NotSupported:
            continue
    if not out:
        raise NotSupported("no field supported")
    return out


def _nvlink(device: NVMLDevice) -> dict[str, float]:
    links = device.nvlink_errors()
    if not links:
        raise NotSupported("no active NVLink")
    total: dict[str, float] = {}
    for counters in links:
        for kind, value in counters.items():
            total[kind] = total.get(kind, 0.0) + value
    return total


# Family name -> reading in the family's unit: a number, or {label value: number} for the family's last label.
READ: dict[str, Callable[[NVMLDevice], float | dict[str, float]]] = {
    "hw_errors_total": lambda d: _each({"corrected": lambda: d.ecc_errors(False),
                                        "uncorrected": lambda: d.ecc_errors(True)}),
    "hw_temperature_celsius": lambda d: float(d.temperature()),
    "hw_power_watts": lambda d: d.power_usage() / 1000.0,
    "hw_gpu_utilization": lambda d: d.utilization() / 100.0,
    "hw_gpu_memory_usage_bytes": lambda d: float(d.memory_used()),
    "gpu_retired_pages": lambda d: _each({"single_bit_ecc": lambda: d.retired_pages(False),
                                          "double_bit_ecc": lambda: d.retired_pages(True)}),
    "gpu_remapped_rows": lambda d: dict(zip(_REMAPPED_KINDS, map(float, d.remapped_rows()), strict=True)),
    "gpu_pcie_replays_total": lambda d: float(d.pcie_replays()),
    "gpu_nvlink_errors_total": _nvlink,
    "gpu_clock_sm_hertz": lambda d: d.sm_clock() * 1e6,
    "gpu_clock_event_reasons": lambda d: {name: float(bool(d.clock_event_reasons() & bit))
                                          for bit, name in CLOCK_EVENT_REASONS.items()},
}


def read(device: NVMLDevice, name: str) -> float | dict[str, float]:
    """Family ``name`` read from ``device`` now (``NotSupported`` when the device lacks it)."""
    return READ[name](device)


def snapshot(device: NVMLDevice, xid_counts: Mapping[int, int] | None = None) -> dict[str, Any]:
    """Every supported field of ``device`` now, JSON-serialisable (for an incident's evidence)."""
    out: dict[str, Any] = {"hw_id": device.uuid, "source": device.source}
    for name in READ:
        try:
            out[name] = read(device, name)
        except NotSupported:
            continue
        except Exception as e:  # noqa: BLE001 - evidence is best effort; say what failed instead
            out.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
    if xid_counts is not None:
        out["gpu_xid_errors_total"] = {str(code): n for code, n in sorted(xid_counts.items())}
    return out


class XidWatcher:
    """Counts XID events of one device on a daemon thread (NVML event sets block, so never on the training thread).

    ``supported`` turns False when the device cannot deliver XID events; ``on_error`` is called once per run of
    failures (the thread then retries slowly).
    """

    POLL_S = 0.5

    def __init__(self, device: NVMLDevice, on_error: Callable[[BaseException], None]) -> None:
        self.supported = True
        self._device = device
        self._on_error = on_error
        self._counts: dict[int, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"sdc-xid-{device.uuid[:12]}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def counts(self) -> dict[int, int]:
        with self._lock:
            return dict(self._counts)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5 * self.POLL_S)

    def _run(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                code = self._device.wait_xid(self.POLL_S)
            except NotSupported:
                self.supported = False
                return
            except Exception as e:  # noqa: BLE001 - a failing event set must not kill telemetry
                if not failing:
                    self._on_error(e)
                failing = True
                self._stop.wait(10 * self.POLL_S)
                continue
            failing = False
            if code is not None:
                with self._lock:
                    self._counts[code] = self._counts.get(code, 0) + 1


class GPUCollector:
    """Observable instruments over one GPU, read when a reader collects (scrape or OTLP thread), never on the
    training thread. Unsupported fields are left out; a failing one is logged once and counted as ``nvml``."""

    def __init__(self, device: NVMLDevice, meter: Meter, attrs: dict[str, str],
                 count_error: Callable[[str], None]) -> None:
        self.device = device
        self._attrs = {**attrs, "hw_id": device.uuid}  # host_name comes with the identity labels
        self._count_error = count_error
        self._unsupported: set[str] = set()
        self._failing: set[str] = set()
        self._warned = False
        self.xid = XidWatcher(device, partial(self._failed, "gpu_xid_errors_total"))
        for f in GPU:
            create = meter.create_observable_counter if f.kind == "counter" else meter.create_observable_gauge
            create(f.otel_name, callbacks=[partial(self._observe, f)], unit=f.unit, description=f.description)
        self.xid.start()

    def _read(self, name: str) -> float | dict[str, float]:
        if name == "gpu_xid_errors_total":
            if not self.xid.supported:
                raise NotSupported(name)
            return {str(code): float(n) for code, n in self.xid.counts().items()}
        return read(self.device, name)

    def _observe(self, f: Family, _options: CallbackOptions) -> list[Observation]:
        if f.name in self._unsupported:
            return []
        try:
            value = self._read(f.name)
        except NotSupported:
            self._unsupported.add(f.name)
            log.info("sdc_telemetry: %s does not support %s; the series is left out", self.device.uuid, f.name)
            return []
        except Exception as e:  # noqa: BLE001 - a failing NVML call loses its series, nothing else
            self._failed(f.name, e)
            return []
        self._failing.discard(f.name)
        attrs = {**self._attrs, "hw_type": "gpu"} if "hw_type" in f.labels else self._attrs
        if isinstance(value, dict):
            return [Observation(v, {**attrs, f.labels[-1]: k}) for k, v in value.items()]
        return [Observation(value, attrs)]

    def _failed(self, name: str, error: BaseException) -> None:
        if name in self._failing:
            return
        self._failing.add(name)
        self._count_error("nvml")
        if not self._warned:
            self._warned = True
            log.warning("sdc_telemetry: reading %s of %s from NVML failed (%s: %s); failing GPU series are left out "
                        "and training goes on", name, self.device.uuid, type(error).__name__, error)

    def snapshot(self) -> dict[str, object]:
        return snapshot(self.device, self.xid.counts() if self.xid.supported else None)

    def close(self) -> None:
        self.xid.stop()
