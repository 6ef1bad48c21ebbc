"""Gradient health: ``grad_local`` (in the DDP comm hook, before all-reduce) and ``grad_reduced`` (before the update).

Measuring: the comm hook records, per parameter, the fingerprint and the norm of the local gradient slice of each
bucket (one pass each, no host sync). Before the optimizer step the reduced gradients' norms are taken. One
all-gather of a small status row per rank then gives every rank the same picture, and ``decide`` turns it into the
same verdict everywhere.

Non-finite test: a gradient holds a NaN or an Inf exactly when its L2 norm is not finite, except for a finite
gradient whose squared norm overflows float32 (norm > 1.8e19), which is reported as non-finite too: such a gradient
would itself wreck the step.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..fingerprint import fingerprint
from . import Finding

__all__ = ["GradRecord", "CommHookState", "comm_hook", "reduced_norms", "StatusRow", "decide"]

GradBucket = Any  # torch.distributed.GradBucket (a pybind class the type checker cannot see)
CommHook = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]


class GradRecord:
    """Local-gradient measurements of the current step, filled bucket by bucket by the comm hook.

    Every step: one norm per bucket (one pass over the flat bucket: the non-finite test and the local norm). On
    replay audit steps only (``detail``): also the per-parameter fingerprints and norms a replay compares against.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], device: torch.device) -> None:
        self._index = {id(p): i for i, p in enumerate(params)}
        self._device = device
        self.fp = torch.zeros(len(params), dtype=torch.int64, device=device)
        self.norms = torch.zeros(len(params), dtype=torch.float32, device=device)
        self.bucket_norms: list[torch.Tensor] = []
        self.buckets = 0
        self.failed = False
        self.repeated = False
        self.detail = False
        self._detailed = False
        self._seen: set[int] = set()

    def reset(self, detail: bool = False) -> None:
        if self._detailed:
            self.fp.zero_()
            self.norms.zero_()
            self._detailed = False
        self.bucket_norms = []
        self.buckets = 0
        self.failed = False
        self.repeated = False
        self.detail = detail
        self._seen.clear()

    def measure(self, bucket: GradBucket) -> None:
        if bucket.index() in self._seen:
            # A second all-reduce of the same bucket in one step (accumulation without no_sync()): the bucket now
            # holds an earlier reduced gradient plus a local one, which no replay can reproduce.
            self.repeated = True
        self._seen.add(bucket.index())
        self.bucket_norms.append(torch.linalg.vector_norm(bucket.buffer()).float().reshape(1))
        self.buckets += 1
        if self.detail:
            self._measure_parameters(bucket)

    def _measure_parameters(self, bucket: GradBucket) -> None:
        self._detailed = True
        # Parameters frozen after DDP was built still sit in its buckets: they are not checked.
        pairs = [(self._index[id(p)], g) for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)
                 if id(p) in self._index]
        if not pairs:
            return
        grads = [g for _, g in pairs]
        key = tuple(i for i, _ in pairs)
        idx = _index_tensor(key, self._device)
        self.fp.index_copy_(0, idx, fingerprint(grads).squeeze(1))
        self.norms.index_copy_(0, idx, torch.stack(torch._foreach_norm(grads)).float())

    def total_fp(self) -> torch.Tensor:
        """Sum of the per-parameter fingerprints (order-independent); meaningful on ``detail`` steps."""
        return self.fp.sum()

    def total_norm(self) -> torch.Tensor:
        norm: torch.Tensor = torch.linalg.vector_norm(torch.cat(self.bucket_norms)) if self.bucket_norms \
            else torch.tensor(math.nan, device=self._device)
        return norm


@dataclass
class CommHookState:
    """State handed to DDP with the hook: what to measure into and which all-reduce to wrap."""

    record: GradRecord
    inner_hook: CommHook
    inner_state: Any
    enabled: bool = True


