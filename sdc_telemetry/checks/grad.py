"""Gradient health: ``grad_local`` (before the all-reduce) and ``grad_reduced`` (after it, before the update).

Measuring: the layout's gradient tap (a DDP comm hook, an FSDP2 reduce-scatter wrapper) records, for each bucket,
the per-parameter norms of the local gradients (one ``_foreach_norm`` pass: it feeds the non-finite test, the
evidence naming the parameters, and the replay's tolerance sketch) and, on replay audit steps only, their
fingerprints. After backward the reduced gradients' norms are taken in
one more pass. Nothing is read on the host: the monitor packs the verdict inputs into the step's status vector.

Deciding (``decide``, pure): non-finite gradients on every rank at once are a ``numerics`` event (fp16 overflow, a
bad batch, divergence: the model's problem, not a node's). Only a subset of ranks disagreeing with the rest makes a
hardware suspect. A single process cannot tell the two apart and names itself.

Non-finite test: a gradient holds a NaN or an Inf exactly when its L2 norm is not finite. Norms are accumulated in
float32 whatever the gradient dtype (a finite fp16 gradient's norm may exceed fp16's range); a finite gradient whose
squared norm overflows float32 (norm > 1.8e19) is reported as non-finite too: such a gradient would wreck the step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sdc_telemetry.checks.sketch import sketch
from sdc_telemetry.core.evidence import bits, json_float, top, unbits
from sdc_telemetry.core.findings import Finding
from sdc_telemetry.core.fingerprint import digest, fingerprint
from sdc_telemetry.core.status import REDUCED_CHECKSUM

__all__ = ["GradCheck", "GradRecord", "reduced_norms", "decide", "GradStatus", "SCALER_PATIENCE",
           "nonfinite_minority"]

class GradRecord:
    """Local-gradient measurements of the current step, filled bucket by bucket by the comm hook (or, without
    DDP, from ``.grad`` after backward)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], device: torch.device) -> None:
        self._index = {id(p): i for i, p in enumerate(params)}
        self._params = list(params)
        self._device = device
        self.norms = torch.zeros(len(params), dtype=torch.float32, device=device)
        self.fp: torch.Tensor | None = None  # (P, C) on audit steps
        self.sketch: torch.Tensor | None = None  # (P, sketch.WIDTH) on audit steps (tolerance mode's input)
        self.sketching = True  # set False where the replay compares bits (exact mode): no sketch pass
        self.buckets = 0
        self.failed = False
        self.repeated = False
        self.detail = False
        self.elapsed = 0.0  # seconds spent measuring in this step's backward
        # Per-parameter norms of the reduced gradients, where the tap read them as each bucket's reduction came
        # back (DDP's checksum pass): then the end of the step needs no second pass over the gradients.
        self.reduced: torch.Tensor | None = None
        self._seen: set[int] = set()
        self.generation = 0  # steps opened: ``reset`` counts them

    def reset(self, detail: bool = False) -> None:
        self.generation += 1
        self.elapsed = 0.0
        self.reduced = None
        self.norms.zero_()
        self.fp = None
        self.sketch = None
        self.buckets = 0
        self.failed = False
        self.repeated = False
        self.detail = detail
        self._seen.clear()

    @property
    def measured(self) -> bool:
        return self.buckets > 0 and not self.failed

    def note_call(self, key: int) -> None:
        """One reduction of bucket (or FSDP parameter group) ``key`` in this step. A second one is a repeat
        (accumulation without ``no_sync()``): the bucket then holds an earlier reduced gradient plus a local one,
        which no replay can reproduce."""
        if key in self._seen:
            self.repeated = True
        self._seen.add(key)
        self.buckets += 1

    def fail(self) -> None:
        self.failed = True

    def store(self, index: list[int], grads: list[torch.Tensor], fp_grads: list[torch.Tensor] | None = None) -> None:
        """Norms of ``grads`` (any strides) at ``index``; on detail steps the fingerprints of ``fp_grads`` (the same
        gradients as flat tensors) or of ``grads``."""
        if index:
            self._store(index, grads, fp_grads)

    def store_norms(self, index: list[int], norms: list[torch.Tensor]) -> None:
        """Local-gradient norms the tap already took (float32, one per parameter at ``index``; healthy steps only:
        detail steps need the gradients themselves, through ``store``)."""
        if index:
            self.norms.index_copy_(0, _index_tensor(tuple(index), self._device), torch.stack(norms).to(self._device))

    def store_reduced(self, index: list[int], norms: torch.Tensor) -> None:
        """The reduced gradients' norms the tap read with the reduction's checksum; kept only when they cover every
        parameter (else the end of the step reads ``.grad``)."""
        if len(index) == len(self._params) and len(set(index)) == len(index):
            out = torch.zeros(len(self._params), dtype=torch.float32, device=self._device)
            self.reduced = out.index_copy_(0, _index_tensor(tuple(index), self._device), norms.to(self._device))

    def measure_local(self) -> None:
        """Without a reduction (one process): the local gradients are ``.grad`` after backward."""
        pairs = [(i, p.grad) for i, p in enumerate(self._params) if p.grad is not None]
        self.buckets += 1
        if pairs:
            self._store([i for i, _ in pairs], [g for _, g in pairs])

    def _store(self, index: list[int], grads: list[torch.Tensor], fp_grads: list[torch.Tensor] | None = None
               ) -> None:
        start = time.perf_counter()
        self._measure(index, grads, fp_grads)
        self.elapsed += time.perf_counter() - start

    def _measure(self, index: list[int], grads: list[torch.Tensor], fp_grads: list[torch.Tensor] | None) -> None:
        idx = _index_tensor(tuple(index), self._device)
        self.norms.index_copy_(0, idx, torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).to(self._device))
        if self.detail:
            fps = fingerprint(fp_grads if fp_grads is not None else grads).to(self._device)
            if self.fp is None:
                self.fp = torch.zeros((len(self._params), fps.shape[1]), dtype=torch.int64, device=self._device)
            self.fp.index_copy_(0, idx, fps)
        if self.detail and self.sketching:  # tolerance mode compares sketches; exact mode needs none
            rows = sketch(fp_grads if fp_grads is not None else grads).to(self._device)
            if self.sketch is None:
                self.sketch = torch.zeros((len(self._params), rows.shape[1]), dtype=torch.float64,
                                          device=self._device)
            self.sketch.index_copy_(0, idx, rows)

    def total_norm(self) -> torch.Tensor:
        norm: torch.Tensor = torch.linalg.vector_norm(self.norms)
        return norm

    def total_fp(self) -> torch.Tensor:
        """Position-sensitive digest of the per-parameter fingerprints (audit steps)."""
        if self.fp is None:
            return torch.zeros((), dtype=torch.int64, device=self._device)
        return digest(self.fp)


