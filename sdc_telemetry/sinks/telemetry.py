"""OpenTelemetry metrics of one rank: the SDC families, this rank's GPU counters, a Prometheus endpoint, OTLP push.

The monitor builds ``Telemetry(config, identity, **deps)`` and hands it one ``StepReport`` per hook point;
``report()`` maps it onto the SDK instruments in one place (no I/O). The Prometheus endpoint and the OTLP reader
collect on their own threads, and GPU counters are read through observable instruments at that time. Nothing here
raises into training: a port in use, NVML missing, an unreachable collector or a malformed report is logged and
counted in ``sdc_internal_errors_total``::

    telemetry = Telemetry(SDCConfig(metrics_port=9860), RankIdentity.local())
    telemetry.report(StepReport(step=0, results={"grad_local": "pass"}))   # steps += 1, checks{pass} += 1
    telemetry.close()        # sdc_monitor_closed = 1, then stop at once (close_scrape_wait_s: wait for a scrape)

Pages: ``sdc_suspect{check}`` latches for an unambiguous hardware suspect only; a suspect of an ambiguous verdict
(``StepReport.ambiguous_checks``) latches ``sdc_suspect_ambiguous{check}`` instead, which the rules turn into a
warning. A failure of the direct push to Alertmanager (``internal_error("alertmanager")``, what the pager's
``on_error`` reports) is counted in ``sdc_pager_failures_total`` as well as in ``sdc_internal_errors_total``.

Every series carries the identity labels (``service_name``, ``service_instance_id``, ``host_name``, ``rank``,
``local_rank``, ``hw_id``): the exporter copies them from the resource, or, with a caller's ``meter_provider``,
they are recorded on each point.

Non-finite gauge values (a NaN gradient norm, the replay delta of a NaN loss): the OpenTelemetry SDK drops NaN and
Inf on every instrument, with a warning per call, so the gauge would freeze at its last finite value and a broken
step would look healthy. They are recorded as ``NONFINITE`` (the largest float) instead, which an OTLP consumer
receives as is, and the Prometheus endpoint renders as ``+Inf``.
"""

from __future__ import annotations

import errno
import logging
import math
import selectors
import socket
import socketserver
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import prometheus_client
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import Meter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricReader, MetricsData
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from prometheus_client.metrics_core import Metric

from sdc_telemetry.core.config import SDCConfig
from sdc_telemetry.core.findings import CHECKS
from sdc_telemetry.core.identity import RankIdentity
from sdc_telemetry.sinks import nvml as _nvml
from sdc_telemetry.sinks.gpu import GPUCollector
from sdc_telemetry.sinks.metrics import CHECK_DURATION_BUCKETS, SDC, Family, family
from sdc_telemetry.sinks.observer import RESULTS, Observer, StepReport
from sdc_telemetry.sinks.tls import TLSAccept

__all__ = ["Telemetry", "resource_attributes", "NONFINITE", "PHASES", "PAGER_COMPONENT"]

log = logging.getLogger("sdc_telemetry")

# Resource attribute -> the label the exporter makes of it (dots become underscores).
_RESOURCE_LABELS = {"service.name": "service_name", "service.instance.id": "service_instance_id",
                    "host.name": "host_name", "rank": "rank", "local_rank": "local_rank", "hw.id": "hw_id"}

NONFINITE = sys.float_info.max  # what a NaN/Inf gauge value is recorded as (the SDK refuses non-finite values)
PHASES = ("local", "reduced")   # gradient phases: before and after the all-reduce
_RAN = ("pass", "fail")         # results of a check that actually ran (error and skipped did not)
# The internal-error component of the direct push to Alertmanager: each of its failures is a pager failure too.
PAGER_COMPONENT = "alertmanager"


