"""Prometheus alert and recording rules and the Alertmanager routing, generated from the metric table.

``generate(out_dir)`` writes ``sdc-rules.yml`` and ``alertmanager.yml`` (checked in under ``alerts/``;
``sdc-telemetry alerts`` regenerates them). Alert names, severities and labels are a contract: on-call routing,
the responder and the direct push (``sdc_telemetry.sinks.pager``) rely on them.

Why the expressions look the way they do:

* Pages are for hardware suspects only. The monitor latches ``sdc_suspect{check}`` to 1 on a rank that a minority
  vote named; a numerics event (NaN/Inf on every rank at once: overflow, a bad batch, divergence) never sets it.
  A suspect of an ambiguous verdict (two replicas and no referee, a single process, a vote without a majority)
  latches ``sdc_suspect_ambiguous{check}`` instead: each suspect alert has a second rule with the same name,
  ``severity="warning"`` and ``ambiguous="true"`` that reads it, so an ambiguous verdict warns and never pages.
  The raw non-finite counters therefore never page: when they rise on every rank step after step,
  ``SDCTrainingNonFinite`` warns the job's owner instead.
* A corruption is usually a one-step event, and a process that stops right after it (``on_suspect="raise"``) is
  scraped a last time at best. So each critical alert fires while any sample of the latched gauge within
  ``EVENT_WINDOW`` is 1: one scrape of the event pages, and the page survives the process.
* ``suspect_alert()`` builds the labels and annotations of a critical alert from the same data as its rule, so an
  alert pushed straight to Alertmanager by the monitor and the rule's alert for the same rank are one alert there.
* Recording rules (``sdc:...``) roll the per-rank series up to host and job, so that the overview dashboard reads a
  few thousand series instead of every rank's at 16,384 ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sdc_telemetry.sinks.alert_table import (
    AMBIGUOUS_LABEL,
    RANK_LABELS,
    RUNBOOK,
    SUSPECT_ALERTS,
    SUSPECTS,
    WHO,
    AlertRule,
    ambiguous_suspect_rule,
    render_template,
    runbook_anchor,
    suspect_alert,
    suspect_rule,
)
from sdc_telemetry.sinks.metrics import family

__all__ = ["AlertRule", "RecordingRule", "RULES", "RECORDING_RULES", "SUSPECT_ALERTS", "RULES_FILE", "TESTS_FILE",
           "ALERTMANAGER_FILE", "RUNBOOK", "SCRAPE_JOB", "RANK_LABELS", "EVENT_WINDOW", "STALE_AFTER", "FAILING_FOR",
           "RESPONDER_URL", "RESPONDER_CREDENTIALS_FILE", "rules_document", "rules_yaml", "alertmanager_config",
           "checks_stalled_expr", "suspect_alert", "render_template", "generate", "runbook_anchor"]

RULES_FILE = "sdc-rules.yml"
ROLLUP_INTERVAL = "1m"
TESTS_FILE = "sdc-rules.test.yml"  # promtool unit tests, written by the test suite (tests/promtool)
ALERTMANAGER_FILE = "alertmanager.yml"
SCRAPE_JOB = "sdc"
# Where the shipped routing sends critical SDC alerts besides the pager: `sdc-telemetry respond` drains the node.
RESPONDER_URL = "http://sdc-responder:9095/alerts"
# The bearer token Alertmanager sends the responder (`sdc-telemetry respond --bearer-token-file` reads the same
# token): the shipped routing reads it from this file on the Alertmanager host.
RESPONDER_CREDENTIALS_FILE = "/etc/alertmanager/sdc-responder.token"

# How long one scraped sample of an SDC event keeps its alert firing (after the process is gone).
EVENT_WINDOW = "15m"
# A check is stalled when steps advance but its last run is older than this. Gradient checks run every step, the
# weight check every weights_every steps (default 1), the replay every replay_every steps (default 100): raise these
# (and regenerate) for jobs with slow steps or sparse cadences.
STALE_AFTER: dict[str, str] = {"grad_local": "10m", "grad_reduced": "10m", "weights": "30m", "replay": "2h"}
# A check that could not run (error/skipped) with no pass or fail for this long is failing: the rank is unprotected.
FAILING_FOR = "30m"
# SDCTrainingNonFinite: the share of steps with non-finite gradients on every rank, sustained for NONFINITE_FOR.
NONFINITE_SHARE = 0.5
NONFINITE_FOR = "10m"
# Rate window of the recording rules (and of the SDCTrainingNonFinite ratio).
ROLLUP_WINDOW = "5m"

_STEPS = family("sdc_steps_total").name
_CHECKS = family("sdc_checks_total").name
_DURATION = family("sdc_check_duration_seconds").name
_SUSPECT = family("sdc_suspect").name
_AMBIGUOUS = family("sdc_suspect_ambiguous").name
_PAGER_FAILURES = family("sdc_pager_failures_total").name
_LAST_RUN = family("sdc_check_last_run_timestamp_seconds").name
_NONFINITE = family("sdc_grad_nonfinite_total").name
_NORM = family("sdc_grad_norm").name
_REPLAY_MISMATCHES = family("sdc_replay_mismatches_total").name
_AGREEMENT = family("sdc_weight_fingerprint_agreement").name
_WEIGHT_MISMATCHES = family("sdc_weight_fingerprint_mismatches_total").name
_INCIDENTS = family("sdc_incidents_total").name
_ERRORS = family("sdc_internal_errors_total").name
_CLOSED = family("sdc_monitor_closed").name
_ECC = family("hw_errors_total").name
_XID = family("gpu_xid_errors_total").name

_JOIN = "service_name, host_name, rank, hw_id"
_BY = ", ".join(RANK_LABELS)
_TARGET = f'job="{SCRAPE_JOB}"'


@dataclass(frozen=True)
class RecordingRule:
    record: str
    expr: str

    def to_rule(self) -> dict[str, Any]:
        return {"record": self.record, "expr": self.expr}


def _sel(name: str, **matchers: str) -> str:
    """``name{k="v", ...}``; a value starting with ``~`` becomes a regex matcher (``k=~"v"``)."""
    inner = ", ".join(f'{k}=~"{v[1:]}"' if v.startswith("~") else f'{k}="{v}"' for k, v in matchers.items())
    return f"{name}{{{inner}}}" if inner else name


def _seconds(duration: str) -> int:
    value, unit = int(duration[:-1]), duration[-1]
    return value * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit]


def _increased(selector: str, window: str) -> str:
    """Series of ``selector`` that counted within ``window``, including a counter born in it: the event that
    creates a counter makes its first sample 1, which ``increase()`` cannot see."""
    return (f"(\n    increase({selector}[{window}]) > 0\n    or\n"
            f"    ({selector} > 0 unless {selector} offset {window})\n  )")


def checks_stalled_expr(matchers: str = "") -> str:
    """Ranks whose steps advance while a check's last run is older than ``STALE_AFTER`` (value: age in seconds).

    ``matchers`` (``service_name=~"$job"``) narrows every selector.
    """
    sep = ", " if matchers else ""
    by_age: dict[str, list[str]] = {}
    for check, age in STALE_AFTER.items():
        by_age.setdefault(age, []).append(check)
    parts = []
    for age, checks in by_age.items():
        sel = f'check="{checks[0]}"' if len(checks) == 1 else f'check=~"{"|".join(checks)}"'
        parts.append(f"time() - max by ({_BY}, check) ({_LAST_RUN}{{{matchers}{sep}{sel}}}) > {_seconds(age)}")
    stale = "\n  or\n  ".join(parts)
    steps = f"{_STEPS}{{{matchers}}}" if matchers else _STEPS
    return f"(\n  {stale}\n)\nand on ({_JOIN})\nmax by ({_BY}) (increase({steps}[10m])) > 0"


# -- critical: hardware suspects ---------------------------------------------------------------------------------------

def _latched(gauge: str, check: str) -> str:
    return f"max by ({_BY}) (max_over_time({_sel(gauge, check=check)}[{EVENT_WINDOW}])) > 0"


def _suspect_rule(check: str) -> AlertRule:
    return suspect_rule(check, _latched(_SUSPECT, check))


def _ambiguous_rule(check: str) -> AlertRule:
    return ambiguous_suspect_rule(check, _latched(_AMBIGUOUS, check))


# -- warnings ---------------------------------------------------------------------------------------------------------

def _check_failing_expr() -> str:
    not_run = _sel(_CHECKS, result="~error|skipped")
    ran = _sel(_CHECKS, result="~pass|fail")
    by = f"{_BY}, check"
    return (f"sum by ({by}) {_increased(not_run, FAILING_FOR)}\n"
            f"unless on ({by})\nsum by ({by}) {_increased(ran, FAILING_FOR)}\n"
            # The rank was already reporting FAILING_FOR ago: errors alone in a young rank's window are not yet
            # "no pass for FAILING_FOR".
            f"and on ({_BY})\nmax by ({_BY}) ({_STEPS} offset {FAILING_FOR})")


def _training_nonfinite_expr() -> str:
    return (f"min by (service_name) (\n"
            f"  max by ({_BY}) (increase({_NONFINITE}[{ROLLUP_WINDOW}]))\n  / on ({_BY})\n"
            f"  max by ({_BY}) (increase({_STEPS}[{ROLLUP_WINDOW}]))\n) > {NONFINITE_SHARE}")


# The last sdc_monitor_closed scraped from each target, carried while the target is down: a self-referencing
# recording rule, so that the newest process on a reused host:port decides (a window over the raw gauge would mix a
# clean earlier run with a crashed later one). It lives while Prometheus knows the target (up exists).
CLOSED_LAST = "sdc:monitor_closed:last_scraped"
_CLOSED_BY = f"job, instance, {_BY}"
_CLOSED_LAST_RULE = RecordingRule(
    CLOSED_LAST,
    f"max by ({_CLOSED_BY}) ({_sel(_CLOSED, job=SCRAPE_JOB)})\nor\n"
    f"(\n  {CLOSED_LAST} unless on (job, instance) {_sel(_CLOSED, job=SCRAPE_JOB)}\n)\n"
    f"and on (job, instance) up{{{_TARGET}}}")


RULES: tuple[AlertRule, ...] = (
    *(_suspect_rule(check) for check in SUSPECTS),
    # Same alert names, severity warning, ambiguous="true": a suspect the evidence cannot pin down warns only.
    *(_ambiguous_rule(check) for check in SUSPECTS),
    AlertRule(
        "SDCChecksStalled", "warning", checks_stalled_expr(), for_="5m",
        summary="SDC check {{ $labels.check }} stalled on " + WHO,
        description=f"Training steps advance on {WHO} but the {{{{ $labels.check }}}} check last ran "
                    "{{ $value | humanizeDuration }} ago: this rank is not protected by it. Check the job's logs "
                    "for sdc_telemetry errors and sdc_internal_errors_total.",
    ),
    AlertRule(
        "SDCCheckFailing", "warning", _check_failing_expr(),
        summary="SDC check {{ $labels.check }} cannot run on " + WHO,
        description=f"For {FAILING_FOR} the {{{{ $labels.check }}}} check on {WHO} counted only error or skipped "
                    "results, not one pass or fail: the check is due but blind, so this rank is not protected by it. "
                    "The job's log names the reason (unfaithful replay, a failed collective, an unmeasured rank); "
                    "see sdc_internal_errors_total by component.",
    ),
    AlertRule(
        "SDCTrainingNonFinite", "warning", _training_nonfinite_expr(), for_=NONFINITE_FOR,
        summary="Training job {{ $labels.service_name }} computes non-finite gradients on every rank",
        description=f"For {NONFINITE_FOR}, more than {NONFINITE_SHARE:.0%} of the steps of every rank of job "
                    "{{ $labels.service_name }} had NaN/Inf gradients. Every replica agrees, so this is numerics "
                    "(loss-scale overflow, a bad batch, divergence), not a node: no node is paged. Look at the "
                    "learning rate, the loss scaler and the data.",
    ),
    AlertRule(
        "SDCExporterDown", "warning",
        f"(up{{{_TARGET}}} == 0)\n* on (job, instance) group_left ({_BY})\n({CLOSED_LAST} == 0)",
        for_="2m",
        summary="SDC endpoint {{ $labels.instance }} of " + WHO + " vanished",
        description="Prometheus cannot scrape the SDC endpoint {{ $labels.instance }} of " + WHO + ", and its "
                    "last scrape said monitoring was still on (sdc_monitor_closed 0): the training process died, "
                    "hung or lost its exporter without close(). Its checks are invisible. A job that ended with "
                    "close() pages nobody.",
    ),
    AlertRule(
        "SDCPagerFailing", "warning", f"max by ({_BY}) {_increased(_PAGER_FAILURES, EVENT_WINDOW)}",
        summary="Direct pages from " + WHO + " to Alertmanager fail",
        description="The monitor on " + WHO + " could not post a page straight to Alertmanager within the last "
                    + EVENT_WINDOW + " (an HTTP error, a refused connection or a timeout on its alertmanager_url); "
                    "it retries with backoff, but a job that stops may lose the page, and the rule's page then "
                    "depends on Prometheus scraping the suspect in time. Check the URL, the network path from the "
                    "training nodes and Alertmanager's health.",
    ),
    AlertRule(
        "GPUUncorrectableECCErrors", "warning",
        f"max by ({_BY}) (max_over_time({_sel(_ECC, hw_type='gpu', error_type='uncorrected')}[{EVENT_WINDOW}])) > 0",
        summary="GPU {{ $labels.hw_id }} on {{ $labels.host_name }} reports uncorrectable ECC errors",
        description="GPU {{ $labels.hw_id }} on host {{ $labels.host_name }} (rank {{ $labels.rank }}) counts "
                    "{{ $value }} uncorrectable ECC error(s) since the driver loaded. Data it held was lost; drain "
                    "the node and reset or replace the GPU.",
    ),
    AlertRule(
        "GPUXidErrors", "warning",
        f"max by ({_BY}, xid) (\n  increase({_XID}[{EVENT_WINDOW}]) > 0\n  or\n"
        f"  ({_XID} > 0 unless {_XID} offset {EVENT_WINDOW})\n)",
        summary="GPU {{ $labels.hw_id }} on {{ $labels.host_name }} raised XID {{ $labels.xid }}",
        description="The driver reported XID {{ $labels.xid }} on GPU {{ $labels.hw_id }} of host "
                    "{{ $labels.host_name }} (rank {{ $labels.rank }}) within " + EVENT_WINDOW + ". XIDs 48, 63, "
                    "64, 74, 79, 92, 94 and 95 point at the hardware; check the kernel log (dmesg) on the host.",
    ),
)

_W = ROLLUP_WINDOW
_HOST = "service_name, host_name"
# Per-rank series rolled up to host and job. The overview dashboard reads these; the names say what they keep
# (level:metric:operation, Prometheus's convention).
RECORDING_RULES: tuple[RecordingRule, ...] = (
    RecordingRule(f"sdc:checks:rate{_W}", f"sum by ({_HOST}, check, result) (rate({_CHECKS}[{_W}]))"),
    # Coverage: the share of due check runs that reached a verdict (pass or fail) rather than error/skipped. Read
    # from the raw counter, not the rollup above: rollups never depend on each other, so they can be backfilled
    # (promtool tsdb create-blocks-from rules) and evaluated in any order.
    RecordingRule(f"sdc:checks:coverage{_W}",
                  f"(\n  sum by (service_name, check) (rate({_sel(_CHECKS, result='~pass|fail')}[{_W}]))\n  or\n"
                  f"  0 * sum by (service_name, check) (rate({_CHECKS}[{_W}]))\n)\n"
                  f"/ sum by (service_name, check) (rate({_CHECKS}[{_W}]))"),
    RecordingRule(f"sdc:steps:rate{_W}", f"sum by ({_HOST}) (rate({_STEPS}[{_W}]))"),
    RecordingRule("sdc:ranks:count", f"count by ({_HOST}) ({_STEPS})"),
    RecordingRule("sdc:ranks_closed:count", f"count by ({_HOST}) ({_CLOSED} == 1)"),
    RecordingRule("sdc:suspect_ranks:count", f"count by ({_HOST}, check) ({_SUSPECT} > 0)"),
    RecordingRule("sdc:ambiguous_suspect_ranks:count", f"count by ({_HOST}, check) ({_AMBIGUOUS} > 0)"),
    RecordingRule("sdc:incidents:max", f"max by (service_name, check) ({_INCIDENTS})"),
    RecordingRule("sdc:internal_errors:sum", f"sum by ({_HOST}, component) ({_ERRORS})"),
    RecordingRule("sdc:pager_failures:sum", f"sum by ({_HOST}) ({_PAGER_FAILURES})"),
    # A rank that never saw a NaN may not export the counter yet: its gradient norm stands in with 0.
    RecordingRule("sdc:grad_nonfinite:max",
                  f"max by ({_HOST}, phase) ({_NONFINITE})\nor\n0 * max by ({_HOST}, phase) ({_NORM})"),
    RecordingRule("sdc:replay_mismatches:sum", f"sum by ({_HOST}) ({_REPLAY_MISMATCHES})"),
    RecordingRule("sdc:weight_fingerprint_agreement:min", f"min by ({_HOST}) ({_AGREEMENT})"),
    RecordingRule("sdc:weight_fingerprint_mismatches:sum", f"sum by ({_HOST}) ({_WEIGHT_MISMATCHES})"),
    RecordingRule(f"sdc:check_duration_seconds_bucket:rate{_W}",
                  f"sum by (service_name, check, le) (rate({_DURATION}_bucket[{_W}]))"),
    RecordingRule(f"sdc:check_duration_seconds_sum:rate{_W}",
                  f"sum by ({_HOST}, check) (rate({_DURATION}_sum[{_W}]))"),
    RecordingRule("sdc:check_last_run_age_seconds:max",
                  f"max by ({_HOST}, check) (time() - {_LAST_RUN})"),
    RecordingRule("sdc:checks_stalled:count", f"count by ({_HOST}) (\n{checks_stalled_expr()}\n)"),
)


def rules_document(runbook_base: str = RUNBOOK, rollup_interval: str | None = ROLLUP_INTERVAL) -> dict[str, Any]:
    """The Prometheus rule file as a dict: groups ``sdc`` (SDC alerts), ``sdc-gpu`` and ``sdc-rollups``."""
    sdc = [_CLOSED_LAST_RULE.to_rule()] + [r.to_rule(runbook_base) for r in RULES if r.name.startswith("SDC")]
    gpu = [r.to_rule(runbook_base) for r in RULES if r.name.startswith("GPU")]
    return {"groups": [{"name": "sdc", "rules": sdc}, {"name": "sdc-gpu", "rules": gpu},
                       # Every minute: the dashboards read trends, and at 16,384 ranks the rollup of every rank's
                       # duration histogram takes tens of seconds per evaluation.
                       {"name": "sdc-rollups", **({"interval": rollup_interval} if rollup_interval else {}),
                        "rules": [r.to_rule() for r in RECORDING_RULES]}]}


# -- the same alert, pushed ------------------------------------------------------------------------------------------

# -- Alertmanager -----------------------------------------------------------------------------------------------------

def alertmanager_config(pager_url: str = "http://webhook-sink:5001/pager",
                        ticket_url: str = "http://webhook-sink:5001/ticket", *,
                        responder_url: str | None = RESPONDER_URL, responder_credentials_file: str | None = None,
                        fast: bool = False) -> dict[str, Any]:
    """Alertmanager routing: group by job and host, critical -> ``pager``, warning -> ``ticket``; this project's
    critical SDC alerts (the suspect alert names, never ``ambiguous="true"``) also -> ``responder``
    (``sdc-telemetry respond`` drains the node; None leaves it out), with the bearer token read from
    ``responder_credentials_file`` (``http_config.authorization.credentials_file``; None sends none, for a bench
    responder run with ``--insecure-no-auth``). The checked-in file uses ``RESPONDER_CREDENTIALS_FILE``.

    ``fast`` shortens the grouping waits (tests, demos) so that a page is sent within a second.
    """
    waits = {"group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"} if fast else \
        {"group_wait": "30s", "group_interval": "5m", "repeat_interval": "4h"}
    pager_waits = {"group_wait": "1s" if fast else "10s", "repeat_interval": "1h"}
    (ambiguous_label, ambiguous_value), = AMBIGUOUS_LABEL.items()
    sdc_critical = ['severity="critical"', f'alertname=~"{"|".join(SUSPECT_ALERTS.values())}"',
                    f'{ambiguous_label}!="{ambiguous_value}"']
    routes: list[dict[str, Any]] = []
    receivers: list[dict[str, Any]] = []
    if responder_url is not None:
        webhook: dict[str, Any] = {"url": responder_url, "send_resolved": False}
        if responder_credentials_file is not None:
            webhook["http_config"] = {"authorization": {"type": "Bearer",
                                                        "credentials_file": responder_credentials_file}}
        # continue: the pager still gets the alert after the responder.
        routes.append({"matchers": sdc_critical, "receiver": "responder", "continue": True, **pager_waits})
        receivers.append({"name": "responder", "webhook_configs": [webhook]})
    routes += [{"matchers": ['severity="critical"'], "receiver": "pager", **pager_waits},
               {"matchers": ['severity="warning"'], "receiver": "ticket"}]
    receivers += [{"name": "pager", "webhook_configs": [{"url": pager_url, "send_resolved": True}]},
                  {"name": "ticket", "webhook_configs": [{"url": ticket_url, "send_resolved": True}]}]
    return {
        "route": {"receiver": "ticket", "group_by": ["service_name", "host_name"], **waits, "routes": routes},
        "inhibit_rules": [
            # A host already paged for: its warnings (ECC, XID, stalled checks) are evidence, not news.
            {"source_matchers": ['severity="critical"'], "target_matchers": ['severity="warning"'],
             "equal": ["host_name"]},
        ],
        "receivers": receivers,
    }


_PAGER_EXAMPLES = """\
  # Page a person instead of (or besides) the webhook: remove "# " from the lines below and fill them in.
  # pagerduty_configs:
  #   - routing_key: <PagerDuty Events v2 integration key>
  #     severity: critical
  #     description: '{{ .CommonAnnotations.summary }}'
  #     links:
  #       - href: '{{ .CommonAnnotations.runbook_url }}'
  #         text: runbook
  # slack_configs:
  #   - api_url: https://hooks.slack.com/services/<...>
  #     channel: '#sdc-oncall'
  #     title: '{{ .CommonLabels.alertname }} on {{ .CommonLabels.host_name }}'
  #     text: '{{ range .Alerts }}{{ .Annotations.description }} {{ .Annotations.runbook_url }}{{ "\\n" }}{{ end }}'
