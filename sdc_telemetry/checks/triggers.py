"""Triggered audits: replay an anomalous step at once, on partners, to tell data from hardware.

Two triggers, both decided from the step's agreed status vector (so every rank triggers at the same step): a
minority of ranks with non-finite local gradients (``nonfinite_audit``), and a rank whose loss or local gradient
norm jumped away from the other ranks and its own history (``outlier_audit``, see ``checks/outliers.py``). The
replay (``ReplayCheck.run`` with no recorded fingerprint: losses and per-parameter norms are compared, non-finite
values alike on both sides counting as agreement) then says which it was: the partner computing the same
micro-batch gets the same result (data: a NaN in the batch, a heavy batch, an overflow it provokes; a numerics
event with ``evidence["verdict"] == "data"``, never a suspect), or it does not (hardware: the replay's attribution,
transient or persistent, in the incident of the check that triggered the audit).

With ``verdicts="deferred"`` the same triggers are read one step late, after the step's update moved the weights:
``late_nonfinite`` and ``late_outlier`` replay the step then (``ReplayCheck.late_run``, ``checks/late.py``: the
anomaly is compared, not the bits), and what that cannot decide is an ambiguous warning, never a hardware page.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from sdc_telemetry.checks.late import LateResult
from sdc_telemetry.checks.replay import ReplayCheck
from sdc_telemetry.core import status as S
from sdc_telemetry.core.findings import Finding

__all__ = ["TriggeredAudits"]

_KEEP = ("mismatching_pairs", "mismatching_pair_count", "reproduced_own_result", "reason", "mode")


class TriggeredAudits:
    """``warn(key, text)`` says a failure once."""

    def __init__(self, replay: ReplayCheck, rank: int, warn: Callable[[str, str], None]) -> None:
        self._replay = replay
        self._rank = rank
        self._warn = warn

    @staticmethod
    def replayable(high: Sequence[int], low: Sequence[int]) -> bool:
        """Every rank can replay the step now (agreed data)."""
        return (bool(low[S.LOCAL_MEASURED]) and bool(low[S.REPLAYABLE]) and not high[S.REPEATED]
                and not high[S.ERROR])

    def nonfinite_minority(self, high: Sequence[int], low: Sequence[int]) -> bool:
        """Some ranks, not all, have non-finite local gradients at a step every rank can replay."""
        return self.replayable(high, low) and bool(high[S.LOCAL_NONFINITE]) and not low[S.LOCAL_NONFINITE]

    def _failed(self, step: int, extra: str = "") -> bool:
        if not self._replay.errors:
            return False
        self._warn("triggered-error", f"step {step}: the triggered audit failed on ranks {self._replay.errors[:16]}: "
                   f"{self._replay.error_text}{extra}")
        return True

    def nonfinite_audit(self, step: int, norms: torch.Tensor, finding: Finding | None) -> Finding | None:
        """Partners recompute the non-finite ranks' micro-batches: the same non-finite result is data, a finite one
        names the rank (transient, or persistent when it reproduces its own result and a second partner
        confirms it). A failed audit leaves the gradient verdict as it was, with the failure in its evidence."""
        replayed, _ = self._replay.run(None, norms)
        if self._failed(step, " (the gradient verdict stands without it)"):
            if finding is None:
                return None
            return Finding(finding.check, finding.suspect_ranks,
                           {**finding.evidence, "triggered_audit": {"error": self._replay.error_text[:200]}})
        base = dict(finding.evidence) if finding is not None else {}
        audit = {"trigger": "nonfinite_minority", "replayed": True}
        if replayed is None:
            return Finding("grad_local", (), {
                **{k: v for k, v in base.items() if k in ("nonfinite_ranks", "ranks")}, "verdict": "data",
                "reason": "a partner recomputing the same micro-batch gets the same non-finite result: the data (a "
                          "bad sample, an overflow it provokes), not the hardware",
                "triggered_audit": {**audit, "mismatching_pairs": []}})
        ev = replayed.evidence
        return Finding("grad_local", replayed.suspect_ranks, {
            **{k: v for k, v in base.items() if k not in ("verdict", "ambiguous", "reason")},
            "verdict": ev.get("verdict", "transient"), "ambiguous": bool(ev.get("ambiguous", False)),
            "reason": "a partner recomputing the same micro-batch gets finite gradients: this rank's computation "
                      "made the non-finite values",
            "triggered_audit": {**audit, **{k: ev[k] for k in _KEEP if k in ev}}})

    def outlier_audit(self, step: int, norms: torch.Tensor) -> tuple[Finding | None, str]:
        """Partners replay an outlier step: reproduced is data (a numerics event of ``replay``), not reproduced
        names the rank. Returns the finding and this rank's replay result."""
        replayed, _ = self._replay.run(None, norms)
        if self._failed(step):
            return None, "error" if self._rank in self._replay.errors else "skipped"
        audit = {"trigger": "outlier", "replayed": True}
        if replayed is None:
            return Finding("replay", (), {"verdict": "data", "triggered_audit": audit,
                                          "reason": "a rank's loss or gradient norm was an outlier and a partner "
                                                    "recomputing its micro-batch got the same: the data, not the "
                                                    "hardware"}), "pass"
        return Finding("replay", replayed.suspect_ranks, {**replayed.evidence, "triggered_audit": audit}), "fail"

    # -- one step late (verdicts="deferred") -----------------------------------------------------------------------

    def _late(self, step: int, trigger: str, anomalous: bool, norms: torch.Tensor
              ) -> tuple[LateResult, dict[str, Any]]:
        result = self._replay.late_run(step, anomalous, norms)
        if result.verdict == "error":
            self._warn("late-error", f"step {step}: the late triggered audit failed: {result.evidence['reason']}"
                       + (f" (here: {self._replay.error_text})" if self._replay.error_text else ""))
        audit = {"trigger": trigger, "replayed": result.verdict in ("data", "hardware"), "late": True,
                 "weights": "one update later", **{k: v for k, v in result.evidence.items() if k in (
                     "band_doublings", "distance_doublings", "reason", "mismatching_pairs")}}
        return result, audit

    def late_nonfinite(self, step: int, anomalous: bool, norms: torch.Tensor, finding: Finding | None
                       ) -> Finding | None:
        """A minority of ranks was non-finite at ``step``, read one step late: partners recompute those ranks'
        micro-batches on today's weights. The same non-finite result is data; finite is the rank's hardware; a step
        that cannot be replayed (its non-finite update was applied, or the rerun failed) leaves the gradient verdict
        standing, ambiguous: a warning, never a page."""
        result, audit = self._late(step, "nonfinite_minority", anomalous, norms)
        base = dict(finding.evidence) if finding is not None else {}
        if result.verdict == "data":
            return Finding("grad_local", (), {
                **{k: v for k, v in base.items() if k in ("nonfinite_ranks", "ranks")}, "verdict": "data",
                "reason": "a partner recomputing the same micro-batch one update later gets the same non-finite "
                          "result: the data (a bad sample, an overflow it provokes), not the hardware",
                "triggered_audit": audit})
        if result.verdict == "hardware":
            ev = result.evidence
            reason = ("a partner recomputing the same micro-batch one update later gets finite gradients: this "
                      "rank's computation made the non-finite values")
            if ev["ambiguous"]:
                reason += " (" + ev["reason"].rpartition("; ")[2] + ")"
            return Finding("grad_local", result.suspects, {
                **{k: v for k, v in base.items() if k not in ("verdict", "ambiguous", "reason")},
                "verdict": ev["verdict"], "ambiguous": ev["ambiguous"], "reason": reason,
                "reproduced_own_result": ev["reproduced_own_result"], "triggered_audit": audit})
        if finding is None or not finding.suspect_ranks:
            return finding  # a numerics event (an overflow a GradScaler expects) stays one
        return Finding(finding.check, finding.suspect_ranks, {
            **base, "ambiguous": True, "triggered_audit": audit,
            "reason": "the late replay could not decide data from hardware: " + str(audit.get("reason", ""))})

    def late_outlier(self, step: int, anomalous: bool, norms: torch.Tensor) -> tuple[Finding | None, str]:
        """A rank's loss or gradient norm was an outlier at ``step``, read one step late: partners recompute its
        micro-batches on today's weights. Reproduced is data, gone is hardware, anything else an ambiguous warning
        naming the outlier ranks. Returns the finding and this rank's replay result."""
        result, audit = self._late(step, "outlier", anomalous, norms)
        if result.verdict == "error":
            return None, "error" if self._rank in self._replay.errors else "skipped"
        if result.verdict == "data":
            return Finding("replay", (), {"verdict": "data", "triggered_audit": audit,
                                          "reason": "a rank's loss or gradient norm was an outlier and a partner "
                                                    "recomputing its micro-batch one update later got the same: the "
                                                    "data, not the hardware"}), "pass"
        if result.verdict == "hardware":
            ev = result.evidence
            return Finding("replay", result.suspects, {
                "verdict": ev["verdict"], "ambiguous": ev["ambiguous"], "reason": ev["reason"],
                "reproduced_own_result": ev["reproduced_own_result"], "triggered_audit": audit}), "fail"
        if not result.anomalous:
            return None, "skipped"
        return Finding("replay", result.anomalous, {
            "verdict": "undecided", "ambiguous": True, "triggered_audit": audit,
            "reason": "the late replay could not decide data from hardware: " + str(audit.get("reason", ""))}), "fail"
