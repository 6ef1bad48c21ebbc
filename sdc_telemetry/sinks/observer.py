"""What the monitor tells the outside world: one ``StepReport`` per hook point, plain data. Telemetry implements
``Observer``; tests can record the reports.

Every method is called on the training thread and must be cheap: record a value, never block on I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sdc_telemetry.core.incident import Incident

__all__ = ["Observer", "StepReport", "ReplayDeltas", "RESULTS"]

# A check's outcome on this rank. ``error``: it tried and failed (a contained exception, an unfaithful replay);
# ``skipped``: it was due but could not run (a rank unmeasured, the step not replayable). Neither is ever a pass.
RESULTS = ("pass", "fail", "error", "skipped")


@dataclass(frozen=True)
class ReplayDeltas:
    """This rank's last replay audit: relative deltas of its recomputation of its partner's micro-batches
    (``origin_rank``: whose; this rank itself where it is alone in its numerics class; -1 not known)."""

    loss_delta: float
    grad_delta: float
    mismatch: bool
    origin_rank: int = -1


@dataclass(frozen=True)
class StepReport:
    """Everything one hook point found on this rank: the single input of telemetry.

    - ``step``: the training step the checks ran in.
    - ``counts_step``: an optimizer step completed (``sdc_steps_total``); False for on-demand checks
      (``verify_weights()``, ``certificate()``).
    - ``results``: check -> one of ``RESULTS``, for each check that was due at this point.
    - ``durations``: check -> seconds this rank spent on it (only checks that ran).
    - ``grad_norms``: phase (``local``, ``reduced``) -> this rank's gradient L2 norm, NaN/Inf when non-finite; only
      the phases that were measured.
    - ``replay``: this rank's audit deltas when a replay comparison ran.
    - ``weights_agree``: whether this rank's weights agree with the replicas' majority, when the weight check ran.
    - ``incidents``: incidents opened at this point (an episode's repeats are not reported again).
    - ``suspect_checks``: checks for which this rank is a hardware suspect in one of ``incidents``.
    - ``ambiguous_checks``: those of ``suspect_checks`` whose incident is ambiguous (``evidence["ambiguous"] is
      True``): latched in ``sdc_suspect_ambiguous`` instead of ``sdc_suspect``, warned and never paged.
    - ``errors``: components with a contained failure at this point (``sdc_internal_errors_total``).
    """

    step: int
    counts_step: bool = True
    results: dict[str, str] = field(default_factory=dict)
    durations: dict[str, float] = field(default_factory=dict)
    grad_norms: dict[str, float] = field(default_factory=dict)
    replay: ReplayDeltas | None = None
    weights_agree: bool | None = None
    incidents: tuple[Incident, ...] = ()
    suspect_checks: tuple[str, ...] = ()
    ambiguous_checks: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()


class Observer:
    """No-op base: subclasses override what they need."""

    def report(self, report: StepReport) -> None:
        """The outcome of one hook point on this rank."""

    def internal_error(self, component: str) -> None:
        """A part of the monitor failed and was contained outside a step's report (a background thread)."""

    def gpu_snapshot(self) -> dict[str, object]:
        """This rank's GPU counters now (JSON-serialisable), for the evidence of an incident naming this rank.
        Called on the training thread on the rare incident path only; empty when there is no GPU telemetry."""
        return {}

    def close(self) -> None:
        """Mark monitoring as ended (``sdc_monitor_closed`` = 1), stop background work; a second call is harmless."""
