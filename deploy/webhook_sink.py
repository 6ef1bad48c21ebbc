"""A tiny Alertmanager webhook receiver for the docker-compose demo: prints every page and ticket it receives.

    python deploy/webhook_sink.py --port 5001      # then: docker compose logs -f webhook-sink

Alertmanager posts JSON to /pager (critical) and /ticket (warning); each alert becomes one log line naming the alert,
its status, severity, host, rank and GPU, and its summary. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def describe(path: str, body: dict[str, Any]) -> list[str]:
    """One line per alert of an Alertmanager notification."""
    lines = []
    for alert in body.get("alerts", []):
        lab = alert.get("labels", {})
        lines.append(f"[{path.strip('/') or 'webhook'}] {alert.get('status', '?').upper()} {lab.get('alertname')} "
                     f"severity={lab.get('severity')} host={lab.get('host_name')} rank={lab.get('rank')} "
                     f"gpu={lab.get('hw_id')} job={lab.get('service_name')}: "
                     f"{alert.get('annotations', {}).get('summary', '')}")
    return lines


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw)
        except ValueError:
            self.send_response(400)
            self.end_headers()
            return
        for line in describe(self.path, body):
            print(line, flush=True)
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="0.0.0.0")  # noqa: S104 - reached by Alertmanager's container
    parser.add_argument("--port", type=int, default=5001)
    args = parser.parse_args(argv)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"webhook sink listening on {args.host}:{args.port} (/pager, /ticket)", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