def resource_attributes(config: SDCConfig, identity: RankIdentity) -> dict[str, str | int]:
    """The OpenTelemetry resource of a rank's metrics: job, instance, host, rank, local rank, hardware id."""
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
    - ``close_scrape_wait_s``: when asked (> 0), ``close()`` sets ``sdc_monitor_closed`` to 1 and keeps the
      endpoint up until one more scrape has read it, so Prometheus tells a clean end from a crash (the demo stack
      asks for it). It never waits when the endpoint was never scraped (nobody watches), and at most 1.5 observed
      scrape intervals, capped by this many seconds. The default, 0, never waits: a job's end (and the stop on
      ``SDCDetected``, which launchers race) costs no scrape interval; ``SDCExporterDown`` may then warn once for
      a job whose last scrape predates its end.
    """

    def __init__(self, config: SDCConfig, identity: RankIdentity, *,
                 registry: prometheus_client.CollectorRegistry | None = None,
                 meter_provider: MeterProvider | None = None, nvml: _nvml.NVMLDevice | None = None,
                 readers: Sequence[MetricReader] = (), otlp_interval_s: float = 15.0,
                 otlp_timeout_s: float = 5.0, close_scrape_wait_s: float = 0.0) -> None:
        if meter_provider is not None and readers:
            raise ValueError("Telemetry: pass readers= only without meter_provider= (add them to your provider)")
        if not (math.isfinite(close_scrape_wait_s) and close_scrape_wait_s >= 0):
            raise ValueError(f"Telemetry: close_scrape_wait_s must be a finite number >= 0, "
                             f"got {close_scrape_wait_s!r}")
        self.config = config
        self.identity = identity
        self.registry = registry if registry is not None else prometheus_client.CollectorRegistry()
        self.port: int | None = None  # the port the endpoint listens on, once it does
        self.setup_error: str | None = None  # a metrics_host this machine cannot bind (refused at set-up)
        self._closed = False
        self._server: _Server | None = None
        self._server_thread: threading.Thread | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None  # wakes the endpoint's accept loop to stop
        self._endpoint: _Endpoint | None = None
        self._owns_provider = meter_provider is None
        self._owned_nvml: _nvml.NVMLDevice | None = None
        self._gpu: GPUCollector | None = None
        self._seen_checks: set[str] = set()
        self._i: dict[str, Any] = {}
        self._report_failures = 0
        self._close_scrape_wait_s = close_scrape_wait_s
        self._scraped = threading.Condition()
        self._last_scrape: float | None = None      # monotonic start of the last completed scrape
        self._scrape_interval: float | None = None  # between the last two scrapes
        if meter_provider is None:
            otel_registry = prometheus_client.CollectorRegistry()  # read only through the endpoint below
            prom = PrometheusMetricReader(registry=otel_registry, scope_info_enabled=False,
                                          resource_attribute_filter=_RESOURCE_LABELS.__contains__)
            endpoint: _Endpoint | None = _Endpoint(otel_registry, self._note_scrape)
            all_readers = [prom, *readers]
            if config.otlp_endpoint:
                all_readers.append(_otlp_reader(config.otlp_endpoint, otlp_interval_s, otlp_timeout_s,
                                                self._otlp_failed))
            meter_provider = MeterProvider(
                resource=Resource.create(resource_attributes(config, identity)), metric_readers=all_readers,
                views=[View(instrument_name=family("sdc_check_duration_seconds").otel_name,
                            aggregation=ExplicitBucketHistogramAggregation(boundaries=CHECK_DURATION_BUCKETS))])
        else:
            endpoint = None
        self._provider = meter_provider
        self._attrs: dict[str, str] = {} if self._owns_provider else {
            _RESOURCE_LABELS[k]: str(v) for k, v in resource_attributes(config, identity).items()}
        try:
            meter = meter_provider.get_meter("sdc_telemetry")
            self._i = {f.name: _instrument(meter, f) for f in SDC}
            self._zero(config)
            self._open_gpu(meter, nvml)
            if endpoint is not None:
                self.registry.register(endpoint)
                self._endpoint = endpoint  # close() unregisters it
                self._serve()
        except BaseException:
            self.close()
            raise

    # -- Observer ------------------------------------------------------------------------------------------------

    def report(self, report: StepReport) -> None:
        """Record what one hook point found. Never raises: a failure is logged and counted as ``telemetry``."""
        try:
            self._record(report)
        except Exception:  # telemetry never breaks training
            self._report_failures += 1
            if self._report_failures == 1:
                log.exception("sdc_telemetry: recording a step report failed; training goes on, and further "
                              "failures are only counted in sdc_internal_errors_total{component=\"telemetry\"}")
            self.internal_error("telemetry")

    def internal_error(self, component: str) -> None:
        """Count a contained failure of ``component``; a failure of the direct push (``PAGER_COMPONENT``) also
        counts in ``sdc_pager_failures_total``. Never raises."""
        try:
            self._count_error(component)
        except Exception:  # counting an error must not become one
            log.debug("sdc_telemetry: counting an internal error of %s failed", component, exc_info=True)

    def gpu_snapshot(self) -> dict[str, object]:
        if self._gpu is None:
            return {}
        try:
            return self._gpu.snapshot()
        except Exception as e:  # noqa: BLE001 - evidence is best effort
            return {"hw_id": self._gpu.device.uuid, "error": f"{type(e).__name__}: {e}"}

    def close(self) -> None:
        """Set ``sdc_monitor_closed`` to 1, let one last scrape read it (bounded, see ``close_scrape_wait_s``), then
        stop the endpoint, the XID watcher and the readers (a final OTLP push, bounded by its timeout)."""
        if self._closed:
            log.warning("sdc_telemetry: telemetry already closed")
            return
        self._closed = True
        steps: list[tuple[str, Callable[[], object]]] = []
        if "sdc_monitor_closed" in self._i:
            steps.append(("final scrape", self._mark_closed))
        steps.append(("endpoint", self._stop_server))
        if self._gpu is not None:
            steps.append(("XID watcher", self._gpu.close))
        if self._owns_provider and hasattr(self, "_provider"):
            steps.append(("meter provider", self._provider.shutdown))
        if self._endpoint is not None:
            steps.append(("registry", lambda: self.registry.unregister(self._endpoint)))
        if self._owned_nvml is not None:
            steps.append(("NVML", self._owned_nvml.close))
        for what, fn in steps:
            try:
                fn()
            except Exception:  # closing must not raise into training either (logged with the traceback)
                log.exception("sdc_telemetry: stopping the %s failed", what)

    # -- recording -----------------------------------------------------------------------------------------------

    def _record(self, r: StepReport) -> None:
        _validate(r)
        i = self._i
        if r.counts_step:
            i["sdc_steps_total"].add(1, self._attrs)
        now = time.time()
        for check, result in r.results.items():
            if check not in self._seen_checks:  # every result exists from the first run: increase() sees 0 -> 1
                self._seen_checks.add(check)
                for each in RESULTS:
                    i["sdc_checks_total"].add(0, self._a(check=check, result=each))
            i["sdc_checks_total"].add(1, self._a(check=check, result=result))
            if result in _RAN:  # an errored or skipped check did not run: the stalled alert must still see it stale
                i["sdc_check_last_run_timestamp_seconds"].set(now, self._a(check=check))
        for check, seconds in r.durations.items():
            i["sdc_check_duration_seconds"].record(seconds, self._a(check=check))
        for phase, norm in r.grad_norms.items():
            i["sdc_grad_norm"].set(_gauge_value(norm), self._a(phase=phase))
            if not math.isfinite(norm):
                i["sdc_grad_nonfinite_total"].add(1, self._a(phase=phase))
        if r.replay is not None:
            i["sdc_replay_loss_delta"].set(_gauge_value(r.replay.loss_delta), self._attrs)
            i["sdc_replay_grad_delta"].set(_gauge_value(r.replay.grad_delta), self._attrs)
            if r.replay.mismatch:
                i["sdc_replay_mismatches_total"].add(1, self._attrs)
        if r.weights_agree is not None:
            i["sdc_weight_fingerprint_agreement"].set(1 if r.weights_agree else 0, self._attrs)
            if not r.weights_agree:
                i["sdc_weight_fingerprint_mismatches_total"].add(1, self._attrs)
        for incident in r.incidents:  # numerics events too: they are incidents, only never a suspect
            i["sdc_incidents_total"].add(1, self._a(check=incident.check))
        # Latched: nothing ever sets them back to 0. An ambiguous verdict warns and never pages, so its suspect is
        # latched apart from the hardware suspects the critical alerts read.
        # The incidents' own evidence counts too, so that an ambiguous verdict never reaches sdc_suspect.
        ambiguous = {*r.ambiguous_checks, *(inc.check for inc in r.incidents if self.identity.rank in inc.suspect_ranks
                                            and inc.evidence.get("ambiguous") is True)}
        for check in r.suspect_checks:
            if check not in ambiguous:
                i["sdc_suspect"].set(1, self._a(check=check))
        for check in sorted(ambiguous):
            i["sdc_suspect_ambiguous"].set(1, self._a(check=check))
        for component in r.errors:
            self._count_error(component)

    # -- plumbing ------------------------------------------------------------------------------------------------

    def _a(self, **labels: str) -> dict[str, str]:
        return {**self._attrs, **labels}

    def _count_error(self, component: str) -> None:
        self._i["sdc_internal_errors_total"].add(1, self._a(component=component))
        if component == PAGER_COMPONENT:
            self._i["sdc_pager_failures_total"].add(1, self._attrs)

    def _otlp_failed(self) -> None:
        if self._i:  # the reader's thread may fail before the instruments exist
            self.internal_error("otlp")

    def _zero(self, config: SDCConfig) -> None:
        """Create the series alerts and dashboards rely on at 0, so the first event is a visible increase."""
        self._i["sdc_steps_total"].add(0, self._attrs)
        self._i["sdc_monitor_closed"].set(0, self._attrs)
        pager = (PAGER_COMPONENT,) if config.alertmanager_url else ()
        for component in ("exporter", "nvml", "telemetry", *(("otlp",) if config.otlp_endpoint else ()), *pager):
            self._i["sdc_internal_errors_total"].add(0, self._a(component=component))
        self._i["sdc_pager_failures_total"].add(0, self._attrs)  # every family exists on every rank
        for check in CHECKS:
            self._i["sdc_incidents_total"].add(0, self._a(check=check))
            self._i["sdc_suspect"].set(0, self._a(check=check))
            self._i["sdc_suspect_ambiguous"].set(0, self._a(check=check))
        if config.grad_checks:
            for phase in PHASES:
                self._i["sdc_grad_nonfinite_total"].add(0, self._a(phase=phase))
        if config.replay_every:
            self._i["sdc_replay_mismatches_total"].add(0, self._attrs)
        if config.weights_every:
            self._i["sdc_weight_fingerprint_mismatches_total"].add(0, self._attrs)

    def _serve(self) -> None:
        base = self.config.metrics_port
        if base is None:
            return
        host, port = self.config.metrics_host, base + self.identity.local_rank
        try:
            tls = tls_context(self.config.metrics_tls_cert, self.config.metrics_tls_key)
        except ValueError as e:
            self.setup_error = str(e)  # a configuration error: refused at set-up on every rank, naming the fields
            return
        try:
            if port > 65535:
                raise OSError(errno.EINVAL, f"port {port} is above 65535")
            self._server, self._server_thread, self._wake = _start_endpoint(host, port, self.registry, tls)
        except Exception as e:  # noqa: BLE001 - no endpoint, but training goes on
            if isinstance(e, socket.gaierror) or (isinstance(e, OSError) and e.errno == errno.EADDRNOTAVAIL):
                # Not this machine's address: the monitor refuses at set-up on every rank, naming the field.
                self.setup_error = (f"SDCConfig.metrics_host={host!r} cannot be bound on this machine ({e}): give "
                                    "an address of one of its interfaces, 0.0.0.0 for all, or metrics_port=None")
                return
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
        log.info("sdc_telemetry: rank %d serves metrics on %s://%s:%d/metrics", self.identity.rank,
                 "https" if tls is not None else "http", host, self.port)

    def _note_scrape(self, started: float) -> None:
        with self._scraped:
            if self._last_scrape is not None:
                self._scrape_interval = started - self._last_scrape
            self._last_scrape = started
            self._scraped.notify_all()

    def _mark_closed(self) -> None:
        """``sdc_monitor_closed`` = 1, then, when asked and Prometheus watches, wait for a scrape that started after
        it."""
        self._i["sdc_monitor_closed"].set(1, self._attrs)
        closed_at = time.monotonic()
        with self._scraped:
            if self._close_scrape_wait_s == 0 or self._server is None or self._last_scrape is None:
                return  # not asked, no endpoint, or nobody has ever scraped it: nobody to tell
            wait_s = self._close_scrape_wait_s
            if self._scrape_interval is not None:
                wait_s = min(wait_s, 1.5 * self._scrape_interval)
            seen = self._scraped.wait_for(lambda: self._last_scrape is not None and self._last_scrape > closed_at,
                                          timeout=wait_s)
        if not seen:
            log.info("sdc_telemetry: rank %d closed without a final scrape within %.1fs", self.identity.rank, wait_s)

    def _stop_server(self) -> None:
        """Stop the endpoint at once: wake its accept loop (no poll interval to wait out), then close the socket."""
        if self._wake is not None:
            try:
                self._wake[0].send(b"x")
            except OSError:
                log.debug("sdc_telemetry: waking the metrics endpoint failed", exc_info=True)
        if self._server_thread is not None:
            self._server_thread.join(timeout=5)
        if self._server is not None:
            self._server.server_close()
        if self._wake is not None:
            for sock in self._wake:
                sock.close()

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


ENDPOINT_BACKLOG = 128      # connections the kernel queues before accept (socketserver's default is 5)
ENDPOINT_IDLE_TIMEOUT_S = 10.0  # a connection idle (or mid-request, TLS handshake included) this long is closed


class _Server(TLSAccept, socketserver.ThreadingMixIn, WSGIServer):
    """The endpoint's HTTP server: prometheus_client's thread-per-request WSGI server, run by ``_accept_loop``, which
    also watches a wake-up socket so that ``close()`` stops it at once (``serve_forever``'s ``shutdown()`` waits
    up to its 0.5 s poll interval, which a launcher stopping the job may not grant). With ``tls`` the accepted
    connections are wrapped, their handshake deferred to the request's own thread (under its idle timeout), so a
    client that connects and says nothing holds only its own thread, and never the accept loop."""

    daemon_threads = True  # request threads are fire and forget (never joined at close)
    timeout = 0            # handle_request() runs after select() said a connection waits: it never blocks
    request_queue_size = ENDPOINT_BACKLOG

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("sdc_telemetry: metrics connection from %s ended with an error", client_address, exc_info=True)


class _QuietHandler(WSGIRequestHandler):
    """Logs no request line (a scrape every few seconds); closes a connection idle past the timeout."""

    timeout = ENDPOINT_IDLE_TIMEOUT_S  # StreamRequestHandler sets it on the connection's socket

    def log_message(self, *args: Any) -> None:
        return None


def tls_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The server-side TLS context of the metrics endpoint (None without a certificate); errors name the fields."""
    if cert is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"SDCConfig.metrics_tls_cert={cert!r} / metrics_tls_key={key!r} cannot be loaded: {e}") \
            from None
    return ctx


