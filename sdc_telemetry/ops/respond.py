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

The parts: :mod:`sdc_telemetry.ops.labels` (which alerts count, label checks, templates),
:mod:`sdc_telemetry.ops.webhook` (the HTTP server and handler), :mod:`sdc_telemetry.ops.respond_metrics` (the
registry behind ``/metrics``) and :mod:`sdc_telemetry.ops.respond_state` (the state file); this module decides.
"""

from __future__ import annotations

import fcntl
import hmac
import logging
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sdc_telemetry.ops.labels import (
    PLACEHOLDERS,
    SDC_CRITICAL_ALERTS,
    Page,
    TemplateError,
    Triage,
    parse_duration,
    parse_listen,
    parse_template,
    render,
    validate_labels,
)
from sdc_telemetry.ops.ledger import DEFAULT_STRIKE_WINDOW_S, Ledger, LedgerError
from sdc_telemetry.ops.respond_metrics import ResponderMetrics
from sdc_telemetry.ops.respond_state import read_state, write_state
from sdc_telemetry.ops.webhook import LISTEN_BACKLOG, MAX_BODY_BYTES, Handler, Server

# The names above that live in labels and webhook stay importable from here.
__all__ = ["PLACEHOLDERS", "MAX_BODY_BYTES", "SDC_CRITICAL_ALERTS", "DEFAULT_REACQUIRE_S", "LISTEN_BACKLOG",
           "Responder", "TemplateError", "parse_duration", "parse_template", "render", "parse_listen",
           "validate_labels"]

log = logging.getLogger("sdc_telemetry")

WINDOW_S = 3600.0
DEFAULT_REACQUIRE_S = 86400.0
_OUTPUT_LOG_CHARS = 2000


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
        self._state_lock = self._lock_state()
        self._load_state()
        self._owns_ledger = not isinstance(ledger, Ledger)
        self.ledger = ledger if isinstance(ledger, Ledger) else Ledger(ledger or "sqlite://")
        self._init_metrics()

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_cls = type("_BoundServer", (Server,), {"address_family": family})
        try:
            self._server: Server = server_cls((host, port), Handler)
        except OSError:
            if self._owns_ledger:
                self.ledger.close()
            self._unlock_state()
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
        self._metrics = ResponderMetrics(lambda: self.ledger.fleet(window_s=self.strike_window_s, now=self._clock()))
        self.registry = self._metrics.registry

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
        self._unlock_state()

    def _lock_state(self) -> int | None:
        """Hold an exclusive lock on ``<state_file>.lock`` while serving: two responders writing one state file
        overwrite each other's memory of the hosts acted on (a restart would drain a host again), so the second
        is refused, naming the file."""
        if self._state_file is None:
            return None
        self._state_file.parent.mkdir(parents=True, exist_ok=True)
        path = self._state_file.with_name(self._state_file.name + ".lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ValueError(f"the state file {self._state_file} is in use by another responder: give each "
                             "responder its own --state (or --ledger, from which the default state file is "
                             "named)") from None
        return fd

    def _unlock_state(self) -> None:
        fd, self._state_lock = getattr(self, "_state_lock", None), None
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the lock

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
        self._metrics.rejected.labels(str(code)).inc()

    def metrics_text(self) -> bytes:
        return self._metrics.text()

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

    def handle(self, triage: Triage | Sequence[Page]) -> dict[str, list[str]]:
        """Act on a triaged notification; returns the hosts acted on (and of them replaced), already acted on,
        refused (cap), failed, rejected (bad labels) and the alerts ignored."""
        if not isinstance(triage, Triage):
            triage = Triage(list(triage), [], [])
        outcome: dict[str, list[str]] = {"acted": [], "replaced": [], "already": [], "refused": [], "failed": [],
                                         "rejected": [], "ignored": []}
        self._metrics.notifications.inc()
        for name, reason in triage.ignored:
            self._metrics.ignored.labels(reason).inc()
            outcome["ignored"].append(name)
            log.info("sdc responder: ignored alert %s (%s)", name, reason)
        self._count("ignored_alerts", len(triage.ignored))
        for host, name, reason in triage.rejected:
            log.error("sdc responder: REFUSED alert %s for host %s: %s; nothing runs (no cap slot used)", name,
                      host, reason)
            self._metrics.refusals.labels("invalid_label").inc()
            self._count("rejected_hosts")
            outcome["rejected"].append(host)
        for page in triage.pages:
            self._act(page, outcome)
        return outcome

    def _act(self, page: Page, outcome: dict[str, list[str]]) -> None:
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
                self._metrics.refusals.labels("cap").inc()
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
            self._metrics.actions.labels(action).inc()
            ok = self._run(argv, page, action)
            if ok and not self.dry_run:
                try:
                    pending = self.ledger.pending
                    strike = self.ledger.add_strike(page.hw_id, host_name=host, job=page.job, step=page.step,
                                                    check=page.check, alertname=page.alertname, at=self._clock(),
                                                    alert_key=page.alert_key)
                    if strike is None:
                        log.info("sdc responder: the strike of %s for %s (%s) was already recorded (the same alert "
                                 "delivered to another responder): one alert, one strike", page.alertname,
                                 page.hw_id, host)
                    elif self.ledger.pending > pending:
                        log.error("sdc responder: the ledger %s cannot take the strike for %s on %s now: kept in the "
                                  "local journal and replayed when it answers", self.ledger.redacted_url,
                                  page.hw_id, host)
                        self._metrics.ledger_errors.inc()
                        self._count("ledger_errors")
                except LedgerError as e:
                    log.error("sdc responder: could not record the strike for %s on %s: %s", page.hw_id, host, e)
                    self._metrics.ledger_errors.inc()
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
            self._metrics.failures.labels(action).inc()
        outcome["acted" if ok else "failed"].append(host)
        if ok and action == "replace":
            outcome["replaced"].append(host)
        if ok and self.screen_argv is not None:
            self._start_screen(page)

    def _choose(self, page: Page, now: float) -> tuple[str, list[str]]:
        """``("replace", argv)`` when the GPU already has a strike within the window and a replace command is set,
        else ``("command", argv)``."""
        since = now - self.strike_window_s
        try:
            # The alert at hand is left out: another responder (Alertmanager HA) may have recorded it already.
            prior = self.ledger.count_strikes(page.hw_id, since=since, excluding=page.alert_key)
        except LedgerError as e:  # decide from this responder's own strikes (its journal): the drain never waits
            prior = self.ledger.count_local_strikes(page.hw_id, since=since, excluding=page.alert_key)
            log.error("sdc responder: cannot read the strikes of %s: %s; deciding from this responder's own %d "
                      "strike(s) of it", page.hw_id, e, prior)
            self._metrics.ledger_errors.inc()
            self._count("ledger_errors")
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

    def _run(self, argv: list[str], page: Page, action: str, timeout_s: float | None = None) -> bool:
        return self._exec(argv, page, action, timeout_s)[0] == 0

    def _exec(self, argv: list[str], page: Page, action: str, timeout_s: float | None = None) -> tuple[int, str]:
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

    def _start_screen(self, page: Page) -> None:
        assert self.screen_argv is not None
        argv = render(self.screen_argv, page.values())

        def screen() -> None:
            rc, _ = self._exec(argv, page, "screen", self.screen_timeout_s)
            result = "pass" if rc == 0 else "fail" if rc == 1 else "error"
            self._metrics.screens.labels(result).inc()
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
        self._acted, actions = read_state(self._state_file)
        self._window.extend(actions)

    def _save_state(self) -> None:
        """Write the state file durably (see :func:`~sdc_telemetry.ops.respond_state.write_state`)."""
        if self._state_file is None:
            return
        now = self._clock()
        keep = max(self.reacquire_after_s, WINDOW_S)
        self._acted = {h: rec for h, rec in self._acted.items() if now - rec["at"] < keep}
        write_state(self._state_file, self._acted, [t for t in self._window if now - t < WINDOW_S])
