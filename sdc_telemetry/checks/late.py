"""Late audits (``verdicts="deferred"``): an anomaly read one step late is replayed then, on today's weights.

When a step's verdict is read one step later, the step's update has already moved the weights, so a partner
recomputing the origin's micro-batch cannot reproduce its recorded bits. What it can reproduce is the anomaly: a
non-finite result, or a loss or gradient norm far from the rank's usual. The protocol (``ReplayCheck.late_run``):

1. Every rank reruns its own record of that step on today's weights. The ranks that were healthy then are the
   control: how far one update moved their loss and gradient norm is the ``band`` (a MAX over them), and they show
   that today's weights still compute finite values (they do not after a non-finite update was applied).
2. Each anomalous origin's replayer recomputes the origin's record on today's weights and compares it with the
   recorded values: the anomaly reproduced (non-finite alike; finite values within the band plus a margin) is the
   data (verdict ``data``); gone (at least twice the band plus half a doubling away, or finite where the origin was
   not) is the origin's hardware, ``transient`` when the origin's own rerun today agrees with its replayer's, else
   ``persistent`` (unambiguous only when a referee agrees with the replayer).
3. Anything else is undecided: an ambiguous warning, never a page naming hardware.

Distances are in doublings (``|log2(a / b)|``) of a micro-batch loss sum and a gradient norm, the scale of the
outlier trigger (which fires at 2 doublings); everything here is pure and unit-tested.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["REPRODUCED", "GONE", "UNCLEAR", "MARGIN", "MAX_BAND", "LateResult", "summary", "distance", "classify",
           "decide"]

REPRODUCED, GONE, UNCLEAR = 0, 1, 2
MARGIN = 0.25    # doublings a reproduced anomaly may move beyond the band (the update fitted that batch a little more)
MAX_BAND = 0.5   # one update moved healthy ranks by more than this: a late replay cannot tell data from hardware


@dataclass
class LateResult:
    """What a late audit found: ``verdict`` is ``data``, ``hardware``, ``undecided`` or ``error``."""

    verdict: str
    suspects: tuple[int, ...] = ()
    anomalous: tuple[int, ...] = ()
    evidence: dict[str, Any] = field(default_factory=dict)


def summary(losses: Sequence[float], scales: Sequence[float], norms: Sequence[float]) -> tuple[float, float]:
    """(the step's loss as the monitor records it, the local gradient's norm) from per-micro-batch losses and scales
    and per-parameter norms."""
    loss = math.fsum(a * s for a, s in zip(losses, scales, strict=True))
    norm = math.sqrt(math.fsum(n * n for n in norms)) if all(math.isfinite(n) for n in norms) else math.nan
    return loss, norm


def _doublings(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if a == 0.0 or b == 0.0 or (a < 0) != (b < 0):
        return math.inf
    return abs(math.log2(abs(a) / abs(b)))


def distance(recorded: tuple[float, float], now: tuple[float, float]) -> float:
    """How far ``now`` is from ``recorded`` in doublings: infinite when one is finite where the other is not; over
    the finite values alone when both are non-finite alike (a NaN batch is NaN on both sides: distance 0)."""
    out = 0.0
    for a, b in zip(recorded, now, strict=True):
        if math.isfinite(a) != math.isfinite(b):
            return math.inf
        if math.isfinite(a):
            out = max(out, _doublings(a, b))
    return out


def classify(dist: float, band: float) -> int:
    """REPRODUCED, GONE or UNCLEAR for a replayer's distance to the recorded anomaly, given the healthy ranks' band."""
    if dist <= band + MARGIN:
        return REPRODUCED
    if dist >= 2 * band + 2 * MARGIN:
        return GONE
    return UNCLEAR


def decide(anomalous: Sequence[int], outcome: dict[int, tuple[int, bool, float]], referee: dict[int, bool],
           band: float, hosts: Sequence[str], ranks: Sequence[int]) -> LateResult:
    """The late verdict from gathered data, keyed by positions in the group (``ranks[p]`` names them). ``outcome[o]``:
    the class, whether the origin's rerun today agrees with its replayer's, and the distance, for each anomalous
    origin; ``referee[o]``: a second replayer also disagrees with the origin's rerun today (asked for persistent
    ones only)."""
    named = tuple(ranks[o] for o in anomalous)
    base = {"band_doublings": round(band, 4),
            "distance_doublings": {str(ranks[o]): round(d, 4) if math.isfinite(d) else "inf"
                                   for o, (_, _, d) in sorted(outcome.items())[:16]}}
    if any(o not in outcome for o in anomalous):
        return LateResult("undecided", anomalous=named, evidence={
            **base, "reason": "an anomalous rank's record was not recomputed by a partner"})
    unclear = [o for o in anomalous if outcome[o][0] == UNCLEAR]
    if unclear:
        return LateResult("undecided", anomalous=named, evidence={
            **base, "reason": "recomputed on weights one update later, the anomaly neither reproduced nor vanished "
                              "clearly (between the healthy ranks' band and twice it)"})
    gone = [o for o in anomalous if outcome[o][0] == GONE]
    if not gone:
        return LateResult("data", anomalous=named, evidence=base)
    persistent = {o for o in gone if not outcome[o][1]}
    ambiguous = any(not referee.get(o, False) for o in persistent)
    reason = ("a partner recomputing the same micro-batch one update later does not reproduce the anomaly, while "
              "the ranks that were healthy moved by less than the band: this rank's computation made it")
    if len(gone) > 1 and len({hosts[o] for o in gone}) > 1 and not ambiguous:
        ambiguous = True
        reason += "; several ranks on several hosts: which host computed it wrongly is not known"
    elif ambiguous:
        reason += "; it still disagrees with its partner today and no referee confirmed which of the two is wrong"
    return LateResult("hardware", suspects=tuple(ranks[o] for o in gone), anomalous=named, evidence={
        **base, "verdict": "persistent" if persistent else "transient", "ambiguous": ambiguous, "reason": reason,
        "reproduced_own_result": {str(ranks[o]): o not in persistent for o in gone}})
