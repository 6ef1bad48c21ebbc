"""TLS for the package's small HTTP servers (the metrics endpoint, the responder's webhook)."""

from __future__ import annotations

import socket as sockets
import ssl
from typing import Any

__all__ = ["TLSAccept"]


class TLSAccept:
    """Mixed into a ``socketserver`` server: with ``tls`` set, every accepted connection is wrapped, its handshake
    deferred to the request's own thread (under the handler's idle timeout), so a client that connects and says
    nothing holds only its own thread, never the accept loop."""

    tls: ssl.SSLContext | None = None
    socket: sockets.socket

    def get_request(self) -> tuple[sockets.socket, Any]:
        sock, addr = self.socket.accept()
        if self.tls is not None:
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr
