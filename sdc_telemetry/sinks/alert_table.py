"""The shape of the alerts that page a suspect: names, labels and annotations, read by both the rule generator
(``sdc_telemetry.ops.alerts``) and the direct push (``sdc_telemetry.sinks.pager``).

Alertmanager identifies an alert by its labels, so an alert the monitor pushes and the rule's alert for the same rank
must carry exactly the same ones: both are built from this one table. Standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AlertRule", "AMBIGUOUS_ANCHOR", "AMBIGUOUS_LABEL", "RANK_LABELS", "RUNBOOK", "SUSPECTS", "SUSPECT_ALERTS",
           "ambiguous_suspect_rule", "render_template", "runbook_anchor", "suspect_alert", "suspect_rule", "WHO"]

RUNBOOK = "docs/runbook.md"
# Labels an alert about one rank carries (the metrics' identity labels, less the per-process instance id).
RANK_LABELS = ("service_name", "host_name", "rank", "local_rank", "hw_id")
WHO = "rank {{ $labels.rank }} on host {{ $labels.host_name }} (GPU {{ $labels.hw_id }})"
# The label an ambiguous suspect's alert carries (with severity="warning"): the responder never acts on it.
AMBIGUOUS_LABEL = {"ambiguous": "true"}
# The runbook section every ambiguous suspect's alert links to.
AMBIGUOUS_ANCHOR = "ambiguous-sdc-verdicts"


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
    anchor: str | None = None  # the runbook anchor when it is not the alert's own section

    def rule_labels(self) -> dict[str, str]:
        """The labels the rule adds to every alert it fires (severity first)."""
        return {"severity": self.severity, **self.labels}

    def annotations(self, runbook_base: str = RUNBOOK) -> dict[str, str]:
        """The annotation templates (``{{ $labels.x }}`` still in them)."""
        return {"summary": self.summary, "description": self.description,
                "runbook_url": f"{runbook_base}#{self.anchor or runbook_anchor(self.name)}"}

    def to_rule(self, runbook_base: str = RUNBOOK) -> dict[str, Any]:
        rule: dict[str, Any] = {"alert": self.name, "expr": self.expr}
        if self.for_ != "0s":
            rule["for"] = self.for_
        rule["labels"] = self.rule_labels()
        rule["annotations"] = self.annotations(runbook_base)
        return rule


@dataclass(frozen=True)
class _Suspect:
    alert: str
    summary: str
    description: str
    labels: Mapping[str, str] = field(default_factory=dict)


# One critical alert per check, keyed by the check that latches sdc_suspect{check}. No $value in these annotations:
# the direct push renders them without a query result.
SUSPECTS: dict[str, _Suspect] = {
    "weights": _Suspect(
        "SDCWeightFingerprintMismatch",
        summary=f"SDC: weights of {WHO} differ from the other replicas",
        description=f"The weight-fingerprint check found that {WHO} holds parameters that differ from the "
                    "replicas' majority, or parameters or optimizer state that changed in its memory between the "
                    "update and the check (at rest). Its memory or arithmetic silently corrupted the model: stop the "
                    "job or let it stop, drain the node, and resume from a checkpoint certified before the incident "
                    "step.",
    ),
    "update": _Suspect(
        "SDCUpdateMismatch",
        summary=f"SDC: the optimizer update applied by {WHO} is not what a partner recomputes",
        description=f"The update audit named {WHO}: a partner recomputed its optimizer step for its own shards "
                    "from the same parameters, gradients, state and hyper-parameters and got other values (a referee "
                    "or the rank's own rerun settled which side is wrong). Where no replica holds the shard, the "
                    "wrong values are in the model and its optimizer state: stop the job or let it stop, drain the "
                    "node, and resume from a checkpoint certified before the incident step.",
    ),
    "replay": _Suspect(
        "SDCReplayMismatch",
        summary=f"SDC: recomputing a step of {WHO} does not reproduce it",
        description=f"The replay check named {WHO}: its recorded loss or gradients differ from a partner's "
                    "recomputation of the same micro-batch with the same weights and RNG state, while the other "
                    "pairs agree. The GPU computes finite but wrong results; see its counters on the GPU health "
                    "dashboard.",
    ),
    "grad_local": _Suspect(
        "SDCNonFiniteGradient",
        labels={"phase": "local"},
        summary=f"SDC: non-finite local gradients on {WHO} while the other ranks' were finite",
        description=f"{WHO} computed NaN/Inf gradients before the all-reduce while the other replicas computed "
                    "finite ones for the same step: suspect this GPU, not the model. The NaN spread to every "
                    "replica through the all-reduce: resume from a checkpoint certified before the incident step.",
    ),
    "grad_reduced": _Suspect(
        "SDCCommunicationCorruption",
        summary=f"SDC: all-reduce delivered corrupted gradients to {WHO}",
        description=f"{WHO} received non-finite reduced gradients while every rank's local gradients were "
                    "finite. Suspect the communication path of this host (NIC, NVLink/NVSwitch, PCIe, the "
                    "collective library) rather than the GPU's arithmetic.",
    ),
}

# check -> alert name of the critical alert that pages its suspects.
SUSPECT_ALERTS: dict[str, str] = {check: s.alert for check, s in SUSPECTS.items()}

_AMBIGUOUS_SUMMARY = "SDC, ambiguous (not paged): {what}"
_AMBIGUOUS_DESCRIPTION = (
    "The {check} check named " + WHO + ", but the evidence cannot tell which side is faulty: two replicas "
    "without a referee, a single process naming itself, or a vote without a majority. Not paged, and the responder "
    "does not drain on it. Look at the incident's evidence and the GPU health dashboard, add a replica or a referee "
    "to the audits, and treat a repeat on the same GPU as a hardware suspect.")
# The unambiguous summaries without their "SDC: " prefix.
_WHAT = {check: s.summary.removeprefix("SDC: ") for check, s in SUSPECTS.items()}


def suspect_rule(check: str, expr: str = "") -> AlertRule:
    """The critical rule that pages an unambiguous hardware suspect of ``check`` (``expr``: its PromQL)."""
    s = SUSPECTS[check]
    return AlertRule(s.alert, "critical", expr, s.summary, s.description, labels={**s.labels, "check": check})


def ambiguous_suspect_rule(check: str, expr: str = "") -> AlertRule:
    """The warning rule, with the same alert name and ``ambiguous="true"``, for a suspect of an ambiguous verdict."""
    s = SUSPECTS[check]
    return AlertRule(s.alert, "warning", expr, _AMBIGUOUS_SUMMARY.format(what=_WHAT[check]),
                     _AMBIGUOUS_DESCRIPTION.format(check=check),
                     labels={**s.labels, "check": check, **AMBIGUOUS_LABEL}, anchor=AMBIGUOUS_ANCHOR)


_TEMPLATE = re.compile(r"\{\{ \$(labels\.(\w+)|value)( \| humanizeDuration)? \}\}")


def render_template(template: str, labels: Mapping[str, str], value: str = "") -> str:
    """What Prometheus renders for the templates these rules use (``{{ $labels.x }}``, ``{{ $value }}``,
    ``{{ $value | humanizeDuration }}`` with ``value`` given already humanized)."""
    def sub(m: re.Match[str]) -> str:
        return value if m.group(1) == "value" else labels.get(m.group(2), "")
    return _TEMPLATE.sub(sub, template)


def suspect_alert(check: str, identity_labels: Mapping[str, object], service_name: str, *, ambiguous: bool = False,
                  runbook_base: str = RUNBOOK) -> dict[str, dict[str, str]]:
    """The labels and annotations of the critical alert the rules fire for a suspect rank of ``check``; with
    ``ambiguous``, of the warning they fire for a suspect of an ambiguous verdict (same alert name,
    ``severity="warning"``, ``ambiguous="true"``).

    ``identity_labels`` holds the rank's ``host_name``, ``rank``, ``local_rank`` and ``hw_id`` (other keys are
    ignored). Alertmanager identifies an alert by its labels, so an alert posted with these
    (``sdc_telemetry.sinks.pager``) and the rule's alert for the same rank are one alert, paged once.

    >>> suspect_alert("weights", {"host_name": "n7", "rank": 2, "local_rank": 2, "hw_id": "GPU-1"}, "llm")["labels"]
    ... # doctest: +NORMALIZE_WHITESPACE
    {'alertname': 'SDCWeightFingerprintMismatch', 'severity': 'critical', 'check': 'weights', 'service_name': 'llm',
     'host_name': 'n7', 'rank': '2', 'local_rank': '2', 'hw_id': 'GPU-1'}
    """
    if check not in SUSPECTS:
        raise ValueError(f"check must be one of {sorted(SUSPECTS)}, got {check!r}")
    missing = [k for k in RANK_LABELS if k != "service_name" and k not in identity_labels]
    if missing:
        raise ValueError(f"identity_labels lacks {missing} (has {sorted(identity_labels)})")
    if not service_name:
        raise ValueError("service_name must be a non-empty string (the job name the metrics carry)")
    rule = ambiguous_suspect_rule(check) if ambiguous else suspect_rule(check)
    ident = {"service_name": service_name, **{k: str(identity_labels[k]) for k in RANK_LABELS[1:]}}
    labels = {"alertname": rule.name, **rule.rule_labels(), **ident}
    annotations = {k: render_template(v, labels) for k, v in rule.annotations(runbook_base).items()}
    return {"labels": labels, "annotations": annotations}


