"""StepContext: one optimizer step of the training loop, as the monitor sees it."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from sdc_telemetry.checks.replay import scaled

__all__ = ["StepContext", "StepDriver", "NO_BATCH"]

NO_BATCH = object()


class StepDriver(Protocol):
    """The small surface of the monitor a step uses (``SDCMonitor`` implements it)."""

    def open_step(self) -> int: ...

    def capture(self, batch: Any) -> None: ...

    def record_loss(self, loss: torch.Tensor, scale: float, grad_scale: torch.Tensor | None) -> None: ...

    def pipeline_step(self, inputs: tuple[Any, ...], target: Any, kwargs: dict[str, Any]
                      ) -> list[torch.Tensor] | None: ...

    def abandon_step(self) -> None: ...

    def discard_step(self, give_back: bool = False) -> None: ...

    def end_step(self) -> None: ...

    def step_finite(self, index: int) -> bool: ...


class StepContext:
    """One optimizer step, opened by ``monitor.step(batch)``. The checks run when the block ends, on every rank,
    before ``optimizer.step()``; that is where ``SDCDetected`` is raised.

    ``backward(loss)`` runs ``loss.backward()`` and records the loss. With gradient accumulation, open the step with
    no batch and register each micro-batch before its forward pass::

        with monitor.step() as step:
            for i, mb in enumerate(micro_batches):
                step.micro_batch(mb)                      # captures RNG state and the micro-batch
                sync = i == len(micro_batches) - 1
                with (nullcontext() if sync else ddp_model.no_sync()):
                    step.backward(compute_loss(ddp_model, mb), scale=1 / len(micro_batches))
        optimizer.step()

    ``scale`` multiplies the loss before backward, and ``scaler`` (a ``torch.amp.GradScaler``) scales it after
    that: the monitor applies both, so that a replay reproduces the same gradients. Pass the unscaled, undivided
    loss.

    After the block, ``step.finite`` says whether the step's gradients were finite on every rank (the same answer
    everywhere): ``if step.finite: optimizer.step()`` keeps a bad batch's NaN out of the weights, as
    ``GradScaler.step`` does for overflows.

    Frameworks that run backward themselves use the same object without ``with``: ``ctx = monitor.step(batch)``,
    ``ctx.begin()``, ``ctx.record_loss(loss, scale=..., scaler=...)`` before their backward, ``ctx.end()`` once
    the gradients are reduced (every rank).
    """

    def __init__(self, monitor: StepDriver, batch: Any) -> None:
        self._monitor = monitor
        self._batch = batch
        self._active = False
        self._done = False
        self.index = -1

    def __enter__(self) -> StepContext:
        return self.begin()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            if self._active:
                self._active = False
                self._monitor.abandon_step()
            return
        self.end()

    def begin(self) -> StepContext:
        """Open the step (``with`` does it)."""
        if self._done or self._active:
            raise RuntimeError("a StepContext opens once: call monitor.step() for every step")
        self.index = self._monitor.open_step()
        self._active = True
        if self._batch is not NO_BATCH:
            try:
                self.micro_batch(self._batch)
            except BaseException:
                # ``with`` never calls __exit__ when __enter__ raises: close the step here (abandoned on this rank),
                # so that the next monitor.step() opens normally.
                self._active = False
                self._monitor.abandon_step()
                raise
        return self

    def end(self) -> None:
        """Close the step and run its checks (collective: every rank, after the gradients are reduced)."""
        self._require_active("end")
        self._active = False
        self._done = True
        self._monitor.end_step()

    def discard(self, *, give_back: bool = False) -> None:
        """Close the step without checking it, every rank alike: a loop that ends inside a gradient-accumulation
        window (its gradients were never reduced). The monitor goes on normally (``close()`` still settles).
        ``give_back``: the next step reuses this one's index (it registered micro-batches but no backward ran: a
        framework's evaluation pass through the training's forward function)."""
        self._require_active("discard")
        self._active = False
        self._done = True
        self._monitor.discard_step(give_back)

    @property
    def finite(self) -> bool:
        """The step's local and reduced gradients were finite on every rank: read after the block, before the update
        (``if step.finite: optimizer.step()``); every rank gets the same answer, so every rank skips alike. With
        ``SDCConfig(verdicts="deferred")`` on a GPU, reading it waits for the step's agreement (one host wait)."""
        if not self._done:
            raise RuntimeError("step.finite is read after the step's `with monitor.step(...)` block ends")
        return self._monitor.step_finite(self.index)

    def micro_batch(self, batch: Any) -> None:
        """Register the next micro-batch of this step (call before its forward pass)."""
        self._require_active("micro_batch")
        self._monitor.capture(batch)

    def backward(self, loss: torch.Tensor, *, scale: float = 1.0, scaler: Any = None) -> None:
        """``(loss * scale)`` (then ``scaler.scale(...)``) ``.backward()``, recording ``loss`` for the replay."""
        grad_scale = self._record(loss, scale, scaler)
        scaled(loss, scale, grad_scale).backward()  # type: ignore[no-untyped-call]

    def pipeline_step(self, *inputs: Any, target: Any = None, **kwargs: Any) -> list[torch.Tensor] | None:
        """Under ``SDCMonitor(stage_module, optimizer, pipeline=schedule)``: one ``schedule.step`` with what this stage
        needs (``inputs`` on the first stage, ``target`` on the last; every stage may pass both). Returns the
        per-micro-batch losses on the last stage, else None. Once per step; the replay reruns the whole schedule step
        on a partner replica with this batch and this step's RNG states."""
        self._require_active("pipeline_step")
        return self._monitor.pipeline_step(inputs, target, kwargs)

    def record_loss(self, loss: torch.Tensor, *, scale: float = 1.0, scaler: Any = None) -> None:
        """Record a micro-batch's loss without running backward (the framework runs it): the backpropagated tensor
        must be ``loss * scale``, then scaled by ``scaler`` if one is given."""
        self._record(loss, scale, scaler)

    def _record(self, loss: torch.Tensor, scale: float, scaler: Any) -> torch.Tensor | None:
        """Check and record a micro-batch's loss; returns the scaler's scale it is backpropagated with."""
        self._require_active("record_loss")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"step.backward() needs a scalar loss tensor, got {type(loss).__name__}"
                             + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise ValueError(f"scale must be a positive number (1 / micro-batches), got {scale!r}")
        if scaler is not None and not callable(getattr(scaler, "scale", None)):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        grad_scale = _grad_scale(scaler, loss)
        self._monitor.record_loss(loss, float(scale), grad_scale)
        return grad_scale

    def _require_active(self, what: str) -> None:
        if not self._active:
            raise RuntimeError(f"step.{what}() called outside its `with monitor.step(...) as step:` block")


def _grad_scale(scaler: Any, loss: torch.Tensor) -> torch.Tensor | None:
    """The scaler's current scale as a tensor on the loss's device (None without an enabled scaler)."""
    if scaler is None or not scaler.is_enabled():
        return None
    if getattr(scaler, "_scale", None) is None:
        scaler.scale(loss.detach())  # a GradScaler creates its scale tensor lazily, on first use
    scale: torch.Tensor = scaler._scale
    return scale.to(device=loss.device, non_blocking=True)
