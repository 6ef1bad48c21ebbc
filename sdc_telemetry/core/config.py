"""SDCConfig: what to check, how often, and what to do about it."""

from __future__ import annotations

import difflib
import ipaddress
import logging
import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

__all__ = ["SDCConfig", "DEFAULT_METRICS_PORT", "http_url_problem", "host_problem"]

log = logging.getLogger("sdc_telemetry")

# 9100 is node_exporter, 9400 dcgm-exporter, 9464 the OpenTelemetry exporters' default: stay clear of all three.
# Rank ports are base + local_rank, so 9860-9867 on an 8-GPU node.
DEFAULT_METRICS_PORT = 9860

Mode = Literal["auto", "exact", "tolerance"]
Action = Literal["record", "raise"]
Verdicts = Literal["immediate", "deferred"]


@dataclass(frozen=True, kw_only=True)
class SDCConfig:
    """Monitor settings. Every field is validated; a bad value raises ``ValueError`` naming the field.

    >>> SDCConfig(weights_every=1, replay_every=50, on_suspect="raise").replay_every
    50

    - ``weights_every``: run the weight-fingerprint check after every Nth optimizer step (0 = off).
    - ``replay_every``: audit steps k with k % N == 0 by cross-replica replay (0 = off; needs ``loss_fn``).
    - ``update_every``: audit the optimizer's update of steps k with k % N == 0: a partner recomputes a slice of
      this rank's update and compares (0 = off). ``"auto"``: ``replay_every``, where the weight vote cannot name a
      rank (no replica holds a tensor, or two replicas) and the optimizer is one the audit can recompute (SGD, Adam,
      AdamW); off otherwise.
    - ``grad_checks``: non-finite checks of local (pre all-reduce) and reduced gradients.
    - ``mode``: ``"exact"`` compares loss and gradient fingerprints bit for bit; ``"tolerance"`` compares relative
      deltas against ``tolerance``; ``"auto"`` is exact on CPU and under ``torch.use_deterministic_algorithms``,
      tolerance otherwise.
    - ``tolerance``: relative threshold for tolerance mode, or ``"auto"`` to calibrate it from healthy reruns.
    - ``on_suspect``: ``"record"`` keeps training; ``"raise"`` raises ``SDCDetected`` on every rank at the same step.
    - ``metrics_port``: base port of the per-rank Prometheus endpoint (rank listens on base + local_rank);
      ``None`` serves no endpoint. ``metrics_host``: interface to bind. ``metrics_tls_cert`` / ``metrics_tls_key``:
      PEM files to serve the endpoint over HTTPS (both or neither; Prometheus scrapes with ``scheme: https``).
    - ``otlp_endpoint``: OTLP/HTTP metrics endpoint (``http://collector:4318/v1/metrics``) or ``None``.
    - ``incident_dir``: where rank 0 appends ``incidents.jsonl`` (``None``: incidents are logged and kept in memory).
    - ``nvml``: read GPU counters through NVML when a GPU is present.
    - ``job_name``: ``service.name`` of every metric series.
    - ``alertmanager_url``: base URL of an Alertmanager (``http://alertmanager:9093``) or ``None``. The first rank of
      the replica group posts each incident with suspects to its v2 API directly (one alert per suspect), so the page
      does not depend on Prometheus scraping a job that is stopping.
    - ``trigger_audits``: replay a step at once when a minority of ranks has non-finite local gradients (or a rank's
      loss or gradient norm is an outlier against the others and its own history), so that a partner recomputing
      the same micro-batch tells data (it gets the same) from hardware (it does not). Needs ``loss_fn``; the step's
      batch and RNG state are kept every step (references).
    - ``verdicts``: ``"immediate"`` (the default, on every device) decides each step at the end of its block, before
      ``optimizer.step()``: on a GPU that is one host wait per step, for the step's fixed-size agreement.
      ``"deferred"`` reads a healthy step's verdict one step later with no host wait; an anomaly seen that late is
      replayed then on today's weights (the step's batch and RNG state are still referenced), and what that replay
      cannot decide is an ambiguous warning, never a page naming hardware.
    """

    weights_every: int = 1
    replay_every: int = 100
    update_every: int | Literal["auto"] = "auto"
    grad_checks: bool = True
    mode: Mode = "auto"
    tolerance: float | Literal["auto"] = "auto"
    on_suspect: Action = "record"
    metrics_port: int | None = DEFAULT_METRICS_PORT
    metrics_host: str = "0.0.0.0"  # noqa: S104 - Prometheus scrapes ranks from another machine
    otlp_endpoint: str | None = None
    incident_dir: str | None = None
    nvml: bool = True
    job_name: str = "training"
    alertmanager_url: str | None = None
    trigger_audits: bool = True
    metrics_tls_cert: str | None = None
    metrics_tls_key: str | None = None
    verdicts: Verdicts = "immediate"

    def __post_init__(self) -> None:
        for name in ("weights_every", "replay_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"SDCConfig.{name} must be an int >= 0 (0 = off), got {value!r}")
        every = self.update_every
        if every != "auto" and (isinstance(every, bool) or not isinstance(every, int) or every < 0):
            raise ValueError(f"SDCConfig.update_every must be 'auto' or an int >= 0 (0 = off), got {every!r}")
        for name in ("grad_checks", "nvml", "trigger_audits"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SDCConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.mode not in ("auto", "exact", "tolerance"):
            raise ValueError(f"SDCConfig.mode must be 'auto', 'exact' or 'tolerance', got {self.mode!r}")
        tol = self.tolerance
        if tol != "auto" and (isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 < tol < 1):
            raise ValueError(f"SDCConfig.tolerance must be 'auto' or a relative threshold in (0, 1), got {tol!r}")
        if self.verdicts not in ("immediate", "deferred"):
            raise ValueError(f"SDCConfig.verdicts must be 'immediate' or 'deferred', got {self.verdicts!r}")
        if self.on_suspect not in ("record", "raise"):
            raise ValueError(f"SDCConfig.on_suspect must be 'record' or 'raise', got {self.on_suspect!r}")
        port = self.metrics_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
            raise ValueError(f"SDCConfig.metrics_port must be a TCP port in 1..65535 or None, got {port!r}")
        for name in ("metrics_host", "job_name"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"SDCConfig.{name} must be a non-empty string, got {getattr(self, name)!r}")
        problem = host_problem(self.metrics_host)
        if problem is not None:
            raise ValueError(f"SDCConfig.metrics_host must be the address or host name of an interface to bind "
                             f"(0.0.0.0, ::, 127.0.0.1, node-7.cluster): {problem}, got {self.metrics_host!r}")
        if self.otlp_endpoint is not None:
            problem = http_url_problem(self.otlp_endpoint)
            if problem is not None:
                raise ValueError(f"SDCConfig.otlp_endpoint must be an http(s) URL with a host "
                                 f"(http://collector:4318/v1/metrics) or None: {problem}, got {self.otlp_endpoint!r}")
        if self.alertmanager_url is not None:
            problem = http_url_problem(self.alertmanager_url)
            if problem is not None:
                raise ValueError(f"SDCConfig.alertmanager_url must be the http(s) base URL of an Alertmanager "
                                 f"(http://alertmanager:9093) or None: {problem}, got {self.alertmanager_url!r}")
        for name in ("metrics_tls_cert", "metrics_tls_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"SDCConfig.{name} must be the path of a PEM file or None, got {value!r}")
        if (self.metrics_tls_cert is None) != (self.metrics_tls_key is None):
            raise ValueError("SDCConfig.metrics_tls_cert and SDCConfig.metrics_tls_key go together: give both PEM "
                             f"files or neither, got cert={self.metrics_tls_cert!r}, key={self.metrics_tls_key!r}")
        if self.incident_dir is not None and (not isinstance(self.incident_dir, (str, os.PathLike))
                                              or not os.fspath(self.incident_dir).strip()):
            raise ValueError(f"SDCConfig.incident_dir must be a non-empty path or None, got {self.incident_dir!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> SDCConfig:
        """Build a config from ``SDC_<FIELD>`` variables (``SDC_REPLAY_EVERY=50``, ``SDC_METRICS_PORT=none``).

        Keyword ``overrides`` win over the environment. A malformed variable raises ``ValueError`` naming it; an
        ``SDC_*`` variable that is neither a field nor one of the package's other variables (``SDC_HOST_NAME``,
        ``SDC_NUMERICS_SIGNATURE``, ``SDC_STATE_DIR``, ``SDC_DEMO_*``) is named in one warning (a typo such as
        ``SDC_ONSUSPECT`` would otherwise be ignored silently).
        """
        env = os.environ if environ is None else environ
        _warn_unknown(env)
        values: dict[str, Any] = {}
        for f in fields(cls):
            var = f"SDC_{f.name.upper()}"
            if var not in env:
                continue
            values[f.name] = _parse(var, env[var], f.name)
        values.update(overrides)
        return cls(**values)


# Variables the package reads that are not SDCConfig fields.
OTHER_VARIABLES = ("SDC_HOST_NAME", "SDC_NUMERICS_SIGNATURE", "SDC_STATE_DIR")
OTHER_PREFIXES = ("SDC_DEMO_",)


def _warn_unknown(env: Mapping[str, str]) -> None:
    known = {f"SDC_{f.name.upper()}" for f in fields(SDCConfig)}
    unknown = sorted(v for v in env if v.startswith("SDC_") and v not in known and v not in OTHER_VARIABLES
                     and not v.startswith(OTHER_PREFIXES))
    if not unknown:
        return
    hints = []
    for v in unknown:
        close = difflib.get_close_matches(v, sorted(known), n=1, cutoff=0.8)
        hints.append(f"{v} (did you mean {close[0]}?)" if close else v)
    log.warning("sdc_telemetry: ignoring environment variables that are not SDCConfig fields: %s", ", ".join(hints))


_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def host_problem(host: object) -> str | None:
    """What is wrong with ``host`` as an address or host name to bind (None when nothing is): an IPv4 or IPv6
    literal, or a host name of letters, digits and hyphens in dot-separated labels."""
    if not isinstance(host, str) or not host:
        return "empty or not a string"
    try:
        ipaddress.ip_address(host.strip("[]"))
        return None
    except ValueError:
        pass
    if len(host) > 253 or not all(_HOST_LABEL.match(label) for label in host.rstrip(".").split(".")):
        return "neither an IP address nor a host name (letters, digits, hyphens, dots)"
    return None


def http_url_problem(url: object) -> str | None:
    """What is wrong with ``url`` as the URL of an HTTP service (None when nothing is): it must be a string with an
    ``http``/``https`` scheme, a host, a valid port if any, and no whitespace, control characters, query or
    fragment."""
    if not isinstance(url, str):
        return f"not a string ({type(url).__name__})"
    if not url or any(c.isspace() or not c.isprintable() for c in url):
        return "empty, or holds whitespace or control characters"
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # raises ValueError for a port that is not a number in 0..65535
    except ValueError as e:
        return f"malformed ({e})"
    if parts.scheme not in ("http", "https"):
        return f"the scheme is {parts.scheme or 'missing'!s}, not http or https"
    if not parts.hostname:
        return "no host"
    if port == 0:
        return "port 0"
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        return "a query or fragment has no place in a base URL"
    return None


_INT_FIELDS = {"weights_every", "replay_every"}
_BOOL_FIELDS = {"grad_checks", "nvml", "trigger_audits"}
_OPTIONAL_FIELDS = {"metrics_port", "otlp_endpoint", "incident_dir", "alertmanager_url", "metrics_tls_cert",
                    "metrics_tls_key"}


def _parse(var: str, raw: str, name: str) -> Any:
    text = raw.strip()
    if name in _OPTIONAL_FIELDS and text.lower() in ("", "none", "off"):
        return None
    try:
        if name in _INT_FIELDS or name == "metrics_port":
            return int(text)
        if name in _BOOL_FIELDS:
            lowered = text.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if name == "tolerance":
            return text if text == "auto" else float(text)
        if name == "update_every":
            return text if text == "auto" else int(text)
    except ValueError:
        raise ValueError(f"environment variable {var}={raw!r} is not a valid value for SDCConfig.{name}") from None
    return text
