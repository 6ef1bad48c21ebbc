"""Push a suspect's page straight to Alertmanager's v2 API, without waiting for a scrape, and keep pushing it until
Alertmanager accepts it.

The metrics path pages through Prometheus: a scrape, a rule evaluation, then Alertmanager. A job that stops on
``SDCDetected`` may exit before that last scrape; the monitor therefore also posts the incident itself::

    pusher = AlertmanagerPusher("http://alertmanager:9093", job_name="llm", on_error=count_error)
    pusher.page(incident)        # returns at once; a background thread posts one alert per suspect
    pusher.flush(timeout_s=2.0)  # before the job stops: waits (bounded) until Alertmanager accepted it
    pusher.resolve(incident)     # the episode closed: one last post that ends the alert, no more re-sends
    pusher.close()               # at shutdown: waits (bounded) for a pending post

Each alert has the alert name, labels and annotations of the Prometheus rule for the same check and rank
(``sdc_telemetry.sinks.alert_table.suspect_alert``), so Alertmanager treats the pushed alert and the rule's alert as
one and pages once. An incident whose evidence says ``ambiguous`` is pushed as the rule's ambiguous alert: the same
alert name with ``severity="warning"`` and ``ambiguous="true"``, never critical. ``endsAt`` is ``ttl_s`` after the
post that delivered it: a pushed alert nobody refreshes resolves by itself.

Re-sending, as Prometheus does with the alerts it fires: an accepted incident's alerts are posted again every
``resend_s`` (with the same ``startsAt`` and a new ``endsAt``) until ``resolve(incident)`` (its episode closed: one
post with ``endsAt`` now ends it) or ``close()`` (the job ends; what was last posted stays firing until its
``endsAt``). So an Alertmanager that restarted empty, or a replica of an HA pair that missed the first post, has the
page again within ``resend_s``.

Delivery: a post that fails (a 5xx or 429 status, a refused connection, a timeout) is retried from the background
thread with exponential backoff (``retry_initial_s`` doubling up to ``retry_max_s``) until Alertmanager answers 2xx,
for at most ``retry_for_s`` seconds and ``max_attempts`` attempts per page, after which the page is given up with an
error in the log (the rule still pages once Prometheus scrapes the suspect). A 4xx other than 429 (a malformed
alert, a refused request: the same post would be refused again) is logged at error level and not retried. Pages are
posted in order. ``flush()``
(what the monitor calls before it raises ``SDCDetected``) and ``close()`` wake a waiting retry at once and keep
retrying briefly (every ``retry_initial_s``) until their timeout, so a stop path stays prompt; after a ``flush()``
that delivered everything, ``close()`` returns at once.

Telemetry never breaks training: ``page()`` and ``close()`` never raise and never block on the network. Each failure
(each failed attempt, and a page still pending when ``close()`` gives up) calls ``on_error``; the monitor counts it in
``sdc_internal_errors_total{component="alertmanager"}`` and ``sdc_pager_failures_total``, which ``SDCPagerFailing``
alerts on. The first failure is logged at warning level, later ones at debug level, a page given up at error level.
Standard library only.
"""

from __future__ import annotations

import collections
import datetime as _dt
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sdc_telemetry.core.config import http_url_problem
from sdc_telemetry.core.incident import Incident
from sdc_telemetry.sinks.alert_table import suspect_alert

__all__ = ["AlertmanagerPusher"]

log = logging.getLogger("sdc_telemetry")


def _rfc3339(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, tz=_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00",
                                                                                                         "Z")


class _Refused(Exception):
    """Alertmanager answered a 4xx other than 429: the same post would be refused again."""


@dataclass
class _Page:
    """One incident's alerts, waiting to be accepted."""

    alerts: list[dict[str, Any]]
    step: int
    starts_at: str
    key: tuple[Any, ...] = ()      # the incident's identity (check, step, suspects), for re-sends
    ends_now: bool = False         # resolve: endsAt is the post's own time
    attempts_resend: bool = False  # a re-send (delivered: the incident stays active only if not resolved since)
    attempts: int = 0
    first_failure: float | None = None  # monotonic time of the first failed attempt
    next_try: float = field(default=0.0)  # monotonic time of the next attempt


