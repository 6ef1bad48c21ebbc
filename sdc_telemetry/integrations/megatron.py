"""Megatron-core integration: ``SDCMegatron``, for loops that run Megatron's pipeline schedules
(``get_forward_backward_func()``) on its ``DistributedDataParallel`` and step its optimizer.

    >>> from sdc_telemetry.megatron import SDCMegatron                          # doctest: +SKIP
    >>> run = SDCMegatron(ddp_model, optimizer, loss_fn=replay_loss, config=sdc.SDCConfig(on_suspect="raise"))
    >>> def forward_step(data_iterator, model):
    ...     batch = next(data_iterator)
    ...     run.micro_batch(batch)                                  # before the forward pass
    ...     output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    ...     return output, run.loss_func(partial(loss_func, batch["loss_mask"]))
    >>> with sdc.exit_on_sdc(run):
    ...     for step in range(steps):
    ...         ddp_model.zero_grad_buffer(); optimizer.zero_grad()
    ...         forward_backward_func(forward_step_func=forward_step, data_iterator=data, model=[ddp_model],
    ...                               num_microbatches=n, seq_length=s, micro_batch_size=b)
    ...         if run.finite:
    ...             optimizer.step()
    >>> run.close()

The loop keeps Megatron's schedule and optimizer. ``run.loss_func(f)`` returns ``f`` unchanged in behaviour; it only
records the loss each micro-batch's ``f`` returns. ``SDCMegatron`` wraps the DDP's ``finish_grad_sync`` (undone by
``close()``), which the schedule's ``finalize_model_grads`` calls once the last micro-batch's backward has run: the
step ends right after it, where the gradients are reduced and ``optimizer.step()`` has not run. The checks run there
on every rank and ``SDCDetected`` is raised from the schedule, before the update. A loop that reduces by hand calls
``ddp_model.finish_grad_sync()`` itself: the same.

``loss_fn(module, batch)`` recomputes one micro-batch's loss on the DDP's module for the replay: the loss your
``loss_func`` returns first, divided by its token count when it returns three values (as the schedule divides it;
not under ``calculate_per_token_loss``), before the schedule's division by the number of micro-batches. An open step
that no reduction followed (an evaluation's ``forward_only`` run with gradients on) is withdrawn, its step index given
back, when the next iteration calls ``ddp_model.zero_grad_buffer()``. What each check reads, and what is refused:
``parallel/megatron.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sdc_telemetry.core.config import SDCConfig
from sdc_telemetry.core.incident import Incident
from sdc_telemetry.integrations._backward import close_open
from sdc_telemetry.monitor import SDCMonitor
from sdc_telemetry.sinks.observer import Observer
from sdc_telemetry.step import StepContext

__all__ = ["SDCMegatron"]

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
_MARKER = "__sdc_megatron__"


class SDCMegatron:
    """Silent-data-corruption checks for a training loop on Megatron-core's ``DistributedDataParallel``.

    ``model``: the DDP-wrapped model (or Megatron's list of one model chunk); ``optimizer``: what
    ``get_megatron_optimizer`` returned; ``loss_fn(module, batch)``: a micro-batch's loss for the replay (see the
    module's docs); ``config``, ``start_step``, ``observer``: as for ``SDCMonitor``. ``monitor`` is the
    ``SDCMonitor``; ``sdc.exit_on_sdc(run)`` reads it."""

    def __init__(self, model: Any, optimizer: Any, *, loss_fn: LossFn, config: SDCConfig | None = None,
                 start_step: int = 0, observer: Observer | None = None) -> None:
        if isinstance(model, (list, tuple)):
            if len(model) != 1:
                raise ValueError(f"SDCMegatron takes one model chunk (no virtual pipeline stages), got {len(model)}")
            model = model[0]
        finish = getattr(model, "finish_grad_sync", None)
        if not callable(finish) or not hasattr(model, "ddp_config"):
            raise TypeError(f"model must be Megatron-core's DistributedDataParallel, got {type(model).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(module, batch), got {type(loss_fn).__name__}")
        if getattr(finish, _MARKER, None) is not None:
            raise ValueError("this model already has an SDCMegatron attached: close() it first")
        self.model = model
        self.monitor = SDCMonitor(model, optimizer, loss_fn=loss_fn, config=config, start_step=start_step,
                                  observer=observer)
        self._per_token = bool(getattr(model.config, "calculate_per_token_loss", False))
        self._step: StepContext | None = None  # open from the first micro-batch to finish_grad_sync
        self._last: StepContext | None = None
        self._micro = 0
        self._losses: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._finish = finish
        self._own_finish = "finish_grad_sync" in vars(model)
        model.finish_grad_sync = self._wrap(finish)
        self._zero = model.zero_grad_buffer
        self._own_zero = "zero_grad_buffer" in vars(model)
        model.zero_grad_buffer = self._wrap_zero(self._zero)

    def micro_batch(self, batch: Any) -> None:
        """Register the next micro-batch (call in ``forward_step_func``, before the forward pass): opens the
        monitor's step on the first micro-batch of an optimizer step. Does nothing once the monitor is closed, or
        with gradients off (an evaluation's ``forward_only`` run under ``torch.no_grad()``, as Megatron-LM runs it)."""
        if self.monitor.closed or not torch.is_grad_enabled():
            return
        if self._step is None:
            self._step = self.monitor.step().begin()
            self._micro, self._losses = 0, []
        self._step.micro_batch(batch)
        self._micro += 1

    def loss_func(self, loss_func: Callable[..., Any]) -> Callable[..., Any]:
        """``loss_func`` (what ``forward_step_func`` returns second), recording the loss it returns."""
        def sdc_loss_func(output_tensor: Any, *args: Any, **kwargs: Any) -> Any:
            outputs = loss_func(output_tensor, *args, **kwargs)
            if self._step is not None and not kwargs.get("non_loss_data", False) and torch.is_grad_enabled() \
                    and not self.monitor.closed:
                if not isinstance(outputs, tuple) or len(outputs) not in (2, 3):
                    raise ValueError("loss_func must return (loss, reported) or (loss, num_tokens, reported), as "
                                     f"Megatron's schedules expect; got {type(outputs).__name__}")
                # a copy: the schedule divides the loss in place next
                self._losses.append((outputs[0].detach().clone(), outputs[1] if len(outputs) == 3 else None))
            return outputs

        return sdc_loss_func

    def _wrap(self, finish: Callable[..., Any]) -> Callable[..., Any]:
        def finish_grad_sync(*args: Any, **kwargs: Any) -> Any:
            out = finish(*args, **kwargs)
            step = self._step
            if step is None or self.monitor.closed:
                return out
            self._step = None
            try:
                self._record(step)
            except BaseException as e:
                step.__exit__(type(e), e, e.__traceback__)  # abandoned on this rank
                raise
            self._last = step
            step.end()  # the checks, before optimizer.step(); SDCDetected from here
            return out

        setattr(finish_grad_sync, _MARKER, self)
        return finish_grad_sync

    def _wrap_zero(self, zero: Callable[..., Any]) -> Callable[..., Any]:
        def zero_grad_buffer(*args: Any, **kwargs: Any) -> Any:
            # A new iteration: a step still open registered micro-batches that no reduction followed (an evaluation
            # run with forward_only and gradients on): withdrawn unchecked, its index given back, on every rank
            step, self._step = self._step, None
            if step is not None and not self.monitor.closed:
                step.discard(give_back=True)
            return zero(*args, **kwargs)

        setattr(zero_grad_buffer, _MARKER, self)
        return zero_grad_buffer

    def _record(self, step: StepContext) -> None:
        """Each micro-batch's loss as the schedule backpropagated it: divided by its token count and the number of
        micro-batches (three values returned; with ``calculate_per_token_loss`` by neither: the reduction scales
        later), or by the number of micro-batches (two values)."""
        if len(self._losses) != self._micro:
            raise RuntimeError(f"{self._micro} micro-batches registered but {len(self._losses)} losses recorded: "
                               "return run.loss_func(loss_func) from forward_step_func")
        n = self._micro
        for loss, tokens in self._losses:
            scale = 1.0 / n
            if tokens is not None and self._per_token:
                scale = 1.0
            elif tokens is not None:
                loss = loss / torch.clamp(tokens, min=1)
            step.record_loss(loss.reshape(()), scale=scale)
        self._losses = []

    @property
    def finite(self) -> bool:
        """The last completed step's gradients were finite on every rank (the same answer everywhere)."""
        if self._last is None:
            raise RuntimeError("no step has ended yet: read run.finite after forward_backward_func")
        return self._last.finite

    @property
    def incidents(self) -> list[Incident]:
        return self.monitor.incidents

    def close(self) -> None:
        """Give ``finish_grad_sync`` back and close the monitor. Idempotent. A step still open is discarded
        unchecked (on an exception path: abandoned, no collective)."""
        for name, own, held in (("finish_grad_sync", self._own_finish, self._finish),
                                ("zero_grad_buffer", self._own_zero, self._zero)):
            if getattr(vars(self.model).get(name), _MARKER, None) is self:
                if own:
                    setattr(self.model, name, held)
                else:
                    delattr(self.model, name)  # the class's method again
        step, self._step = self._step, None
        close_open(step, self.monitor)

    def __enter__(self) -> SDCMegatron:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
