"""StepContext: one optimizer step of the training loop, as the monitor sees it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .checks.replay import scaled

if TYPE_CHECKING:
    from .monitor import SDCMonitor

__all__ = ["StepContext", "NO_BATCH"]

NO_BATCH = object()


class StepContext:
    """One optimizer step, opened by ``monitor.step(batch)``.

    ``backward(loss)`` runs ``loss.backward()`` and records the loss. With gradient accumulation, open the step with
    no batch and register each micro-batch before its forward pass::

        with monitor.step() as step:
            for i, mb in enumerate(micro_batches):
                step.micro_batch(mb)                      # captures RNG state and the micro-batch
                sync = i == len(micro_batches) - 1
                with (nullcontext() if sync else ddp_model.no_sync()):
                    step.backward(compute_loss(ddp_model, mb), scale=1 / len(micro_batches))
        optimizer.step()

    ``scale`` multiplies the loss before backward (the monitor applies it, so that replay applies it identically).
    """

    def __init__(self, monitor: SDCMonitor, batch: Any) -> None:
        self._monitor = monitor
        self._batch = batch
        self._active = False
        self.index = -1

    def __enter__(self) -> StepContext:
        self.index = self._monitor._open_step()
        self._active = True
        if self._batch is not NO_BATCH:
            self.micro_batch(self._batch)
        return self

    def __exit__(self, *exc: object) -> None:
        self._active = False

    def micro_batch(self, batch: Any) -> None:
        """Register the next micro-batch of this step (call before its forward pass)."""
        self._require_active("micro_batch")
        self._monitor._micro_batch(batch)

    def backward(self, loss: torch.Tensor, *, scale: float = 1.0) -> None:
        """``(loss * scale).backward()``, recording ``loss`` for the replay check."""
        self._require_active("backward")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"step.backward() needs a scalar loss tensor, got {type(loss).__name__}"
                             + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
        self._monitor._record_loss(loss, scale)
        scaled(loss, scale).backward()  # type: ignore[no-untyped-call]

    def _require_active(self, what: str) -> None:
        if not self._active:
            raise RuntimeError(f"step.{what}() called outside its `with monitor.step(...) as step:` block")
