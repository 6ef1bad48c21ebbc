"""Hugging Face Accelerate integration: ``SDCAccelerate``, for loops written with ``accelerator.backward``.

    >>> from sdc_telemetry.accelerate import SDCAccelerate                     # doctest: +SKIP
    >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    >>> run = SDCAccelerate(accelerator, model, optimizer, loss_fn=compute_loss,
    ...                     config=sdc.SDCConfig(replay_every=50, on_suspect="raise"))
    >>> with sdc.exit_on_sdc(run):
    ...     for batch in loader:
    ...         with accelerator.accumulate(model):
    ...             run.micro_batch(batch)           # before the forward pass
    ...             loss = compute_loss(model, batch)
    ...             accelerator.backward(loss)       # recorded; the checks run in the last micro-batch's backward
    ...             optimizer.step()
    ...             optimizer.zero_grad()
    >>> run.close()

The loop keeps ``accelerator.backward(loss)``: ``SDCAccelerate`` wraps that method on the accelerator it is given
(undone by ``close()``). Each call records the micro-batch's loss with what Accelerate applies before its backward
(``1 / gradient_accumulation_steps``, then its ``GradScaler`` under fp16 mixed precision), so that the replay
recomputes the same gradients, then runs Accelerate's backward. The monitor's step opens at the first micro-batch
``micro_batch(batch)`` registers (capturing its RNG state for the replay) and ends right after the backward of the
micro-batch on which Accelerate synchronises gradients (``accelerator.sync_gradients``: the last one of an
``accelerator.accumulate`` window, or every one without accumulation). That is where every rank runs the checks,
after the gradients are reduced and before ``optimizer.step()`` applies them, and where ``SDCDetected`` is raised
on every rank at the same step.

- The optimizer ``accelerator.prepare`` returns (``AcceleratedOptimizer``) is accepted as it is; the monitor hooks
  the torch optimizer inside it. ``skip_nonfinite=True`` makes that optimizer skip the update of a step whose
  gradients were not finite on every rank (a NaN in one rank's batch never reaches the weights), the same way on
  every rank, as the fp16 scaler skips an overflow.
- ``loss_fn(module, batch)`` recomputes a micro-batch's loss for the replay on the unwrapped model; under bf16 or
  fp16 mixed precision Accelerate's autocast sits on that model's ``forward``, so the replay runs it too.
- Layouts: single process, DDP, and Accelerate's FSDP2 plugin (``fsdp_version=2``: the monitor reads the mesh from
  the sharded parameters). DeepSpeed, Megatron-LM, FSDP1 and XLA are refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sdc_telemetry.core.config import SDCConfig
from sdc_telemetry.integrations._backward import WrappedBackward
from sdc_telemetry.monitor import SDCMonitor
from sdc_telemetry.sinks.observer import Observer

__all__ = ["SDCAccelerate"]

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]

# Accelerate's DistributedType values this integration refuses, with why.
_REFUSED = {
    "DEEPSPEED": "DeepSpeed runs its own backward and partitions the optimizer",
    "MEGATRON_LM": "Megatron-LM runs its own backward inside its train step",
    "XLA": "XLA devices are not supported",
}


class SDCAccelerate(WrappedBackward):
    """Silent-data-corruption checks for a training loop on an ``accelerate.Accelerator``.

    ``accelerator``: the Accelerator that prepared ``model`` and ``optimizer``; ``model``: the prepared model (the
    DDP wrapper, the FSDP2 module, or the plain module in one process); ``optimizer``: the prepared optimizer;
    ``loss_fn(module, batch)``: a micro-batch's loss, as the loop computes it (the replay calls it on the unwrapped
    model); ``config``, ``start_step``, ``observer``: as for ``SDCMonitor``; ``skip_nonfinite``: see the module.
    ``monitor`` is the ``SDCMonitor`` (its ``incidents`` stay readable after ``close()``); ``sdc.exit_on_sdc(run)``
    reads it.
    """

    call = "accelerator.backward()"
    marker = "__sdc_accelerate__"

    def __init__(self, accelerator: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 loss_fn: LossFn, config: SDCConfig | None = None, start_step: int = 0,
                 observer: Observer | None = None, skip_nonfinite: bool = False) -> None:
        backward = getattr(accelerator, "backward", None)
        if not callable(backward) or not hasattr(accelerator, "sync_gradients"):
            raise TypeError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(module, batch), got {type(loss_fn).__name__}")
        if not isinstance(skip_nonfinite, bool):
            raise TypeError(f"skip_nonfinite must be a bool, got {type(skip_nonfinite).__name__}")
        kind = str(getattr(accelerator.distributed_type, "name", accelerator.distributed_type))
        if kind in _REFUSED:
            raise ValueError(f"SDCAccelerate does not support Accelerate's {kind} mode: {_REFUSED[kind]}")
        if kind == "FSDP" and not getattr(accelerator, "is_fsdp2", False):
            raise ValueError("SDCAccelerate supports Accelerate's FSDP plugin with fsdp_version=2 (fully_shard), "
                             "not FSDP1")
        self.free(accelerator)
        self.accelerator = accelerator
        monitor = SDCMonitor(model, optimizer, loss_fn=loss_fn, config=config, start_step=start_step,
                             observer=observer)
        try:
            if skip_nonfinite:
                monitor.skip_nonfinite_updates()
        except BaseException:
            monitor.close()
            raise
        super().__init__(accelerator, monitor)

    def _scale(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[float, Any]:
        """What Accelerate's backward does to the loss: divide by the accumulation steps, then its scaler."""
        return 1.0 / self.accelerator.gradient_accumulation_steps, self.accelerator.scaler

    def _ends_step(self, before: bool | None) -> bool:
        return bool(self.accelerator.sync_gradients)

    def __enter__(self) -> SDCAccelerate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