def _start_endpoint(host: str, port: int, registry: prometheus_client.CollectorRegistry,
                    tls: ssl.SSLContext | None = None
                    ) -> tuple[_Server, threading.Thread, tuple[socket.socket, socket.socket]]:
    """Serve ``registry`` on ``host:port`` from a daemon thread (IPv6 hosts too, as prometheus_client does), over
    TLS with ``tls``."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server_class = type("_FamilyServer", (_Server,), {"address_family": family, "tls": tls})
    server: _Server = make_server(str(sockaddr[0]), port, prometheus_client.make_wsgi_app(registry), server_class,
                                  handler_class=_QuietHandler)
    wake = socket.socketpair()
    try:
        thread = threading.Thread(target=_accept_loop, args=(server, wake[1]), name="sdc-metrics-endpoint",
                                  daemon=True)
        thread.start()
    except BaseException:
        server.server_close()
        for sock in wake:
            sock.close()
        raise
    return server, thread, wake


def _accept_loop(server: _Server, wake: socket.socket) -> None:
    """Handle connections until ``wake`` is readable."""
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(server, selectors.EVENT_READ)
            selector.register(wake, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fileobj is wake:
                        return
                    server.handle_request()
    except (OSError, ValueError):  # the sockets were closed under the loop: the endpoint is stopping anyway
        log.debug("sdc_telemetry: the metrics endpoint's accept loop stopped", exc_info=True)


class _Endpoint:
    """What the endpoint serves: the OpenTelemetry exporter's registry, with ``NONFINITE`` gauge values rendered as
    +Inf, noting each completed scrape (its start time) for ``close()``."""

    def __init__(self, otel_registry: prometheus_client.CollectorRegistry,
                 on_scrape: Callable[[float], None]) -> None:
        self._otel = otel_registry
        self._on_scrape = on_scrape

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        started = time.monotonic()
        for metric in self._otel.collect():
            if metric.type == "gauge":
                metric.samples = [s._replace(value=math.inf) if s.value == NONFINITE else s for s in metric.samples]
            yield metric
        self._on_scrape(started)  # after the last family: the scrape has read everything, closed gauge included


def _gauge_value(x: float) -> float:
    return x if math.isfinite(x) else NONFINITE


def _validate(r: StepReport) -> None:
    """A report whose labels would leave the fixed series set, or that the SDK would drop, is a monitor bug."""
    if not isinstance(r, StepReport):
        raise TypeError(f"Telemetry.report expects a StepReport, got {type(r).__name__}")
    for check, result in r.results.items():
        if result not in RESULTS:
            raise ValueError(f"StepReport.results[{check!r}] is {result!r}, not one of {'|'.join(RESULTS)}")
    checks = [*r.results, *r.durations, *r.suspect_checks, *r.ambiguous_checks, *(inc.check for inc in r.incidents)]
    unknown = sorted({c for c in checks if c not in CHECKS})
    if unknown:
        raise ValueError(f"StepReport names unknown check(s) {unknown}; known: {', '.join(CHECKS)}")
    for check, seconds in r.durations.items():
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"StepReport.durations[{check!r}] is {seconds!r}, not a finite number of seconds >= 0")
    bad_phases = sorted(set(r.grad_norms) - set(PHASES))
    if bad_phases:
        raise ValueError(f"StepReport.grad_norms has unknown phase(s) {bad_phases}; known: {', '.join(PHASES)}")


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
