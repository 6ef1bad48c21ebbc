"""Alert labels and command templates: which alerts the responder acts on, whether their labels are fit for a
command, and how a command template is parsed and filled in.

- **Only our pages.** :func:`triage_body` keeps firing alerts with ``severity="critical"`` whose alertname is one of the
  SDC critical alerts (``SDC_CRITICAL_ALERTS``) and that are not ``ambiguous="true"``; everything else is ignored.
- **Labels validated before anything runs.** ``host_name`` must be one host name (letters, digits, ``-``, ``.``,
  ``_``, not starting with ``-``: no lists, ranges, globs, spaces or control characters that a scheduler would
  expand), ``rank`` digits, ``hw_id`` letters, digits, ``-``, ``:``, ``.``, ``_``, not starting with ``-``
  (:func:`validate_labels`).
- **No shell.** A template is split once, like a shell line (:func:`parse_template`); the placeholders
  ``{host_name}``, ``{rank}``, ``{hw_id}`` and ``{alertname}`` are replaced inside each argument in one pass
  (:func:`render`). The program (first word) may not contain a placeholder.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sdc_telemetry.sinks.alert_table import SUSPECT_ALERTS

__all__ = ["PLACEHOLDERS", "SDC_CRITICAL_ALERTS", "BadRequest", "Page", "TemplateError", "Triage", "parse_duration",
           "parse_listen", "parse_template", "render", "safe_text", "triage_body", "validate_labels"]

PLACEHOLDERS = ("host_name", "rank", "hw_id", "alertname")
SDC_CRITICAL_ALERTS = frozenset(SUSPECT_ALERTS.values())
_BRACES = re.compile(r"\{([^{}]*)\}")
_KNOWN = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")
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


def safe_text(text: str) -> str:
    """``text`` as printable ASCII (escapes for control characters, non-ASCII and lone surrogates): safe to log
    and echo."""
    return ascii(text)[1:-1]


class BadRequest(ValueError):
    """A webhook body that is not an Alertmanager notification (HTTP 400)."""


@dataclass(frozen=True)
class Page:
    """One firing critical SDC alert for one host: the values substituted into the template, and the strike."""

    host_name: str
    rank: str
    hw_id: str
    alertname: str
    job: str | None = None
    step: int | None = None
    check: str | None = None
    alert_key: str | None = None  # the alert's identity (fingerprint@startsAt): one alert, one strike

    def values(self) -> dict[str, str]:
        return {"host_name": self.host_name, "rank": self.rank, "hw_id": self.hw_id, "alertname": self.alertname}


@dataclass
class Triage:
    pages: list[Page]
    rejected: list[tuple[str, str, str]]  # (host_name made safe, alertname, reason)
    ignored: list[tuple[str, str]]        # (alertname made safe, reason)


def triage_body(body: Any) -> Triage:
    """Validate a webhook body (Alertmanager's JSON, version 4) and sort its alerts into pages (one per host),
    rejected pages (bad labels) and ignored alerts. The whole body's shape is checked before anything runs, so a
    half-malformed notification does nothing."""
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    if "status" in body and not isinstance(body["status"], str):
        raise BadRequest("'status' must be a string")
    alerts = body.get("alerts")
    if not isinstance(alerts, list):
        raise BadRequest("'alerts' must be a list")
    for i, alert in enumerate(alerts):
        if not isinstance(alert, dict):
            raise BadRequest(f"alerts[{i}] must be an object")
        status, labels = alert.get("status"), alert.get("labels")
        if status not in ("firing", "resolved"):
            raise BadRequest(f"alerts[{i}].status must be 'firing' or 'resolved'")
        if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in labels.items()):
            raise BadRequest(f"alerts[{i}].labels must be an object of strings")
        if "annotations" in alert and not isinstance(alert["annotations"], dict):
            raise BadRequest(f"alerts[{i}].annotations must be an object")
    out = Triage([], [], [])
    pages: dict[str, Page] = {}
    for alert in alerts:
        labels = alert["labels"]
        name = labels.get("alertname", "")
        if alert["status"] != "firing":
            continue
        if labels.get("severity") != "critical":
            out.ignored.append((safe_text(name), "not_critical"))
            continue
        if name not in SDC_CRITICAL_ALERTS:
            out.ignored.append((safe_text(name), "foreign"))
            continue
        if labels.get("ambiguous") == "true":
            out.ignored.append((name, "ambiguous"))
            continue
        host = labels.get("host_name", "")
        reason = validate_labels(labels)
        if reason is not None:
            out.rejected.append((safe_text(host), name, reason))
            continue
        annotations = alert.get("annotations") or {}
        step_text = labels.get("step", annotations.get("step"))
        step = int(step_text) if isinstance(step_text, str) and _RANK_RE.fullmatch(step_text) else None
        pages.setdefault(host, Page(host, labels["rank"], labels["hw_id"], name, job=labels.get("service_name"),
                                    step=step, check=labels.get("check"), alert_key=alert_key(alert)))
    out.pages = list(pages.values())
    return out


def alert_key(alert: dict[str, Any]) -> str:
    """An alert's identity across deliveries: Alertmanager's ``fingerprint`` (a hash of its labels; computed here
    from the labels when absent) and its ``startsAt``: the same alert sent to several responders (HA) has the same
    key; the same labels firing again later do not."""
    fp = alert.get("fingerprint")
    if not isinstance(fp, str) or not fp or len(fp) > 64:
        labels = alert.get("labels") or {}
        fp = hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).hexdigest()[:16]
    starts = alert.get("startsAt")
    return f"{safe_text(fp)}@{safe_text(starts) if isinstance(starts, str) else ''}"[:200]
