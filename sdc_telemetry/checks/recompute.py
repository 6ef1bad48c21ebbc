"""How a replica recomputes an origin's micro-batches: losses and accumulated local gradients, reduced to rows.

``Recomputer.run(micro)`` reruns the micro-batches under the origin's RNG and autocast state without touching
``.grad``, buffers, RNG or DDP state, and returns per-micro-batch losses, the gradient digest, per-parameter norms
and (tolerance mode) block sketches, with one copy to the host. Three ways to get the gradients:

- ``torch.autograd.grad`` (the default): nothing is accumulated anywhere;
- ``backward()`` into ``.grad``, saved before and restored after (reentrant activation checkpointing refuses
  ``autograd.grad``; switched to once, on the first such error);
- a lockstep layout's ``recompute(params, run_backward)`` (FSDP2: every rank recomputes through the sharded model).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from sdc_telemetry.checks.shipping import MicroBatch
from sdc_telemetry.checks.sketch import WIDTH, sketch
from sdc_telemetry.core.fingerprint import digest, fingerprint

__all__ = ["Recomputer", "Recompute", "Result", "scaled", "autocast_state"]

# A lockstep layout's recomputation (FSDP2): run_backward on every rank at once, with the accumulated local gradient
# of each parameter returned (nothing reaches ``.grad``).
Recompute = Callable[[Sequence[torch.nn.Parameter], Callable[[], None]], "list[torch.Tensor | None] | None"]


def scaled(loss: torch.Tensor, scale: float, grad_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor backpropagated for ``loss``; the step and the replay must build it identically.

    ``grad_scale`` is a GradScaler's current scale: ``scaler.scale(loss * scale)`` multiplies by it in this order."""
    out = loss if scale == 1.0 else loss * scale
    if grad_scale is not None:
        out = out * grad_scale.to(device=out.device, non_blocking=True)
    return out


@dataclass
class Result:
    """What recomputing some micro-batches gave: per-micro-batch losses, total gradient fingerprint, norm sketch."""

    losses: list[float]
    fp: int
    norms: torch.Tensor
    sketch: torch.Tensor | None = None  # tolerance mode: per-parameter block sketches (checks/sketch.py)


