"""Outlier triggers: a rank whose loss or local gradient norm jumps away from the other ranks and from its own recent
history gets its step replayed at once (a triggered audit), instead of waiting for the next scheduled audit.

Measuring stays on the device and in the step's one agreement: each rank contributes its loss and gradient norm as
quantized log2 values (MAX and MIN over the group give the spread between ranks) and its own jump against its recent
median (MAX over the group). Deciding is pure and uses agreed data only, so every rank triggers at the same step:
the spread between ranks must exceed its own recent median by a factor, and some rank must have jumped by that
factor against its own history. A transient fault that scales a rank's activations shows as both; a hard batch
moves one rank's loss too, and the replay then says data (the partner computes the same), never hardware.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

import torch

__all__ = ["OutlierTrigger", "quantize", "Q_SCALE", "NONE"]

Q_SCALE = 64          # quantization: 1/64 of a doubling
_OFFSET = 1 << 20     # keeps every quantized finite positive value > 0, so 0 can mean "no value"
NONE = 0
FACTOR_Q = 2 * Q_SCALE  # 4x: the spread over its median, and a rank's jump over its own median
WARMUP = 10             # decided steps of history before anything triggers
WINDOW = 20


def quantize(x: torch.Tensor) -> torch.Tensor:
    """round(64 * log2(x)) + offset for finite x > 0, else NONE; int64, on x's device, no host synchronisation."""
    x = x.detach().double()
    q = torch.round(torch.log2(x.clamp_min(1e-300)) * Q_SCALE).to(torch.int64) + _OFFSET
    return torch.where(torch.isfinite(x) & (x > 0), q, torch.zeros_like(q))


def quantize_host(x: float) -> int:
    return round(math.log2(x) * Q_SCALE) + _OFFSET if math.isfinite(x) and x > 0 else NONE


class OutlierTrigger:
    """Histories (the same on every rank for the agreed spreads; this rank's own for its values) and the rule."""

    def __init__(self) -> None:
        self._own: tuple[deque[int], deque[int]] = (deque(maxlen=WINDOW), deque(maxlen=WINDOW))  # loss, norm
        self._spread: tuple[deque[int], deque[int]] = (deque(maxlen=WINDOW), deque(maxlen=WINDOW))

    @property
    def warm(self) -> bool:
        return len(self._spread[1]) >= WARMUP

    def jump(self, loss_q: torch.Tensor, norm_q: torch.Tensor) -> torch.Tensor:
        """This rank's largest jump against its own recent medians (device int64; 0 before warm-up)."""
        out = torch.zeros((), dtype=torch.int64, device=norm_q.device)
        for q, own in zip((loss_q, norm_q), self._own, strict=True):
            if self.warm and len(own) >= WARMUP:
                med = int(statistics.median(own))
                out = torch.maximum(out, torch.where(q != NONE, q - med, torch.zeros_like(q)))
        return out

    def jumped(self, own: tuple[float, float]) -> bool:
        """This rank's (loss, norm) jumped by more than the trigger's factor against its own recent medians (or is
        not finite): the rank a late audit (deferred verdicts) treats as the anomaly, not as the control."""
        for value, hist in zip(own, self._own, strict=True):
            q = quantize_host(value)
            if not math.isfinite(value) or (q != NONE and len(hist) >= WARMUP
                                            and q - statistics.median(hist) > FACTOR_Q):
                return True
        return False

    def observe(self, high: Sequence[int], low: Sequence[int], fields: tuple[int, int, int],
                own: tuple[float, float]) -> bool:
        """Whether this step triggers (from agreed data), then fold the step into the histories.
        ``fields``: the status-vector indices of (loss, norm, jump); ``own``: this rank's (loss, norm)."""
        loss_f, norm_f, jump_f = fields
        spreads = [high[f] - low[f] if low[f] != NONE else None for f in (loss_f, norm_f)]
        trigger = self.warm and high[jump_f] > FACTOR_Q and any(
            s is not None and len(hist) >= WARMUP and s - statistics.median(hist) > FACTOR_Q
            for s, hist in zip(spreads, self._spread, strict=True))
        if not trigger:  # an outlier step is kept out of the medians it is judged against
            for s, hist in zip(spreads, self._spread, strict=True):
                if s is not None:
                    hist.append(s)
            for value, hist in zip(own, self._own, strict=True):
                q = quantize_host(value)
                if q != NONE:
                    hist.append(q)
        return trigger
