"""Where a step's result goes: telemetry (OpenTelemetry, the Prometheus endpoint, NVML), the incident log and the
Alertmanager pager. Built outside the monitor and handed to it (``SDCMonitor(..., sinks=Sinks(...))``), the way
``prometheus_client`` collectors take ``registry=``: tests pass fakes, and the monitor does not know how telemetry
or the pager are made.

Telemetry never breaks training: every call into a sink is guarded (logged, counted in
``sdc_internal_errors_total{component}``), except ``SDCDetected``. Heavy dependencies (OpenTelemetry) are imported
only when ``Sinks.from_config`` builds the telemetry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sdc_telemetry.core.config import SDCConfig
from sdc_telemetry.core.identity import RankIdentity
from sdc_telemetry.core.incident import Incident, SDCDetected
from sdc_telemetry.sinks.incident_log import IncidentLog
from sdc_telemetry.sinks.observer import Observer, StepReport

__all__ = ["Sinks"]

log = logging.getLogger("sdc_telemetry")


class Sinks:
    """The observer (telemetry), the incident log and the pager of one rank; each may be absent.

    ``writer``: this rank writes the log lines of incidents (the first rank of the group, so a line is not
    repeated by every rank). ``log_error``: why the configured incident log could not be opened (agreed at set-up
    so that every rank stops with the same error)."""

    def __init__(self, observer: Observer | None = None, *, incident_log: IncidentLog | None = None,
                 pager: Any = None, writer: bool = True, log_error: str | None = None) -> None:
        self.observer = observer if observer is not None else Observer()
        self.incident_log = incident_log
        self.pager = pager
        self.writer = writer
        self.log_error = log_error
        self.rank = -1

    @classmethod
    def from_config(cls, config: SDCConfig, identity: RankIdentity, *, writer: bool, observer: Observer | None = None,
                    registry: Any = None, meter_provider: Any = None, nvml: Any = None) -> Sinks:
        """What ``config`` asks for: telemetry (unless ``observer`` replaces it), the incident log and the pager on
        the writer rank."""
        incident_log, log_error = None, None
        if writer and config.incident_dir:
            try:
                incident_log = IncidentLog(config.incident_dir)
            except OSError as e:
                log_error = f"SDCConfig.incident_dir={config.incident_dir!r} is not usable: {e}"
        telemetry = observer if observer is not None else _telemetry(config, identity, registry, meter_provider, nvml)
        # A metrics_host no interface of this machine has (or that does not resolve) is a configuration error, agreed
        # at set-up like the incident log's; a port already in use is not (the endpoint is skipped, training goes on).
        log_error = log_error or getattr(telemetry, "setup_error", None)
        sinks = cls(telemetry, incident_log=incident_log, writer=writer, log_error=log_error)
        if config.alertmanager_url and writer:
            sinks.pager = _pager(config, sinks.observer)
        return sinks

    # -- what the monitor hands on -------------------------------------------------------------------------------

    def opened(self, incident: Incident) -> None:
        """A new episode: one log line, one JSONL record, one page (for incidents with suspects)."""
        if self.writer:
            (log.warning if incident.numerics else log.error)("%s", incident.describe())
        if self.incident_log is not None:
            self.guard("incident_log", self.incident_log.append, incident)
        if self.pager is not None and incident.suspect_ranks:
            self.guard("alertmanager", self.pager.page, incident)

    def touched(self, incident: Incident) -> None:
        """An open episode reached a repeat milestone: an update line and record, a refreshed page."""
        if self.writer:
            log.warning("sdc_telemetry: incident of step %d (check=%s) still ongoing at step %d: %d findings",
                        incident.step, incident.check, incident.last_step, incident.count)
        if self.incident_log is not None:
            self.guard("incident_log", self.incident_log.update, incident)
        if self.pager is not None and incident.suspect_ranks:
            self.guard("alertmanager", self.pager.page, incident)

    def closed(self, incident: Incident) -> None:
        """An episode ended (its check passed on every rank, or another finding replaced it): the pager resolves
        its alert and stops re-sending it."""
        resolve = getattr(self.pager, "resolve", None)
        if resolve is not None and incident.suspect_ranks:
            self.guard("alertmanager", resolve, incident)

    def report(self, report: StepReport) -> None:
        self.guard("telemetry", self.observer.report, report)
        if self.incident_log is not None and self.incident_log.held:  # a failed write, written when it can be
            self.guard("incident_log", self.incident_log.retry)

    def gpu_snapshot(self) -> dict[str, object] | None:
        snap: dict[str, object] | None = self.guard("telemetry", self.observer.gpu_snapshot)
        return snap

    def internal_error(self, component: str) -> None:
        self.guard("telemetry", self.observer.internal_error, component)

    def flush(self, timeout_s: float = 2.0) -> None:
        """What the monitor calls right before it raises ``SDCDetected``, so that nothing a rank must hand on is
        still in flight when the ranks start to exit: waits at most ``timeout_s`` until Alertmanager accepted the
        pending page (a page still pending then keeps being retried until ``close()``). The incident log needs no
        flush (each record is written and fsynced when appended). Never raises."""
        flush = getattr(self.pager, "flush", None)
        if flush is None:
            return
        delivered = self.guard("alertmanager", flush, timeout_s)
        if delivered is False:
            log.warning("sdc_telemetry: the page of this incident was not accepted by Alertmanager within %.1fs; "
                        "it is retried until the monitor closes", timeout_s)

    def close(self) -> None:
        """Flush a pending page (bounded), close the log, mark telemetry closed. Never raises."""
        if self.pager is not None:
            self.guard("alertmanager", self.pager.close)
        if self.incident_log is not None:
            self.guard("incident_log", self.incident_log.close)
        self.guard("telemetry", self.observer.close)

    def guard(self, component: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn``; a failure is logged and counted, never raised (``SDCDetected`` passes through)."""
        try:
            return fn(*args, **kwargs)
        except SDCDetected:
            raise
        except Exception:  # telemetry and bookkeeping never break training
            log.exception("sdc_telemetry: %s failed (rank %d); training goes on", component, self.rank)
            if component != "telemetry":
                try:
                    self.observer.internal_error(component)
                except Exception:
                    log.debug("sdc_telemetry: counting an internal error failed", exc_info=True)
            return None


def _telemetry(config: SDCConfig, identity: RankIdentity, registry: Any, meter_provider: Any, nvml: Any) -> Observer:
    try:
        from sdc_telemetry.sinks.telemetry import Telemetry
    except ImportError:
        log.warning("sdc_telemetry: OpenTelemetry is not importable; checks go on without metrics", exc_info=True)
        return Observer()
    try:
        telemetry: Observer = Telemetry(config, identity, registry=registry, meter_provider=meter_provider, nvml=nvml)
        return telemetry
    except Exception:
        log.exception("sdc_telemetry: telemetry could not start; checks go on without metrics")
        return Observer()


def _pager(config: SDCConfig, observer: Observer) -> Any:
    assert config.alertmanager_url is not None
    try:
        from sdc_telemetry.sinks.pager import AlertmanagerPusher

        return AlertmanagerPusher(config.alertmanager_url, config.job_name,
                                  on_error=lambda: observer.internal_error("alertmanager"))
    except Exception:
        log.exception("sdc_telemetry: the Alertmanager push could not start; pages depend on Prometheus")
        return None
