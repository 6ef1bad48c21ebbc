"""Calibrating tolerance mode's thresholds (``tolerance="auto"``) from healthy audits, at a fixed size per rank.

What a replay compares is a vector of quantities: the loss and the whole gradient's norms, each parameter's gradient
norm, and each parameter's block sketch (``checks/sketch.py``). Each has its own threshold: a parameter whose
gradient cancels to rounding (a bias before a LayerNorm) measures large relative noise, and one threshold for all,
set by the noisiest, hid a persistent fault of 1e-4 relative in every audit of the project's campaign.

Two sources, each reduced over the group at a fixed size at any world size, never a gather: a rank rerunning its own
step (the noise floor of non-deterministic kernels: the median rank's, from a summed histogram of one delta per rank,
so one faulty rank cannot raise it; one floor per kind of quantity, the loss and the norms apart from the
sketches, whose heavy-tailed rerun deltas would otherwise floor the norms' thresholds far above what a norm's noise
is: that floor, 3x a sketch's rerun noise, hid persistent faults of 1e-4), and two different ranks computing the same
micro-batch in a healthy audit (ranks whose kernels consistently differ, as when autotuning picked another
algorithm): per quantity, the largest healthy delta over the ranks, an exact MAX that rides in the audit's own
agreement (one int64 per quantity: the model's size, not the world's), at every scheduled audit. Each source keeps a
window of recent audits; a threshold is a factor above its quantity's largest delta in the window (``CROSS_FACTOR``
for norms, ``SKETCH_FACTOR`` for sketches, whose deltas are heavy-tailed), capped so that noise cannot blind the
check for good.

Why norms: a fault in a module's arithmetic (an output scaled by 1 + r) scales its parameters' gradients coherently,
so their norms move by about r; kernel noise of relative size e, spread over the elements, moves a norm by much less
than e. Measured on the campaign's models (a rank whose kernels are 1e-5 off, noise 1e-6 everywhere): the largest
per-parameter norm change of the deviating rank 3e-6 to 2e-5, of a 1e-4 fault 7e-5 to 2e-4.

An audit is judged against the thresholds measured before it, and only ranks whose comparison passed contribute their
deltas: a fault present at a calibration audit can neither hide itself nor raise the threshold. Until a quantity has
been calibrated at ``_SETTLED`` healthy cross-rank audits its threshold is at least 1e-3 (room for a rank whose
kernels differ: a few audits are too few to know how far they move it).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

__all__ = ["Calibration", "histogram", "noise_median", "AUTO_FLOOR", "CROSS_FACTOR", "SKETCH_FACTOR"]

AUTO_FLOOR = 1e-5      # relative tolerance when reruns are bitwise identical
_AUTO_FACTOR = 3.0     # thresholds >= factor x the rerun noise floor (the median rank's, a bucket's upper edge)
CROSS_FACTOR = 4.0     # threshold of a compared quantity = factor x its largest healthy cross-rank delta
SKETCH_FACTOR = 10.0   # block sketches: a decade (their deltas are heavy-tailed where a block's terms cancel)
_AUTO_CAP = 0.05       # a calibrated threshold never rises above this
_INITIAL = 1e-3        # until a healthy cross-rank audit was measured: room for ranks whose kernels differ
_WINDOW = 10           # calibrations each source is taken over (cross-rank: the last audits)
_SETTLED = 5           # cross-rank calibrations of a quantity before its threshold may drop below the initial one


class Calibration:
    """Thresholds, one per compared quantity (the loss and the whole gradient's norms, each parameter's gradient
    norm, then each parameter's block sketch), and what they were measured from. ``size`` quantities: fixed by the
    model, never by the world size."""

    def __init__(self, size: int = 1, factors: Sequence[float] | None = None,
                 kinds: Sequence[int] | None = None) -> None:
        self.size = max(1, size)
        self.factors = list(factors) if factors is not None else [CROSS_FACTOR] * self.size
        if len(self.factors) != self.size:
            raise ValueError(f"{self.size} quantities need as many factors, got {len(self.factors)}")
        # Each quantity's kind (0: the loss and the norms, 1: the block sketches): a kind's rerun noise floor bounds
        # its own quantities only (the sketches' heavy-tailed rerun deltas must not floor the norms' thresholds).
        self.kinds = list(kinds) if kinds is not None else [0] * self.size
        if len(self.kinds) != self.size:
            raise ValueError(f"{self.size} quantities need as many kinds, got {len(self.kinds)}")
        self._floors: dict[int, deque[float]] = {k: deque(maxlen=_WINDOW) for k in set(self.kinds)}
        self._cross: deque[list[float]] = deque(maxlen=_WINDOW)
        self.thresholds = [_INITIAL] * self.size
        self.noise_floor = 0.0

    @property
    def tolerance(self) -> float:
        """The loosest threshold (what a single-number comparison, a triggered audit's, uses)."""
        return max(self.thresholds)

    def rerun(self, counts: Sequence[int], kind: int | None = None) -> bool:
        """Fold in a summed histogram of same-rank rerun deltas, of the quantities of ``kind`` (None: of every
        quantity); False when no rank contributed."""
        floor = noise_median(counts)
        if floor is None:
            return False
        for k, floors in self._floors.items():
            if kind is None or k == kind:
                floors.append(floor)
        self._update()
        return True

    def across(self, largest: float | Sequence[float | None] | None) -> bool:
        """Fold in the largest healthy cross-rank delta of an audit, per quantity (a single number applies to every
        quantity; None, a non-finite or a negative value: that quantity has no data and keeps its window); False when
        nothing was folded in."""
        values = [largest] * self.size if largest is None or isinstance(largest, (int, float)) else list(largest)
        if len(values) != self.size:
            raise ValueError(f"calibration of {self.size} quantities got {len(values)} deltas")
        usable = [v if v is not None and math.isfinite(v) and v >= 0 else math.nan for v in values]
        if all(math.isnan(v) for v in usable):
            return False
        self._cross.append(usable)
        self._update()
        return True

    def _update(self) -> None:
        measured = [v for row in self._cross for v in row if not math.isnan(v)]
        self.noise_floor = max([*(v for floors in self._floors.values() for v in floors), *measured], default=0.0)
        lows = {k: max(AUTO_FLOOR, _AUTO_FACTOR * max(floors, default=0.0)) for k, floors in self._floors.items()}
        out = []
        for i in range(self.size):
            low = lows[self.kinds[i]]
            seen = [row[i] for row in self._cross if not math.isnan(row[i])]
            # Until a quantity has been calibrated at _SETTLED audits its threshold stays at least the initial one:
            # one or two audits are too few to know how far a deviating rank's kernels move it.
            across = self.factors[i] * max(seen) if seen else _INITIAL
            if len(seen) < _SETTLED:
                across = max(across, _INITIAL)
            out.append(min(max(low, across), _AUTO_CAP))
        self.thresholds = out


# Rerun-noise histogram: bucket 0 holds exact reruns (delta 0), buckets 1.._BINS cover 1e-20..1 in half decades,
# the last one everything larger or non-finite. Ranks that could not rerun contribute nothing.
_BINS = 40


def histogram(delta: float) -> list[int]:
    counts = [0] * (_BINS + 2)
    if math.isnan(delta):
        return counts
    if delta <= 0.0:
        counts[0] = 1
    elif not math.isfinite(delta) or delta >= 1.0:
        counts[-1] = 1
    else:
        counts[1 + min(_BINS - 1, max(0, int((math.log10(delta) + 20) * 2)))] = 1
    return counts


def noise_median(counts: Sequence[int]) -> float | None:
    """The median rank's rerun noise from a summed ``histogram``, as the upper edge of its bucket (None: no data).

    >>> noise_median([3, 0] + [0] * 40)
    0.0
    """
    total = sum(counts)
    if total == 0:
        return None
    seen = 0
    for i, c in enumerate(counts):
        seen += c
        if 2 * seen > total:
            if i == 0:
                return 0.0
            if i == len(counts) - 1:
                return math.inf
            return float(10 ** ((i) / 2 - 20))
    return math.inf