def comm_hook(state: CommHookState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Measure the bucket's local gradients, then run the wrapped all-reduce hook (the user's or DDP's default)."""
    if state.enabled:
        try:
            state.record.measure(bucket)
        except Exception:  # noqa: BLE001 - reported through the status row; the all-reduce must still happen
            state.record.failed = True
    return state.inner_hook(state.inner_state, bucket)


# DDP compares the annotations with the real classes; postponed (string) annotations would fail that check.
comm_hook.__annotations__ = {}


_INDEX_TENSORS: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _index_tensor(key: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``key`` as an index tensor on ``device``, made once: no host-to-device copy per step. Bucket layouts are
    fixed after DDP's first-iteration rebuild, so there are a handful of keys in all."""
    idx = _INDEX_TENSORS.get((key, device))
    if idx is None:
        idx = _INDEX_TENSORS[(key, device)] = torch.tensor(key, dtype=torch.int64, device=device)
    return idx


def reduced_norms(params: Sequence[torch.nn.Parameter], device: torch.device) -> torch.Tensor:
    """Per-parameter norms of the reduced gradients (0 where a parameter has no gradient)."""
    out = torch.zeros(len(params), dtype=torch.float32, device=device)
    with_grad = [(i, p.grad) for i, p in enumerate(params) if p.grad is not None]
    if with_grad:
        idx = _index_tensor(tuple(i for i, _ in with_grad), device)
        grads = [g for _, g in with_grad]
        out.index_copy_(0, idx, torch.stack(torch._foreach_norm(grads)).float().to(device))
    return out


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.float64).reshape(1).view(torch.int64)


def _float(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


@dataclass(frozen=True)
class StatusRow:
    """One rank's status in a step, as gathered: the plain-data input of ``decide``."""

    step: int
    local_measured: bool
    local_norm: float
    reduced_norm: float
    local_fp: int
    error: bool
    repeated: bool = False     # a bucket was all-reduced twice in the step (accumulation without no_sync)
    replayable: bool = False   # this rank captured a complete replay record of the step

    @property
    def comparable(self) -> bool:
        """The recorded local gradients are what a replay of the step must reproduce."""
        return self.local_measured and not self.repeated and not self.error

    @staticmethod
    def build(step: int, record: GradRecord | None, reduced: torch.Tensor | None, error: bool,
              replayable: bool = False) -> torch.Tensor:
        """The row this rank contributes (device tensor, no host sync)."""
        device = record.fp.device if record is not None else torch.device("cpu")
        nan = torch.tensor([math.nan], dtype=torch.float64, device=device).view(torch.int64)
        measured = record is not None and record.buckets > 0 and not record.failed
        repeated = record is not None and record.repeated
        parts = [
            torch.tensor([step, int(measured), int(repeated), int(replayable)], dtype=torch.int64, device=device),
            _bits(record.total_norm()) if measured and record is not None else nan,
            _bits(torch.linalg.vector_norm(reduced)) if reduced is not None else nan,
            record.total_fp().reshape(1) if measured and record is not None else torch.zeros(1, dtype=torch.int64,
                                                                                              device=device),
            torch.tensor([int(error)], dtype=torch.int64, device=device),
        ]
        return torch.cat(parts)

    @classmethod
    def parse(cls, row: Sequence[int]) -> StatusRow:
        return cls(step=row[0], local_measured=bool(row[1]), repeated=bool(row[2]), replayable=bool(row[3]),
                   local_norm=_float(row[4]), reduced_norm=_float(row[5]), local_fp=row[6], error=bool(row[7]))


def decide(rows: Sequence[StatusRow], ranks: Sequence[int], check_local: bool) -> Finding | None:
    """Same verdict on every rank from the gathered rows.

    A rank whose local gradients are non-finite is the ``grad_local`` suspect (its NaN spreads to every replica
    through the all-reduce, so reduced non-finites are expected then). Reduced non-finite gradients while every local
    gradient was finite point at the communication path: ``grad_reduced`` with verdict ``communication``, naming the
    ranks that received them.
    """
    local_bad = [r for r, s in zip(ranks, rows, strict=True) if s.local_measured and not math.isfinite(s.local_norm)]
    if check_local and local_bad:
        return Finding("grad_local", tuple(local_bad), {
            "verdict": "nonfinite_local_gradients",
            "local_grad_norm": {str(r): _json_float(s.local_norm) for r, s in zip(ranks, rows, strict=True)},
        })
    reduced_bad = [r for r, s in zip(ranks, rows, strict=True) if not math.isfinite(s.reduced_norm)]
    if reduced_bad:
        all_measured = all(s.local_measured for s in rows)
        return Finding("grad_reduced", tuple(reduced_bad), {
            "verdict": "communication" if all_measured else "nonfinite_reduced_gradients",
            "local_gradients_finite": all_measured,
            "reduced_grad_norm": {str(r): _json_float(s.reduced_norm) for r, s in zip(ranks, rows, strict=True)},
            "local_grad_norm": {str(r): _json_float(s.local_norm) for r, s in zip(ranks, rows, strict=True)},
        })
    return None


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)
