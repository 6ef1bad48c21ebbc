"""How a replica recomputes an origin's micro-batches: losses and accumulated local gradients, reduced to rows.

``Recomputer.run(micro)`` reruns the micro-batches under the origin's RNG and autocast state without touching
``.grad``, buffers, RNG or DDP state, and returns per-micro-batch losses, the gradient digest, per-parameter norms
and (tolerance mode) block sketches, with one copy to the host. Three ways to get the gradients:

- ``torch.autograd.grad`` (the default), with a hook on each parameter that reads its gradient as the engine
  produces it: nothing is accumulated anywhere;
- ``backward()`` into ``.grad``, saved before and restored after, with a post-accumulate-grad hook on each parameter
  (reentrant activation checkpointing refuses ``autograd.grad``; switched to once, on the first such error);
- a lockstep layout's ``recompute(params, run_backward, take)`` (FSDP2: every rank recomputes through the sharded
  model), which hands each parameter's gradient to ``take`` as it is accumulated.

Streaming: a parameter's rows (fingerprint, float32 norm, sketch in tolerance mode) are taken the moment its
gradient is final, and the gradient is dropped at once; the rows are the same values as those of the whole gradient
(each row depends on its own tensor only). A gradient is final when the last micro-batch's backward accumulates it.
With gradient accumulation the origin's reduction consumed the sum over the step's micro-batches (``no_sync``: what
``.grad`` holds at the last backward), so the running sum of each parameter is held until the last micro-batch, as
training holds it: the audit holds at most one parameter's gradient (one micro-batch), or one local gradient of
the model (several). A parameter that receives its gradient in several pieces within one backward (shared by two
reentrant checkpointed regions) is held until the backward ends; that is learned when it first happens (the
recomputation is redone, or, in lockstep, the audit is an error once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from sdc_telemetry.checks.shipping import MicroBatch
from sdc_telemetry.checks.sketch import WIDTH, sketch
from sdc_telemetry.core.fingerprint import digest, fingerprint

__all__ = ["Recomputer", "Recompute", "Take", "Result", "scaled", "autocast_state", "pipeline_loss"]

# ``take(i, grad, divide)``: one accumulation of parameter i's local gradient, as the reduction would consume it (the
# reduce dtype), owned by the callee (nothing else refers to it); ``divide``: the factor the reduction's input is
# divided by once accumulated over the micro-batches (None: not divided).
Take = Callable[[int, torch.Tensor, "float | None"], None]
# A lockstep layout's recomputation (FSDP2): run_backward on every rank at once, each accumulation handed to ``take``
# as it happens (nothing reaches ``.grad``).
Recompute = Callable[[Sequence[torch.nn.Parameter], Callable[[], None], Take], None]


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


class _Again(Exception):
    """A parameter's gradient arrived after its rows were taken: recompute, now holding it to the end."""