"""


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (PromQL) as literal blocks, so the checked-in rules read like the Python."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def to_yaml(doc: Any) -> str:
    """YAML as the checked-in files write it: keys in order, PromQL as literal blocks."""
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)


HEADER = "# Generated by sdc_telemetry.ops.alerts (sdc-telemetry alerts); edit the Python, not this file.\n"


def rules_yaml(runbook_base: str = RUNBOOK, rollup_interval: str | None = ROLLUP_INTERVAL) -> str:
    """The text of ``alerts/sdc-rules.yml``; ``LocalStack`` loads it with ``rollup_interval=None`` (its own short
    evaluation interval)."""
    return HEADER + to_yaml(rules_document(runbook_base, rollup_interval))


def _alertmanager_text(doc: dict[str, Any]) -> str:
    text = to_yaml(doc)
    marker = "- name: pager\n"
    assert marker in text
    header = HEADER + ("# Receivers are webhooks (the docker-compose webhook sink and the sdc-telemetry respond "
                       "service); see the commented examples.\n"
                       "# The responder gets only the unambiguous SDC criticals, with the bearer token of "
                       f"{RESPONDER_CREDENTIALS_FILE}\n# (the token sdc-telemetry respond --bearer-token-file "
                       "reads).\n")
    return header + text.replace(marker, marker + _PAGER_EXAMPLES, 1)


def generate(out_dir: str | Path) -> list[Path]:
    """Write ``sdc-rules.yml`` and ``alertmanager.yml`` into ``out_dir``; return the paths.

    >>> generate("alerts")                                          # doctest: +SKIP
    [PosixPath('alerts/sdc-rules.yml'), PosixPath('alerts/alertmanager.yml')]
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {RULES_FILE: rules_yaml(),
             ALERTMANAGER_FILE: _alertmanager_text(alertmanager_config(
                 responder_credentials_file=RESPONDER_CREDENTIALS_FILE))}
    paths = []
    for name, text in files.items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths
