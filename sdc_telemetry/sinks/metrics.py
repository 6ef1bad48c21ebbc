"""The one table of metric families. The exporter, the dashboards and the alert rules all read it; no other module
spells a family name.

``name`` is the Prometheus name as scraped. Every SDC family also carries the identity labels
``IDENTITY_LABELS`` (copied from the OpenTelemetry resource), and every GPU family carries ``host_name`` and ``hw_id``.
``FLEET`` families are not exported by training ranks: the responder (``sdc-telemetry respond``) serves them on its
own ``/metrics``, with their own labels only (no per-rank identity).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Family", "FAMILIES", "SDC", "GPU", "FLEET", "IDENTITY_LABELS", "family", "CHECK_DURATION_BUCKETS",
           "UNIT_SUFFIX"]

Kind = Literal["counter", "gauge", "histogram"]

# Copied from the resource attributes onto every series (service.name -> service_name, host.name -> host_name ...).
IDENTITY_LABELS = ("service_name", "service_instance_id", "host_name", "rank", "local_rank", "hw_id")

# Checks run from ~50 us (gradient bookkeeping on a small model) to seconds (replay of a large step).
CHECK_DURATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                          2.5, 5.0, 10.0)


# The suffix the OpenTelemetry Prometheus exporter appends for each UCUM unit ("1" adds none).
UNIT_SUFFIX = {"1": "", "s": "seconds", "W": "watts", "Cel": "celsius", "By": "bytes", "Hz": "hertz"}


@dataclass(frozen=True)
class Family:
    name: str            # Prometheus family name as scraped (counters without the _total suffix stripped)
    kind: Kind
    unit: str            # UCUM unit of the OpenTelemetry instrument ("1" for dimensionless, "s", "W", "Cel", "By")
    description: str
    labels: tuple[str, ...] = ()
    source: Literal["sdc", "gpu", "fleet"] = "sdc"

    @property
    def otel_name(self) -> str:
        """The OpenTelemetry instrument name, derived so that the Prometheus exporter produces ``name``.

        The exporter turns dots into underscores, appends the unit's suffix and, for counters, ``_total``:
        ``hw.gpu.memory.usage`` (``By``) is scraped as ``hw_gpu_memory_usage_bytes``, ``sdc.steps`` (counter) as
        ``sdc_steps_total``.
        """
        base = self.name.removesuffix("_total") if self.kind == "counter" else self.name
        suffix = UNIT_SUFFIX[self.unit]
        if suffix:
            base = base.removesuffix("_" + suffix)
        return base.replace("_", ".")


# OpenTelemetry refuses NaN/Inf values; the exporter records them as the largest float instead (see telemetry.py).
_NONFINITE = "NaN/Inf is +Inf on the Prometheus endpoint, the largest float over OTLP."

SDC: tuple[Family, ...] = (
    Family("sdc_steps_total", "counter", "1", "Optimizer steps seen by the monitor."),
    Family("sdc_checks_total", "counter", "1",
           "Check outcomes on this rank, by check and result: pass, fail, error (it tried and failed), "
           "skipped (due but could not run). Neither error nor skipped is a pass.", ("check", "result")),
    Family("sdc_check_duration_seconds", "histogram", "s", "Wall time of one check on this rank.", ("check",)),
    Family("sdc_check_last_run_timestamp_seconds", "gauge", "s", "Unix time of the last run of each check.",
           ("check",)),
    Family("sdc_grad_nonfinite_total", "counter", "1",
           "Steps in which this rank's gradients held NaN/Inf, by phase (local before all-reduce, reduced after).",
           ("phase",)),
    Family("sdc_grad_norm", "gauge", "1",
           f"L2 norm of this rank's gradients, by phase. {_NONFINITE}", ("phase",)),
    Family("sdc_replay_loss_delta", "gauge", "1",
           f"Relative loss difference of this rank's last replay of its partner's micro-batches. {_NONFINITE}"),
    Family("sdc_replay_grad_delta", "gauge", "1",
           "Relative gradient-sketch difference of this rank's last replay of its partner's micro-batches. "
           f"{_NONFINITE}"),
    Family("sdc_replay_mismatches_total", "counter", "1",
           "Replay audits in which this rank's recomputation of its partner's micro-batches did not match."),
    Family("sdc_weight_fingerprint_agreement", "gauge", "1",
           "1 when this rank's weight fingerprints agree with the replicas' majority, else 0."),
    Family("sdc_weight_fingerprint_mismatches_total", "counter", "1",
           "Weight checks in which this rank disagreed with the majority."),
    Family("sdc_suspect", "gauge", "1",
           "1 once this rank has been named an unambiguous hardware suspect by a check (latched).", ("check",)),
    Family("sdc_suspect_ambiguous", "gauge", "1",
           "1 once this rank has been named a suspect by an ambiguous verdict of a check (two replicas and no "
           "referee, a single process, a vote without a majority): warned, never paged (latched).", ("check",)),
    Family("sdc_incidents_total", "counter", "1", "Incidents decided, by check (counted on every rank).",
           ("check",)),
    Family("sdc_internal_errors_total", "counter", "1", "Contained failures of the monitor, by component.",
           ("component",)),
    Family("sdc_pager_failures_total", "counter", "1",
           "Failed pushes of this rank's direct page to Alertmanager (an HTTP error, a refused connection, a "
           "timeout, a page still pending at close); a failed push is retried with backoff until accepted "
           "(bounded)."),
    Family("sdc_monitor_closed", "gauge", "1",
           "0 while the monitor runs, 1 once close() ran: an endpoint that vanishes with 0 died, "
           "with 1 ended cleanly."),
)

GPU: tuple[Family, ...] = (
    Family("hw_errors_total", "counter", "1", "GPU ECC errors (volatile), by type.", ("hw_type", "error_type"), "gpu"),
    Family("hw_temperature_celsius", "gauge", "Cel", "GPU temperature.", (), "gpu"),
    Family("hw_power_watts", "gauge", "W", "GPU power draw.", (), "gpu"),
    Family("hw_gpu_utilization", "gauge", "1", "GPU utilisation (0-1).", (), "gpu"),
    Family("hw_gpu_memory_usage_bytes", "gauge", "By", "GPU memory in use.", (), "gpu"),
    Family("gpu_xid_errors_total", "counter", "1", "XID errors reported by the driver, by XID code.", ("xid",),
           "gpu"),
    Family("gpu_retired_pages", "gauge", "1", "Retired memory pages, by cause.", ("cause",), "gpu"),
    Family("gpu_remapped_rows", "gauge", "1", "Remapped memory rows, by kind.", ("kind",), "gpu"),
    Family("gpu_pcie_replays_total", "counter", "1", "PCIe replay counter.", (), "gpu"),
    Family("gpu_nvlink_errors_total", "counter", "1", "NVLink error counters summed over links, by type.",
           ("type",), "gpu"),
    Family("gpu_clock_sm_hertz", "gauge", "Hz", "SM clock.", (), "gpu"),
    Family("gpu_clock_event_reasons", "gauge", "1", "1 while a clock event (throttle) reason is active.",
           ("reason",), "gpu"),
)

# Exported by the responder, not by training ranks (labels: these only, no rank identity).
FLEET: tuple[Family, ...] = (
    Family("sdc_fleet_gpu_strikes", "gauge", "1",
           "Strikes of each GPU in the responder's ledger (acted SDC pages within the strike window).",
           ("hw_id", "host_name"), "fleet"),
)

FAMILIES: tuple[Family, ...] = SDC + GPU + FLEET
_BY_NAME = {f.name: f for f in FAMILIES}


def family(name: str) -> Family:
    """The family called ``name``; ``KeyError`` names the unknown family."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no metric family {name!r} in sdc_telemetry.sinks.metrics") from None