class AlertmanagerPusher:
    """Posts one alert per suspect of an incident to ``<url>/api/v2/alerts`` from a background thread, retrying a
    failed post with backoff until Alertmanager accepts it (bounded).

    ``url``: the Alertmanager base URL (``http://host:9093``, a path prefix is kept). ``job_name``: the
    ``service_name`` the job's metrics carry. ``timeout_s``: per HTTP request. ``on_error``: called (without
    arguments) for each failed push. ``ttl_s``: how long Alertmanager keeps a pushed alert firing unless refreshed.
    ``retry_initial_s`` / ``retry_max_s``: the first wait after a failure and the cap of the doubling waits.
    ``retry_for_s`` / ``max_attempts``: a page is given up when its first failure is this old, or after this many
    attempts, whichever comes first (defaults: 10 minutes, 40 attempts). ``resend_s``: how often an accepted
    incident's alerts are posted again until it is resolved or the pusher closed (default 60 s, as Prometheus).

    >>> pusher = AlertmanagerPusher("http://127.0.0.1:9093", job_name="llm")
    >>> pusher.close()
    """

    def __init__(self, url: str, job_name: str, *, timeout_s: float = 2.0,
                 on_error: Callable[[], None] | None = None, ttl_s: float = 1800.0,
                 retry_initial_s: float = 0.25, retry_max_s: float = 30.0, retry_for_s: float = 600.0,
                 max_attempts: int = 40, resend_s: float = 60.0) -> None:
        problem = http_url_problem(url)
        if problem is not None:
            raise ValueError(f"url must be an http(s) URL of an Alertmanager (http://host:9093): {problem}, "
                             f"got {url!r}")
        if not isinstance(job_name, str) or not job_name:
            raise ValueError(f"job_name must be a non-empty string, got {job_name!r}")
        for name, value in (("timeout_s", timeout_s), ("ttl_s", ttl_s), ("retry_initial_s", retry_initial_s),
                            ("retry_max_s", retry_max_s), ("retry_for_s", retry_for_s), ("resend_s", resend_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value)
                                                                                    and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if retry_max_s < retry_initial_s:
            raise ValueError(f"retry_max_s ({retry_max_s!r}) must be >= retry_initial_s ({retry_initial_s!r})")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts must be an int >= 1, got {max_attempts!r}")
        self.endpoint = url.rstrip("/") + "/api/v2/alerts"
        self.job_name = job_name
        self.timeout_s = float(timeout_s)
        self.ttl_s = float(ttl_s)
        self.retry_initial_s = float(retry_initial_s)
        self.retry_max_s = float(retry_max_s)
        self.retry_for_s = float(retry_for_s)
        self.max_attempts = max_attempts
        self.resend_s = float(resend_s)
        self._on_error = on_error
        # Accepted incidents still open: their alerts, startsAt, and the monotonic time of the next re-send.
        self._active: dict[tuple[Any, ...], tuple[list[dict[str, Any]], int, str, float]] = {}
        self._resolved: set[tuple[Any, ...]] = set()  # resolved before their first page was accepted
        self._cond = threading.Condition()
        self._pending: collections.deque[_Page] = collections.deque()
        self._thread: threading.Thread | None = None
        self._closed = False       # close() was called: no new pages
        self._deadline: float | None = None  # monotonic time close() stops waiting for the thread
        self._flushing = 0         # flush() calls waiting: retries are not held back by their backoff
        self._abandoned = False    # close() gave up: the thread stops after its current attempt
        self._warned = False
        self._last_try = 0.0       # monotonic time of the last attempt
        self.delivered = 0         # pages accepted by Alertmanager
        self.failures = 0          # failed attempts (each also reported through on_error)
        self.given_up = 0          # pages dropped after their retries or at close
        self.refused = 0           # pages Alertmanager refused with a 4xx other than 429 (not retried)
        self.resent = 0            # re-sends of accepted incidents

    def page(self, incident: Incident) -> None:
        """Queue one alert per suspect of ``incident`` (nothing for an incident without suspects). Never blocks,
        never raises."""
        try:
            if not incident.suspects:
                return
            ambiguous = incident.evidence.get("ambiguous") is True
            alerts = [suspect_alert(incident.check, {"host_name": s.host_name, "rank": s.rank,
                                                     "local_rank": s.local_rank, "hw_id": s.hw_id},
                                    self.job_name, ambiguous=ambiguous)
                      for s in incident.suspects]
            coordinates = incident.evidence.get("coordinates")
            if isinstance(coordinates, dict):  # N-D layouts: where in the mesh each suspect sits
                for alert, s in zip(alerts, incident.suspects, strict=True):
                    coord = coordinates.get(str(s.rank))
                    if isinstance(coord, dict):
                        alert["annotations"]["coordinate"] = " ".join(f"{k}={v}" for k, v in coord.items())
            key = _key(incident)
            with self._cond:
                known = self._active.get(key)
            page = _Page(alerts, incident.step, known[2] if known else _rfc3339(time.time()), key)
            with self._cond:
                if self._closed:
                    log.debug("sdc_telemetry: Alertmanager pusher closed; incident at step %s not pushed",
                              incident.step)
                    return
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="sdc-alertmanager-push", daemon=True)
                    self._thread.start()
                self._pending.append(page)
                self._cond.notify_all()
        except Exception as e:  # noqa: BLE001 - telemetry never raises into training
            self._failed(f"could not build the alert for incident {getattr(incident, 'check', '?')}: {e!r}")

    def resolve(self, incident: Incident) -> None:
        """The incident's episode closed: stop re-sending its alerts and post them once more with ``endsAt`` now,
        so that Alertmanager resolves the page. Never blocks, never raises."""
        try:
            with self._cond:
                key = _key(incident)
                known = self._active.pop(key, None)
                if known is None:
                    if any(p.key == key for p in self._pending):
                        self._resolved.add(key)  # ended once its page is accepted, never re-sent
                    return
                if self._closed:
                    return
                alerts, step, starts_at, _ = known
                self._pending.append(_Page(alerts, step, starts_at, ends_now=True))
                self._cond.notify_all()
        except Exception:
            log.debug("sdc_telemetry: resolving a page failed", exc_info=True)

    @property
    def pending(self) -> int:
        """Pages queued or being retried."""
        with self._cond:
            return len(self._pending)

    def flush(self, timeout_s: float = 2.0) -> bool:
        """Wait at most ``timeout_s`` until every queued page is accepted (or given up); a retry waiting out its
        backoff tries again now, then every ``retry_initial_s``. Returns True when nothing is pending. What is still
        pending after ``timeout_s`` stays queued and retried in the background (``close()`` has the last word). Never
        raises; the pusher stays open."""
        try:
            deadline = time.monotonic() + max(0.0, float(timeout_s))
            with self._cond:
                if not self._pending:
                    return True
                self._flushing += 1
                self._cond.notify_all()  # a retry waiting out its backoff tries again now
                try:
                    while self._pending and not self._abandoned and self._thread is not None:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                    return not self._pending
                finally:
                    self._flushing -= 1
        except Exception:
            log.debug("sdc_telemetry: flushing the Alertmanager pusher failed", exc_info=True)
            return False

    def close(self, timeout_s: float = 2.0) -> None:
        """Post what is pending, retrying for at most ``timeout_s``; what is still pending then is dropped (and
        reported through ``on_error``); later pages are dropped. A second call is harmless."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._deadline = time.monotonic() + max(0.0, timeout_s)
            thread = self._thread
            self._cond.notify_all()  # a retry waiting out its backoff tries again now
        if thread is None:
            return
        thread.join(max(0.0, timeout_s))
        with self._cond:
            self._abandoned = True
            dropped = len(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        if dropped:
            self.given_up += dropped
            self._failed(f"{dropped} page(s) to {self.endpoint} still pending after {timeout_s:g}s at close(); "
                         "dropped")

    # -- the background thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                page = self._next_due()
                if page is None:
                    return
            ok, error, retry = self._attempt(page)
            with self._cond:
                if self._abandoned:
                    return
                if ok:
                    self._pending.popleft()
                    self.delivered += 1
                    if page.key in self._resolved:  # resolved while this page was on its way: end it now
                        self._resolved.discard(page.key)
                        self._pending.append(_Page(page.alerts, page.step, page.starts_at, ends_now=True))
                    elif page.key and not page.ends_now and (page.key in self._active or not page.attempts_resend):
                        self._active[page.key] = (page.alerts, page.step, page.starts_at,
                                                  time.monotonic() + self.resend_s)
                    self._cond.notify_all()  # a flush() waiting for this page returns
                    if page.attempts > 1:
                        log.warning("sdc_telemetry: page of the incident at step %d accepted by %s after %d "
                                    "attempts", page.step, self.endpoint, page.attempts)
                    continue
                now = time.monotonic()
                if page.first_failure is None:
                    page.first_failure = now
                self.failures += 1
                give_up = not retry or page.attempts >= self.max_attempts or \
                    now - page.first_failure >= self.retry_for_s
                if not retry:
                    self.refused += 1
                    self._active.pop(page.key, None)
                if give_up:
                    self._pending.popleft()
                    self.given_up += 1
                    self._cond.notify_all()
                else:
                    page.next_try = now + min(self.retry_max_s, self.retry_initial_s * 2 ** (page.attempts - 1))
            self._failed(f"push of {len(page.alerts)} alert(s) to {self.endpoint} failed (attempt "
                         f"{page.attempts}): {error}")
            if give_up and not retry:
                log.error("sdc_telemetry: %s refused the page of the incident at step %d (%s); not retried (the same "
                          "post would be refused again); the rule pages once Prometheus scrapes the suspect",
                          self.endpoint, page.step, error)
            elif give_up:
                log.error("sdc_telemetry: gave up the page of the incident at step %d after %d attempts over %.0fs; "
                          "the rule pages once Prometheus scrapes the suspect", page.step, page.attempts,
                          time.monotonic() - (page.first_failure or now))

    def _next_due(self) -> _Page | None:
        """Wait (lock held) until the head page is due; None when the thread should stop."""
        while True:
            if self._abandoned:
                return None
            if not self._pending:
                if self._closed:
                    return None
                if not self._active:
                    self._cond.wait()
                    continue
                # Nothing queued: the earliest re-send of an accepted incident, when it is due.
                key, (alerts, step, starts_at, due_at) = min(self._active.items(), key=lambda kv: kv[1][3])
                wait = due_at - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                self._active[key] = (alerts, step, starts_at, time.monotonic() + self.resend_s)
                self.resent += 1
                self._pending.append(_Page(alerts, step, starts_at, key, attempts_resend=True))
                continue
            page = self._pending[0]
            now = time.monotonic()
            due = page.next_try
            if self._closed and self._deadline is not None:
                if now >= self._deadline:
                    return None  # close() drops what is left
                # Closing: no long backoff, a retry every retry_initial_s until close()'s deadline.
                due = min(due, self._last_try + self.retry_initial_s)
            elif self._flushing:  # flushing: the same, until the flush returns
                due = min(due, self._last_try + self.retry_initial_s)
            if now >= due:
                return page
            wait = due - now
            if self._deadline is not None:
                wait = min(wait, max(0.0, self._deadline - now))
            self._cond.wait(wait)

    def _attempt(self, page: _Page) -> tuple[bool, str, bool]:
        """(accepted, the error, worth retrying)."""
        page.attempts += 1
        self._last_try = time.monotonic()
        now = time.time()
        ends = _rfc3339(now if page.ends_now else now + self.ttl_s)
        body = [{**a, "startsAt": page.starts_at, "endsAt": ends} for a in page.alerts]
        try:
            self._post(body)
        except _Refused as e:
            return False, str(e), False
        except Exception as e:  # noqa: BLE001 - a failed page is counted, logged and retried, never raised
            return False, str(e) if isinstance(e, RuntimeError) else repr(e), True
        return True, "", True

    def _post(self, body: list[dict[str, Any]]) -> None:
        req = urllib.request.Request(self.endpoint, data=json.dumps(body).encode(), method="POST",  # noqa: S310
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:  # noqa: S310 - scheme checked in __init__
                r.read()
        except urllib.error.HTTPError as e:
            detail = e.read(500).decode(errors="replace")
            if 400 <= e.code < 500 and e.code != 429:
                raise _Refused(f"HTTP {e.code}: {detail}") from None
            raise RuntimeError(f"HTTP {e.code}: {detail}") from None

    def _failed(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("sdc_telemetry: %s (retried with backoff; later failures are logged at debug level)",
                        message)
        else:
            log.debug("sdc_telemetry: %s", message)
        if self._on_error is not None:
            try:
                self._on_error()
            except Exception:  # the error counter must not break the pusher either
                log.debug("sdc_telemetry: on_error callback failed", exc_info=True)


def _key(incident: Incident) -> tuple[Any, ...]:
    """An incident's identity for re-sends: its episode's first step, check and suspects."""
    return (incident.check, incident.step, tuple(incident.suspect_ranks))
