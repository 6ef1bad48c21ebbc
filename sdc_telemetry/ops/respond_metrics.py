"""The responder's Prometheus registry: its counters, and ``sdc_fleet_gpu_strikes`` read from the ledger at scrape
time."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from sdc_telemetry.ops.ledger import GPURecord, LedgerError
from sdc_telemetry.sinks.metrics import family

__all__ = ["ResponderMetrics"]

log = logging.getLogger("sdc_telemetry")

_STRIKES = family("sdc_fleet_gpu_strikes")  # the one metric table spells the name and its labels


class _FleetCollector:
    """``sdc_fleet_gpu_strikes{hw_id,host_name}``, read from the ledger at scrape time."""

    def __init__(self, read_fleet: Callable[[], Sequence[GPURecord]], ledger_errors: Counter) -> None:
        self._read_fleet = read_fleet
        self._ledger_errors = ledger_errors

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(_STRIKES.name, _STRIKES.description, labels=list(_STRIKES.labels))
        try:
            fleet = self._read_fleet()
        except LedgerError as e:
            log.error("sdc responder: cannot read the ledger for /metrics: %s", e)
            self._ledger_errors.inc()
            fleet = []
        for gpu in fleet:
            if gpu.strikes_in_window:
                g.add_metric([gpu.hw_id, gpu.host_name], float(gpu.strikes_in_window))
        yield g


class ResponderMetrics:
    """The responder's counters in their own registry; ``read_fleet`` returns the ledger's GPUs for the strike gauge
    (a :class:`~sdc_telemetry.ops.ledger.LedgerError` there is logged and counted in ``ledger_errors``)."""

    def __init__(self, read_fleet: Callable[[], Sequence[GPURecord]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.notifications = Counter("sdc_responder_notifications", "Well-formed notifications received.",
                                     registry=reg)
        self.actions = Counter("sdc_responder_actions", "Commands started (or logged in a dry run), by action: "
                               "command (the drain) or replace (a GPU's second strike).", ["action"], registry=reg)
        self.failures = Counter("sdc_responder_failures", "Commands that did not succeed, by action.", ["action"],
                                registry=reg)
        self.refusals = Counter("sdc_responder_refusals", "Alerts not acted on, by reason: cap (over the hourly "
                                "cap) or invalid_label (a label unfit for a command).", ["reason"], registry=reg)
        self.ignored = Counter("sdc_responder_ignored_alerts", "Firing alerts this responder does not act on, by "
                               "reason: not_critical, foreign (not an SDC alert), ambiguous.", ["reason"],
                               registry=reg)
        self.rejected = Counter("sdc_responder_rejected_requests", "HTTP requests refused, by status code.",
                                ["code"], registry=reg)
        self.screens = Counter("sdc_responder_screens", "Screens run after an action, by result: pass, fail, "
                               "error.", ["result"], registry=reg)
        self.ledger_errors = Counter("sdc_responder_ledger_errors", "Ledger reads or writes that failed.",
                                     registry=reg)
        for action in ("command", "replace"):
            self.actions.labels(action)
            self.failures.labels(action)
        for reason in ("cap", "invalid_label"):
            self.refusals.labels(reason)
        for reason in ("not_critical", "foreign", "ambiguous"):
            self.ignored.labels(reason)
        for code in ("400", "401", "404", "411", "413", "415"):
            self.rejected.labels(code)
        for result in ("pass", "fail", "error"):
            self.screens.labels(result)
        reg.register(cast(Any, _FleetCollector(read_fleet, self.ledger_errors)))

    def text(self) -> bytes:
        """The registry in the Prometheus text format (``GET /metrics``)."""
        return bytes(generate_latest(self.registry))