class Recomputer:
    """Recomputes micro-batches for the replay (one per ReplayCheck)."""

    def __init__(self, module: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                 params: Sequence[torch.nn.Parameter], device: torch.device, mode: str,
                 lockstep: Recompute | None = None) -> None:
        self._module = module
        self._loss_fn = loss_fn
        self._params = list(params)
        self._device = device
        self.mode = mode
        self.lockstep = lockstep
        self.through_grad_fields = False  # recompute through .grad (reentrant checkpointing), not autograd.grad
        self.replaying = False  # a recomputation is running (the forward pre-hook must not capture it)

    def run(self, micro: Sequence[MicroBatch]) -> Result:
        """Recompute losses and accumulated local gradients without touching .grad, buffers, RNG or DDP state."""
        losses: list[torch.Tensor] = []
        with self._preserved():
            if self.lockstep is not None:
                # FSDP2: forward and backward through the sharded model (every rank at once), gradient sync off,
                # each parameter's unsharded gradient collected in the reduce dtype (what the tap recorded).
                def run_backward() -> None:
                    for mb in micro:
                        loss = self._loss_of(mb)
                        scaled(loss, mb.scale, mb.grad_scale).backward()  # type: ignore[no-untyped-call]
                        losses.append(loss.detach().double())

                accumulated = self.lockstep(self._params, run_backward)
                assert accumulated is not None
                return self._result(losses, accumulated)
            if not self.through_grad_fields:
                try:
                    return self._result(losses, self._recompute_by_grad(micro, losses))
                except RuntimeError as e:
                    if "checkpoint" not in str(e).lower():
                        raise
                    # Reentrant activation checkpointing runs its own backward into .grad and refuses
                    # autograd.grad(): from now on this model is recomputed through .grad, saved and restored.
                    self.through_grad_fields = True
                    losses.clear()
            return self._result(losses, self._recompute_by_backward(micro, losses))

    def _recompute_by_grad(self, micro: Sequence[MicroBatch], losses: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """autograd.grad: nothing is accumulated anywhere (no .grad, no accumulation hooks such as DDP's)."""
        total: list[torch.Tensor | None] = [None] * len(self._params)
        for mb in micro:
            loss = self._loss_of(mb)
            grads = torch.autograd.grad(scaled(loss, mb.scale, mb.grad_scale), self._params, allow_unused=True)
            for i, grad in enumerate(grads):
                if grad is not None:
                    prev = total[i]
                    if prev is None and mb.had_grad is not None and mb.had_grad[i]:
                        prev = torch.zeros_like(grad)  # zero_grad(set_to_none=False): .grad = 0.0 + g
                    total[i] = grad if prev is None else prev + grad  # the order autograd accumulates .grad in
            losses.append(loss.detach().double())
        return total

    def _recompute_by_backward(self, micro: Sequence[MicroBatch], losses: list[torch.Tensor]
                               ) -> list[torch.Tensor | None]:
        """backward() into .grad, which is saved before and restored after, exactly (the same tensors)."""
        saved = [p.grad for p in self._params]
        try:
            for i, p in enumerate(self._params):
                had = micro[0].had_grad is not None and micro[0].had_grad[i]
                p.grad = torch.zeros_like(p) if had else None  # zero_grad(set_to_none=False) leaves zeros
            for mb in micro:
                loss = self._loss_of(mb)
                scaled(loss, mb.scale, mb.grad_scale).backward()  # type: ignore[no-untyped-call]
                losses.append(loss.detach().double())
            return [p.grad for p in self._params]
        finally:
            for p, g in zip(self._params, saved, strict=True):
                p.grad = g

    def _loss_of(self, mb: MicroBatch) -> torch.Tensor:
        """The micro-batch's loss under the origin's RNG and autocast state."""
        torch.set_rng_state(mb.cpu_rng)
        if mb.dev_rng is not None and self._device.type == "cuda":
            torch.cuda.set_rng_state(mb.dev_rng, self._device)
        ctx = (torch.autocast(self._device.type, dtype=mb.autocast[1])
               if mb.autocast is not None and mb.autocast[0] else nullcontext())
        with torch.enable_grad(), ctx:
            return self._loss_fn(self._module, mb.batch)

    @contextmanager
    def _preserved(self) -> Iterator[None]:
        """Buffers and RNG states as they were before the recomputation, whatever happens in it."""
        cpu_rng = torch.get_rng_state()
        dev_rng = torch.cuda.get_rng_state(self._device) if self._device.type == "cuda" else None
        buffers = [(b, b.detach().clone()) for b in self._module.buffers()]
        self.replaying = True
        try:
            yield
        finally:
            self.replaying = False
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            torch.set_rng_state(cpu_rng)
            if dev_rng is not None:
                torch.cuda.set_rng_state(dev_rng, self._device)

    def _result(self, losses: list[torch.Tensor], total: Sequence[torch.Tensor | None]) -> Result:
        fps = torch.zeros((len(self._params), 1), dtype=torch.int64, device=self._device)
        # A trainable parameter without a gradient in this step (unused with find_unused_parameters=True, an expert
        # that got no token) was reduced as zeros: the origin's local gradient record holds a zero slot for it.
        total = [g if g is not None or self.lockstep is not None else torch.zeros_like(p)
                 for g, p in zip(total, self._params, strict=True)]
        present = [(i, g) for i, g in enumerate(total) if g is not None]
        if present:
            rows = fingerprint([g for _, g in present]).to(self._device)
            if rows.shape[1] != fps.shape[1]:
                fps = torch.zeros((len(self._params), rows.shape[1]), dtype=torch.int64, device=self._device)
            fps[torch.tensor([i for i, _ in present], device=self._device)] = rows
        # Everything stays on the device until one copy to the host at the end: O(1) synchronisations per audit,
        # not one per parameter or micro-batch.
        norms = torch.zeros(len(self._params), dtype=torch.float32, device=self._device)
        if present:
            norms[[i for i, _ in present]] = torch.stack(
                [torch.linalg.vector_norm(g, dtype=torch.float32) for _, g in present]).to(self._device)
        sketch_rows = torch.zeros((len(self._params), WIDTH), dtype=torch.float64, device=self._device)
        if self.mode == "tolerance" and present:
            sketch_rows[[i for i, _ in present]] = sketch([g for _, g in present]).to(self._device)
        scalars = [digest(fps).reshape(1).view(torch.float64)]  # the digest's bits, reinterpreted, not converted
        scalars += [loss.reshape(1).to(self._device) for loss in losses]
        host = torch.cat(scalars).cpu()
        fp = int(host[:1].view(torch.int64).item())
        return Result([float(x) for x in host[1:].tolist()], fp, norms.cpu(),
                       sketch_rows.cpu() if self.mode == "tolerance" else None)


def autocast_state(device: torch.device) -> tuple[bool, torch.dtype] | None:
    kind = device.type
    try:
        if torch.is_autocast_enabled(kind):
            return True, torch.get_autocast_dtype(kind)
    except (RuntimeError, TypeError):
        pass
    return None
