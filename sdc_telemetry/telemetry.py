"""OpenTelemetry metrics of one rank: the SDC families, this rank's GPU counters, a Prometheus endpoint, OTLP push.

The monitor builds ``Telemetry(config, identity, **deps)`` and calls the ``Observer`` methods on the training thread;
each one records into an SDK instrument (no I/O). The Prometheus endpoint and the OTLP reader collect on their own
threads, and GPU counters are read through observable instruments at that time. Nothing here raises into training:
a port in use, NVML missing or an unreachable collector is logged and counted in ``sdc_internal_errors_total``::

    telemetry = Telemetry(SDCConfig(metrics_port=9860), RankIdentity.local())
    telemetry.step_done(0)                # sdc_steps_total += 1
    telemetry.close()                     # stops the endpoint and the OTLP reader

Every series carries the identity labels (``service_name``, ``service_instance_id``, ``host_name``, ``rank``,
``local_rank``, ``hw_id``): the exporter copies them from the resource where it can (``resource_attribute_filter``),
else they are recorded on each point.
"""

from __future__ import annotations

import atexit
import errno
import inspect
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import prometheus_client
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import Meter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricReader, MetricsData
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource

from . import nvml as _nvml
from .checks import CHECKS
from .config import SDCConfig
from .gpu import GPUCollector
from .identity import RankIdentity
from .metrics import CHECK_DURATION_BUCKETS, SDC, Family, family
from .observer import Observer
from .response import Incident

__all__ = ["Telemetry", "resource_attributes"]

log = logging.getLogger("sdc_telemetry")

# Resource attribute -> the label the exporter makes of it (dots become underscores).
_RESOURCE_LABELS = {"service.name": "service_name", "service.instance.id": "service_instance_id",
                    "host.name": "host_name", "rank": "rank", "local_rank": "local_rank", "hw.id": "hw_id"}
_READER_PARAMS = frozenset(inspect.signature(PrometheusMetricReader.__init__).parameters)


def resource_attributes(config: SDCConfig, identity: RankIdentity) -> dict[str, str | int]:
    """The resource of a rank's metrics (DESIGN.md section 4)."""
    return {"service.name": config.job_name, "service.instance.id": f"{identity.host_name}-rank{identity.rank}",
            "host.name": identity.host_name, "rank": identity.rank, "local_rank": identity.local_rank,
            "hw.id": identity.hw_id}


