"""Prometheus alert rules, their promtool unit tests and the Alertmanager routing, generated from the metric table.

``generate(out_dir)`` writes ``sdc-rules.yml``, ``sdc-rules.test.yml`` and ``alertmanager.yml`` (checked in under
``alerts/``; ``sdc-telemetry alerts`` regenerates them). Names, severities and labels are the contract of DESIGN.md
section 5.

Why the expressions look the way they do: a corruption is usually a one-step event. ``sdc_suspect`` latches for the
life of the process and the counters are the event record, but a counter created by the event itself has 1 as its
first sample, which ``increase()`` cannot see, and a process that stops right after the incident (``on_suspect=
"raise"``) is scraped a last time at best. So each SDC alert fires while any sample of the latched gauge or of the
counter within ``EVENT_WINDOW`` is non-zero: one scrape of the event pages, and the page survives the process.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .metrics import family

__all__ = ["AlertRule", "RULES", "RULES_FILE", "TESTS_FILE", "ALERTMANAGER_FILE", "EVENT_WINDOW", "STALE_AFTER",
           "rules_document", "rules_yaml", "alertmanager_config", "rule_tests_document", "checks_stalled_expr",
           "generate", "runbook_anchor"]

RULES_FILE = "sdc-rules.yml"
TESTS_FILE = "sdc-rules.test.yml"
ALERTMANAGER_FILE = "alertmanager.yml"
RUNBOOK = "docs/runbook.md"
SCRAPE_JOB = "sdc"

# How long one scraped sample of an SDC event keeps its alert firing (after the process is gone).
EVENT_WINDOW = "15m"
# A check is stalled when steps advance but its last run is older than this. Gradient checks run every step, the
# weight check every weights_every steps (default 1), the replay every replay_every steps (default 100): raise these
# (and regenerate) for jobs with slow steps or sparse cadences.
STALE_AFTER: dict[str, str] = {"grad_local": "10m", "grad_reduced": "10m", "weights": "30m", "replay": "2h"}

_STEPS = family("sdc_steps_total").name
_SUSPECT = family("sdc_suspect").name
_LAST_RUN = family("sdc_check_last_run_timestamp_seconds").name
_NONFINITE = family("sdc_grad_nonfinite_total").name
_WEIGHT_MISMATCHES = family("sdc_weight_fingerprint_mismatches_total").name
_ECC = family("hw_errors_total").name
_XID = family("gpu_xid_errors_total").name

# Labels an alert about one rank carries (DESIGN.md section 4 identity labels, less the instance id).
RANK_LABELS = ("service_name", "host_name", "rank", "local_rank", "hw_id")
_JOIN = "service_name, host_name, rank, hw_id"
_BY = ", ".join(RANK_LABELS)
_WHO = "rank {{ $labels.rank }} on host {{ $labels.host_name }} (GPU {{ $labels.hw_id }})"


def runbook_anchor(alert: str) -> str:
    """The runbook heading anchor of ``alert`` (GitHub slug of a ``## <AlertName>`` heading)."""
    return alert.lower()


@dataclass(frozen=True)
class AlertRule:
    name: str
    severity: str
    expr: str
    summary: str
    description: str
    for_: str = "0s"
    labels: Mapping[str, str] = field(default_factory=dict)

    def to_rule(self, runbook_base: str) -> dict[str, Any]:
        rule: dict[str, Any] = {"alert": self.name, "expr": self.expr}
        if self.for_ != "0s":
            rule["for"] = self.for_
        rule["labels"] = {"severity": self.severity, **self.labels}
        rule["annotations"] = {"summary": self.summary, "description": self.description,
                               "runbook_url": f"{runbook_base}#{runbook_anchor(self.name)}"}
        return rule


def _seen(selector: str, by: str = _BY) -> str:
    """Max over the event window of every sample of ``selector``, per rank: non-zero once one scrape saw an event."""
    return f"max by ({by}) (max_over_time({selector}[{EVENT_WINDOW}]))"


def _sel(name: str, **matchers: str) -> str:
    """``name{k="v", ...}``."""
    inner = ", ".join(f'{k}="{v}"' for k, v in matchers.items())
    return f"{name}{{{inner}}}" if inner else name


def _suspected(check: str) -> str:
    return f"{_seen(_sel(_SUSPECT, check=check))} > 0"


def checks_stalled_expr(matchers: str = "") -> str:
    """Ranks whose steps advance while a check's last run is older than ``STALE_AFTER`` (value: age in seconds).

    ``matchers`` (``service_name=~"$job"``) narrows every selector; the dashboards reuse this expression.
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


def _seconds(duration: str) -> int:
    value, unit = int(duration[:-1]), duration[-1]
    return value * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit]


RULES: tuple[AlertRule, ...] = (
    AlertRule(
        "SDCWeightFingerprintMismatch", "critical",
        f"{_seen(_WEIGHT_MISMATCHES)} > 0\nor on ({_JOIN})\n{_suspected('weights')}",
        summary=f"SDC: weights of {_WHO} differ from the other replicas",
        description=f"The weight-fingerprint check found that {_WHO} holds parameters that differ from the "
                    "replicas' majority ({{ $value }} mismatching weight check(s)). Its memory or arithmetic "
                    "silently corrupted the model: stop the job or let it stop, and do not save a checkpoint from "
                    "this rank.",
    ),
    AlertRule(
        "SDCReplayMismatch", "critical", _suspected("replay"),
        summary=f"SDC: recomputing a step of {_WHO} does not reproduce it",
        description=f"The replay check named {_WHO}: its recorded loss or gradients differ from a partner's "
                    "recomputation of the same micro-batch with the same weights and RNG state. The GPU computes "
                    "finite but wrong results; see the replay deltas on the SDC overview dashboard.",
    ),
    AlertRule(
        "SDCNonFiniteGradient", "critical",
        f"{_seen(_sel(_NONFINITE, phase='local'))} > 0\nor on ({_JOIN})\n{_suspected('grad_local')}",
        labels={"phase": "local"},
        summary=f"SDC: non-finite local gradients on {_WHO}",
        description=f"{_WHO} computed NaN/Inf gradients before the all-reduce ({{{{ $value }}}} step(s)); they "
                    "spread to every replica through the all-reduce. If the other ranks' gradients stayed finite, "
                    "suspect this GPU before the model: look at its counters.",
    ),
    AlertRule(
        # Reduced non-finites that a rank's local NaN explains are the echo, not the cause: the alert above names it.
        "SDCNonFiniteGradient", "critical",
        f"{_seen(_sel(_NONFINITE, phase='reduced'))} > 0\nunless on (service_name)\n(\n"
        f"  {_seen(_sel(_NONFINITE, phase='local'), 'service_name')} > 0\n  or\n"
        f"  {_seen(_sel(_SUSPECT, check='grad_local'), 'service_name')} > 0\n)",
        for_="1m", labels={"phase": "reduced"},
        summary=f"SDC: non-finite reduced gradients on {_WHO}",
        description=f"{_WHO} holds NaN/Inf gradients after the all-reduce ({{{{ $value }}}} step(s)) while no "
                    "rank's local gradients were non-finite: the data was corrupted between the GPUs.",
    ),
    AlertRule(
        "SDCCommunicationCorruption", "critical", _suspected("grad_reduced"),
        summary=f"SDC: all-reduce delivered corrupted gradients to {_WHO}",
        description=f"{_WHO} received non-finite reduced gradients while every rank's local gradients were "
                    "finite. Suspect the communication path of this host (NIC, NVLink/NVSwitch, PCIe, the "
                    "collective library) rather than the GPU's arithmetic.",
    ),
    AlertRule(
        "SDCChecksStalled", "warning", checks_stalled_expr(), for_="5m",
        summary="SDC check {{ $labels.check }} stalled on " + _WHO,
        description=f"Training steps advance on {_WHO} but the {{{{ $labels.check }}}} check last ran "
                    "{{ $value | humanizeDuration }} ago: this rank is not protected by it. Check the job's logs "
                    "for sdc_telemetry errors and sdc_internal_errors_total.",
    ),
    AlertRule(
        "SDCExporterDown", "critical",
        f'(up{{job="{SCRAPE_JOB}"}} == 0)\n  * on (instance) group_left ({_BY})\n'
        f'  topk by (instance) (1, last_over_time({_STEPS}{{job="{SCRAPE_JOB}"}}[6h]))\n'
        # A rank that never reported: name at least the host, from the target address.
        f'or on (instance)\nlabel_replace(up{{job="{SCRAPE_JOB}"}} == 0, "host_name", "$1", "instance", "(.+):[0-9]+")',
        for_="2m",
        summary="SDC endpoint {{ $labels.instance }} on {{ $labels.host_name }} is down",
        description="Prometheus cannot scrape the SDC endpoint {{ $labels.instance }}{{ if $labels.rank }} of rank "
                    "{{ $labels.rank }} on host {{ $labels.host_name }} (GPU {{ $labels.hw_id }}){{ end }}: its checks "
                    "are invisible. The training process exited (an SDCDetected stop ends every rank), hung, or its "
                    "exporter failed.",
    ),
    AlertRule(
        "GPUUncorrectableECCErrors", "warning",
        f"{_seen(_sel(_ECC, hw_type='gpu', error_type='uncorrected'))} > 0",
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

_GROUPS = (("sdc", ("SDC",)), ("sdc-gpu", ("GPU",)))


def rules_document(runbook_base: str = RUNBOOK) -> dict[str, Any]:
    """The Prometheus rule file as a dict (``yaml.safe_dump`` it): the groups ``sdc`` and ``sdc-gpu``."""
    groups = []
    for name, prefixes in _GROUPS:
        rules = [r.to_rule(runbook_base) for r in RULES if r.name.startswith(prefixes)]
        groups.append({"name": name, "rules": rules})
    return {"groups": groups}


def alertmanager_config(pager_url: str = "http://webhook-sink:5001/pager",
                        ticket_url: str = "http://webhook-sink:5001/ticket", *, fast: bool = False) -> dict[str, Any]:
    """Alertmanager routing: group by job and host, critical -> ``pager``, warning -> ``ticket``.

    ``fast`` shortens the grouping waits (tests, demos) so that a page is sent within a second.
    """
    waits = {"group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"} if fast else \
        {"group_wait": "30s", "group_interval": "5m", "repeat_interval": "4h"}
    pager_waits = {"group_wait": "1s" if fast else "10s", "repeat_interval": "1h"}
    return {
        "route": {
            "receiver": "ticket",
            "group_by": ["service_name", "host_name"],
            **waits,
            "routes": [
                {"matchers": ['severity="critical"'], "receiver": "pager", **pager_waits},
                {"matchers": ['severity="warning"'], "receiver": "ticket"},
            ],
        },
        "inhibit_rules": [
            # A host already paged for: its warnings (ECC, XID, stalled checks) are evidence, not news.
            {"source_matchers": ['severity="critical"'], "target_matchers": ['severity="warning"'],
             "equal": ["host_name"]},
            # The diagnosis supersedes the symptom on the same rank.
            {"source_matchers": ['alertname="SDCCommunicationCorruption"'],
             "target_matchers": ['alertname="SDCNonFiniteGradient"', 'phase="reduced"'],
             "equal": ["service_name", "host_name", "rank"]},
        ],
        "receivers": [
            {"name": "pager", "webhook_configs": [{"url": pager_url, "send_resolved": True}]},
            {"name": "ticket", "webhook_configs": [{"url": ticket_url, "send_resolved": True}]},
        ],
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


def _yaml(doc: Any) -> str:
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)


_HEADER = "# Generated by sdc_telemetry.alerts (sdc-telemetry alerts); edit the Python, not this file.\n"


def rules_yaml(runbook_base: str = RUNBOOK) -> str:
    """The text of ``alerts/sdc-rules.yml`` (what ``LocalStack`` loads too)."""
    return _HEADER + _yaml(rules_document(runbook_base))


def _alertmanager_text(doc: dict[str, Any]) -> str:
    text = _yaml(doc)
    marker = "- name: ticket\n"
    assert marker in text
    header = _HEADER + "# Receivers are webhooks (the docker-compose webhook sink); see the commented examples.\n"
    return header + text.replace(marker, _PAGER_EXAMPLES + marker, 1)


# -- promtool unit tests ----------------------------------------------------------------------------------------------

_TEMPLATE = re.compile(r"\{\{ \$(labels\.(\w+)|value)( \| humanizeDuration)? \}\}")
_IF = re.compile(r"\{\{ if \$labels\.(\w+) \}\}(.*?)\{\{ end \}\}")


def _render(template: str, labels: Mapping[str, str], value: str) -> str:
    """What Prometheus renders for our templates (``$labels.x``, ``$value``, ``$value | humanizeDuration`` and
    ``if $labels.x``): the tests compare it with promtool's rendering, so a typo in a template fails them."""
    def sub(m: re.Match[str]) -> str:
        if m.group(1) == "value":
            return value
        return labels.get(m.group(2), "")
    text = _IF.sub(lambda m: m.group(2) if labels.get(m.group(1)) else "", template)
    return _TEMPLATE.sub(sub, text)


def _ident(rank: int, host: str = "node-b", job: str = "llm") -> dict[str, str]:
    return {"service_name": job, "host_name": host, "rank": str(rank), "local_rank": str(rank % 4),
            "hw_id": f"GPU-{rank:08d}-aaaa-bbbb-cccc-dddddddddddd"}


def _series(name: str, labels: Mapping[str, str], values: str) -> dict[str, str]:
    return {"series": _sel(name, **labels), "values": values}


def _scraped(rank: int, host: str = "node-b") -> dict[str, str]:
    ident = _ident(rank, host)
    port = 9860 + int(ident["local_rank"])
    return {**ident, "service_instance_id": f"{host}-rank{rank}", "job": SCRAPE_JOB, "instance": f"{host}:{port}"}


def _expect(name: str, labels: Mapping[str, str], value: str, rule_index: int = 0) -> dict[str, Any]:
    rule = [r for r in RULES if r.name == name][rule_index]
    all_labels = {"severity": rule.severity, **rule.labels, **labels}
    return {"exp_labels": all_labels,
            "exp_annotations": {"summary": _render(rule.summary, all_labels, value),
                                "description": _render(rule.description, all_labels, value),
                                "runbook_url": f"{RUNBOOK}#{runbook_anchor(name)}"}}


def _healthy_job(ranks: range, minutes: int) -> list[dict[str, str]]:
    """Every family a healthy 4-rank job exports, sampled every minute (check timestamps follow the clock)."""
    out = []
    for r in ranks:
        lab = _scraped(r, "node-a" if r < 2 else "node-b")
        out.append(_series("up", {"job": SCRAPE_JOB, "instance": lab["instance"]}, f"1x{minutes}"))
        out.append(_series(_STEPS, lab, f"0+60x{minutes}"))
        for check in STALE_AFTER:
            out.append(_series(_LAST_RUN, {**lab, "check": check}, f"0+60x{minutes}"))
            out.append(_series(_SUSPECT, {**lab, "check": check}, f"0x{minutes}"))
        for phase in ("local", "reduced"):
            out.append(_series(_NONFINITE, {**lab, "phase": phase}, f"0x{minutes}"))
        out.append(_series(_WEIGHT_MISMATCHES, lab, f"0x{minutes}"))
        gpu = {k: lab[k] for k in ("service_name", "host_name", "rank", "local_rank", "hw_id", "job", "instance")}
        out.append(_series(_ECC, {**gpu, "hw_type": "gpu", "error_type": "corrected"}, f"0+3x{minutes}"))
        out.append(_series(_ECC, {**gpu, "hw_type": "gpu", "error_type": "uncorrected"}, f"0x{minutes}"))
    return out


_ALERT_NAMES = tuple(dict.fromkeys(r.name for r in RULES))


def _quiet(*times: str) -> list[dict[str, Any]]:
    return [{"eval_time": t, "alertname": a, "exp_alerts": []} for t in times for a in _ALERT_NAMES]


def rule_tests_document(rules_file: str = RULES_FILE) -> dict[str, Any]:
    """promtool unit tests: every alert firing and not firing, a healthy job paging nothing."""
    r2 = _scraped(2)
    id2 = _ident(2)
    tests: list[dict[str, Any]] = []

    def case(name: str, series: list[dict[str, str]], checks: list[dict[str, Any]]) -> None:
        tests.append({"name": name, "interval": "1m", "input_series": series, "alert_rule_test": checks})

    case("a healthy job pages nothing", _healthy_job(range(4), 120), _quiet("5m", "30m", "1h", "119m"))

    case("a weight mismatch seen in one scrape pages, names the rank and lasts the event window",
         [_series(_WEIGHT_MISMATCHES, r2, "0x10 1 stale"), _series(_SUSPECT, {**r2, "check": "weights"},
                                                                   "0x10 1 stale")],
         [{"eval_time": "10m", "alertname": "SDCWeightFingerprintMismatch", "exp_alerts": []},
          {"eval_time": "11m", "alertname": "SDCWeightFingerprintMismatch",
           "exp_alerts": [_expect("SDCWeightFingerprintMismatch", id2, "1")]},
          {"eval_time": "25m", "alertname": "SDCWeightFingerprintMismatch",
           "exp_alerts": [_expect("SDCWeightFingerprintMismatch", id2, "1")]},
          {"eval_time": "27m", "alertname": "SDCWeightFingerprintMismatch", "exp_alerts": []}])

    case("a mismatch counter born at 1 (the event created it) pages; so does the latched gauge alone",
         [_series(_WEIGHT_MISMATCHES, r2, "_x5 1x20"),
          _series(_SUSPECT, {**_scraped(5, "node-c"), "check": "weights"}, "0x5 1x20")],
         [{"eval_time": "6m", "alertname": "SDCWeightFingerprintMismatch",
           "exp_alerts": [_expect("SDCWeightFingerprintMismatch", id2, "1"),
                          _expect("SDCWeightFingerprintMismatch", _ident(5, "node-c"), "1")]}])

    case("a replay verdict pages the suspect only",
         [_series(_SUSPECT, {**r2, "check": "replay"}, "0x5 1x20"),
          _series(_SUSPECT, {**_scraped(1, "node-a"), "check": "replay"}, "0x25")],
         [{"eval_time": "5m", "alertname": "SDCReplayMismatch", "exp_alerts": []},
          {"eval_time": "6m", "alertname": "SDCReplayMismatch",
           "exp_alerts": [_expect("SDCReplayMismatch", id2, "1")]}])

    nan_series = [_series(_SUSPECT, {**r2, "check": "grad_local"}, "0x5 1x20")]
    for r in range(4):
        lab = _scraped(r, "node-a" if r < 2 else "node-b")
        nan_series.append(_series(_NONFINITE, {**lab, "phase": "local"}, "0x5 1x20" if r == 2 else "0x25"))
        nan_series.append(_series(_NONFINITE, {**lab, "phase": "reduced"}, "0x5 1x20"))
    case("a local NaN pages its rank with phase=local; the NaN it spread through the all-reduce pages nobody",
         nan_series,
         [{"eval_time": "6m", "alertname": "SDCNonFiniteGradient",
           "exp_alerts": [_expect("SDCNonFiniteGradient", {**id2, "phase": "local"}, "1")]},
          {"eval_time": "10m", "alertname": "SDCNonFiniteGradient",
           "exp_alerts": [_expect("SDCNonFiniteGradient", {**id2, "phase": "local"}, "1")]},
          {"eval_time": "10m", "alertname": "SDCCommunicationCorruption", "exp_alerts": []}])

    comm_series = [_series(_SUSPECT, {**r2, "check": "grad_reduced"}, "0x5 1 stale")]
    for r in range(4):
        lab = _scraped(r, "node-a" if r < 2 else "node-b")
        comm_series.append(_series(_NONFINITE, {**lab, "phase": "local"}, "0x20"))
        comm_series.append(_series(_NONFINITE, {**lab, "phase": "reduced"}, "0x5 1 stale" if r == 2 else "0x20"))
    case("reduced NaNs with finite local gradients page communication corruption (one scrape is enough)",
         comm_series,
         [{"eval_time": "5m", "alertname": "SDCCommunicationCorruption", "exp_alerts": []},
          {"eval_time": "6m", "alertname": "SDCCommunicationCorruption",
           "exp_alerts": [_expect("SDCCommunicationCorruption", id2, "1")]},
          {"eval_time": "6m", "alertname": "SDCNonFiniteGradient", "exp_alerts": []},
          {"eval_time": "8m", "alertname": "SDCNonFiniteGradient",
           "exp_alerts": [_expect("SDCNonFiniteGradient", {**id2, "phase": "reduced"}, "1", rule_index=1)]}])

    stalled = [_series(_STEPS, r2, "0+60x90"),
               _series(_LAST_RUN, {**r2, "check": "grad_local"}, "0+60x90"),
               _series(_LAST_RUN, {**r2, "check": "weights"}, "0+60x10 600x80"),
               _series(_STEPS, _scraped(1, "node-a"), "0+60x10 600x80"),
               _series(_LAST_RUN, {**_scraped(1, "node-a"), "check": "weights"}, "0+60x10 600x80")]
    case("a check whose last run ages while steps advance warns; a paused job does not",
         stalled,
         [{"eval_time": "44m", "alertname": "SDCChecksStalled", "exp_alerts": []},
          {"eval_time": "46m", "alertname": "SDCChecksStalled",
           "exp_alerts": [_expect("SDCChecksStalled", {**id2, "check": "weights"}, "36m 0s")]}])

    down = [_series("up", {"job": SCRAPE_JOB, "instance": r2["instance"]}, "1x5 0x20"),
            _series(_STEPS, r2, "0+60x5 stale"),
            _series("up", {"job": SCRAPE_JOB, "instance": "node-c:9860"}, "1x5 0x20"),
            _series("up", {"job": SCRAPE_JOB, "instance": "node-a:9861"}, "1x5 0 1x20"),
            _series("up", {"job": "node", "instance": "node-a:9100"}, "0x25")]
    target = {"job": SCRAPE_JOB, "instance": r2["instance"]}
    case("a dead exporter pages with the identity it last reported; a single failed scrape does not",
         down,
         [{"eval_time": "7m", "alertname": "SDCExporterDown", "exp_alerts": []},
          {"eval_time": "9m", "alertname": "SDCExporterDown",
           "exp_alerts": [_expect("SDCExporterDown", {**target, **id2}, "0"),
                          _expect("SDCExporterDown", {**target, "instance": "node-c:9860", "host_name": "node-c"},
                                  "0")]}])

    gpu = {k: r2[k] for k in ("service_name", "host_name", "rank", "local_rank", "hw_id", "job", "instance")}
    case("uncorrectable ECC errors warn; corrected ones do not",
         [_series(_ECC, {**gpu, "hw_type": "gpu", "error_type": "uncorrected"}, "0x5 2x20"),
          _series(_ECC, {**gpu, "hw_type": "gpu", "error_type": "corrected"}, "0+10x25")],
         [{"eval_time": "5m", "alertname": "GPUUncorrectableECCErrors", "exp_alerts": []},
          {"eval_time": "6m", "alertname": "GPUUncorrectableECCErrors",
           "exp_alerts": [_expect("GPUUncorrectableECCErrors", id2, "2")]}])

    case("an XID warns for the event window, also when its counter is born by the event",
         [_series(_XID, {**gpu, "xid": "79"}, "_x5 1x40"),
          _series(_XID, {**_scraped(1, "node-a"), "xid": "13"}, "0x30 1x10")],
         [{"eval_time": "4m", "alertname": "GPUXidErrors", "exp_alerts": []},
          {"eval_time": "6m", "alertname": "GPUXidErrors",
           "exp_alerts": [_expect("GPUXidErrors", {**id2, "xid": "79"}, "1")]},
          {"eval_time": "25m", "alertname": "GPUXidErrors", "exp_alerts": []},
          {"eval_time": "32m", "alertname": "GPUXidErrors",
           "exp_alerts": [_expect("GPUXidErrors", {**_ident(1, "node-a"), "xid": "13"}, "1")]}])

    return {"rule_files": [rules_file], "evaluation_interval": "1m", "tests": tests}


# -- files ------------------------------------------------------------------------------------------------------------

def generate(out_dir: str | Path) -> list[Path]:
    """Write ``sdc-rules.yml``, ``sdc-rules.test.yml`` and ``alertmanager.yml`` into ``out_dir``; return the paths.

    >>> generate("alerts")                                          # doctest: +SKIP
    [PosixPath('alerts/sdc-rules.yml'), PosixPath('alerts/sdc-rules.test.yml'), PosixPath('alerts/alertmanager.yml')]
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        RULES_FILE: rules_yaml(),
        TESTS_FILE: _HEADER + "# Run: promtool test rules alerts/sdc-rules.test.yml\n" + _yaml(rule_tests_document()),
        ALERTMANAGER_FILE: _alertmanager_text(alertmanager_config()),
    }
    paths = []
    for name, text in files.items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths
