"""The responder's HTTP side: a threading HTTP(S) server and the handler of ``POST /alerts``, ``GET /healthz`` and
``GET /metrics``.

The handler refuses, before anything runs: a POST without the right bearer token (401), a path other than ``/`` or
``/alerts`` (404), a body without a numeric ``Content-Length`` (411/400), one over ``MAX_BODY_BYTES`` (413), one that
is not ``application/json`` (415, so that a browser form cannot send one without a CORS preflight) and a malformed one
(400). A well-formed notification goes to the responder's ``handle``; its outcome is the JSON reply.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sdc_telemetry.ops.labels import BadRequest, Triage, triage_body
from sdc_telemetry.sinks.tls import TLSAccept

__all__ = ["LISTEN_BACKLOG", "MAX_BODY_BYTES", "Handler", "Server", "WebhookTarget"]

log = logging.getLogger("sdc_telemetry")

MAX_BODY_BYTES = 1 << 20
LISTEN_BACKLOG = 128


class WebhookTarget(Protocol):
    """What the handler needs of the responder behind it (:class:`~sdc_telemetry.ops.respond.Responder`)."""

    idle_timeout_s: float

    def health(self) -> dict[str, Any]: ...

    def metrics_text(self) -> bytes: ...

    def handle(self, triage: Triage) -> dict[str, list[str]]: ...

    def _authorized(self, header: str | None) -> bool: ...

    def _rejected(self, code: int) -> None: ...

    def _count(self, name: str, n: int = 1) -> None: ...


class Server(TLSAccept, ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG
    responder: WebhookTarget

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("sdc responder: connection from %s ended with an error", client_address, exc_info=True)


class Handler(BaseHTTPRequestHandler):
    server: Server
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
            triage = triage_body(json.loads(raw))
        except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError and BadRequest
            reason = str(e) if isinstance(e, BadRequest) else "body is not valid JSON"
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
