"""Helpers shared by the responder tests: a recorder command, HTTP(S) requests, a self-signed certificate."""

from __future__ import annotations

import http.client
import json
import os
import shlex
import shutil
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# Writes its arguments as one JSON line to the file named by its first argument.
RECORDER = "import json, sys\nwith open(sys.argv[1], 'a') as f:\n    f.write(json.dumps(sys.argv[2:]) + '\\n')\n"
TOKEN = "t0ken-for-tests"


def recorder_template(tmp_path: Path, name: str, suffix: str = " {host_name} rank={rank} {hw_id} {alertname}") \
        -> tuple[str, Path]:
    """A template that records its arguments per run, and the file it writes."""
    script, out = tmp_path / "record.py", tmp_path / f"{name}.jsonl"
    script.write_text(RECORDER)
    return " ".join(shlex.quote(a) for a in (sys.executable, str(script), str(out))) + suffix, out


def runs(out: Path) -> list[list[str]]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def alert(host: str, *, status: str = "firing", severity: str = "critical", name: str = "SDCWeightFingerprintMismatch",
          rank: str = "2", hw_id: str | None = None, starts_at: str = "2024-01-01T00:00:00Z",
          **extra: str) -> dict[str, Any]:
    """One alert as Alertmanager's webhook sends it; ``starts_at`` tells a new firing from a re-notification."""
    labels = {"alertname": name, "severity": severity, "host_name": host, "rank": rank,
              "hw_id": f"GPU-{rank}" if hw_id is None else hw_id, "service_name": "job", **extra}
    return {"status": status, "labels": labels, "annotations": {"summary": "weights differ"},
            "startsAt": starts_at}


def notification(*alerts: dict[str, Any]) -> dict[str, Any]:
    return {"version": "4", "status": "firing", "receiver": "responder", "groupKey": "{}:{}", "alerts": list(alerts)}


def request(url: str, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
            cafile: Path | None = None) -> tuple[int, Any]:
    """One request to ``url`` (http:// or https://); (status, decoded JSON body or the text)."""
    scheme, _, hostport = url.partition("://")
    host, _, port = hostport.rpartition(":")
    conn: http.client.HTTPConnection
    if scheme == "https":
        ctx = ssl.create_default_context(cafile=str(cafile) if cafile else None)
        conn = http.client.HTTPSConnection(host, int(port), timeout=30, context=ctx)
    else:
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        if resp.getheader("Content-Type", "").startswith("application/json"):
            return resp.status, json.loads(data)
        return resp.status, data.decode()
    finally:
        conn.close()


def post(url: str, doc: Any, *, token: str | None = TOKEN, path: str = "/alerts", cafile: Path | None = None,
         content_type: str = "application/json") -> tuple[int, Any]:
    headers = {"Content-Type": content_type}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return request(url, "POST", path, body, headers, cafile)


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in Prometheus text, or None."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        sname, _, rest = series.partition("{")
        got = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
        if sname == name and got == want:
            return float(value)
    return None


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 made with the openssl binary: (cert, key)."""
    binary = shutil.which("openssl")
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no openssl binary on PATH (CI=true: a missing binary is a failure)")
        pytest.skip("no openssl binary on PATH")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([binary, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key
