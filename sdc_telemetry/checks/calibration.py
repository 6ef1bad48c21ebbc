"""Calibrating tolerance mode's threshold (``tolerance="auto"``) from healthy audits, at a fixed size per rank.

Two sources, each reduced over the group at a fixed size at any world size, never a gather: a rank rerunning its own
step (the noise floor of non-deterministic kernels: the median rank's, from a summed histogram of one delta per rank,
so one faulty rank cannot raise it), and two different ranks computing the same micro-batch in a healthy audit
(ranks whose kernels consistently differ, as when autotuning picked another algorithm: the largest healthy delta, an
exact MAX that rides in the audit's own agreement, so such a rank is never named). Each source keeps a window of
recent calibrations; the threshold is a factor above the larger, capped so that noise cannot blind the check for good.

A rank whose kernels differ measures a delta that moves from step to step: on the campaign's MLP, 2.9e-5 at the
first audit and 1.8e-4 at the second, for kernels 1e-5 off (the sketches amplify a relative difference of the
arithmetic about tenfold, more where a gradient's terms cancel). So the cross-rank threshold is a decade above the
largest healthy delta, and it is measured at each of the first ``WARMUP`` audits, then with the rerun calibration.

An audit is judged against the threshold measured before it, and only ranks whose comparison passed contribute their
cross-rank delta: a fault present at a calibration audit can neither hide itself nor raise the threshold. Until the
first healthy cross-rank audit the threshold is 1e-3 (a first threshold of 1e-4 named a 1e-5-deviating rank at the
first audit).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

__all__ = ["Calibration", "histogram", "noise_median", "AUTO_FLOOR", "WARMUP"]

AUTO_FLOOR = 1e-5      # relative tolerance when reruns are bitwise identical
_AUTO_FACTOR = 10.0    # threshold = factor x the rerun noise floor
_CROSS_FACTOR = 10.0   # threshold = factor x the largest healthy cross-rank delta
_AUTO_CAP = 0.05       # a calibrated threshold never rises above this
_INITIAL = 1e-3        # until a healthy cross-rank audit was measured: room for ranks whose kernels differ
_WINDOW = 5            # calibrations each source is taken over
WARMUP = 5             # the first audits, each of which measures the cross-rank delta


class Calibration:
    """The threshold and what it was measured from."""

    def __init__(self) -> None:
        self._reruns: deque[float] = deque(maxlen=_WINDOW)
        self._cross: deque[float] = deque(maxlen=_WINDOW)
        self.tolerance = _INITIAL
        self.noise_floor = 0.0

    def rerun(self, counts: Sequence[int]) -> bool:
        """Fold in a summed histogram of same-rank rerun deltas; False when no rank contributed."""
        floor = noise_median(counts)
        if floor is None:
            return False
        self._reruns.append(floor)
        self._update()
        return True

    def across(self, largest: float | None) -> bool:
        """Fold in the largest healthy cross-rank delta of an audit (None: no rank contributed; a non-finite or
        negative value is refused as no data); False when nothing was folded in."""
        if largest is None or not math.isfinite(largest) or largest < 0:
            return False
        self._cross.append(largest)
        self._update()
        return True

    def _update(self) -> None:
        self.noise_floor = max([*self._reruns, *self._cross], default=0.0)
        across = _CROSS_FACTOR * max(self._cross) if self._cross else _INITIAL
        self.tolerance = min(max(AUTO_FLOOR, _AUTO_FACTOR * max(self._reruns, default=0.0), across), _AUTO_CAP)


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
