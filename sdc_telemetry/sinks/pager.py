"""Push a suspect's page straight to Alertmanager's v2 API, without waiting for a scrape.

The metrics path pages through Prometheus: a scrape, a rule evaluation, then Alertmanager. A job that stops on
``SDCDetected`` may exit before that last scrape; the monitor therefore also posts the incident itself::

    pusher = AlertmanagerPusher("http://alertmanager:9093", job_name="llm", on_error=count_error)
    pusher.page(incident)        # returns at once; a background thread posts one alert per suspect
    pusher.close()               # at shutdown: waits (bounded) for a pending post

Each alert has the alert name, labels and annotations of the Prometheus rule for the same check and rank
(``sdc_telemetry.sinks.alert_table.suspect_alert``), so Alertmanager treats the pushed alert and the rule's alert as
one and pages once. ``endsAt`` is ``ttl_s`` ahead: a pushed alert nobody refreshes resolves by itself.

Telemetry never breaks training: ``page()`` and ``close()`` never raise and never block on the network. A failure
calls ``on_error`` (the monitor counts it in ``sdc_internal_errors_total{component="alertmanager"}``) and is logged
at warning level once, at debug level afterwards. Standard library only.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from sdc_telemetry.core.incident import Incident
from sdc_telemetry.sinks.alert_table import suspect_alert

__all__ = ["AlertmanagerPusher"]

log = logging.getLogger("sdc_telemetry")

_STOP = None


def _rfc3339(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, tz=_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00",
                                                                                                         "Z")


class AlertmanagerPusher:
    """Posts one alert per suspect of an incident to ``<url>/api/v2/alerts`` from a background thread.

    ``url``: the Alertmanager base URL (``http://host:9093``, a path prefix is kept). ``job_name``: the
    ``service_name`` the job's metrics carry. ``timeout_s``: per HTTP request. ``on_error``: called (without
    arguments) for each failed push. ``ttl_s``: how long Alertmanager keeps a pushed alert firing unless refreshed.

    >>> pusher = AlertmanagerPusher("http://127.0.0.1:9093", job_name="llm")
    >>> pusher.close()
    """

    def __init__(self, url: str, job_name: str, *, timeout_s: float = 2.0,
                 on_error: Callable[[], None] | None = None, ttl_s: float = 1800.0) -> None:
        parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"url must be an http(s) URL of an Alertmanager (http://host:9093), got {url!r}")
        if not isinstance(job_name, str) or not job_name:
            raise ValueError(f"job_name must be a non-empty string, got {job_name!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        self.endpoint = url.rstrip("/") + "/api/v2/alerts"
        self.job_name = job_name
        self.timeout_s = float(timeout_s)
        self.ttl_s = float(ttl_s)
        self._on_error = on_error
        self._queue: queue.SimpleQueue[list[dict[str, Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._warned = False

    def page(self, incident: Incident) -> None:
        """Queue one alert per suspect of ``incident`` (nothing for an incident without suspects). Never blocks,
        never raises."""
        try:
            if not incident.suspects:
                return
            now = time.time()
            body = []
            for s in incident.suspects:
                alert: dict[str, Any] = suspect_alert(incident.check, {"host_name": s.host_name, "rank": s.rank,
                                                                       "local_rank": s.local_rank, "hw_id": s.hw_id},
                                                      self.job_name)
                body.append({**alert, "startsAt": _rfc3339(now), "endsAt": _rfc3339(now + self.ttl_s)})
            with self._lock:
                if self._closed:
                    log.debug("sdc_telemetry: Alertmanager pusher closed; incident at step %s not pushed",
                              incident.step)
                    return
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="sdc-alertmanager-push", daemon=True)
                    self._thread.start()
                self._queue.put(body)
        except Exception as e:  # noqa: BLE001 - telemetry never raises into training
            self._failed(f"could not build the alert for incident {getattr(incident, 'check', '?')}: {e!r}")

    def close(self, timeout_s: float = 2.0) -> None:
        """Post what is pending, waiting at most ``timeout_s``; later pages are dropped. A second call is
        harmless."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            self._queue.put(_STOP)
        if thread is not None:
            thread.join(max(0.0, timeout_s))
            if thread.is_alive():
                self._failed(f"a push to {self.endpoint} was still pending after {timeout_s:g}s at close(); "
                             "dropped")

    def _run(self) -> None:
        while True:
            body = self._queue.get()
            if body is _STOP:
                return
            try:
                self._post(body)
            except Exception as e:  # noqa: BLE001 - a failed page is counted and logged, never raised
                self._failed(f"push of {len(body)} alert(s) to {self.endpoint} failed: {e!r}")

    def _post(self, body: list[dict[str, Any]]) -> None:
        req = urllib.request.Request(self.endpoint, data=json.dumps(body).encode(), method="POST",  # noqa: S310
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:  # noqa: S310 - scheme checked in __init__
                r.read()
        except urllib.error.HTTPError as e:
            detail = e.read(500).decode(errors="replace")
            raise RuntimeError(f"HTTP {e.code}: {detail}") from None

    def _failed(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("sdc_telemetry: %s (later failures are logged at debug level)", message)
        else:
            log.debug("sdc_telemetry: %s", message)
        if self._on_error is not None:
            try:
                self._on_error()
            except Exception:  # the error counter must not break the pusher either
                log.debug("sdc_telemetry: on_error callback failed", exc_info=True)

