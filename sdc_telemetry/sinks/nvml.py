"""NVML access for one GPU: the calls the GPU collector needs, over nvidia-ml-py or a fake.

``NVMLDevice`` is the protocol, in NVML's own units (mW, MHz, percent). ``RealNVML`` implements it over ``pynvml``;
``FakeNVML`` with values you set, for tests and for the CPU demo (its ``source`` says the values are simulated). A
field the device does not support raises ``NotSupported``; the collector (``sdc_telemetry.sinks.gpu``) leaves it out::

    gpu = FakeNVML("GPU-0f3c...", values={"temperature": 71}, unsupported={"retired_pages"})
    gpu.power_usage()          # 250000.0 (mW, as NVML reports it)
    gpu.inject_xid(79)         # an XID event, as the driver would deliver it
"""

from __future__ import annotations

import queue
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

__all__ = ["NVMLDevice", "NotSupported", "RealNVML", "FakeNVML", "NVLINK_ERRORS"]

# NVML_NVLINK_ERROR_DL_* counter ids -> the `type` label.
NVLINK_ERRORS = {0: "replay", 1: "recovery", 2: "crc_flit", 3: "crc_data", 4: "ecc_data"}


class NotSupported(Exception):
    """The device (or driver) does not provide this field."""


@runtime_checkable
class NVMLDevice(Protocol):
    """The NVML calls the collector makes on one GPU, in NVML's units. Unsupported fields raise ``NotSupported``."""

    uuid: str
    source: str  # "nvml", or a label saying the values are simulated

    def ecc_errors(self, uncorrected: bool) -> int: ...  # volatile ECC error count
    def temperature(self) -> float: ...  # Celsius
    def power_usage(self) -> float: ...  # milliwatts
    def utilization(self) -> float: ...  # percent
    def memory_used(self) -> int: ...  # bytes
    def retired_pages(self, double_bit: bool) -> int: ...
    def remapped_rows(self) -> tuple[int, int, int, int]: ...  # correctable, uncorrectable, pending, failure
    def pcie_replays(self) -> int: ...
    def nvlink_errors(self) -> list[dict[str, int]]: ...  # one {type: count} per active link
    def sm_clock(self) -> float: ...  # MHz
    def clock_event_reasons(self) -> int: ...  # bit mask of gpu.CLOCK_EVENT_REASONS
    def wait_xid(self, timeout_s: float) -> int | None: ...  # next XID code, or None when none came in time
    def close(self) -> None: ...