class _Stream:
    """Each parameter's recomputed local gradient, accumulated over the micro-batches and reduced to its rows the
    moment it is final (then dropped)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], device: torch.device, sketching: bool, micro: int,
                 held: set[int], into: Sequence[torch.dtype | None] | None = None) -> None:
        n = len(params)
        # per parameter, the dtype of the zeroed buffer its framework adds each local gradient into (Megatron's
        # main_grad, fp32 for a bf16 parameter): each piece is added into zeros of that dtype, as the framework does
        self.into = into
        self.params = params
        self.device = device
        self.count = micro
        self.micro = 0
        self.held = held  # learned: parameters whose gradient comes in several pieces per backward
        self.acc: list[torch.Tensor | None] = [None] * n
        self.divide: list[float | None] = [None] * n
        self.done = [False] * n
        self.late: list[int] = []
        self._fired: set[int] = set()
        self.fps: torch.Tensor | None = None
        self.norms = torch.zeros(n, dtype=torch.float32, device=device)
        self.sketch = torch.zeros((n, WIDTH), dtype=torch.float64, device=device) if sketching else None

    def begin(self, k: int) -> None:
        """Micro-batch ``k``'s backward starts."""
        self.micro = k
        self._fired.clear()

    def _note(self, i: int) -> bool:
        """A piece of parameter i's gradient arrived; False when its rows were already taken (too late)."""
        if i in self._fired:
            self.held.add(i)
        self._fired.add(i)
        if self.done[i]:
            self.late.append(i)
            return False
        return True

    def _final_now(self, i: int) -> bool:
        return self.micro == self.count - 1 and i not in self.held

    def piece(self, i: int, grad: torch.Tensor, *, owned: bool, had: bool = False, divide: float | None = None
              ) -> None:
        """One accumulation (autograd.grad, a lockstep layout): summed as ``.grad`` sums, in place when ``owned``."""
        if not self._note(i):
            return
        into = self.into[i] if self.into is not None else None
        prev = self.acc[i]
        self.acc[i] = None
        if into is not None and prev is None:
            prev = torch.zeros_like(grad, dtype=into)  # the framework's zeroed buffer: 0.0 + g, in its dtype
        if prev is None and had:
            prev = torch.zeros_like(grad)  # zero_grad(set_to_none=False): .grad = 0.0 + g
        if prev is None:
            total = grad
        else:
            total = prev.add_(grad) if owned else prev + grad  # the order autograd accumulates .grad in
        del prev, grad
        self.divide[i] = divide
        if self._final_now(i):
            self._take(i, total)
        else:
            self.acc[i] = total

    def accumulated(self, i: int, p: torch.nn.Parameter) -> None:
        """backward() into .grad: autograd accumulated into ``p.grad``; taken (and dropped) when final, or at once
        where the framework adds each gradient into a buffer of its own (``into``)."""
        if self.into is not None and self.into[i] is not None:
            if p.grad is not None:
                grad, p.grad = p.grad, None
                self.piece(i, grad, owned=True)
            return
        if self._note(i) and self._final_now(i) and p.grad is not None:
            grad, p.grad = p.grad, None
            self._take(i, grad)

    def settle(self, zeros: bool, fields: bool = False) -> None:
        """After the last backward: the held and the earlier-only gradients; a trainable parameter with no gradient
        at all is a zero slot where the origin's reduction had one (``zeros``: DDP), else an empty row."""
        for i, p in enumerate(self.params):
            if self.done[i]:
                continue
            grad = self.acc[i]
            self.acc[i] = None
            if fields and p.grad is not None:
                grad, p.grad = p.grad, None
            if grad is None and zeros:
                grad = torch.zeros_like(p)
            if grad is not None:
                self._take(i, grad)
            del grad
            self.done[i] = True

    def _take(self, i: int, grad: torch.Tensor) -> None:
        self.done[i] = True
        divide = self.divide[i]
        if divide is not None:
            grad = grad.div_(divide)  # FSDP's pre-division of the reduce-scatter input (fp16)
        row = fingerprint([grad]).to(self.device)
        if self.fps is None:
            self.fps = torch.zeros((len(self.params), row.shape[1]), dtype=torch.int64, device=self.device)
        self.fps[i] = row[0]
        self.norms[i] = torch.linalg.vector_norm(grad, dtype=torch.float32).to(self.device)
        if self.sketch is not None:
            self.sketch[i] = sketch([grad])[0].to(self.device)


def _released(grad: torch.Tensor) -> torch.Tensor:
    """What a gradient hook returns to autograd.grad once the rows are taken: zeros without storage (an expanded
    scalar), so the engine keeps nothing of the size of the gradient until it returns."""
    return torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape)


