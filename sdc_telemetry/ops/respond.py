"""Drain the suspect node: an authenticated Alertmanager webhook receiver that runs one command per paged host.

Point Alertmanager's ``responder`` receiver at it, with the token in ``http_config.authorization.credentials_file``,
and it runs a command template for each host named by a firing, unambiguous, critical SDC alert, for example a Slurm
drain::

    sdc-telemetry respond --listen 10.0.0.5:9095 --bearer-token-file /etc/sdc/token \\
        --command 'scontrol update NodeName={host_name} State=DRAIN Reason="SDC {alertname} rank {rank} {hw_id}"' \\
        --replace-command '/usr/local/bin/sdc-replace-gpu {host_name} {hw_id}'

In Python (tests, drills)::

    with Responder("kubectl cordon {host_name}", bearer_token="s3cret", port=0, dry_run=True) as r:
        print(r.url)   # POST notifications to f"{r.url}/alerts"; GET f"{r.url}/healthz" and f"{r.url}/metrics"

Safety, because the input comes over the network and the command can take a node out of service:

- **Authentication.** With a bearer token every POST must carry ``Authorization: Bearer <token>`` (compared in
  constant time); anything else gets 401 and runs nothing. Running without a token needs ``insecure_no_auth=True``
  (``--insecure-no-auth``). ``tls_cert``/``tls_key`` serve HTTPS. A body that is not ``application/json`` gets 415
  (a browser form cannot send one without a CORS preflight), a malformed one 400, one over ``MAX_BODY_BYTES`` 413.
- **Only our pages.** It acts on firing alerts with ``severity="critical"`` whose alertname is one of the SDC
  critical alerts (``SUSPECT_ALERTS``) and that are not ``ambiguous="true"``; everything else is ignored (counted).
- **Labels validated before anything runs.** ``host_name`` must be one host name (letters, digits, ``-``, ``.``,
  ``_``, not starting with ``-``: no lists, ranges, globs, spaces or control characters that a scheduler would
  expand), ``rank`` digits, ``hw_id`` letters, digits, ``-``, ``:``, ``.``, ``_``, not starting with ``-``. A bad
  value refuses that alert (log line, counter), runs nothing and uses no slot of the hourly cap.
- **No shell.** The template is split once, at start, like a shell line (``shlex.split``); the placeholders
  ``{host_name}``, ``{rank}``, ``{hw_id}`` and ``{alertname}`` are replaced inside each argument in one pass, and the
  argv runs without a shell. The program (first word) may not contain a placeholder.
- **Once per host per ``reacquire_after_s``** (default 24 h), remembered across restarts in ``state_file`` (written
  with fsync before an atomic rename). A command that fails leaves the host unmarked, so Alertmanager's next
  notification retries it.
- **Hourly cap.** At most ``max_actions_per_hour`` commands start in any sliding hour; past that it refuses, logs
  and counts: pages for many hosts at once are more likely a software fault than many broken GPUs.
- **Strikes.** Every action is a strike for the alert's GPU in the ledger (``sdc_telemetry.ops.ledger``); when the
  GPU already has a strike within ``strike_window_s`` (default 90 days) the ``replace_command`` runs instead of the
  command. After a successful action ``screen_command`` (if given) runs in the background.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
import shlex
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sdc_telemetry.ops.ledger import DEFAULT_STRIKE_WINDOW_S, Ledger, LedgerError
from sdc_telemetry.sinks.alert_table import SUSPECT_ALERTS
from sdc_telemetry.sinks.metrics import family

_STRIKES = family("sdc_fleet_gpu_strikes")  # the one metric table spells the name and its labels

__all__ = ["PLACEHOLDERS", "MAX_BODY_BYTES", "SDC_CRITICAL_ALERTS", "DEFAULT_REACQUIRE_S", "Responder",
           "TemplateError", "parse_duration", "parse_template", "render", "parse_listen", "validate_labels"]

log = logging.getLogger("sdc_telemetry")

PLACEHOLDERS = ("host_name", "rank", "hw_id", "alertname")
SDC_CRITICAL_ALERTS = frozenset(SUSPECT_ALERTS.values())
MAX_BODY_BYTES = 1 << 20
WINDOW_S = 3600.0
DEFAULT_REACQUIRE_S = 86400.0
LISTEN_BACKLOG = 128
_BRACES = re.compile(r"\{([^{}]*)\}")
_KNOWN = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")
_OUTPUT_LOG_CHARS = 2000
_HOST_RE = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]{0,252}")
_RANK_RE = re.compile(r"[0-9]{1,9}")
_HW_ID_RE = re.compile(r"[A-Za-z0-9_.:][A-Za-z0-9_.:-]{0,127}")
_RESERVED_HOSTS = frozenset({"all"})  # scontrol NodeName=ALL means every node
_DURATION_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h|d|w)?")
_DURATION_UNITS = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


class TemplateError(ValueError):
    """The command template cannot be used (does not parse, no placeholder, unknown placeholder)."""


def parse_template(template: str, option: str = "--command") -> list[str]:
    """Split ``template`` like a shell line and check its placeholders; returns the argv with placeholders in place.

    >>> parse_template('scontrol update NodeName={host_name} Reason="SDC {alertname}"')
    ['scontrol', 'update', 'NodeName={host_name}', 'Reason=SDC {alertname}']
    """
    try:
        argv = shlex.split(template)
    except ValueError as e:
        raise TemplateError(f"{option} does not parse like a shell line: {e}") from None
    if not argv:
        raise TemplateError(f"{option} is empty")
    unknown = sorted({m for arg in argv for m in _BRACES.findall(arg) if m not in PLACEHOLDERS})
    if unknown:
        raise TemplateError(f"{option} has unknown placeholder(s) {', '.join('{' + u + '}' for u in unknown)}; "
                            f"known: {', '.join('{' + p + '}' for p in PLACEHOLDERS)}")
    if not any(_KNOWN.search(arg) for arg in argv):
        raise TemplateError(f"{option} has no placeholder: it must name the host, e.g. {{host_name}} "
                            f"(known: {', '.join('{' + p + '}' for p in PLACEHOLDERS)})")
    if _KNOWN.search(argv[0]):
        raise TemplateError(f"{option}: the program {argv[0]!r} may not contain a placeholder (an alert label "
                            f"would choose what runs)")
    return argv


def render(argv: Sequence[str], values: Mapping[str, str]) -> list[str]:
    """Replace the placeholders inside each argument with ``values`` in one pass (values are never re-scanned)."""
    return [_KNOWN.sub(lambda m: values[m.group(1)], arg) for arg in argv]


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9095`` for IPv6) -> (host, port); ValueError naming the problem."""
    host, sep, port_text = listen.rpartition(":")
    if not sep or not host:
        raise ValueError(f"--listen must be HOST:PORT, got {listen!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"--listen port must be an integer in 0..65535, got {port_text!r}")
    return host, int(port_text)


def parse_duration(text: str, option: str = "duration") -> float:
    """``2s``, ``10m``, ``24h``, ``90d``, ``1w``, ``500ms`` or plain seconds -> seconds (> 0); ValueError otherwise.

    >>> parse_duration("24h"), parse_duration("90d"), parse_duration("30")
    (86400.0, 7776000.0, 30.0)
    """
    m = _DURATION_RE.fullmatch(str(text).strip())
    if not m:
        raise ValueError(f"{option} must be a duration like 2s, 10m, 24h or 90d, got {text!r}")
    seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    if not seconds > 0:
        raise ValueError(f"{option} must be longer than zero, got {text!r}")
    return seconds


def validate_labels(labels: Mapping[str, str]) -> str | None:
    """Why the labels substituted into a command are unusable, or None when ``host_name``, ``rank`` and ``hw_id``
    are each one plain value (see the module docstring)."""
    checks = (("host_name", _HOST_RE, "one host name of letters, digits, '-', '.', '_', not starting with '-'"),
              ("rank", _RANK_RE, "digits"),
              ("hw_id", _HW_ID_RE, "letters, digits, '-', ':', '.', '_', not starting with '-'"))
    for name, pattern, want in checks:
        value = labels.get(name)
        if value is None:
            return f"label {name} is missing"
        if not pattern.fullmatch(value):
            return f"label {name}={ascii(value)[:80]} is not {want}"
    if labels["host_name"].lower() in _RESERVED_HOSTS:
        return f"label host_name={labels['host_name']!r} is a scheduler keyword for many nodes, not one host"
    return None


def _safe(text: str) -> str:
    """``text`` as printable ASCII (escapes for control characters, non-ASCII and lone surrogates): safe to log
    and echo."""
    return ascii(text)[1:-1]


class _BadRequest(ValueError):
    pass


@dataclass(frozen=True)
class _Page:
    """One firing critical SDC alert for one host: the values substituted into the template, and the strike."""

    host_name: str
    rank: str
    hw_id: str
    alertname: str
    job: str | None = None
    step: int | None = None
    check: str | None = None

    def values(self) -> dict[str, str]:
        return {"host_name": self.host_name, "rank": self.rank, "hw_id": self.hw_id, "alertname": self.alertname}


@dataclass
class _Triage:
    pages: list[_Page]
    rejected: list[tuple[str, str, str]]  # (host_name made safe, alertname, reason)
    ignored: list[tuple[str, str]]        # (alertname made safe, reason)


def _triage(body: Any) -> _Triage:
    """Validate a webhook body (Alertmanager's JSON, version 4) and sort its alerts into pages (one per host),
    rejected pages (bad labels) and ignored alerts. The whole body's shape is checked before anything runs, so a
    half-malformed notification does nothing."""
    if not isinstance(body, dict):
        raise _BadRequest("body must be a JSON object")
    if "status" in body and not isinstance(body["status"], str):
        raise _BadRequest("'status' must be a string")
    alerts = body.get("alerts")
    if not isinstance(alerts, list):
        raise _BadRequest("'alerts' must be a list")
    for i, alert in enumerate(alerts):
        if not isinstance(alert, dict):
            raise _BadRequest(f"alerts[{i}] must be an object")
        status, labels = alert.get("status"), alert.get("labels")
        if status not in ("firing", "resolved"):
            raise _BadRequest(f"alerts[{i}].status must be 'firing' or 'resolved'")
        if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in labels.items()):
            raise _BadRequest(f"alerts[{i}].labels must be an object of strings")
        if "annotations" in alert and not isinstance(alert["annotations"], dict):
            raise _BadRequest(f"alerts[{i}].annotations must be an object")
    out = _Triage([], [], [])
    pages: dict[str, _Page] = {}
    for alert in alerts:
        labels = alert["labels"]
        name = labels.get("alertname", "")
        if alert["status"] != "firing":
            continue
        if labels.get("severity") != "critical":
            out.ignored.append((_safe(name), "not_critical"))
            continue
        if name not in SDC_CRITICAL_ALERTS:
            out.ignored.append((_safe(name), "foreign"))
            continue
        if labels.get("ambiguous") == "true":
            out.ignored.append((name, "ambiguous"))
            continue
        host = labels.get("host_name", "")
        reason = validate_labels(labels)
        if reason is not None:
            out.rejected.append((_safe(host), name, reason))
            continue
        annotations = alert.get("annotations") or {}
        step_text = labels.get("step", annotations.get("step"))
        step = int(step_text) if isinstance(step_text, str) and _RANK_RE.fullmatch(step_text) else None
        pages.setdefault(host, _Page(host, labels["rank"], labels["hw_id"], name, job=labels.get("service_name"),
                                     step=step, check=labels.get("check")))
    out.pages = list(pages.values())
    return out


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG
    responder: Responder
    tls: ssl.SSLContext | None = None

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = self.socket.accept()
        if self.tls is not None:
            # The handshake happens on the handler's thread at its first read, under the idle timeout, so a client
            # that connects and says nothing holds no more than its own thread for that long.
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("sdc responder: connection from %s ended with an error", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        # Seconds a connection may sit idle or mid-request (TLS handshake included) before it is closed.
        self.request.settimeout(self.server.responder.idle_timeout_s)
        super().setup()

    def _reply(self, code: int, doc: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> None:
        data = (json.dumps(doc, sort_keys=True) + "\n").encode()
        self._send(code, data, "application/json", headers)

    def _send(self, code: int, data: bytes, content_type: str, headers: Mapping[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _path(self) -> str:
        return self.path.split("?", 1)[0]

    def do_GET(self) -> None:
        path = self._path()
        responder = self.server.responder
        if path == "/healthz":
            self._reply(200, responder.health())
        elif path == "/metrics":
            self._send(200, responder.metrics_text(), CONTENT_TYPE_LATEST)
        elif path in ("/", "/alerts"):
            self._reply(405, {"error": "POST Alertmanager notifications here"})
        else:
            self._reply(404, {"error": f"no such path {path!a}: POST /alerts, GET /healthz, GET /metrics"})

    def _reject(self, code: int, reason: str, headers: Mapping[str, str] | None = None) -> None:
        self.close_connection = True  # the body is not read
        self.server.responder._rejected(code)
        self._reply(code, {"error": reason}, headers)

    def do_POST(self) -> None:
        path = self._path()
        responder = self.server.responder
        if path not in ("/", "/alerts"):
            self._reject(404, f"no such path {path!a}: POST /alerts, GET /healthz, GET /metrics")
            return
        if not responder._authorized(self.headers.get("Authorization")):
            log.warning("sdc responder: 401 for a POST from %s without the right bearer token: nothing runs",
                        self.client_address[0])
            self._reject(401, "a valid 'Authorization: Bearer <token>' header is required",
                         {"WWW-Authenticate": 'Bearer realm="sdc-telemetry respond"'})
            return
        length_text = self.headers.get("Content-Length")
        if length_text is None or not length_text.isdigit():
            self._reject(411 if length_text is None else 400, "a numeric Content-Length is required")
            return
        if int(length_text) > MAX_BODY_BYTES:
            self._reject(413, f"body over {MAX_BODY_BYTES} bytes")
            return
        media = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            self._reject(415, f"Content-Type must be application/json, got {media or '(none)'!a}")
            return
        try:
            raw = self.rfile.read(int(length_text))
        except OSError:  # the client sent less than it announced and went quiet
            self.close_connection = True
            return
        try:
            triage = _triage(json.loads(raw))
        except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError and _BadRequest
            reason = str(e) if isinstance(e, _BadRequest) else "body is not valid JSON"
            log.warning("sdc responder: rejected a notification from %s: %s", self.client_address[0], reason)
            responder._rejected(400)
            self._reply(400, {"error": reason})
            return
        responder._count("notifications")
        try:
            outcome = responder.handle(triage)
        except Exception as e:  # the server outlives any one notification
            log.exception("sdc responder: internal error")
            self._reply(500, {"error": f"internal error: {type(e).__name__}"})
            return
        self._reply(200, outcome)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("sdc responder http: " + format, *(ascii(a) if isinstance(a, str) else a for a in args))


class _FleetCollector:
    """``sdc_fleet_gpu_strikes{hw_id,host_name}``, read from the ledger at scrape time."""

    def __init__(self, responder: Responder) -> None:
        self._responder = responder

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(_STRIKES.name, _STRIKES.description, labels=list(_STRIKES.labels))
        r = self._responder
        try:
            fleet = r.ledger.fleet(window_s=r.strike_window_s, now=r._clock())
        except LedgerError as e:
            log.error("sdc responder: cannot read the ledger for /metrics: %s", e)
            r._ledger_errors.inc()
            fleet = []
        for gpu in fleet:
            if gpu.strikes_in_window:
                g.add_metric([gpu.hw_id, gpu.host_name], float(gpu.strikes_in_window))
        yield g


class Responder:
    """Authenticated Alertmanager webhook receiver that drains paged hosts (see the module docstring).

    ``command``: the template, e.g. ``"kubectl cordon {host_name}"`` (``TemplateError`` when unusable).
    ``bearer_token``: the token every POST must carry; ``insecure_no_auth=True`` is required to run without one.
    ``tls_cert``/``tls_key``: PEM files; serve HTTPS. ``host``/``port``: where to listen (``port=0`` picks a free
    port: read ``.port``). ``max_actions_per_hour``: commands allowed to start in any sliding hour. ``dry_run``: log
    the argv instead of running it (and record no strike). ``state_file``: JSON file remembering the hosts acted on
    and recent action times across restarts (None: memory only). ``reacquire_after_s``: a host acted on is not acted
    on again for this long. ``ledger``: a :class:`~sdc_telemetry.ops.ledger.Ledger` or its URL (None: an in-memory
    SQLite ledger). ``replace_command``: template run instead of ``command`` on a GPU's second strike within
    ``strike_window_s``. ``screen_command``: template run in the background after a successful action, for at most
    ``screen_timeout_s``. ``timeout_s``: per command. ``idle_timeout_s``: how long a connection may sit idle.
    ``clock``: wall-clock seconds (tests pass a fake one). The server runs on a background thread from construction
    until ``close()``.
    """

    def __init__(self, command: str, *, host: str = "127.0.0.1", port: int = 0, max_actions_per_hour: int = 3,
                 dry_run: bool = False, state_file: str | Path | None = None, timeout_s: float = 60.0,
                 bearer_token: str | None = None, insecure_no_auth: bool = False, tls_cert: str | Path | None = None,
                 tls_key: str | Path | None = None, reacquire_after_s: float = DEFAULT_REACQUIRE_S,
                 ledger: Ledger | str | None = None, replace_command: str | None = None,
                 strike_window_s: float = DEFAULT_STRIKE_WINDOW_S, screen_command: str | None = None,
                 screen_timeout_s: float = 3600.0, idle_timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.argv = parse_template(command)
        self.replace_argv = parse_template(replace_command, "--replace-command") if replace_command else None
        self.screen_argv = parse_template(screen_command, "--screen-command") if screen_command else None
        if not dry_run:
            for option, argv in (("--command", self.argv), ("--replace-command", self.replace_argv),
                                 ("--screen-command", self.screen_argv)):
                if argv is not None and shutil.which(argv[0]) is None:
                    raise TemplateError(f"{option}: program {argv[0]!r} not found (not on PATH, or not executable)")
        if isinstance(max_actions_per_hour, bool) or not isinstance(max_actions_per_hour, int) \
                or max_actions_per_hour < 0:
            raise ValueError(f"max_actions_per_hour must be an integer >= 0, got {max_actions_per_hour!r}")
        for name, value in (("timeout_s", timeout_s), ("reacquire_after_s", reacquire_after_s),
                            ("strike_window_s", strike_window_s), ("screen_timeout_s", screen_timeout_s),
                            ("idle_timeout_s", idle_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if bearer_token is not None:
            if not isinstance(bearer_token, str) or not bearer_token.strip():
                raise ValueError("bearer_token is empty")
            if insecure_no_auth:
                raise ValueError("give a bearer token or insecure_no_auth=True, not both")
            self._token: bytes | None = bearer_token.strip().encode("utf-8")
        elif not insecure_no_auth:
            raise ValueError("the responder needs a bearer token (--bearer-token-file FILE: the token Alertmanager "
                             "sends with http_config.authorization.credentials_file); to run without "
                             "authentication on a bench, say so with --insecure-no-auth")
        else:
            self._token = None
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together: give both PEM files, or neither")
        tls = None
        if tls_cert is not None and tls_key is not None:
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            tls.minimum_version = ssl.TLSVersion.TLSv1_2
            try:
                tls.load_cert_chain(str(tls_cert), str(tls_key))
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"cannot load --tls-cert {tls_cert} / --tls-key {tls_key}: {e}") from None
        self.max_actions_per_hour = max_actions_per_hour
        self.dry_run = dry_run
        self.timeout_s = float(timeout_s)
        self.reacquire_after_s = float(reacquire_after_s)
        self.strike_window_s = float(strike_window_s)
        self.screen_timeout_s = float(screen_timeout_s)
        self.idle_timeout_s = float(idle_timeout_s)
        self._clock = clock
        self._state_file = Path(state_file) if state_file is not None else None
        self._lock = threading.Lock()
        self._acted: dict[str, dict[str, Any]] = {}  # host -> {"at", "alertname", "hw_id", "action"}
        self._busy: set[str] = set()  # hosts whose command is running now
        self._window: deque[float] = deque()  # start times of recent actions
        self._counts = {"actions": 0, "replacements": 0, "refusals": 0, "failures": 0, "rejected_bodies": 0,
                        "rejected_hosts": 0, "ignored_alerts": 0, "notifications": 0, "unauthorized": 0,
                        "screens_passed": 0, "screens_failed": 0, "ledger_errors": 0}
        self.refused: list[dict[str, Any]] = []  # the most recent refusals, for /healthz and tests
        self._screens: list[threading.Thread] = []
        self._load_state()
        self._owns_ledger = not isinstance(ledger, Ledger)
        self.ledger = ledger if isinstance(ledger, Ledger) else Ledger(ledger or "sqlite://")
        self._init_metrics()

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_cls = type("_BoundServer", (_Server,), {"address_family": family})
        try:
            self._server: _Server = server_cls((host, port), _Handler)
        except OSError:
            if self._owns_ledger:
                self.ledger.close()
            raise
        self._server.responder = self
        self._server.tls = tls
        self.host = host
        self.port = int(self._server.server_address[1])
        self.scheme = "https" if tls is not None else "http"
        self._thread = threading.Thread(target=self._server.serve_forever, name="sdc-responder", daemon=True)
        self._thread.start()
        self._closed = False
        log.info("sdc responder listening on %s (%s; command %s%s%s, at most %d action(s) an hour, reacquire after "
                 "%.0fs, ledger %s)", self.url, "bearer token" if self._token else "NO AUTHENTICATION", self.argv,
                 f", replace {self.replace_argv}" if self.replace_argv else "", ", dry run" if dry_run else "",
                 max_actions_per_hour, self.reacquire_after_s, self.ledger.redacted_url)

    def _init_metrics(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self._m_notifications = Counter("sdc_responder_notifications", "Well-formed notifications received.",
                                        registry=reg)
        self._m_actions = Counter("sdc_responder_actions", "Commands started (or logged in a dry run), by action: "
                                  "command (the drain) or replace (a GPU's second strike).", ["action"], registry=reg)
        self._m_failures = Counter("sdc_responder_failures", "Commands that did not succeed, by action.", ["action"],
                                   registry=reg)
        self._m_refusals = Counter("sdc_responder_refusals", "Alerts not acted on, by reason: cap (over the hourly "
                                   "cap) or invalid_label (a label unfit for a command).", ["reason"], registry=reg)
        self._m_ignored = Counter("sdc_responder_ignored_alerts", "Firing alerts this responder does not act on, by "
                                  "reason: not_critical, foreign (not an SDC alert), ambiguous.", ["reason"],
                                  registry=reg)
        self._m_rejected = Counter("sdc_responder_rejected_requests", "HTTP requests refused, by status code.",
                                   ["code"], registry=reg)
        self._m_screens = Counter("sdc_responder_screens", "Screens run after an action, by result: pass, fail, "
                                  "error.", ["result"], registry=reg)
        self._ledger_errors = Counter("sdc_responder_ledger_errors", "Ledger reads or writes that failed.",
                                      registry=reg)
        for action in ("command", "replace"):
            self._m_actions.labels(action)
            self._m_failures.labels(action)
        for reason in ("cap", "invalid_label"):
            self._m_refusals.labels(reason)
        for reason in ("not_critical", "foreign", "ambiguous"):
            self._m_ignored.labels(reason)
        for code in ("400", "401", "404", "411", "413", "415"):
            self._m_rejected.labels(code)
        for result in ("pass", "fail", "error"):
            self._m_screens.labels(result)
        reg.register(cast(Any, _FleetCollector(self)))

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def __enter__(self) -> Responder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving and join the server thread (screens still running are left to finish on their own)."""
        if self._closed:
            log.warning("sdc responder: close() called twice")
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
        if self._owns_ledger:
            self.ledger.close()

    def wait_screens(self, timeout: float = 60.0) -> bool:
        """Wait for the screens started so far; True when all finished."""
        deadline = time.monotonic() + timeout
        for t in list(self._screens):
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._screens)

    # -- HTTP-side helpers -------------------------------------------------------------------------------------

    def _authorized(self, header: str | None) -> bool:
        if self._token is None:
            return True
        scheme, _, credentials = (header or "").strip().partition(" ")
        given = credentials.strip().encode("latin-1", "replace")
        ok = hmac.compare_digest(given, self._token)  # constant time whatever the scheme says
        return ok and scheme.lower() == "bearer"

    def _rejected(self, code: int) -> None:
        self._count("unauthorized" if code == 401 else "rejected_bodies")
        self._m_rejected.labels(str(code)).inc()

    def metrics_text(self) -> bytes:
        return bytes(generate_latest(self.registry))

    def health(self) -> dict[str, Any]:
        """Counts for ``GET /healthz``: notifications (well-formed bodies received), actions (commands started, or
        logged in a dry run), replacements (of them, replace commands), refusals (over the hourly cap), failures
        (commands that did not succeed), rejected_bodies (HTTP 4xx other than 401), unauthorized (401),
        rejected_hosts (alerts refused for a label unfit for a command), ignored_alerts, hosts_acted_on (within the
        reacquire time) and the hosts."""
        with self._lock:
            now = self._clock()
            hosts = sorted(h for h, rec in self._acted.items() if now - rec["at"] < self.reacquire_after_s)
            return {"status": "ok", **self._counts, "hosts_acted_on": len(hosts), "hosts": hosts,
                    "actions_last_hour": sum(1 for t in self._window if now - t < WINDOW_S),
                    "max_actions_per_hour": self.max_actions_per_hour, "dry_run": self.dry_run,
                    "authenticated": self._token is not None, "reacquire_after_s": self.reacquire_after_s,
                    "strike_window_s": self.strike_window_s, "ledger": self.ledger.redacted_url,
                    "recent_refusals": list(self.refused)}

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    # -- decisions ---------------------------------------------------------------------------------------------

    def handle(self, triage: _Triage | Sequence[_Page]) -> dict[str, list[str]]:
        """Act on a triaged notification; returns the hosts acted on (and of them replaced), already acted on,
        refused (cap), failed, rejected (bad labels) and the alerts ignored."""
        if not isinstance(triage, _Triage):
            triage = _Triage(list(triage), [], [])
        outcome: dict[str, list[str]] = {"acted": [], "replaced": [], "already": [], "refused": [], "failed": [],
                                         "rejected": [], "ignored": []}
        self._m_notifications.inc()
        for name, reason in triage.ignored:
            self._m_ignored.labels(reason).inc()
            outcome["ignored"].append(name)
            log.info("sdc responder: ignored alert %s (%s)", name, reason)
        self._count("ignored_alerts", len(triage.ignored))
        for host, name, reason in triage.rejected:
            log.error("sdc responder: REFUSED alert %s for host %s: %s; nothing runs (no cap slot used)", name,
                      host, reason)
            self._m_refusals.labels("invalid_label").inc()
            self._count("rejected_hosts")
            outcome["rejected"].append(host)
        for page in triage.pages:
            self._act(page, outcome)
        return outcome

    def _act(self, page: _Page, outcome: dict[str, list[str]]) -> None:
        host = page.host_name
        with self._lock:
            now = self._clock()
            rec = self._acted.get(host)
            if (rec is not None and now - rec["at"] < self.reacquire_after_s) or host in self._busy:
                outcome["already"].append(host)
                return
            reason = self._refusal(now)
            if reason:
                self._counts["refusals"] += 1
                self._m_refusals.labels("cap").inc()
                self.refused = [*self.refused[-19:], {"host_name": host, "alertname": page.alertname, "at": now,
                                                      "reason": reason}]
                log.error("sdc responder: REFUSED to act on host %r (%s, rank %s, %s): %s. Act by hand after "
                          "checking that the pages are real.", host, page.alertname, page.rank, page.hw_id, reason)
                outcome["refused"].append(host)
                return
            self._window.append(now)
            self._busy.add(host)
        action, ok = "command", False
        try:
            action, argv = self._choose(page, now)
            with self._lock:
                self._counts["actions"] += 1
                if action == "replace":
                    self._counts["replacements"] += 1
            self._m_actions.labels(action).inc()
            ok = self._run(argv, page, action)
            if ok and not self.dry_run:
                try:
                    self.ledger.add_strike(page.hw_id, host_name=host, job=page.job, step=page.step,
                                           check=page.check, alertname=page.alertname, at=self._clock())
                except LedgerError as e:
                    log.error("sdc responder: could not record the strike for %s on %s: %s", page.hw_id, host, e)
                    self._ledger_errors.inc()
                    self._count("ledger_errors")
        finally:
            with self._lock:
                self._busy.discard(host)
        with self._lock:
            if ok:
                self._acted[host] = {"at": self._clock(), "alertname": page.alertname, "hw_id": page.hw_id,
                                     "action": action}
            else:
                self._counts["failures"] += 1
            self._save_state()
        if not ok:
            self._m_failures.labels(action).inc()
        outcome["acted" if ok else "failed"].append(host)
        if ok and action == "replace":
            outcome["replaced"].append(host)
        if ok and self.screen_argv is not None:
            self._start_screen(page)

    def _choose(self, page: _Page, now: float) -> tuple[str, list[str]]:
        """``("replace", argv)`` when the GPU already has a strike within the window and a replace command is set,
        else ``("command", argv)``."""
        try:
            prior = self.ledger.count_strikes(page.hw_id, since=now - self.strike_window_s)
        except LedgerError as e:  # drain anyway: the safe action does not depend on the ledger
            log.error("sdc responder: cannot read the strikes of %s: %s; running the drain command", page.hw_id, e)
            self._ledger_errors.inc()
            self._count("ledger_errors")
            prior = 0
        if prior >= 1:
            if self.replace_argv is not None:
                log.warning("sdc responder: GPU %s on %r has %d earlier strike(s) within %.0f days: running the "
                            "replace command", page.hw_id, page.host_name, prior, self.strike_window_s / 86400)
                return "replace", render(self.replace_argv, page.values())
            log.warning("sdc responder: GPU %s on %r has %d earlier strike(s) within %.0f days: replace it (no "
                        "--replace-command given; running the drain command)", page.hw_id, page.host_name, prior,
                        self.strike_window_s / 86400)
        return "command", render(self.argv, page.values())

    def _refusal(self, now: float) -> str | None:
        while self._window and now - self._window[0] >= WINDOW_S:
            self._window.popleft()
        if len(self._window) >= self.max_actions_per_hour:
            return (f"{len(self._window)} action(s) in the last hour reach the cap of {self.max_actions_per_hour} "
                    f"(pages for many hosts at once are more likely a software fault than broken hardware)")
        return None

    def _run(self, argv: list[str], page: _Page, action: str, timeout_s: float | None = None) -> bool:
        return self._exec(argv, page, action, timeout_s)[0] == 0

    def _exec(self, argv: list[str], page: _Page, action: str, timeout_s: float | None = None) -> tuple[int, str]:
        """Run argv; (exit code, or -1 when it could not run or timed out; a short account)."""
        if self.dry_run:
            log.warning("sdc responder: DRY RUN for host %r (%s, %s): would run %s", page.host_name, page.alertname,
                        action, argv)
            return 0, "dry run"
        log.warning("sdc responder: acting on host %r (%s, rank %s, %s): running %s %s", page.host_name,
                    page.alertname, page.rank, page.hw_id, action, argv)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            log.error("sdc responder: %s timed out after %.0fs", argv, timeout)
            return -1, f"timed out after {timeout:.0f}s"
        except OSError as e:
            log.error("sdc responder: could not run %s: %s", argv, e)
            return -1, str(e)
        out = proc.stdout.decode(errors="replace")[-_OUTPUT_LOG_CHARS:].strip()
        err = proc.stderr.decode(errors="replace")[-_OUTPUT_LOG_CHARS:].strip()
        level = logging.INFO if proc.returncode == 0 else logging.ERROR
        log.log(level, "sdc responder: %s exited with %d; stdout: %s; stderr: %s", argv, proc.returncode,
                out or "(empty)", err or "(empty)")
        return proc.returncode, out[-200:]

    def _start_screen(self, page: _Page) -> None:
        assert self.screen_argv is not None
        argv = render(self.screen_argv, page.values())

        def screen() -> None:
            rc, _ = self._exec(argv, page, "screen", self.screen_timeout_s)
            result = "pass" if rc == 0 else "fail" if rc == 1 else "error"
            self._m_screens.labels(result).inc()
            if result == "pass":
                self._count("screens_passed")
            else:
                self._count("screens_failed")
            level = logging.INFO if result == "pass" else logging.ERROR
            log.log(level, "sdc responder: screen of host %r after %s: %s (exit %d)%s", page.host_name,
                    page.alertname, result, rc, "" if result == "pass" else
                    ": keep the node out of service" + (" and look at the odd device" if result == "fail" else ""))

        t = threading.Thread(target=screen, name=f"sdc-screen-{page.host_name}", daemon=True)
        self._screens = [*(x for x in self._screens if x.is_alive()), t]
        t.start()

    # -- state -------------------------------------------------------------------------------------------------

    def _load_state(self) -> None:
        if self._state_file is None or not self._state_file.exists():
            return
        try:
            doc = json.loads(self._state_file.read_text())
            hosts, actions = doc["hosts"], doc["actions"]
            if not isinstance(hosts, dict) or not isinstance(actions, list) \
                    or not all(isinstance(t, (int, float)) for t in actions) \
                    or not all(isinstance(v, dict) and isinstance(v.get("at"), (int, float)) for v in hosts.values()):
                raise TypeError("'hosts' must map host names to {'at': time, ...} and 'actions' be a list of times")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--state file {self._state_file} is unreadable or malformed: {e}") from None
        self._acted = {str(h): v for h, v in hosts.items()}
        self._window.extend(sorted(float(t) for t in actions))

    def _save_state(self) -> None:
        """Write the state file durably: a temp file, fsync, atomic rename, fsync of the directory."""
        if self._state_file is None:
            return
        now = self._clock()
        keep = max(self.reacquire_after_s, WINDOW_S)
        self._acted = {h: rec for h, rec in self._acted.items() if now - rec["at"] < keep}
        doc = {"hosts": self._acted, "actions": [t for t in self._window if now - t < WINDOW_S]}
        path = self._state_file
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(doc, indent=1, sort_keys=True))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as e:  # the process memory still holds the state; losing the file is not worth a crash
            log.error("sdc responder: could not write --state file %s: %s", path, e)
