"""Hugging Face ``Trainer`` integration: ``SDCTrainer`` (or ``SDCTrainerMixin`` for a Trainer subclass of yours).

    >>> from sdc_telemetry.transformers import SDCTrainer                     # doctest: +SKIP
    >>> trainer = SDCTrainer(model=model, args=args, train_dataset=data,
    ...                      sdc_config=sdc.SDCConfig(replay_every=50, on_suspect="raise"))
    >>> trainer.train()

    >>> class MyTrainer(SDCTrainerMixin, SFTTrainer): ...                     # doctest: +SKIP

Why a Trainer subclass and not a ``TrainerCallback``: the monitor must register each micro-batch (with its RNG
state) before its forward pass and record its loss before its backward pass, and ``TrainerCallback`` events see
neither the micro-batches nor the losses (``on_step_begin`` fires once per optimizer step, nothing fires between a
micro-batch's forward and backward). So the mixin overrides ``compute_loss`` (called by ``training_step`` right
before the forward pass, returning the loss right before ``accelerator.backward``) and adds an internal callback for
the points where events suffice:

- ``on_train_begin``: builds the monitor from ``trainer.model_wrapped`` (the DDP wrapper Accelerate built; the plain
  model in one process) and the optimizer, counting steps from ``state.global_step`` (resume goes on from the
  checkpoint's step).
- ``compute_loss`` during ``training_step``: opens the step on its first micro-batch, registers the micro-batch and
  records the loss with the factor the Trainer applies before backward: ``1 / current_gradient_accumulation_steps``
  unless the loss is already normalised over the accumulated batch (``num_items_in_batch``, the default for models
  that accept loss kwargs, such as GPT-2). A mixed-precision ``GradScaler`` is passed on too.
- ``on_pre_optimizer_step``: ends the step and runs the checks. Every rank reaches it after the last micro-batch's
  backward (gradients reduced) and before ``optimizer.step()``, also when the scaler then skips the update on one
  rank. ``SDCDetected`` raised here propagates out of ``trainer.train()`` on every rank at the same step.
- ``_save_checkpoint`` (the Trainer's save of ``checkpoint-N``, on every rank): certifies the weights first
  (``monitor.certificate()``, collective, labelled with ``state.global_step``, the ``N`` of ``checkpoint-N``) and
  writes ``sdc_certificate.json`` into the checkpoint directory from the process that saves (``args.should_save``)
  before the Trainer writes the model there, so that a hub push of the checkpoint carries it too. A checkpoint saved
  with nothing to certify (a hardware suspect still open with ``on_suspect="record"``) carries no certificate, and
  the reason is logged. ``sdc-telemetry verify-checkpoint checkpoint-N`` checks the directory.
- ``on_train_end``, and the end of ``train()`` whatever happened: close the monitor.

The replay recomputes a micro-batch with the Trainer's own ``compute_loss`` on the unwrapped model (the same code,
so a subclass's ``compute_loss``, label smoothing or ``compute_loss_func`` are replayed as trained), with the
micro-batch's ``num_items_in_batch``. DeepSpeed and FSDP are not supported.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from sdc_telemetry.core.config import SDCConfig
from sdc_telemetry.integrations._certify import certify, write_certificate
from sdc_telemetry.monitor import SDCMonitor
from sdc_telemetry.sinks.observer import Observer
from sdc_telemetry.step import StepContext

__all__ = ["SDCTrainer", "SDCTrainerMixin"]

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]

_INPUTS, _NUM_ITEMS = "inputs", "num_items_in_batch"

log = logging.getLogger("sdc_telemetry")


class SDCTrainerMixin:
    """Adds silent-data-corruption checks to a ``transformers.Trainer`` subclass; put it first in the bases.

    Keyword arguments (the rest go to the Trainer): ``sdc_config``, the monitor's ``SDCConfig``
    (``SDCConfig.from_env()`` when None); ``sdc_loss_fn(module, inputs)``, to recompute a micro-batch's loss for the
    replay instead of the Trainer's ``compute_loss``: it gets the unwrapped model and the micro-batch's inputs dict
    and must return what ``compute_loss`` returned for it; ``sdc_observer``, replacing the telemetry built from the
    config; ``sdc_skip_nonfinite=True``, skipping the update of a step whose gradients were not finite on every rank
    (a NaN in one rank's batch never reaches the weights), the same way on every rank, as a ``GradScaler`` skips an
    overflow. ``sdc_monitor`` is the running ``SDCMonitor`` (None before ``train()``); its ``incidents`` stay
    readable after training.
    """

    def __init__(self, *args: Any, sdc_config: SDCConfig | None = None, sdc_loss_fn: LossFn | None = None,
                 sdc_observer: Observer | None = None, sdc_skip_nonfinite: bool = False, **kwargs: Any) -> None:
        if not isinstance(sdc_skip_nonfinite, bool):
            raise TypeError(f"sdc_skip_nonfinite must be a bool, got {type(sdc_skip_nonfinite).__name__}")
        if sdc_config is not None and not isinstance(sdc_config, SDCConfig):
            raise TypeError(f"sdc_config must be an SDCConfig, got {type(sdc_config).__name__}")
        if sdc_loss_fn is not None and not callable(sdc_loss_fn):
            raise TypeError(f"sdc_loss_fn must be callable as sdc_loss_fn(module, inputs), got "
                            f"{type(sdc_loss_fn).__name__}")
        super().__init__(*args, **kwargs)
        self.sdc_config = sdc_config
        self.sdc_loss_fn = sdc_loss_fn
        self.sdc_observer = sdc_observer
        self.sdc_skip_nonfinite = sdc_skip_nonfinite
        self.sdc_monitor: SDCMonitor | None = None
        self._sdc_step: StepContext | None = None
        self._sdc_in_training_step = False
        self._trainer.add_callback(_Events(self))

    @property
    def _trainer(self) -> Trainer:
        assert isinstance(self, Trainer), "SDCTrainerMixin must be mixed into a transformers.Trainer subclass"
        return self

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._sdc_close()

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        self._sdc_in_training_step = self.sdc_monitor is not None
        try:
            loss: torch.Tensor = super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
            return loss
        finally:
            self._sdc_in_training_step = False

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        if not self._sdc_in_training_step or self.sdc_monitor is None:  # evaluation, or the replay itself
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)  # type: ignore[misc]
        self._sdc_in_training_step = False  # one micro-batch per training_step
        if self._sdc_step is None:  # the first micro-batch of an optimizer step
            self._sdc_step = self.sdc_monitor.step().begin()
        # A shallow copy: compute_loss may pop "labels" from the dict it gets.
        self._sdc_step.micro_batch({_INPUTS: dict(inputs), _NUM_ITEMS: num_items_in_batch})
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)  # type: ignore[misc]
        loss = out[0] if return_outputs else out
        self._sdc_step.record_loss(loss, scale=self._sdc_scale(num_items_in_batch),
                                   scaler=self._trainer.accelerator.scaler)
        return out

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any, *args: Any, **kwargs: Any) -> None:
        t = self._trainer
        step = t.state.global_step
        name = f"checkpoint-{step}"  # transformers' PREFIX_CHECKPOINT_DIR, numbered by global_step like the Trainer
        cert = certify(self.sdc_monitor, step, name)  # every rank: the Trainer saves on every rank
        if t.args.should_save:
            get_dir = getattr(t, "_get_output_dir", None)
            run_dir = get_dir(trial=trial) if callable(get_dir) else t.args.output_dir
            directory = os.path.join(str(run_dir), name)
            try:
                write_certificate(directory, cert)
            except OSError:
                log.exception("sdc_telemetry: writing the weight certificate of %s failed; it is saved without one",
                              name)
                try:  # an older certificate in a reused directory must not stay
                    write_certificate(directory, None)
                except OSError:
                    log.debug("sdc_telemetry: removing %s's stale certificate failed", name, exc_info=True)
        super()._save_checkpoint(model, trial, *args, **kwargs)  # type: ignore[misc]

    def _sdc_scale(self, num_items_in_batch: torch.Tensor | int | None) -> float:
        """The factor ``training_step`` and ``accelerator.backward`` apply to ``compute_loss``'s result."""
        t = self._trainer
        normalised = t.loss_is_scaled_for_ga
        if normalised is None:
            normalised = (t.model_accepts_loss_kwargs and num_items_in_batch is not None) \
                or t.compute_loss_func is not None
        scale = 1.0 if normalised else 1.0 / t.current_gradient_accumulation_steps
        return float(scale / t.accelerator.gradient_accumulation_steps)

    def _sdc_replay_loss(self, module: torch.nn.Module, micro_batch: dict[str, Any]) -> torch.Tensor:
        inputs = dict(micro_batch[_INPUTS])
        if self.sdc_loss_fn is not None:
            return self.sdc_loss_fn(module, inputs)
        loss = self._trainer.compute_loss(module, inputs, num_items_in_batch=micro_batch[_NUM_ITEMS])
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"compute_loss returned {type(loss).__name__}, not a loss tensor: pass sdc_loss_fn=")
        return loss

    def _sdc_start(self) -> None:
        t = self._trainer
        kind = str(t.accelerator.distributed_type)
        if "DEEPSPEED" in kind or "FSDP" in kind or "MEGATRON" in kind:
            raise ValueError(f"SDCTrainer supports DDP and single-process training, not {kind}")
        self._sdc_close()
        optimizer = t.optimizer
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps the real one
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"the Trainer's optimizer must be a torch.optim.Optimizer, got {type(inner).__name__}")
        self.sdc_monitor = SDCMonitor(t.model_wrapped, inner, loss_fn=self._sdc_replay_loss, config=self.sdc_config,
                                      start_step=t.state.global_step, observer=self.sdc_observer)
        if self.sdc_skip_nonfinite:
            self.sdc_monitor.skip_nonfinite_updates()

    def _sdc_end_step(self) -> None:
        step, self._sdc_step = self._sdc_step, None
        if step is not None:
            step.end()

    def _sdc_close(self) -> None:
        self._sdc_step = None
        if self.sdc_monitor is not None:
            self.sdc_monitor.close()


class SDCTrainer(SDCTrainerMixin, Trainer):
    """``transformers.Trainer`` with silent-data-corruption checks: ``SDCTrainer(..., sdc_config=SDCConfig(...))``.
    See ``SDCTrainerMixin`` for the keyword arguments."""


class _Events(TrainerCallback):
    """The Trainer events the mixin needs: start, the end of each step's backward passes, the end of training."""

    def __init__(self, trainer: SDCTrainerMixin) -> None:
        self._trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._trainer._sdc_start()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._trainer._sdc_end_step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._trainer._sdc_close()