class Telemetry(Observer):
    """The ``Observer`` that exports. Dependencies are arguments, so tests need no globals:

    - ``registry``: the prometheus-client ``CollectorRegistry`` the endpoint serves (default: a private one).
    - ``meter_provider``: record into this provider instead of a private one (no endpoint, no OTLP; the caller owns
      its resource, so the identity labels are recorded on each point).
    - ``nvml``: the GPU to read (an ``nvml.NVMLDevice``: ``FakeNVML`` on CPU); default real NVML for the rank's
      CUDA device when ``config.nvml``.
    - ``readers``: extra metric readers on the private provider (``InMemoryMetricReader`` in tests).
    - ``otlp_interval_s`` / ``otlp_timeout_s``: push period and per-export bound of the OTLP reader.
    - ``scrape_grace_s``: after an incident, ``close()`` (and, with ``on_suspect="raise"``, interpreter exit) keeps
      the endpoint up until Prometheus has scraped it once more, at most this long. A rank that stops right after
      raising would otherwise take its latched ``sdc_suspect`` with it before any scrape saw it, and nobody is paged.
    """

    def __init__(self, config: SDCConfig, identity: RankIdentity, *,
                 registry: prometheus_client.CollectorRegistry | None = None,
                 meter_provider: MeterProvider | None = None, nvml: _nvml.NVMLDevice | None = None,
                 readers: Sequence[MetricReader] = (), otlp_interval_s: float = 15.0,
                 otlp_timeout_s: float = 5.0, scrape_grace_s: float = 60.0) -> None:
        if meter_provider is not None and readers:
            raise ValueError("Telemetry: pass readers= only without meter_provider= (add them to your provider)")
        self.config = config
        self.identity = identity
        self.registry = registry if registry is not None else prometheus_client.CollectorRegistry()
        self.port: int | None = None  # the port the endpoint listens on, once it does
        self._closed = False
        self._server: Any = None
        self._server_thread: threading.Thread | None = None
        self._moved_collector: Any = None
        self._owns_provider = meter_provider is None
        self._owned_nvml: _nvml.NVMLDevice | None = None
        self._gpu: GPUCollector | None = None
        self._seen: set[tuple[str, str]] = set()
        self._i: dict[str, Any] = {}
        self._scrape_grace_s = scrape_grace_s
        self._last_scrape = 0.0
        self._incident_at: float | None = None
        self._exit_hook = False
        self.registry.register(_ScrapeClock(self))
        labels_from_resource = False
        if meter_provider is None:
            prom, labels_from_resource = self._prometheus_reader()
            all_readers = [prom, *readers]
            if config.otlp_endpoint:
                all_readers.append(_otlp_reader(config.otlp_endpoint, otlp_interval_s, otlp_timeout_s,
                                                self._otlp_failed))
            meter_provider = MeterProvider(
                resource=Resource.create(resource_attributes(config, identity)), metric_readers=all_readers,
                views=[View(instrument_name=family("sdc_check_duration_seconds").otel_name,
                            aggregation=ExplicitBucketHistogramAggregation(boundaries=CHECK_DURATION_BUCKETS))])
        self._provider = meter_provider
        self._attrs: dict[str, str] = {} if labels_from_resource else {
            _RESOURCE_LABELS[k]: str(v) for k, v in resource_attributes(config, identity).items()}
        try:
            meter = meter_provider.get_meter("sdc_telemetry")
            self._i = {f.name: _instrument(meter, f) for f in SDC}
            self._zero(config)
            self._open_gpu(meter, nvml)
            if self._owns_provider:
                self._serve()
        except BaseException:
            self.close()
            raise

    # -- Observer ------------------------------------------------------------------------------------------------

    def step_done(self, step: int) -> None:
        self._i["sdc_steps_total"].add(1, self._attrs)

    def check_done(self, check: str, passed: bool, duration_s: float) -> None:
        if ("check", check) not in self._seen:  # both results exist from the first run, so increase() sees a 0->1
            self._seen.add(("check", check))
            for result in ("pass", "fail"):
                self._i["sdc_checks_total"].add(0, self._a(check=check, result=result))
        self._i["sdc_checks_total"].add(1, self._a(check=check, result="pass" if passed else "fail"))
        self._i["sdc_check_duration_seconds"].record(duration_s, self._a(check=check))
        self._i["sdc_check_last_run_timestamp_seconds"].set(time.time(), self._a(check=check))

    def grad_measured(self, phase: str, norm: float, nonfinite: bool) -> None:
        self._i["sdc_grad_norm"].set(norm, self._a(phase=phase))
        self._i["sdc_grad_nonfinite_total"].add(1 if nonfinite else 0, self._a(phase=phase))

    def replay_measured(self, origin_rank: int, loss_delta: float, grad_delta: float, mismatch: bool) -> None:
        attrs = self._a(origin_rank=str(origin_rank))
        self._i["sdc_replay_loss_delta"].set(loss_delta, attrs)
        self._i["sdc_replay_grad_delta"].set(grad_delta, attrs)
        self._i["sdc_replay_mismatches_total"].add(1 if mismatch else 0, attrs)

    def weights_measured(self, agrees: bool) -> None:
        self._i["sdc_weight_fingerprint_agreement"].set(1 if agrees else 0, self._attrs)
        if not agrees:
            self._i["sdc_weight_fingerprint_mismatches_total"].add(1, self._attrs)

    def incident(self, incident: Incident, is_suspect: bool) -> None:
        self._i["sdc_incidents_total"].add(1, self._a(check=incident.check))
        if is_suspect:  # latched: nothing ever sets it back to 0
            self._i["sdc_suspect"].set(1, self._a(check=incident.check))
        self._incident_at = time.monotonic()
        if self.config.on_suspect == "raise" and self._server is not None and not self._exit_hook:
            self._exit_hook = True  # the exception may end the process without close(): still let one scrape in
            atexit.register(self._await_scrape)

    def internal_error(self, component: str) -> None:
        self._i["sdc_internal_errors_total"].add(1, self._a(component=component))

    def gpu_snapshot(self) -> dict[str, object]:
        if self._gpu is None:
            return {}
        try:
            return self._gpu.snapshot()
        except Exception as e:  # noqa: BLE001 - evidence is best effort
            return {"hw_id": self._gpu.device.uuid, "error": f"{type(e).__name__}: {e}"}

    def close(self) -> None:
        """Stop the endpoint, the XID watcher and the readers (a final OTLP push, bounded by its timeout)."""
        if self._closed:
            log.warning("sdc_telemetry: telemetry already closed")
            return
        self._await_scrape()
        self._closed = True
        steps: list[tuple[str, Callable[[], object]]] = [("endpoint", self._stop_server)]
        if self._gpu is not None:
            steps.append(("XID watcher", self._gpu.close))
        if self._owns_provider and hasattr(self, "_provider"):
            steps.append(("meter provider", self._shutdown_provider))
        if self._owned_nvml is not None:
            steps.append(("NVML", self._owned_nvml.close))
        for what, fn in steps:
            try:
                fn()
            except Exception:  # closing must not raise into training either (logged with the traceback)
                log.exception("sdc_telemetry: stopping the %s failed", what)

    # -- plumbing ------------------------------------------------------------------------------------------------

    def _a(self, **labels: str) -> dict[str, str]:
        return {**self._attrs, **labels}

    def _otlp_failed(self) -> None:
        if self._i:  # the reader's thread may fail before the instruments exist
            self.internal_error("otlp")

    def _zero(self, config: SDCConfig) -> None:
        """Create the series alerts and dashboards rely on at 0, so the first event is a visible increase."""
        self._i["sdc_steps_total"].add(0, self._attrs)
        for component in ("exporter", "nvml", *(("otlp",) if config.otlp_endpoint else ())):  # telemetry's own
            self._i["sdc_internal_errors_total"].add(0, self._a(component=component))
        for check in CHECKS:
            self._i["sdc_incidents_total"].add(0, self._a(check=check))
            self._i["sdc_suspect"].set(0, self._a(check=check))
        if config.grad_checks:
            for phase in ("local", "reduced"):
                self._i["sdc_grad_nonfinite_total"].add(0, self._a(phase=phase))
        if config.weights_every:
            self._i["sdc_weight_fingerprint_mismatches_total"].add(0, self._attrs)

    def _prometheus_reader(self) -> tuple[PrometheusMetricReader, bool]:
        kwargs: dict[str, Any] = {}
        copies_resource = "resource_attribute_filter" in _READER_PARAMS
        if copies_resource:
            kwargs["resource_attribute_filter"] = _RESOURCE_LABELS.__contains__
        if "scope_info_enabled" in _READER_PARAMS:
            kwargs["scope_info_enabled"] = False
        if "registry" in _READER_PARAMS:
            return PrometheusMetricReader(registry=self.registry, **kwargs), copies_resource
        # Older exporters register on the global registry only: move the collector to ours (and back in close()).
        reader = PrometheusMetricReader(**kwargs)
        prometheus_client.REGISTRY.unregister(reader._collector)
        self.registry.register(reader._collector)
        self._moved_collector = reader._collector
        return reader, copies_resource

    def _shutdown_provider(self) -> None:
        if self._moved_collector is not None:
            self.registry.unregister(self._moved_collector)
            prometheus_client.REGISTRY.register(self._moved_collector)
        self._provider.shutdown()

    def _serve(self) -> None:
        base = self.config.metrics_port
        if base is None:
            return
        host, port = self.config.metrics_host, base + self.identity.local_rank
        try:
            if port > 65535:
                raise OSError(errno.EINVAL, f"port {port} is above 65535")
            self._server, self._server_thread = prometheus_client.start_http_server(port, addr=host,
                                                                                   registry=self.registry)
        except Exception as e:  # noqa: BLE001 - no endpoint, but training goes on
            self.internal_error("exporter")
            in_use = isinstance(e, OSError) and e.errno == errno.EADDRINUSE
            suggestion = _free_base(host, base, self.identity.local_rank)
            log.warning("sdc_telemetry: rank %d cannot serve metrics on %s:%d (metrics_port %d + local_rank %d): %s; "
                        "training goes on without this endpoint. Choose a free base port%s (SDCConfig.metrics_port "
                        "or SDC_METRICS_PORT; ranks listen on base + local_rank), or metrics_port=None.",
                        self.identity.rank, host, port, base, self.identity.local_rank,
                        "the port is in use" if in_use else e,
                        f", for example {suggestion}" if suggestion is not None else "")
            return
        self.port = int(self._server.server_port)
        log.info("sdc_telemetry: rank %d serves metrics on http://%s:%d/metrics", self.identity.rank, host, self.port)

    def _await_scrape(self) -> None:
        """Keep serving until the registry was collected after the last incident, at most ``scrape_grace_s``."""
        if self._closed or self._server is None or self._incident_at is None:
            return
        deadline = time.monotonic() + self._scrape_grace_s
        if self._last_scrape >= self._incident_at:
            return
        log.warning("sdc_telemetry: rank %d keeps http://%s:%s/metrics up until Prometheus scrapes the incident "
                    "(at most %.0fs)", self.identity.rank, self.config.metrics_host, self.port, self._scrape_grace_s)
        while self._last_scrape < self._incident_at and time.monotonic() < deadline:
            time.sleep(0.05)

    def _stop_server(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._server_thread is not None:
            self._server_thread.join(timeout=5)

    def _open_gpu(self, meter: Meter, device: _nvml.NVMLDevice | None) -> None:
        if device is None and self.config.nvml and self.identity.hw_id.startswith("GPU-"):
            try:
                device = self._owned_nvml = _nvml.RealNVML(self.identity.hw_id)
            except Exception as e:  # noqa: BLE001 - no GPU series, training goes on
                log.warning("sdc_telemetry: NVML is unavailable for %s (%s: %s); GPU counters are not exported",
                            self.identity.hw_id, type(e).__name__, e)
                self.internal_error("nvml")
                return
        if device is None:
            return
        if device.source != "nvml":
            log.warning("sdc_telemetry: GPU counters of %s come from %s", device.uuid, device.source)
        self._gpu = GPUCollector(device, meter, self._attrs, self.internal_error)


class _ScrapeClock:
    """A collector with no metrics: registered in the served registry, it notes when a scrape happened."""

    def __init__(self, owner: Telemetry) -> None:
        self._owner = owner

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        self._owner._last_scrape = time.monotonic()
        return []


def _instrument(meter: Meter, f: Family) -> Any:
    if f.kind == "counter":
        return meter.create_counter(f.otel_name, unit=f.unit, description=f.description)
    if f.kind == "gauge":
        return meter.create_gauge(f.otel_name, unit=f.unit, description=f.description)
    return meter.create_histogram(f.otel_name, unit=f.unit, description=f.description,
                                  explicit_bucket_boundaries_advisory=list(CHECK_DURATION_BUCKETS))


def _free_base(host: str, base: int, local_rank: int) -> int | None:
    """A base port (in steps of 100 above ``base``) at which this rank's port is free now."""
    for candidate in range(base + 100, min(base + 2000, 65536 - local_rank), 100):
        try:
            with socket.create_server((host, candidate + local_rank)):
                return candidate
        except OSError:
            continue
    return None


class _CountingExporter(MetricExporter):  # type: ignore[misc]  # the SDK is untyped for mypy here
    """Wraps the OTLP exporter to count failed pushes (``internal_errors_total{component="otlp"}``)."""

    def __init__(self, inner: MetricExporter, endpoint: str, on_failure: Callable[[], None]) -> None:
        super().__init__(preferred_temporality=getattr(inner, "_preferred_temporality", None),
                         preferred_aggregation=getattr(inner, "_preferred_aggregation", None))
        self._inner = inner
        self._endpoint = endpoint
        self._on_failure = on_failure
        self._failing = False

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        result: MetricExportResult = self._inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        if result is MetricExportResult.SUCCESS:
            self._failing = False
            return result
        self._on_failure()
        if not self._failing:
            log.warning("sdc_telemetry: OTLP push to %s failed; retrying each period, training goes on",
                        self._endpoint)
        self._failing = True
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return bool(self._inner.force_flush(timeout_millis=timeout_millis))

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._inner.shutdown(timeout_millis=timeout_millis, **kwargs)


def _otlp_reader(endpoint: str, interval_s: float, timeout_s: float, on_failure: Callable[[], None]) -> MetricReader:
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    exporter = _CountingExporter(OTLPMetricExporter(endpoint=endpoint, timeout=timeout_s), endpoint, on_failure)
    return PeriodicExportingMetricReader(exporter, export_interval_millis=interval_s * 1000,
                                         export_timeout_millis=timeout_s * 1000)
