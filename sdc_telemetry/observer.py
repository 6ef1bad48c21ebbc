"""What the monitor tells the outside world about each check. Telemetry implements it; tests can record it.

Every method is called on the training thread and must be cheap: record a value, never do I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .response import Incident

__all__ = ["Observer"]


class Observer:
    """No-op base: subclasses override what they need."""

    def step_done(self, step: int) -> None:
        """An optimizer step finished (``sdc_steps_total``)."""

    def check_done(self, check: str, passed: bool, duration_s: float) -> None:
        """A check ran to a verdict on this rank."""

    def grad_measured(self, phase: str, norm: float, nonfinite: bool) -> None:
        """Gradient norm of this rank for ``phase`` ("local" before all-reduce, "reduced" after)."""

    def replay_measured(self, origin_rank: int, loss_delta: float, grad_delta: float, mismatch: bool) -> None:
        """This rank replayed ``origin_rank``'s micro-batches; relative deltas against what the origin recorded."""

    def weights_measured(self, agrees: bool) -> None:
        """This rank's weights agree (or not) with the replicas' majority."""

    def incident(self, incident: Incident, is_suspect: bool) -> None:
        """An incident was decided; ``is_suspect`` when this rank is among its suspects."""

    def internal_error(self, component: str) -> None:
        """A part of the monitor failed and was contained."""

    def gpu_snapshot(self) -> dict[str, object]:
        """This rank's GPU counters now (JSON-serialisable), for the evidence of an incident naming this rank.
        Called on the training thread on the rare incident path only; empty when there is no GPU telemetry."""
        return {}

    def close(self) -> None:
        """Stop background work; a second call is harmless."""
