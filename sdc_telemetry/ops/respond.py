"""Drain the suspect node: an Alertmanager webhook receiver that runs one command per paged host.

Point Alertmanager's ``pager`` receiver at it (``webhook_configs: [{url: http://<responder>:<port>/alerts}]``) and it
runs a command template once for each host named by a FIRING alert with ``severity="critical"`` and a ``host_name``
label, for example a Slurm drain::

    sdc-telemetry respond --listen 0.0.0.0:9095 \\
        --command 'scontrol update NodeName={host_name} State=DRAIN Reason="SDC {alertname} rank {rank} {hw_id}"'

In Python (tests, drills)::

    with Responder("kubectl cordon {host_name}", port=0, dry_run=True) as r:
        print(r.url)        # POST Alertmanager notifications to f"{r.url}/alerts"; GET f"{r.url}/healthz"

Safety, because the input comes over the network and the command can take a node out of service:
- The template is split once, at start, like a shell line (``shlex.split``); the placeholders ``{host_name}``,
  ``{rank}``, ``{hw_id}`` and ``{alertname}`` are then replaced inside each argument in one pass (the value of a
  label is never searched for placeholders again, and ``str.format`` never sees it), and the argv runs without a
  shell. A label holding ``;``, ``$(...)``, quotes or spaces arrives as one literal argument. The program (first
  word) may not contain a placeholder, and a host name starting with ``-`` (it could be read as an option) or holding
  a NUL character is refused.
- Each host is acted on once for the life of the process (and across restarts with ``state_file``). A command that
  fails (non-zero exit, timeout, not found) leaves the host unmarked, so Alertmanager's next notification retries it.
- At most ``max_actions_per_hour`` commands start in any sliding hour; past that the responder refuses, logs an
  error and counts the refusal: pages for many hosts at once are more likely a software fault than many broken GPUs,
  and a person should look before more nodes go.
- Resolved and non-critical alerts do nothing. A malformed body gets HTTP 400, a body over ``MAX_BODY_BYTES`` 413,
  and the server goes on; nothing in a request can stop it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

__all__ = ["PLACEHOLDERS", "MAX_BODY_BYTES", "Responder", "TemplateError", "parse_template", "render", "parse_listen"]

log = logging.getLogger("sdc_telemetry")

PLACEHOLDERS = ("host_name", "rank", "hw_id", "alertname")
MAX_BODY_BYTES = 1 << 20
WINDOW_S = 3600.0
_BRACES = re.compile(r"\{([^{}]*)\}")
_KNOWN = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")
_OUTPUT_LOG_CHARS = 2000


class TemplateError(ValueError):
    """The command template cannot be used (does not parse, no placeholder, unknown placeholder)."""


def parse_template(template: str) -> list[str]:
    """Split ``template`` like a shell line and check its placeholders; returns the argv with placeholders in place.

    >>> parse_template('scontrol update NodeName={host_name} Reason="SDC {alertname}"')
    ['scontrol', 'update', 'NodeName={host_name}', 'Reason=SDC {alertname}']
    """
    try:
        argv = shlex.split(template)
    except ValueError as e:
        raise TemplateError(f"--command does not parse like a shell line: {e}") from None
    if not argv:
        raise TemplateError("--command is empty")
    unknown = sorted({m for arg in argv for m in _BRACES.findall(arg) if m not in PLACEHOLDERS})
    if unknown:
        raise TemplateError(f"--command has unknown placeholder(s) {', '.join('{' + u + '}' for u in unknown)}; "
                            f"known: {', '.join('{' + p + '}' for p in PLACEHOLDERS)}")
    if not any(_KNOWN.search(arg) for arg in argv):
        raise TemplateError(f"--command has no placeholder: it must name the host, e.g. {{host_name}} "
                            f"(known: {', '.join('{' + p + '}' for p in PLACEHOLDERS)})")
    if _KNOWN.search(argv[0]):
        raise TemplateError(f"--command: the program {argv[0]!r} may not contain a placeholder (an alert label "
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


class _BadRequest(ValueError):
    pass


@dataclass(frozen=True)
class _Page:
    """One firing critical alert for one host: the values substituted into the template."""

    host_name: str
    rank: str
    hw_id: str
    alertname: str

    def values(self) -> dict[str, str]:
        return {"host_name": self.host_name, "rank": self.rank, "hw_id": self.hw_id, "alertname": self.alertname}


def _pages(body: Any) -> list[_Page]:
    """Validate a webhook body (Alertmanager's JSON, version 4) and return its firing critical pages, one per host.

    The whole body is checked before anything runs, so a half-malformed notification does nothing.
    """
    if not isinstance(body, dict):
        raise _BadRequest("body must be a JSON object")
    if "status" in body and not isinstance(body["status"], str):
        raise _BadRequest("'status' must be a string")
    alerts = body.get("alerts")
    if not isinstance(alerts, list):
        raise _BadRequest("'alerts' must be a list")
    pages: dict[str, _Page] = {}
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
        host = labels.get("host_name", "")
        if status != "firing" or labels.get("severity") != "critical" or not host:
            continue
        pages.setdefault(host, _Page(host, labels.get("rank", "unknown"), labels.get("hw_id", "unknown"),
                                     labels.get("alertname", "unknown")))
    return list(pages.values())


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    responder: Responder


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = 30  # seconds a client may take to send its request

    def _reply(self, code: int, doc: Mapping[str, Any]) -> None:
        data = (json.dumps(doc, sort_keys=True) + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _path(self) -> str:
        return self.path.split("?", 1)[0]

    def do_GET(self) -> None:
        path = self._path()
        if path == "/healthz":
            self._reply(200, self.server.responder.health())
        elif path in ("/", "/alerts"):
            self._reply(405, {"error": "POST Alertmanager notifications here"})
        else:
            self._reply(404, {"error": f"no such path {path!r}: POST /alerts, GET /healthz"})

    def do_POST(self) -> None:
        path = self._path()
        responder = self.server.responder
        if path not in ("/", "/alerts"):
            self.close_connection = True  # the body is not read
            self._reply(404, {"error": f"no such path {path!r}: POST /alerts, GET /healthz"})
            return
        length_text = self.headers.get("Content-Length")
        if length_text is None or not length_text.isdigit():
            self.close_connection = True
            responder._count("rejected_bodies")
            self._reply(411 if length_text is None else 400, {"error": "a numeric Content-Length is required"})
            return
        if int(length_text) > MAX_BODY_BYTES:
            self.close_connection = True
            responder._count("rejected_bodies")
            self._reply(413, {"error": f"body over {MAX_BODY_BYTES} bytes"})
            return
        try:
            raw = self.rfile.read(int(length_text))
        except OSError:  # the client sent less than it announced and went quiet
            self.close_connection = True
            return
        try:
            pages = _pages(json.loads(raw))
        except (ValueError, RecursionError) as e:  # JSONDecodeError and _BadRequest are ValueErrors
            reason = str(e) if isinstance(e, _BadRequest) else "body is not valid JSON"
            log.warning("sdc responder: rejected a notification from %s: %s", self.client_address[0], reason)
            responder._count("rejected_bodies")
            self._reply(400, {"error": reason})
            return
        responder._count("notifications")
        try:
            outcome = responder.handle(pages)
        except Exception as e:  # the server outlives any one notification
            log.exception("sdc responder: internal error")
            self._reply(500, {"error": f"internal error: {type(e).__name__}"})
            return
        self._reply(200, outcome)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("sdc responder http: " + format, *args)


class Responder:
    """Alertmanager webhook receiver that runs ``command`` once per paged host (see the module docstring).

    ``command``: the template, e.g. ``"kubectl cordon {host_name}"`` (``TemplateError`` when unusable).
    ``host``/``port``: where to listen (``port=0`` picks a free port: read ``.port``). ``max_actions_per_hour``:
    commands allowed to start in any sliding hour. ``dry_run``: log the argv instead of running it. ``state_file``:
    JSON file remembering the hosts acted on and recent action times across restarts. ``timeout_s``: per command.
    ``clock``: wall-clock seconds (tests pass a fake one to move the hour on). The server runs on a background thread
    from construction until ``close()``.
    """

    def __init__(self, command: str, *, host: str = "127.0.0.1", port: int = 0, max_actions_per_hour: int = 3,
                 dry_run: bool = False, state_file: str | Path | None = None, timeout_s: float = 60.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.argv = parse_template(command)
        if not dry_run and shutil.which(self.argv[0]) is None:
            raise TemplateError(f"--command: program {self.argv[0]!r} not found (not on PATH, or not executable)")
        if isinstance(max_actions_per_hour, bool) or not isinstance(max_actions_per_hour, int) \
                or max_actions_per_hour < 0:
            raise ValueError(f"max_actions_per_hour must be an integer >= 0, got {max_actions_per_hour!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.max_actions_per_hour = max_actions_per_hour
        self.dry_run = dry_run
        self.timeout_s = timeout_s
        self._clock = clock
        self._state_file = Path(state_file) if state_file is not None else None
        self._lock = threading.Lock()
        self._acted: dict[str, dict[str, Any]] = {}  # host -> {"at", "alertname", "argv"}
        self._busy: set[str] = set()  # hosts whose command is running now
        self._window: deque[float] = deque()  # start times of recent actions
        self._counts = {"actions": 0, "refusals": 0, "failures": 0, "rejected_bodies": 0, "rejected_hosts": 0,
                        "notifications": 0}
        self.refused: list[dict[str, Any]] = []  # the most recent refusals, for /healthz and tests
        self._load_state()

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_cls = type("_BoundServer", (_Server,), {"address_family": family})
        self._server: _Server = server_cls((host, port), _Handler)
        self._server.responder = self
        self.host = host
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="sdc-responder", daemon=True)
        self._thread.start()
        self._closed = False
        log.info("sdc responder listening on %s (command %s%s, at most %d action(s) an hour)", self.url,
                 self.argv, ", dry run" if dry_run else "", max_actions_per_hour)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def __enter__(self) -> Responder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving and join the server thread. A second call only warns."""
        if self._closed:
            log.warning("sdc responder: close() called twice")
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    # -- decisions ---------------------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """Counts for ``GET /healthz``: notifications (well-formed bodies received), actions (commands started,
        or logged in a dry run), refusals (over the hourly cap), failures (commands that did not succeed),
        rejected_bodies (HTTP 4xx), rejected_hosts (a host name starting with ``-``, a NUL in a label),
        hosts_acted_on, and the hosts."""
        with self._lock:
            now = self._clock()
            return {"status": "ok", **self._counts, "hosts_acted_on": len(self._acted), "hosts": sorted(self._acted),
                    "actions_last_hour": sum(1 for t in self._window if now - t < WINDOW_S),
                    "max_actions_per_hour": self.max_actions_per_hour, "dry_run": self.dry_run,
                    "recent_refusals": list(self.refused)}

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def handle(self, pages: Sequence[_Page]) -> dict[str, list[str]]:
        """Act on validated pages; returns the hosts acted on, already done, refused and failed."""
        outcome: dict[str, list[str]] = {"acted": [], "already": [], "refused": [], "failed": [], "rejected": []}
        for page in pages:
            if page.host_name.startswith("-") or any("\x00" in v for v in page.values().values()):
                log.error("sdc responder: host name %r (%s) starts with '-' or a label holds a NUL character: not "
                          "acted on", page.host_name, page.alertname)
                self._count("rejected_hosts")
                outcome["rejected"].append(page.host_name)
                continue
            argv = render(self.argv, page.values())
            with self._lock:
                if page.host_name in self._acted or page.host_name in self._busy:
                    outcome["already"].append(page.host_name)
                    continue
                reason = self._refusal()
                if reason:
                    self._counts["refusals"] += 1
                    self.refused = [*self.refused[-19:], {"host_name": page.host_name, "alertname": page.alertname,
                                                          "at": self._clock(), "reason": reason}]
                    log.error("sdc responder: REFUSED to act on host %r (%s, rank %s, %s): %s. Act by hand after "
                              "checking that the pages are real.", page.host_name, page.alertname, page.rank,
                              page.hw_id, reason)
                    outcome["refused"].append(page.host_name)
                    continue
                self._window.append(self._clock())
                self._counts["actions"] += 1
                self._busy.add(page.host_name)
            ok = self._run(argv, page)
            with self._lock:
                self._busy.discard(page.host_name)
                if ok:
                    self._acted[page.host_name] = {"at": self._clock(), "alertname": page.alertname, "argv": argv}
                else:
                    self._counts["failures"] += 1
                self._save_state()
            outcome["acted" if ok else "failed"].append(page.host_name)
        return outcome

    def _refusal(self) -> str | None:
        now = self._clock()
        while self._window and now - self._window[0] >= WINDOW_S:
            self._window.popleft()
        if len(self._window) >= self.max_actions_per_hour:
            return (f"{len(self._window)} action(s) in the last hour reach the cap of {self.max_actions_per_hour} "
                    f"(pages for many hosts at once are more likely a software fault than broken hardware)")
        return None

    def _run(self, argv: list[str], page: _Page) -> bool:
        if self.dry_run:
            log.warning("sdc responder: DRY RUN for host %r (%s): would run %s", page.host_name, page.alertname, argv)
            return True
        log.warning("sdc responder: acting on host %r (%s, rank %s, %s): running %s", page.host_name,
                    page.alertname, page.rank, page.hw_id, argv)
        try:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=self.timeout_s,
                                  check=False)
        except subprocess.TimeoutExpired:
            log.error("sdc responder: %s timed out after %.0fs", argv, self.timeout_s)
            return False
        except OSError as e:
            log.error("sdc responder: could not run %s: %s", argv, e)
            return False
        out = proc.stdout.decode(errors="replace")[-_OUTPUT_LOG_CHARS:].strip()
        err = proc.stderr.decode(errors="replace")[-_OUTPUT_LOG_CHARS:].strip()
        level = logging.INFO if proc.returncode == 0 else logging.ERROR
        log.log(level, "sdc responder: %s exited with %d; stdout: %s; stderr: %s", argv, proc.returncode,
                out or "(empty)", err or "(empty)")
        return proc.returncode == 0

    # -- state -------------------------------------------------------------------------------------------------

    def _load_state(self) -> None:
        if self._state_file is None or not self._state_file.exists():
            return
        try:
            doc = json.loads(self._state_file.read_text())
            hosts, actions = doc["hosts"], doc["actions"]
            if not isinstance(hosts, dict) or not isinstance(actions, list) \
                    or not all(isinstance(t, (int, float)) for t in actions):
                raise TypeError("'hosts' must be an object and 'actions' a list of times")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--state file {self._state_file} is unreadable or malformed: {e}") from None
        self._acted = {str(h): v for h, v in hosts.items()}
        self._window.extend(sorted(float(t) for t in actions))

    def _save_state(self) -> None:
        if self._state_file is None:
            return
        doc = {"hosts": self._acted, "actions": list(self._window)}
        tmp = self._state_file.with_name(self._state_file.name + f".tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
            os.replace(tmp, self._state_file)
        except OSError as e:  # the process memory still holds the state; losing the file is not worth a crash
            log.error("sdc responder: could not write --state file %s: %s", self._state_file, e)
