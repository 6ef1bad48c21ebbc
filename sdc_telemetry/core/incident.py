"""Incidents: one episode of one check, identical on every rank, and the exception that stops every rank."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sdc_telemetry.core.identity import RankIdentity

__all__ = ["Incident", "SDCDetected", "EXIT_SDC", "CAUSAL_ORDER", "root_cause"]


@dataclass
class Incident:
    """One episode of one check: opened at ``step``, identical on every rank.

    ``evidence`` is JSON-serialisable and bounded in size: the fingerprints or values that disagreed, and the check's
    reasoning (``ambiguous``, ``verdict``...). ``evidence["verdict"] == "numerics"`` with no suspects is a numerics
    event (every rank non-finite at once: overflow, a bad batch, divergence), never a hardware suspect.

    One fault is one incident: while later steps find the same check naming the same suspects, the episode is
    updated (``count`` findings so far, ``last_step``) instead of a new incident being opened.
    """

    step: int
    check: str
    suspect_ranks: tuple[int, ...]
    suspects: tuple[RankIdentity, ...]
    evidence: dict[str, Any] = field(default_factory=dict)
    time_unix: float = field(default_factory=time.time)
    count: int = 1
    last_step: int = -1

    def __post_init__(self) -> None:
        if self.last_step < 0:
            self.last_step = self.step

    @property
    def numerics(self) -> bool:
        """Every rank non-finite at once: recorded and counted, never raised or paged as a node."""
        return not self.suspect_ranks and self.evidence.get("verdict") in ("numerics", "data")

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "check": self.check,
            "suspect_ranks": list(self.suspect_ranks),
            "suspects": [s.to_dict() for s in self.suspects],
            "evidence": self.evidence,
            "time_unix": self.time_unix,
            "count": self.count,
            "last_step": self.last_step,
        }

    def describe(self) -> str:
        """One log line naming check, step, host, rank and GPU of every suspect."""
        who = "; ".join(f"host={s.host_name} rank={s.rank} local_rank={s.local_rank} gpu={s.hw_id}"
                        for s in self.suspects)
        extra = " (ambiguous)" if self.evidence.get("ambiguous") else ""
        verdict = self.evidence.get("verdict")
        what = f" verdict={verdict}" if verdict else ""
        if self.numerics and verdict == "data":
            return (f"SDC numerics event: check={self.check} step={self.step} verdict=data: a partner recomputing the "
                    "anomalous rank's micro-batch got the same result (the data, not the hardware; nobody named)")
        if self.numerics:
            return (f"SDC numerics event: check={self.check} step={self.step}: non-finite gradients on every rank "
                    "(overflow, a bad batch or divergence; not a hardware suspect)")
        return f"SDC incident: check={self.check} step={self.step}{what} suspects{extra}: {who}"


# The process exit code of a rank that stopped on an SDC incident (sysexits' EX_TEMPFAIL: "try again later"), so
# that torchrun, Slurm and Kubernetes can tell a stop on purpose from a crash and restart without the node.
EXIT_SDC = 75


class SDCDetected(RuntimeError):
    """Raised on every rank at the same step when ``on_suspect="raise"`` (at the end of the step's
    ``with monitor.step()`` block, before ``optimizer.step()``); ``.incident`` says what and who.

    Stop recipe, for any loop shape::

        with sdc.exit_on_sdc(monitor):      # SDCDetected: close without collectives, exit 75 on every rank
            train()

    ``.incident`` is the root cause in causal order (``root_cause``); ``.incidents`` lists every incident of the
    step that raised.
    """

    exit_code = EXIT_SDC

    def __init__(self, incident: Incident, incidents: Sequence[Incident] | None = None) -> None:
        super().__init__(incident.describe())
        self.incident = incident  # the root cause, in causal order (see ``root_cause``)
        self.incidents: list[Incident] = list(incidents) if incidents is not None else [incident]


# What can cause what within one step: corrupted weights break the step's gradients, a non-finite local gradient
# spreads through the reduction, and every one of them makes the replay disagree.
CAUSAL_ORDER = ("update", "weights", "grad_local", "grad_reduced", "replay")


def root_cause(incidents: Sequence[Incident]) -> list[Incident]:
    """``incidents`` in causal order: the first is the root cause of the others found at the same step."""
    rank = {check: i for i, check in enumerate(CAUSAL_ORDER)}
    return sorted(incidents, key=lambda i: rank.get(i.check, len(rank)))