class RealNVML:
    """``NVMLDevice`` over nvidia-ml-py for the GPU with ``uuid`` (``GPU-...``, as ``RankIdentity.hw_id`` holds).

    Raises (``ImportError``, ``pynvml.NVMLError``) when NVML or the device is missing; the caller degrades.
    """

    source = "nvml"

    def __init__(self, uuid: str) -> None:
        import pynvml

        self._nv: Any = pynvml
        self.uuid = uuid
        pynvml.nvmlInit()
        try:
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except BaseException:
            pynvml.nvmlShutdown()
            raise
        self._events: Any = None
        self._closed = False

    def _call(self, fn: str, *args: Any) -> Any:
        nv = self._nv
        try:
            return getattr(nv, fn)(self._handle, *args)
        except AttributeError as e:  # an older nvidia-ml-py without this call
            raise NotSupported(fn) from e
        except nv.NVMLError as e:
            if e.value in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
                raise NotSupported(fn) from e
            raise

    def ecc_errors(self, uncorrected: bool) -> int:
        kind = self._nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED if uncorrected else self._nv.NVML_MEMORY_ERROR_TYPE_CORRECTED
        return int(self._call("nvmlDeviceGetTotalEccErrors", kind, self._nv.NVML_VOLATILE_ECC))

    def temperature(self) -> float:
        return float(self._call("nvmlDeviceGetTemperature", self._nv.NVML_TEMPERATURE_GPU))

    def power_usage(self) -> float:
        return float(self._call("nvmlDeviceGetPowerUsage"))

    def utilization(self) -> float:
        return float(self._call("nvmlDeviceGetUtilizationRates").gpu)

    def memory_used(self) -> int:
        return int(self._call("nvmlDeviceGetMemoryInfo").used)

    def retired_pages(self, double_bit: bool) -> int:
        cause = (self._nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR if double_bit
                 else self._nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
        return len(self._call("nvmlDeviceGetRetiredPages", cause))

    def remapped_rows(self) -> tuple[int, int, int, int]:
        corr, unc, pending, failure = self._call("nvmlDeviceGetRemappedRows")
        return int(corr), int(unc), int(pending), int(failure)

    def pcie_replays(self) -> int:
        return int(self._call("nvmlDeviceGetPcieReplayCounter"))

    def nvlink_errors(self) -> list[dict[str, int]]:
        links: list[dict[str, int]] = []
        for link in range(self._nv.NVML_NVLINK_MAX_LINKS):
            try:
                if not self._call("nvmlDeviceGetNvLinkState", link):
                    continue
            except NotSupported:
                continue
            except self._nv.NVMLError as e:
                if e.value == self._nv.NVML_ERROR_INVALID_ARGUMENT:  # past the device's last link
                    continue
                raise
            counters: dict[str, int] = {}
            for counter, kind in NVLINK_ERRORS.items():
                try:
                    counters[kind] = int(self._call("nvmlDeviceGetNvLinkErrorCounter", link, counter))
                except NotSupported:
                    continue
            if counters:
                links.append(counters)
        return links

    def sm_clock(self) -> float:
        return float(self._call("nvmlDeviceGetClockInfo", self._nv.NVML_CLOCK_SM))

    def clock_event_reasons(self) -> int:
        try:
            return int(self._call("nvmlDeviceGetCurrentClocksEventReasons"))
        except NotSupported:
            return int(self._call("nvmlDeviceGetCurrentClocksThrottleReasons"))

    def wait_xid(self, timeout_s: float) -> int | None:
        nv = self._nv
        if self._events is None:
            events = nv.nvmlEventSetCreate()
            try:
                self._call("nvmlDeviceRegisterEvents", nv.nvmlEventTypeXidCriticalError, events)
            except BaseException:
                nv.nvmlEventSetFree(events)
                raise
            self._events = events
        try:
            data = nv.nvmlEventSetWait_v2(self._events, int(timeout_s * 1000))
        except nv.NVMLError as e:
            if e.value == nv.NVML_ERROR_TIMEOUT:
                return None
            raise
        return int(data.eventData) if data.eventType == nv.nvmlEventTypeXidCriticalError else None

    def close(self) -> None:
        """Free the event set and release NVML (call after the XID watcher stopped). A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._events is not None:
            self._nv.nvmlEventSetFree(self._events)
        self._nv.nvmlShutdown()


class FakeNVML:
    """An ``NVMLDevice`` with the values you set, for tests and for the CPU demo (its ``source`` says simulated).

    ``values`` overrides ``FakeNVML.DEFAULTS`` (NVML units: ``power_usage`` in mW, ``sm_clock`` in MHz,
    ``utilization`` in percent, ``nvlink_errors`` one dict per link); ``unsupported`` names fields that raise
    ``NotSupported``; ``errors`` maps fields to the exception they raise (an NVML failure). ``inject_xid(code)``
    delivers an XID event. ``set(**values)`` changes values later.

    >>> FakeNVML("GPU-1", values={"power_usage": 300_000}).power_usage()
    300000.0
    """

    DEFAULTS: Mapping[str, Any] = {
        "ecc_corrected": 0, "ecc_uncorrected": 0, "temperature": 45.0, "power_usage": 250_000.0,
        "utilization": 90.0, "memory_used": 40 * 2**30, "retired_pages_single": 0, "retired_pages_double": 0,
        "remapped_rows": (0, 0, 0, 0), "pcie_replays": 0,
        "nvlink_errors": ({"replay": 0, "recovery": 0, "crc_flit": 0, "crc_data": 0},) * 2,
        "sm_clock": 1980.0, "clock_event_reasons": 0,
    }
    FIELDS = frozenset({"ecc_errors", "temperature", "power_usage", "utilization", "memory_used", "retired_pages",
                        "remapped_rows", "pcie_replays", "nvlink_errors", "sm_clock", "clock_event_reasons", "xid"})

    def __init__(self, uuid: str = "GPU-00000000-0000-0000-0000-000000000000", *,
                 values: Mapping[str, Any] | None = None, unsupported: Iterable[str] = (),
                 errors: Mapping[str, BaseException] | None = None,
                 source: str = "fake (simulated counters, no NVML)") -> None:
        self.uuid = uuid
        self.source = source
        self._values = dict(self.DEFAULTS)
        self.set(**(values or {}))
        self.unsupported = frozenset(unsupported)
        self.errors = dict(errors or {})
        unknown = (self.unsupported | set(self.errors)) - self.FIELDS
        if unknown:
            raise ValueError(f"FakeNVML: unknown fields {sorted(unknown)}; known: {sorted(self.FIELDS)}")
        self._xids: queue.Queue[int] = queue.Queue()
        self.closed = False

    @classmethod
    def for_demo(cls, uuid: str) -> FakeNVML:
        """A plausible busy GPU with a few corrected ECC errors, labelled as simulated, for the CPU demo."""
        return cls(uuid, values={"ecc_corrected": 3, "temperature": 67.0, "power_usage": 412_000.0,
                                 "utilization": 97.0, "memory_used": 61 * 2**30, "sm_clock": 1755.0},
                   source="fake (FakeNVML: simulated GPU counters for the CPU demo, not a real device)")

    def set(self, **values: Any) -> None:
        unknown = set(values) - set(self.DEFAULTS)
        if unknown:
            raise ValueError(f"FakeNVML: unknown values {sorted(unknown)}; known: {sorted(self.DEFAULTS)}")
        self._values.update(values)

    def inject_xid(self, code: int) -> None:
        """Deliver one XID event (as the driver would on an Xid error)."""
        self._xids.put(int(code))

    def _get(self, field: str, key: str | None = None) -> Any:
        if field in self.unsupported:
            raise NotSupported(field)
        if field in self.errors:
            raise self.errors[field]
        return self._values[key or field]

    def ecc_errors(self, uncorrected: bool) -> int:
        return int(self._get("ecc_errors", "ecc_uncorrected" if uncorrected else "ecc_corrected"))

    def temperature(self) -> float:
        return float(self._get("temperature"))

    def power_usage(self) -> float:
        return float(self._get("power_usage"))

    def utilization(self) -> float:
        return float(self._get("utilization"))

    def memory_used(self) -> int:
        return int(self._get("memory_used"))

    def retired_pages(self, double_bit: bool) -> int:
        return int(self._get("retired_pages", "retired_pages_double" if double_bit else "retired_pages_single"))

    def remapped_rows(self) -> tuple[int, int, int, int]:
        corr, unc, pending, failure = self._get("remapped_rows")
        return int(corr), int(unc), int(pending), int(failure)

    def pcie_replays(self) -> int:
        return int(self._get("pcie_replays"))

    def nvlink_errors(self) -> list[dict[str, int]]:
        return [dict(link) for link in self._get("nvlink_errors")]

    def sm_clock(self) -> float:
        return float(self._get("sm_clock"))

    def clock_event_reasons(self) -> int:
        return int(self._get("clock_event_reasons"))

    def wait_xid(self, timeout_s: float) -> int | None:
        if "xid" in self.unsupported:
            raise NotSupported("xid")
        if "xid" in self.errors:
            raise self.errors["xid"]
        try:  # short waits: a fake has no reason to hold up close()
            return self._xids.get(timeout=min(timeout_s, 0.05))
        except queue.Empty:
            return None

    def close(self) -> None:
        self.closed = True
