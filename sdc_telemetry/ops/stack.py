"""A real Prometheus and Alertmanager on loopback, with the repository's rules and routing, and an in-process webhook
that records every page. The demo and the end-to-end tests use it; it needs the ``prometheus`` and ``alertmanager``
binaries (``LocalStack.available()``)::

    with LocalStack(targets=["127.0.0.1:9860", "127.0.0.1:9861"], workdir=tmp) as stack:
        ...                                                   # train; ranks serve metrics on those ports
        page = stack.wait_for_alert("SDCWeightFingerprintMismatch", timeout=60)
        print(page["labels"]["host_name"], page["labels"]["rank"], page["labels"]["hw_id"])
        stack.query('sdc_suspect == 1')

The rules are rendered from ``sdc_telemetry.ops.alerts`` (the same text as ``alerts/sdc-rules.yml``), the routing is
``alerts/alertmanager.yml`` with its grouping waits shortened and its webhooks pointed at this process (the
``responder`` route only with ``responder=True``, to ``<webhook_url>/responder``, or with ``responder_url`` to a
real ``sdc-telemetry respond``, sending the bearer token of ``responder_credentials_file`` as the shipped routing
does), and the scrape job is named ``sdc`` like the shipped ``deploy/prometheus.yml``. Every process and thread
started is stopped by ``stop()`` (also on error and at interpreter exit).
"""

from __future__ import annotations

import atexit
import json
import logging
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any

import yaml

from sdc_telemetry.ops.alerts import RULES_FILE, SCRAPE_JOB, alertmanager_config, rules_yaml

__all__ = ["LocalStack", "StackError", "prometheus_config"]

log = logging.getLogger("sdc_telemetry")

PROMETHEUS_NAMES = ("prometheus",)
ALERTMANAGER_NAMES = ("alertmanager", "prometheus-alertmanager")  # Debian and Ubuntu rename the binary


class StackError(RuntimeError):
    """Prometheus or Alertmanager did not start, or an API call failed."""


def prometheus_config(targets: Sequence[str], rule_files: Sequence[str], alertmanagers: Sequence[str], *,
                      scrape_interval: str = "15s", evaluation_interval: str = "15s") -> dict[str, Any]:
    """A Prometheus config scraping the ranks' endpoints as job ``sdc`` (the shape of ``deploy/prometheus.yml``)."""
    return {
        "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval,
                   "evaluation_interval": evaluation_interval},
        "rule_files": list(rule_files),
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": list(alertmanagers)}]}]},
        "scrape_configs": [{"job_name": SCRAPE_JOB, "static_configs": [{"targets": list(targets)}]}],
    }


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _which(names: Sequence[str]) -> str | None:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