class Recomputer:
    """Recomputes micro-batches for the replay (one per ReplayCheck)."""

    def __init__(self, module: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None,
                 params: Sequence[torch.nn.Parameter], device: torch.device, mode: str,
                 lockstep: Recompute | None = None, *, rerun: Callable[..., Any] | None = None,
                 grad_fields: bool = True, quiet: Callable[[], AbstractContextManager[None]] | None = None,
                 rng: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
                 into: Sequence[torch.dtype | None] | None = None) -> None:
        self._module = module
        self._loss_fn = loss_fn
        self._params = list(params)
        self._device = device
        self.mode = mode
        self.lockstep = lockstep
        self.rerun = rerun  # a pipeline stage: the partner replica reruns the origin's whole schedule step
        self.through_grad_fields = False  # recompute through .grad (reentrant checkpointing), not autograd.grad
        self.grad_fields = grad_fields  # that fallback is allowed (Layout.grad_fields)
        self._quiet = quiet or nullcontext  # the context it runs in (Layout.recomputing)
        self._rng = rng  # a framework's own RNG states: (get, set) (Layout.rng_state, Layout.set_rng_state)
        self._into = into  # per parameter: the dtype its local gradient accumulates in (Layout.accumulates_in)
        self.replaying = False  # a recomputation is running (the forward pre-hook must not capture it)
        self._held: set[int] = set()  # parameters whose gradient arrives in several pieces per backward

    def run(self, micro: Sequence[MicroBatch]) -> Result:
        """Recompute losses and accumulated local gradients without touching .grad, buffers, RNG or DDP state."""
        for _ in range(len(self._params) + 1):  # each redo holds one more parameter: a handful at most
            try:
                return self._run(micro)
            except _Again:
                continue
        raise RuntimeError("replay could not stream the recomputed gradients (they kept arriving in pieces)")

    def _run(self, micro: Sequence[MicroBatch]) -> Result:
        losses: list[torch.Tensor] = []
        with self._preserved():
            if self.rerun is not None:
                return self._rerun_schedule(micro, losses)
            if self.lockstep is not None and not getattr(self.lockstep, "by_grad", False):
                return self._lockstep(micro, losses)
            if not self.through_grad_fields:
                try:
                    return self._by_grad(micro, losses)
                except RuntimeError as e:
                    if "checkpoint" not in str(e).lower():
                        raise
                    if not self.grad_fields:
                        raise RuntimeError("reentrant activation checkpointing refuses autograd.grad(), and this "
                                           "layout cannot recompute through .grad (its framework reduces what "
                                           "accumulates there): the replay cannot run; checkpoint with "
                                           "use_reentrant=False") from e
                    # Reentrant activation checkpointing runs its own backward into .grad and refuses
                    # autograd.grad(): from now on this model is recomputed through .grad, saved and restored.
                    self.through_grad_fields = True
                    losses.clear()
            return self._by_backward(micro, losses)

    def _stream(self, micro: Sequence[MicroBatch]) -> _Stream:
        return _Stream(self._params, self._device, self.mode == "tolerance", len(micro), self._held, self._into)

    def _lockstep(self, micro: Sequence[MicroBatch], losses: list[torch.Tensor]) -> Result:
        """FSDP2: forward and backward through the sharded model (every rank at once), gradient sync off, each
        parameter's unsharded gradient handed over in the reduce dtype (what the tap recorded)."""
        assert self.lockstep is not None
        stream = self._stream(micro)

        def take(i: int, grad: torch.Tensor, divide: float | None) -> None:
            stream.piece(i, grad, owned=True, divide=divide)

        self.lockstep(self._params, lambda: self._backward_each(micro, stream, losses), take)
        stream.settle(zeros=False)
        if stream.late:  # every rank finished the collectives; the next audits hold these parameters
            raise RuntimeError(f"the gradient of parameter {stream.late[0]} arrived in several pieces within one "
                               "backward (a parameter shared by reentrant checkpointed regions): this audit is not "
                               "measured; later audits hold it until the backward ends")
        return self._result(losses, stream)

    def _rerun_schedule(self, micro: Sequence[MicroBatch], losses: list[torch.Tensor]) -> Result:
        """A pipeline stage: every stage of this replica reruns the origin replica's schedule step at once (the
        stage-to-stage sends line up), with the origin's same-stage RNG states; nothing reaches ``.grad`` or the
        schedule's state. The recorded loss is the last stage's sum of micro-batch losses (0 elsewhere)."""
        assert self.rerun is not None
        if len(micro) != 1:
            raise RuntimeError(f"a pipeline step is one replay unit (one step.pipeline_step() per step), got "
                               f"{len(micro)} micro-batches")
        mb = micro[0]
        inputs, target, kwargs = mb.batch
        result = self.rerun(*inputs, target=target, cpu_rng=mb.cpu_rng, dev_rng=mb.dev_rng, had_grad=mb.had_grad,
                            params=self._params, autocast=mb.autocast, **kwargs)
        losses.append(pipeline_loss(result.losses, self._device))
        stream = self._stream(micro)
        stream.begin(0)
        grads = result.grads
        del result
        for i in range(len(grads)):
            grad, grads[i] = grads[i], None
            if grad is not None:
                stream.piece(i, grad, owned=True)
            del grad
        stream.settle(zeros=True)  # DDP's reduction zero-fills a parameter without a gradient
        return self._result(losses, stream)

    def _by_grad(self, micro: Sequence[MicroBatch], losses: list[torch.Tensor]) -> Result:
        """autograd.grad, with a hook per parameter that hands its gradient to the stream and releases it: nothing
        is accumulated anywhere (no .grad, no accumulation hooks such as DDP's)."""
        stream = self._stream(micro)
        mb_of: list[MicroBatch] = [micro[0]]

        def hook_for(i: int) -> Callable[[torch.Tensor], torch.Tensor]:
            def hook(grad: torch.Tensor) -> torch.Tensor:
                had = mb_of[0].had_grad is not None and mb_of[0].had_grad[i]
                stream.piece(i, grad, owned=False, had=had)
                return _released(grad)
            return hook

        trainable = [p for p in self._params if p.requires_grad]
        handles = [p.register_hook(hook_for(i))  # type: ignore[no-untyped-call]
                   for i, p in enumerate(self._params) if p.requires_grad]
        try:
            for k, mb in enumerate(micro):
                loss = self._loss_of(mb)
                mb_of[0] = mb
                stream.begin(k)
                grads = torch.autograd.grad(scaled(loss, mb.scale, mb.grad_scale), trainable, allow_unused=True)
                del grads
                losses.append(loss.detach().double())
                del loss
        finally:
            for h in handles:
                h.remove()
        stream.settle(zeros=True)
        return self._result(losses, stream)

    def _by_backward(self, micro: Sequence[MicroBatch], losses: list[torch.Tensor]) -> Result:
        """backward() into .grad, which is saved before and restored after, exactly (the same tensors); each
        parameter's .grad is read and dropped by a post-accumulate-grad hook when final."""
        stream = self._stream(micro)
        saved = [p.grad for p in self._params]
        handles = []
        try:
            for i, p in enumerate(self._params):
                had = micro[0].had_grad is not None and micro[0].had_grad[i]
                p.grad = torch.zeros_like(p) if had else None  # zero_grad(set_to_none=False) leaves zeros
                if p.requires_grad:
                    handles.append(p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                        lambda q, i=i: stream.accumulated(i, q)))
            with self._quiet():
                self._backward_each(micro, stream, losses)
            for h in handles:
                h.remove()
            handles.clear()
            if stream.late:  # rows taken before the last piece: redo, holding those parameters to the end
                raise _Again()
            stream.settle(zeros=True, fields=True)
        finally:
            for h in handles:
                h.remove()
            for p, g in zip(self._params, saved, strict=True):
                p.grad = g
        return self._result(losses, stream)

    def _backward_each(self, micro: Sequence[MicroBatch], stream: _Stream, losses: list[torch.Tensor]) -> None:
        """Forward and backward of each micro-batch in turn, as the step ran them, telling the stream which one."""
        for k, mb in enumerate(micro):
            loss = self._loss_of(mb)
            stream.begin(k)
            scaled(loss, mb.scale, mb.grad_scale).backward()  # type: ignore[no-untyped-call]
            losses.append(loss.detach().double())
            del loss

    def framework_rng(self) -> Any:
        """The framework's own RNG states now (captured with each micro-batch), None without any."""
        return self._rng[0]() if self._rng is not None else None

    def _set_framework_rng(self, state: Any) -> None:
        if self._rng is not None and state is not None:
            self._rng[1](state)

    def _loss_of(self, mb: MicroBatch) -> torch.Tensor:
        """The micro-batch's loss under the origin's RNG and autocast state."""
        self._set_framework_rng(mb.framework_rng)
        torch.set_rng_state(mb.cpu_rng)
        if mb.dev_rng is not None and self._device.type == "cuda":
            torch.cuda.set_rng_state(mb.dev_rng, self._device)
        ctx = (torch.autocast(self._device.type, dtype=mb.autocast[1])
               if mb.autocast is not None and mb.autocast[0] else nullcontext())
        with torch.enable_grad(), ctx:
            if self._loss_fn is None:
                raise RuntimeError("replay needs loss_fn(module, batch) -> scalar loss")
            return self._loss_fn(self._module, mb.batch)

    @contextmanager
    def _preserved(self) -> Iterator[None]:
        """Buffers and RNG states as they were before the recomputation, whatever happens in it."""
        cpu_rng = torch.get_rng_state()
        dev_rng = torch.cuda.get_rng_state(self._device) if self._device.type == "cuda" else None
        framework_rng = self.framework_rng()
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
            self._set_framework_rng(framework_rng)

    def _result(self, losses: list[torch.Tensor], stream: _Stream) -> Result:
        fps = stream.fps if stream.fps is not None else torch.zeros((len(self._params), 1), dtype=torch.int64,
                                                                    device=self._device)
        # Everything stays on the device until one copy to the host at the end: O(1) synchronisations per audit,
        # not one per parameter or micro-batch.
        scalars = [digest(fps).reshape(1).view(torch.float64)]  # the digest's bits, reinterpreted, not converted
        scalars += [loss.reshape(1).to(self._device) for loss in losses]
        host = torch.cat(scalars).cpu()
        fp = int(host[:1].view(torch.int64).item())
        return Result([float(x) for x in host[1:].tolist()], fp, stream.norms.cpu(),
                       stream.sketch.cpu() if stream.sketch is not None else None)


def pipeline_loss(losses: Sequence[torch.Tensor] | None, device: torch.device) -> torch.Tensor:
    """The loss a pipeline stage records for its step: the last stage's per-micro-batch losses summed in float64 in
    order (bitwise reproducible), 0 on the other stages."""
    if not losses:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([loss.detach().double().reshape(()).to(device) for loss in losses]).sum()


def autocast_state(device: torch.device) -> tuple[bool, torch.dtype] | None:
    kind = device.type
    try:
        if torch.is_autocast_enabled(kind):
            return True, torch.get_autocast_dtype(kind)
    except (RuntimeError, TypeError):
        pass
    return None
