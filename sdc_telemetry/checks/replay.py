"""``replay``: recompute a partner rank's micro-batches and compare loss and local-gradient fingerprints.

Before the optimizer step every replica holds the same weights, so rank j recomputing rank i's micro-batches with
rank i's RNG states must reproduce rank i's losses and pre-all-reduce gradients: bit for bit in exact mode, within
``tolerance`` otherwise. Only recomputation catches finite-but-wrong arithmetic, since the all-reduce averages it
into identical (wrong) weights everywhere.

Protocol per audit step (all ranks, same collectives):
1. cross round: replayer p audits origin (p + s) mod W; the shift s rotates between audits and prefers partners on
   another host. Micro-batches, RNG states, losses and the per-parameter gradient-norm sketch travel point-to-point.
2. only after a mismatch: every rank reruns its own micro-batches (is the origin reproducible?) and, with 3 or more
   ranks, a referee round with another shift audits every origin again.
``attribute`` turns the gathered outcomes into one verdict (pure, unit-tested).
"""

from __future__ import annotations

import math
import struct
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._collective import collective_device, gather_rows
from ..fingerprint import fingerprint
from ..identity import RankIdentity
from . import Finding
from .pairing import Outcome, attribute, pick_shifts
from .shipping import MicroBatch, check_shippable, pack, unpack

__all__ = ["ReplayCheck", "Measurement", "Outcome", "attribute", "pick_shifts", "scaled", "check_shippable"]

_CALIBRATE_EVERY = 10  # audits between noise-floor recalibrations in tolerance="auto"
_AUTO_FLOOR = 1e-5     # relative tolerance when reruns are bitwise identical
_AUTO_FACTOR = 10.0    # threshold = factor x the rerun noise floor
_CALIBRATION_WINDOW = 5  # calibrations the noise floor is taken over


def scaled(loss: torch.Tensor, scale: float) -> torch.Tensor:
    """The tensor backpropagated for ``loss``; the step and the replay must build it identically."""
    return loss if scale == 1.0 else loss * scale


@dataclass
class _Result:
    """What recomputing some micro-batches gave: per-micro-batch losses, total gradient fingerprint, norm sketch."""

    losses: list[float]
    fp: int
    norms: torch.Tensor


@dataclass(frozen=True)
class Measurement:
    """This rank's comparison against one origin rank (exported per ``origin_rank``)."""

    origin_rank: int
    loss_delta: float
    grad_delta: float
    mismatch: bool