class _Webhook(ThreadingHTTPServer):
    """Records Alertmanager webhook notifications (JSON bodies) with the path they were posted to."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _WebhookHandler)
        self.received: list[dict[str, Any]] = []
        self.changed = threading.Condition()

    def record(self, path: str, body: dict[str, Any]) -> None:
        with self.changed:
            self.received.append({"path": path, "received_at": time.time(), **body})
            self.changed.notify_all()


class _WebhookHandler(BaseHTTPRequestHandler):
    server: _Webhook

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except ValueError:
            self.send_response(400)
            self.end_headers()
            return
        self.server.record(self.path, body if isinstance(body, dict) else {"body": body})
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("webhook: " + format, *args)


class LocalStack:
    """Prometheus + Alertmanager + a recording webhook, on free loopback ports, for the life of a ``with`` block.

    ``targets``: ``host:port`` of the ranks' metrics endpoints. ``workdir``: where configs, data and logs go (a
    temporary directory, removed on stop, when None). ``scrape_interval`` / ``evaluation_interval`` are short by
    default so that a page arrives within seconds of the event. ``responder``: also route critical SDC alerts to
    ``<webhook_url>/responder``, as the shipped routing sends them to ``sdc-telemetry respond``; ``responder_url``
    sends them to a real responder there instead. ``responder_credentials_file``: the file holding the responder's
    bearer token; Alertmanager reads it and sends ``Authorization: Bearer <token>``
    (``http_config.authorization.credentials_file``, as in the shipped routing). It must exist and needs a responder
    route.
    """

    def __init__(self, targets: Sequence[str] = (), workdir: str | Path | None = None, *,
                 scrape_interval: str = "1s", evaluation_interval: str = "1s", startup_timeout: float = 30.0,
                 prometheus_bin: str | None = None, alertmanager_bin: str | None = None,
                 responder: bool = False, responder_url: str | None = None,
                 responder_credentials_file: str | Path | None = None) -> None:
        if responder_credentials_file is not None:
            if responder_url is None and not responder:
                raise StackError("responder_credentials_file needs a responder route: pass responder_url= (or "
                                 "responder=True)")
            if not Path(responder_credentials_file).is_file():
                raise StackError(f"responder_credentials_file {responder_credentials_file}: no such file (Alertmanager "
                                 "reads the bearer token from it)")
        self.targets = list(targets)
        self.scrape_interval = scrape_interval
        self.evaluation_interval = evaluation_interval
        self.startup_timeout = startup_timeout
        self.responder = responder
        self._responder_url = responder_url
        self._credentials = None if responder_credentials_file is None else \
            str(Path(responder_credentials_file).resolve())
        self._prometheus_bin = prometheus_bin or _which(PROMETHEUS_NAMES)
        self._alertmanager_bin = alertmanager_bin or _which(ALERTMANAGER_NAMES)
        self._own_workdir = workdir is None
        self._workdir_arg = workdir
        self.workdir: Path | None = None
        self._procs: list[tuple[str, subprocess.Popen[bytes], IO[bytes], Path]] = []
        self._webhook: _Webhook | None = None
        self._webhook_thread: threading.Thread | None = None
        self.prometheus_url = ""
        self.alertmanager_url = ""
        self.webhook_url = ""
        self._started = False
        self._stopped = False

    # -- lifecycle -----------------------------------------------------------------------------------------------

    @staticmethod
    def available() -> bool:
        """Whether the Prometheus and Alertmanager binaries are on PATH."""
        return _which(PROMETHEUS_NAMES) is not None and _which(ALERTMANAGER_NAMES) is not None

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> LocalStack:
        """Start the webhook, Alertmanager and Prometheus; wait until both answer ``/-/ready``."""
        if self._started:
            raise StackError("LocalStack already started")
        if not self._prometheus_bin or not self._alertmanager_bin:
            raise StackError(f"LocalStack needs the prometheus and alertmanager binaries on PATH (looked for "
                             f"{PROMETHEUS_NAMES + ALERTMANAGER_NAMES}); install them or skip")
        self._started = True
        atexit.register(self.stop)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        assert self._prometheus_bin and self._alertmanager_bin
        base = Path(tempfile.mkdtemp(prefix="sdc-stack-")) if self._workdir_arg is None else \
            Path(self._workdir_arg) / "localstack"
        base.mkdir(parents=True, exist_ok=True)
        self.workdir = base

        self._webhook = _Webhook()
        self._webhook_thread = threading.Thread(target=self._webhook.serve_forever, name="sdc-stack-webhook",
                                                daemon=True)
        self._webhook_thread.start()
        self.webhook_url = f"http://127.0.0.1:{self._webhook.server_address[1]}"

        am_port, prom_port = _free_port(), _free_port()
        am_config = alertmanager_config(f"{self.webhook_url}/pager", f"{self.webhook_url}/ticket", fast=True,
                                        responder_url=self._responder_url or
                                        (f"{self.webhook_url}/responder" if self.responder else None),
                                        responder_credentials_file=self._credentials)
        (base / "alertmanager.yml").write_text(yaml.safe_dump(am_config, sort_keys=False))
        self.alertmanager_url = f"http://127.0.0.1:{am_port}"
        self._spawn("alertmanager", [self._alertmanager_bin, f"--config.file={base / 'alertmanager.yml'}",
                                     f"--storage.path={base / 'alertmanager-data'}",
                                     f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address=",
                                     "--log.level=warn"])

        # Rollups at the stack's own (short) evaluation interval, so that a run of seconds already feeds them.
        (base / RULES_FILE).write_text(rules_yaml(rollup_interval=None))
        config = prometheus_config(self.targets, [str(base / RULES_FILE)], [f"127.0.0.1:{am_port}"],
                                   scrape_interval=self.scrape_interval,
                                   evaluation_interval=self.evaluation_interval)
        (base / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        self.prometheus_url = f"http://127.0.0.1:{prom_port}"
        self._spawn("prometheus", [self._prometheus_bin, f"--config.file={base / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={base / 'prometheus-data'}",
                                   f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"])
        self._wait_ready("alertmanager", self.alertmanager_url)
        self._wait_ready("prometheus", self.prometheus_url)

    def _spawn(self, name: str, argv: list[str]) -> None:
        assert self.workdir is not None
        log_path = self.workdir / f"{name}.log"
        log_file = open(log_path, "wb")
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._procs.append((name, proc, log_file, log_path))

    def _wait_ready(self, name: str, url: str) -> None:
        deadline = time.monotonic() + self.startup_timeout
        proc = next(p for n, p, _, _ in self._procs if n == name)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise StackError(f"{name} exited with code {proc.returncode}: {self.log_tail(name)}")
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:  # noqa: S310 - our loopback URL
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise StackError(f"{name} was not ready within {self.startup_timeout:.0f}s: {self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 20) -> str:
        """The last lines of ``prometheus.log`` or ``alertmanager.log``."""
        for n, _, f, path in self._procs:
            if n == name:
                f.flush()
                return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self) -> None:
        """Stop Prometheus, Alertmanager and the webhook. Safe to call twice, and after a failed start."""
        if self._stopped or not self._started:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        for _, proc, _, _ in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
        for _, proc, f, _ in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            f.close()
        if self._webhook is not None:
            self._webhook.shutdown()
            self._webhook.server_close()
        if self._webhook_thread is not None:
            self._webhook_thread.join(timeout=5)
        if self._own_workdir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    @property
    def running(self) -> bool:
        """Both processes are alive."""
        return bool(self._procs) and all(p.poll() is None for _, p, _, _ in self._procs)

    # -- Alertmanager notifications ------------------------------------------------------------------------------

    @property
    def notifications(self) -> list[dict[str, Any]]:
        """Every webhook payload received so far (Alertmanager's JSON, plus ``path`` and ``received_at``)."""
        if self._webhook is None:
            return []
        with self._webhook.changed:
            return [dict(n) for n in self._webhook.received]

    def alerts(self, name: str | None = None, *, status: str | None = None,
               labels: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        """Alerts delivered so far, each with the ``receiver`` and ``received_at`` of its notification."""
        out = []
        for n in self.notifications:
            for alert in n.get("alerts", []):
                lab = alert.get("labels", {})
                if name is not None and lab.get("alertname") != name:
                    continue
                if status is not None and alert.get("status") != status:
                    continue
                if labels and any(lab.get(k) != v for k, v in labels.items()):
                    continue
                out.append({**alert, "receiver": n.get("receiver"), "received_at": n["received_at"]})
        return out

    def wait_for_alert(self, name: str, timeout: float = 60.0, *, status: str = "firing",
                       labels: Mapping[str, str] | None = None) -> dict[str, Any] | None:
        """The first delivered alert called ``name`` with ``status`` (and ``labels``); None after ``timeout`` s."""
        if self._webhook is None:
            raise StackError("LocalStack is not started")
        deadline = time.monotonic() + timeout
        with self._webhook.changed:
            while True:
                found = self.alerts(name, status=status, labels=labels)
                if found:
                    return found[0]
                left = deadline - time.monotonic()
                if left <= 0 or self._stopped:
                    return None
                self._webhook.changed.wait(min(left, 1.0))

    def send_alerts(self, alerts: Sequence[Mapping[str, Any]]) -> None:
        """Post alerts (``{"labels": {...}, "annotations": {...}}``) straight to Alertmanager, as Prometheus would:
        a routing drill without metrics."""
        body = json.dumps(list(alerts)).encode()
        req = urllib.request.Request(f"{self.alertmanager_url}/api/v2/alerts", data=body, method="POST",  # noqa: S310
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10):  # noqa: S310 - our loopback URL
                pass
        except urllib.error.HTTPError as e:
            raise StackError(f"Alertmanager refused the alerts ({e.code}): {e.read().decode(errors='replace')}") \
                from None

    # -- Prometheus API ------------------------------------------------------------------------------------------

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query: the result samples (``[{"metric": {...}, "value": [t, "v"]}, ...]``; a scalar comes back
        as one sample without labels). ``StackError`` carries Prometheus's message for a bad query."""
        url = f"{self.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=30) as r:  # noqa: S310 - our loopback URL
                doc = json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            raise StackError(f"query failed ({e.code}): {detail}\n{expr}") from None
        if doc.get("status") != "success":
            raise StackError(f"query failed: {doc}\n{expr}")
        data = doc["data"]
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def wait_for_query(self, expr: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Poll ``query(expr)`` until it returns samples (returned) or ``timeout`` passes (empty list)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result or time.monotonic() >= deadline:
                return result
            time.sleep(0.5)

    def targets_up(self) -> dict[str, bool]:
        """Scrape health of each target of the ``sdc`` job, by ``host:port``."""
        return {s["metric"].get("instance", ""): s["value"][1] == "1"
                for s in self.query(f'up{{job="{SCRAPE_JOB}"}}')}