_INDEX_TENSORS: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _index_tensor(key: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``key`` as an index tensor on ``device``, made once: no host-to-device copy per step. Bucket layouts are
    fixed after DDP's first-iteration rebuild, so there are a handful of keys in all."""
    idx = _INDEX_TENSORS.get((key, device))
    if idx is None:
        idx = _INDEX_TENSORS[(key, device)] = torch.tensor(key, dtype=torch.int64, device=device)
    return idx


def reduced_norms(count: int, held: Sequence[tuple[int, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """Per-parameter norms of the reduced gradients (``count`` parameters; 0 where this rank holds none): ``held``,
    the layout's (index, reduced gradient as this rank holds it) pairs (``Layout.reduced``)."""
    out = torch.zeros(count, dtype=torch.float32, device=device)
    if held:
        idx = _index_tensor(tuple(i for i, _ in held), device)
        grads = [g for _, g in held]
        out.index_copy_(0, idx, torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).to(device))
    return out


@dataclass(frozen=True)
class GradStatus:
    """One rank's gradient status at a step, as gathered on the rare path (plain data: the input of ``decide``)."""

    rank: int
    local_measured: bool
    local_nonfinite: bool
    reduced_measured: bool
    reduced_nonfinite: bool
    local_norm: float = math.nan
    reduced_norm: float = math.nan
    reduced_mismatch: bool = False  # the reduction's checksum: reduced gradients are not the sum of local ones


# With a GradScaler, the same minority of ranks non-finite at this many consecutive steps is not an overflow: the
# scaler halves its scale at every overflow, so a real one is gone after a few steps (2**5 = 32 times smaller).
SCALER_PATIENCE = 5


def nonfinite_minority(rows: Sequence[GradStatus]) -> tuple[int, ...]:
    """The ranks whose local gradients are non-finite while others' are finite (empty otherwise)."""
    measured = [s for s in rows if s.local_measured]
    bad = tuple(s.rank for s in measured if s.local_nonfinite)
    return bad if len(bad) < len(measured) else ()


def decide(rows: Sequence[GradStatus], *, overflow_expected: bool = False, repeats: int = 0,
           shard_of: Sequence[int] | None = None) -> Finding | None:
    """Same verdict on every rank from the ranks' gradient status.

    - Local non-finite on every measured rank (or, with a GradScaler, on any rank: an fp16 overflow is routine and
      the scaler skips the step everywhere): a ``numerics`` event of ``grad_local``, no suspect. ``repeats``: how
      many steps in a row the same minority was non-finite before this one; with a GradScaler, at
      ``SCALER_PATIENCE`` steps in a row the minority is named (verdict ``persistent_nonfinite``).
    - Local non-finite on some ranks only: those ranks are the ``grad_local`` suspects (their NaN reaches every
      replica through the all-reduce, so reduced non-finites are expected then).
    - Every local gradient finite, reduced non-finite on some ranks only: ``grad_reduced``, verdict
      ``communication``, naming the receivers. On every rank: a ``numerics`` event (overflow in the reduction).
    - One rank in all (a single process): a non-finite local gradient names it (numerics and hardware look alike).
    - ``shard_of`` (FSDP2: each position's shard index): reduced gradients are shards, so they are compared only
      among the replicas of the same shard; a shard non-finite on all its replicas (and any shard of a 1-D mesh) is
      numerics (an overflow in the reduction), not a receiver's fault.
    - Every local gradient finite and the reduction's checksum off (``reduced_mismatch``: the reduced gradients are
      not the sum of the local ones, finite or NaN; a sum that may legitimately overflow is not flagged):
      ``grad_reduced``, verdict ``communication``, ``evidence["reduce_phase"]``. Off on every rank alike, the fault
      happened inside the reduction and reached every rank: every rank is a suspect and the verdict is ambiguous
      (it cannot say which link or GPU); off on some ranks only, those receivers are named.
    """
    measured = [s for s in rows if s.local_measured]
    local_bad = [s for s in measured if s.local_nonfinite]
    if local_bad:
        every = len(local_bad) == len(measured) and len(rows) > 1
        if not every and overflow_expected and repeats + 1 >= SCALER_PATIENCE:
            return Finding("grad_local", tuple(s.rank for s in local_bad), {
                "verdict": "persistent_nonfinite", "consecutive_steps": repeats + 1,
                "nonfinite_ranks": len(local_bad), "ranks": len(rows),
                "reason": "non-finite local gradients on the same ranks at every step while the GradScaler kept "
                          "lowering its scale: not an overflow",
                "local_grad_norm": top({str(s.rank): json_float(s.local_norm) for s in local_bad})})
        if every or overflow_expected:
            return Finding("grad_local", (), {
                "verdict": "numerics", "nonfinite_ranks": len(local_bad), "ranks": len(rows),
                "reason": "a GradScaler overflow (the scaler skips this step)" if overflow_expected and not every
                else "non-finite local gradients on every rank: overflow, a bad batch or divergence"})
        return Finding("grad_local", tuple(s.rank for s in local_bad), {
            "verdict": "nonfinite_local_gradients" if len(rows) > 1 else "undetermined",
            "ambiguous": len(rows) == 1,
            "nonfinite_ranks": len(local_bad), "ranks": len(rows),
            "local_grad_norm": top({str(s.rank): json_float(s.local_norm) for s in local_bad}),
        })
    reduced = [s for s in rows if s.reduced_measured]
    reduced_bad = [s for s in reduced if s.reduced_nonfinite]
    all_measured = len(measured) == len(rows)
    mismatched = [s for s in rows if s.reduced_mismatch]
    if mismatched:
        every = len(mismatched) == len(rows)
        named = rows if every else mismatched
        return Finding("grad_reduced", tuple(s.rank for s in named), {
            "verdict": "communication", "reduce_phase": True, "ambiguous": every,
            "local_gradients_finite": all_measured, "checksum_mismatch_ranks": len(mismatched),
            "nonfinite_ranks": len(reduced_bad), "ranks": len(rows),
            "reason": "the reduced gradients are not the sum of the ranks' local gradients (reduction checksum): "
                      + ("the same on every rank, the fault is inside the reduction (which link or GPU is unknown)"
                         if every else "on these ranks only, corrupted on the way to them"),
            "reduced_grad_norm": top({str(s.rank): json_float(s.reduced_norm) for s in named}),
        })
    if not reduced_bad:
        return None
    if shard_of is not None:
        replicas: dict[int, list[GradStatus]] = {}
        for shard, st in zip(shard_of, rows, strict=True):
            if st.reduced_measured:
                replicas.setdefault(shard, []).append(st)
        reduced_bad = [st for group in replicas.values() if not all(x.reduced_nonfinite for x in group)
                       for st in group if st.reduced_nonfinite]
        if not reduced_bad:
            return Finding("grad_reduced", (), {
                "verdict": "numerics", "ranks": len(rows),
                "reason": "non-finite reduced gradient shards on every replica of their shard while local gradients "
                          "were finite: overflow in the reduction"})
    elif len(reduced_bad) == len(reduced) and len(rows) > 1:
        return Finding("grad_reduced", (), {
            "verdict": "numerics", "nonfinite_ranks": len(reduced_bad), "ranks": len(rows),
            "reason": "non-finite reduced gradients on every rank while local ones were finite: overflow in the "
                      "reduction"})
    return Finding("grad_reduced", tuple(s.rank for s in reduced_bad), {
        "verdict": "communication" if all_measured else "nonfinite_reduced_gradients",
        "local_gradients_finite": all_measured,
        "nonfinite_ranks": len(reduced_bad), "ranks": len(rows),
        "reduced_grad_norm": top({str(s.rank): json_float(s.reduced_norm) for s in reduced_bad}),
    })


class GradCheck:
    """The gradient verdict of one step, on every rank, from the agreed status vector: the healthy path reads the
    agreement only; per-rank status is gathered only when ranks disagree (``gather``: plain data on every rank)."""

    def __init__(self, ranks: Sequence[int], rank: int, names: Sequence[str], reduces: bool,
                 shard_of: Sequence[int] | None, gather: Callable[[torch.Tensor], list[list[int]]],
                 gather_objects: Callable[[object], list[object]]) -> None:
        self._ranks = list(ranks)
        self._rank = rank
        self._names = list(names)
        self.reduces = reduces
        self._shard_of = shard_of
        self._gather = gather
        self._gather_objects = gather_objects
        self._minority: tuple[tuple[int, ...], int] = ((), 0)  # ranks non-finite alone, and for how many steps

    def verdict(self, high: Sequence[int], low: Sequence[int], mine: Sequence[int], local: tuple[float, ...],
                norms: torch.Tensor, fields: tuple[int, int, int, int], scaler: bool,
                checksum: int | None = REDUCED_CHECKSUM) -> Finding | None:
        """``fields``: the status-vector indices of (local measured, local non-finite, reduced measured, reduced
        non-finite); ``checksum``: that of the reduction's checksum flag (None: not used); ``local``: this rank's
        (local, reduced) norms and, third, its checksum flag (1.0 when off); ``norms``: its per-parameter local
        norms."""
        lm, ln, _, rn = fields
        rc = checksum if checksum is not None and checksum < len(high) else None
        if not (high[ln] or high[rn] or (rc is not None and high[rc])):
            self._minority = ((), 0)
            return None
        if all(high[f] == low[f] for f in (*fields, *(() if rc is None else (rc,)))):  # every rank alike
            lm_, ln_, rm_, rn_ = (bool(high[f]) for f in fields)
            off = rc is not None and bool(high[rc])
            rows = [GradStatus(r, lm_, ln_, rm_, rn_, reduced_mismatch=off) for r in self._ranks]
        else:  # rare path: who?
            flag = int(len(local) > 2 and local[2] == 1.0)
            row = torch.tensor([mine[lm], bits(local[0]), bits(local[1]), flag], dtype=torch.int64)
            rows = []
            for r, g in zip(self._ranks, self._gather(row), strict=True):
                loc, red = unbits(g[1]), unbits(g[2])
                rows.append(GradStatus(r, bool(g[0]), bool(g[0]) and not math.isfinite(loc), self.reduces,
                                       self.reduces and not math.isfinite(red), loc, red, bool(g[3])))
        minority = nonfinite_minority(rows)
        repeats = self._minority[1] if minority and minority == self._minority[0] else 0
        self._minority = (minority, repeats + 1 if minority else 0)
        finding = decide(rows, overflow_expected=scaler, repeats=repeats, shard_of=self._shard_of)
        if finding is not None and finding.suspect_ranks and finding.check == "grad_local":
            finding = self._with_nonfinite_names(norms, finding)
        return finding

    def results(self, error: bool, local_measured: bool, reduced_measured: bool, finding: Finding | None
                ) -> dict[str, str]:
        """This rank's results: a rank that measured nothing (or failed to) never counts a pass."""
        if error:
            return {"grad_local": "error", **({"grad_reduced": "error"} if self.reduces else {})}
        out = {"grad_local": "skipped" if not local_measured else
               "fail" if finding is not None and finding.check == "grad_local" else "pass"}
        if self.reduces:
            out["grad_reduced"] = "skipped" if not reduced_measured else "fail" if finding is not None else "pass"
        return out

    def _with_nonfinite_names(self, norms: torch.Tensor, finding: Finding) -> Finding:
        """Rare path: which parameters the suspects' local gradients (before any clipping) were non-finite in."""
        mine: list[str] = []
        if self._rank in finding.suspect_ranks:
            mine = [self._names[i] for i, n in enumerate(norms.tolist()) if not math.isfinite(n)][:16]
        names = self._gather_objects(mine)
        evidence = dict(finding.evidence)
        evidence["nonfinite_parameters"] = {str(self._ranks[i]): n for i, n in enumerate(names)
                                            if self._ranks[i] in finding.suspect_ranks}
        return Finding(finding.check, finding.suspect_ranks, evidence)