class ReplayCheck:
    """Captures audited steps and runs the replay protocol. Collective: every rank calls ``run`` at the same step."""

    def __init__(self, module: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None,
                 named_params: Sequence[tuple[str, torch.nn.Parameter]], group: dist.ProcessGroup | None,
                 ranks: Sequence[int], identities: dict[int, RankIdentity], device: torch.device, mode: str,
                 tolerance: float | str, every: int) -> None:
        if loss_fn is None:
            raise ValueError("replay needs loss_fn(module, batch) -> scalar loss")
        self._module = module
        self._loss_fn = loss_fn
        self._params = [p for _, p in named_params]
        self._group = group
        self._ranks = list(ranks)
        self._pos = self._ranks.index(dist.get_rank())
        self._device = device
        self._wire = collective_device(group)
        self.mode = mode
        self._auto = tolerance == "auto"
        self.tolerance = _AUTO_FLOOR if self._auto else float(tolerance)
        self.noise_floor = 0.0
        self._every = every
        self._shifts = pick_shifts([identities[r].host_name if r in identities else str(r) for r in self._ranks])
        self._audits = 0
        self._capturing = False
        self._replaying = False
        self._floors: deque[float] = deque(maxlen=_CALIBRATION_WINDOW)
        self._hook = module.register_forward_pre_hook(self._on_forward)
        self._micro: list[MicroBatch] = []
        self.errors: list[int] = []
        self.error_text = ""

    # -- capture (training thread, every step) -------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return step % self._every == 0

    def begin_step(self, step: int) -> None:
        self._micro = []
        self._capturing = self.due(step)

    def close(self) -> None:
        self._hook.remove()
        self._micro = []

    def ready(self) -> bool:
        """This rank holds a complete record of the step being audited (every micro-batch and its loss)."""
        return self._capturing and bool(self._micro) and all(m.loss is not None for m in self._micro)

    def drop(self) -> None:
        self._micro = []
        self._capturing = False

    def capture(self, batch: Any) -> None:
        check_shippable(batch)
        if not self._capturing:
            self._micro.append(MicroBatch(None, torch.empty(0), None, None))  # counts micro-batches only
            return
        dev_rng = torch.cuda.get_rng_state(self._device) if self._device.type == "cuda" else None
        self._micro.append(MicroBatch(batch, torch.get_rng_state(), dev_rng, _autocast_state(self._device)))

    def _on_forward(self, *_: Any) -> None:
        """Forward pre-hook of the module: the autocast state the forward pass really runs under (users enter
        autocast around the forward and leave it before backward, so neither micro_batch() nor backward() sees it)."""
        if self._capturing and not self._replaying and self._micro and self._micro[-1].loss is None:
            state = _autocast_state(self._device)
            if state is not None:
                self._micro[-1].autocast = state

    def record_loss(self, loss: torch.Tensor, scale: float) -> None:
        pending = [m for m in self._micro if m.loss is None]
        if not pending:
            raise ValueError("step.backward() without a registered micro-batch: the replay check needs the batch. "
                             "Open the step with monitor.step(batch), or call step.micro_batch(batch) before each "
                             "micro-batch's forward pass")
        mb = pending[0]
        mb.scale = float(scale)
        mb.loss = loss.detach().clone() if self._capturing else torch.empty(0)
        if self._capturing:
            mb.had_grad = [p.grad is not None for p in self._params]
            if mb.autocast is None:
                mb.autocast = _autocast_state(self._device)

    # -- the audit (pre optimizer step) --------------------------------------------------------------------------

    def run(self, step: int, local_fps: Sequence[int], local_norms: torch.Tensor
            ) -> tuple[Finding | None, list[Measurement]]:
        """Audit this step. ``local_fps``: every position's recorded local-gradient fingerprint (gathered);
        ``local_norms``: this rank's per-parameter local-gradient norms (the tolerance sketch)."""
        self.errors, self.error_text = [], ""
        micro = [m for m in self._micro if m.loss is not None and m.batch is not None]
        self._micro, self._capturing = [], False
        world = len(self._ranks)
        shift = self._shifts[self._audits % len(self._shifts)]
        calibrate = self._auto and self.mode == "tolerance" and self._audits % _CALIBRATE_EVERY == 0
        self._audits += 1

        mine = {"micro": micro, "fp": int(local_fps[self._pos]), "norms": local_norms.detach().float().cpu()}
        outcome = Outcome(world)
        if calibrate:  # before comparing, so the first audit already uses a measured threshold
            self._calibrate(mine)
        edges, measured = self._cross_round(shift, mine, local_fps)
        outcome.edges += edges
        if self.errors:
            return None, measured
        if not edges:
            return None, measured
        # Rare path: a mismatch. Same-rank reruns, and with 3+ ranks a referee round with another shift.
        outcome.reproduced = self._self_round(mine)
        referee = next((s for s in range(1, world) if s != shift), None) if world >= 3 else None
        if referee is not None:
            more, _ = self._cross_round(referee, mine, local_fps)
            outcome.edges += more
        if self.errors:
            return None, measured
        suspects, why = attribute(outcome)
        if why.get("fault") == "unfaithful":  # most ranks cannot reproduce themselves: replay is wrong, not hardware
            self.errors = list(self._ranks)
            self.error_text = ("replay could not reproduce the recorded step on most ranks (an unsupported pattern: "
                               "state changed between the step and the audit, or nondeterminism in exact mode)")
            return None, measured
        if not suspects:
            return None, measured
        evidence: dict[str, Any] = dict(why)
        evidence.update({
            "mode": self.mode,
            "tolerance": self.tolerance if self.mode == "tolerance" else 0.0,
            "mismatching_pairs": [{"replayer": self._ranks[a], "origin": self._ranks[b]} for a, b in outcome.edges],
            "reproduced_own_result": {str(self._ranks[p]): ok for p, ok in outcome.reproduced.items()},
            "recorded_grad_fingerprints": {str(self._ranks[p]): f"{local_fps[p] & (2**64 - 1):016x}"
                                           for p in range(world)},
            "deltas": self._last_deltas,
            "verdict": "transient" if why.get("fault") == "transient" else "persistent",
        })
        return Finding("replay", tuple(self._ranks[p] for p in suspects), evidence), measured

    def _cross_round(self, shift: int, mine: dict[str, Any], local_fps: Sequence[int]
                     ) -> tuple[list[tuple[int, int]], list[Measurement]]:
        world = len(self._ranks)
        origin = (self._pos + shift) % world
        replayer_of_mine = (self._pos - shift) % world
        theirs = self._exchange(mine, send_to=replayer_of_mine, recv_from=origin)
        row = self._compare(theirs, local_fps[origin] if theirs is not None else 0)
        rows = gather_rows(row, self._group)
        self._collect_errors(rows)
        edges, measured = [], []
        self._last_deltas = {}
        for p, r in enumerate(rows):
            o = (p + shift) % world
            loss_d, grad_d = _float(r[1]), _float(r[2])
            self._last_deltas[f"{self._ranks[p]}->{self._ranks[o]}"] = {"loss": _json(loss_d), "grad": _json(grad_d)}
            if r[0] == 1:
                edges.append((p, o))
            if p == self._pos and r[3] == 0:
                measured.append(Measurement(self._ranks[o], loss_d, grad_d, r[0] == 1))
        return edges, measured

    def _self_round(self, mine: dict[str, Any]) -> dict[int, bool]:
        row = self._compare(mine, mine["fp"])
        rows = gather_rows(row, self._group)
        self._collect_errors(rows)
        return {p: r[0] == 0 for p, r in enumerate(rows)}

    def _calibrate(self, mine: dict[str, Any]) -> None:
        """Same-rank rerun of this rank's own step: the noise floor of non-deterministic kernels."""
        row = self._compare(mine, mine["fp"])
        rows = gather_rows(row, self._group)
        deltas = sorted(max(_float(r[1]), _float(r[2])) for r in rows if r[3] == 0)
        finite = [d for d in deltas if math.isfinite(d)]
        if finite:
            # The median rank's rerun noise, over a window of recent calibrations: one faulty rank (or one bad
            # calibration) cannot raise the threshold for good and blind the check.
            self._floors.append(finite[len(finite) // 2])
            self.noise_floor = max(self._floors)
            self.tolerance = min(max(_AUTO_FLOOR, _AUTO_FACTOR * self.noise_floor), 0.5)

    def _compare(self, record: dict[str, Any] | None, recorded_fp: int) -> torch.Tensor:
        """[mismatch, loss_delta_bits, grad_delta_bits, error] for recomputing ``record``."""
        try:
            if record is None:
                raise RuntimeError("no replay record received from the origin rank")
            micro: list[MicroBatch] = record["micro"]
            if not micro:
                raise RuntimeError("the origin rank captured no micro-batch for this audit step")
            result = self._recompute(micro)
            recorded_losses = [float(m.loss.double().item()) for m in micro if m.loss is not None]
            loss_delta = max(_rel(a, b) for a, b in zip(result.losses, recorded_losses, strict=True))
            ref = record["norms"].double()
            grad_delta = float(torch.linalg.vector_norm(result.norms.double().cpu() - ref)
                               / max(float(torch.linalg.vector_norm(ref)), 1e-30))
            if self.mode == "exact":
                same_loss = all(_same_bits(a, b) for a, b in zip(result.losses, recorded_losses, strict=True))
                mismatch = not (same_loss and result.fp == recorded_fp)
            else:
                mismatch = not (loss_delta <= self.tolerance and grad_delta <= self.tolerance)
            return torch.tensor([int(mismatch), _bits(loss_delta), _bits(grad_delta), 0], dtype=torch.int64)
        except Exception as e:  # noqa: BLE001 - reported to every rank through the gathered row
            self.error_text = f"{type(e).__name__}: {e}"
            return torch.tensor([0, _bits(math.nan), _bits(math.nan), 1], dtype=torch.int64)

    def _collect_errors(self, rows: Sequence[Sequence[int]]) -> None:
        self.errors += [self._ranks[p] for p, r in enumerate(rows) if r[3] and self._ranks[p] not in self.errors]

    # -- recomputation -------------------------------------------------------------------------------------------

    def _recompute(self, micro: Sequence[MicroBatch]) -> _Result:
        """Recompute losses and accumulated local gradients without touching .grad, buffers, RNG or DDP state."""
        cpu_rng = torch.get_rng_state()
        dev_rng = torch.cuda.get_rng_state(self._device) if self._device.type == "cuda" else None
        buffers = [(b, b.detach().clone()) for b in self._module.buffers()]
        self._replaying = True
        try:
            total: list[torch.Tensor | None] = [None] * len(self._params)
            losses = []
            for mb in micro:
                torch.set_rng_state(mb.cpu_rng)
                if mb.dev_rng is not None and self._device.type == "cuda":
                    torch.cuda.set_rng_state(mb.dev_rng, self._device)
                ctx = (torch.autocast(self._device.type, dtype=mb.autocast[1])
                       if mb.autocast is not None and mb.autocast[0] else nullcontext())
                with torch.enable_grad(), ctx:
                    loss = self._loss_fn(self._module, mb.batch)
                grads = torch.autograd.grad(scaled(loss, mb.scale), self._params, allow_unused=True)
                for i, grad in enumerate(grads):
                    if grad is not None:
                        prev = total[i]
                        if prev is None and mb.had_grad is not None and mb.had_grad[i]:
                            prev = torch.zeros_like(grad)  # zero_grad(set_to_none=False): .grad = 0.0 + g
                        total[i] = grad if prev is None else prev + grad  # the order autograd accumulates .grad in
                losses.append(float(loss.detach().double().item()))
            present = [g for g in total if g is not None]
            fp = int(fingerprint(present).sum().item()) if present else 0
            norms = torch.zeros(len(self._params), dtype=torch.float32)
            for i, g in enumerate(total):
                if g is not None:
                    norms[i] = torch.linalg.vector_norm(g).float().cpu()
            return _Result(losses, _wrap64(fp), norms)
        finally:
            self._replaying = False
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            torch.set_rng_state(cpu_rng)
            if dev_rng is not None:
                torch.cuda.set_rng_state(dev_rng, self._device)

    # -- shipping ------------------------------------------------------------------------------------------------

    def _exchange(self, mine: dict[str, Any], send_to: int, recv_from: int) -> dict[str, Any] | None:
        """Send this rank's record to ``send_to`` and receive ``recv_from``'s (group positions), point-to-point."""
        try:
            payload = pack(mine)
        except Exception as e:  # noqa: BLE001 - send an empty payload so the peer does not wait forever
            self.error_text = f"packing the replay record failed: {type(e).__name__}: {e}"
            payload = torch.zeros(0, dtype=torch.uint8)
        size_out = torch.tensor([payload.numel()], dtype=torch.int64, device=self._wire)
        size_in = torch.zeros(1, dtype=torch.int64, device=self._wire)
        self._p2p(size_out, size_in, send_to, recv_from)
        data_in = torch.empty(int(size_in.item()), dtype=torch.uint8, device=self._wire)
        self._p2p(payload.to(self._wire), data_in, send_to, recv_from)
        if data_in.numel() == 0:
            return None
        try:
            return unpack(data_in, self._device)
        except Exception as e:  # noqa: BLE001
            self.error_text = f"unpacking the replay record failed: {type(e).__name__}: {e}"
            return None

    def _p2p(self, out: torch.Tensor, into: torch.Tensor, send_to: int, recv_from: int) -> None:
        ops = [dist.P2POp(dist.isend, out, self._ranks[send_to], self._group),
               dist.P2POp(dist.irecv, into, self._ranks[recv_from], self._group)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def _autocast_state(device: torch.device) -> tuple[bool, torch.dtype] | None:
    kind = device.type
    try:
        if torch.is_autocast_enabled(kind):
            return True, torch.get_autocast_dtype(kind)
    except (RuntimeError, TypeError):
        pass
    return None


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-30)


def _same_bits(a: float, b: float) -> bool:
    return struct.pack("<d", a) == struct.pack("<d", b)


def _bits(x: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", x))[0])


def _float(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


def _json(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def _wrap64(x: int) -> int:
    x &= 2**64 - 1
    return x - 2**64 if x >= 2**63 else x
