"""PyTorch Lightning integration: ``SDCCallback`` runs the monitor inside ``Trainer.fit``.

    >>> import lightning.pytorch as pl                                          # doctest: +SKIP
    >>> from sdc_telemetry.lightning import SDCCallback
    >>> trainer = pl.Trainer(strategy="ddp", callbacks=[SDCCallback(config=sdc.SDCConfig(replay_every=50))])
    >>> trainer.fit(model, loader)                                              # doctest: +SKIP

Where the callback hooks in (automatic optimization, Lightning 2.x). The forward and backward passes run inside
``optimizer.step(closure)``, after the optimizer's own pre-step hooks, so those hooks cannot end a step:

- ``on_train_start``: builds the monitor from ``trainer.strategy.model`` (the DDP wrapper under ``"ddp"`` or
  ``"ddp_spawn"``, the plain module on one device) and the trainer's optimizer, counting steps from
  ``trainer.global_step`` (a resumed fit goes on from the checkpoint's step).
- ``on_train_batch_start``: opens the step on the first micro-batch after the previous optimizer step and registers
  each micro-batch (its RNG state is captured here, before the forward pass).
- ``on_before_backward``: records the micro-batch's loss. Lightning backpropagates ``loss / accumulate_grad_batches``
  (then a mixed-precision ``GradScaler`` scales it); the callback records that divided loss, and the replay
  recomputes it with the same division, so that losses and gradients compare bit for bit.
- ``on_before_optimizer_step``: ends the step and runs the checks. Every rank reaches it after the backward pass
  (gradients reduced) and before gradient clipping and the update, also when a ``GradScaler`` then skips the update
  on one rank. ``SDCDetected`` is raised here on every rank at the same step and propagates out of ``fit``.
- ``on_save_checkpoint``: certifies the weights (``monitor.certificate()``, labelled with ``trainer.global_step``,
  the step Lightning saves in the checkpoint) and stores ``cert.to_dict()`` under ``checkpoint["sdc_certificate"]``,
  so that ``sdc-telemetry verify-checkpoint`` checks the ``.ckpt`` file. Lightning calls it on every rank while
  building the checkpoint (``ModelCheckpoint``, ``trainer.save_checkpoint``, which must run on every rank), and
  the certificate is collective. A checkpoint saved with nothing to certify (after an exception, after the fit, while
  a hardware suspect is open with ``on_suspect="record"``) carries no certificate, and the reason is logged.
  Lightning does not call callbacks for weights-only checkpoints (``save_weights_only=True``): those carry none.
- ``on_exception`` and ``teardown``: close the monitor.

The stop: wrap ``fit`` in ``with sdc.exit_on_sdc(callback):`` and every rank exits 75 on ``SDCDetected``. Lightning
registers a SIGTERM handler for the fit that runs a collective (a broadcast), which a rank that gets the launcher's
SIGTERM while it is still stopping (its peers already exited) must not run; so from ``on_train_start`` until
Lightning restores its handlers, the callback puts a guard in front of it (``sdc_telemetry.stop.guard_sigterm``): a
SIGTERM on the SDC stop path is held back (the rank exits 75 when its stop is done), any other goes to Lightning.

Manual optimization and several optimizers are not supported (there is no single point per step every rank
reaches); the callback says so when the fit starts.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerStatus

from sdc_telemetry.core.config import SDCConfig
from sdc_telemetry.integrations._certify import CERTIFICATE_KEY, certify
from sdc_telemetry.monitor import SDCMonitor
from sdc_telemetry.sinks.observer import Observer
from sdc_telemetry.step import StepContext
from sdc_telemetry.stop import guard_sigterm

__all__ = ["SDCCallback", "training_step_loss"]

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]

log = logging.getLogger("sdc_telemetry")


def training_step_loss(module: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The default replay loss: ``module.training_step(batch, 0)``, its ``loss`` when it returns a dict.

    ``self.log`` calls inside ``training_step`` do nothing during the recomputation (it would log twice)."""
    with _quiet(module):
        out = module.training_step(batch, 0)  # type: ignore[operator]
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"training_step returned {type(out).__name__}, not a loss tensor or a dict with 'loss': "
                        "pass SDCCallback(loss_fn=...) to recompute the loss for the replay check")
    return loss


@contextlib.contextmanager
def _quiet(module: torch.nn.Module) -> Iterator[None]:
    if not isinstance(module, pl.LightningModule):
        yield
        return
    module.log, module.log_dict = _no_log, _no_log  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log, module.log_dict


def _no_log(*_: Any, **__: Any) -> None:
    return None


class SDCCallback(pl.Callback):
    """Silent-data-corruption checks for ``lightning.pytorch.Trainer.fit`` (automatic optimization, one optimizer).

    ``config``: the monitor's ``SDCConfig`` (``SDCConfig.from_env()`` when None). ``loss_fn(module, batch)``
    recomputes a micro-batch's loss for the replay check: it gets the LightningModule and the batch as
    ``training_step`` got it, and returns the loss ``training_step`` returns (the callback divides it by
    ``accumulate_grad_batches`` as Lightning does). The default calls ``training_step(batch, 0)``, so the loss must
    not depend on ``batch_idx``. ``observer`` replaces the telemetry built from the config (tests, custom sinks).
    ``skip_nonfinite=True`` skips the update of a step whose gradients were not finite on every rank (a NaN in one
    rank's batch never reaches the weights), the same way on every rank, as a ``GradScaler`` skips an overflow.

    On ``on_suspect="raise"``, ``SDCDetected`` propagates out of ``trainer.fit`` on every rank at the same step;
    catch it around ``fit`` and exit with ``e.exit_code``. ``monitor`` is the running ``SDCMonitor`` (None before
    the fit starts); its ``incidents`` stay readable after the fit.
    """

    def __init__(self, config: SDCConfig | None = None, loss_fn: LossFn | None = None, *,
                 observer: Observer | None = None, skip_nonfinite: bool = False) -> None:
        if not isinstance(skip_nonfinite, bool):
            raise TypeError(f"skip_nonfinite must be a bool, got {type(skip_nonfinite).__name__}")
        if config is not None and not isinstance(config, SDCConfig):
            raise TypeError(f"config must be an SDCConfig, got {type(config).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(module, batch), got {type(loss_fn).__name__}")
        self.config = config
        self.loss_fn: LossFn = loss_fn if loss_fn is not None else training_step_loss
        self.observer = observer
        self.skip_nonfinite = skip_nonfinite
        self.monitor: SDCMonitor | None = None
        self._step: StepContext | None = None
        self._sigterm: guard_sigterm | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise ValueError("SDCCallback supports automatic optimization only: with manual optimization, build an "
                             "sdc_telemetry.SDCMonitor and wrap training_step's backward in `with monitor.step(batch)`")
        if len(trainer.optimizers) != 1:
            raise ValueError(f"SDCCallback supports one optimizer, the LightningModule configured "
                             f"{len(trainer.optimizers)}")
        self._close()
        model = trainer.strategy.model
        if model is None:
            raise RuntimeError("the strategy holds no model at on_train_start")
        accumulate = trainer.accumulate_grad_batches
        base = self.loss_fn

        def loss_fn(module: torch.nn.Module, batch: Any) -> torch.Tensor:
            # The same operation as Lightning's closure (loss / normalize): bit-identical to the recorded loss.
            return base(module, batch) / accumulate

        self.monitor = SDCMonitor(model, trainer.optimizers[0], loss_fn=loss_fn, config=self.config,
                                  start_step=trainer.global_step, observer=self.observer)
        if self.skip_nonfinite:
            self.monitor.skip_nonfinite_updates()
        if self._sigterm is not None:  # a guard left by an earlier fit (released unless Lightning replaced it)
            self._sigterm.release()
        self._sigterm = guard_sigterm(self)  # in front of Lightning's SIGTERM handler until it restores its own
        if trainer.is_global_zero and any(getattr(cb, "save_weights_only", False)
                                          for cb in trainer.checkpoint_callbacks):
            log.warning("sdc_telemetry: ModelCheckpoint(save_weights_only=True) checkpoints carry no weight "
                        "certificate (Lightning does not call callbacks for them): resume from full checkpoints")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.monitor is None:
            return
        if self._step is None:  # the first micro-batch of an optimizer step
            self._step = self.monitor.step().begin()
        self._step.micro_batch(batch)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._step is None:
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        scale = getattr(scaler, "_scale", None) if scaler is not None and scaler.is_enabled() else None
        if scale is None:
            self._step.record_loss(loss)
        else:  # Lightning hands over scaler.scale(loss); the scale is a power of two, so the division is exact
            self._step.record_loss(loss.detach() / scale.to(loss.device), scaler=scaler)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        step, self._step = self._step, None
        if step is not None:
            step.end()

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        checkpoint.pop(CERTIFICATE_KEY, None)
        monitor = self.monitor if trainer.state.status == TrainerStatus.RUNNING else None  # not on an exception path
        cert = certify(monitor, trainer.global_step, f"the checkpoint of step {trainer.global_step}")
        if cert is not None:
            checkpoint[CERTIFICATE_KEY] = cert.to_dict()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()
        if self._sigterm is not None:  # not on_exception: the stop path keeps the guard until Lightning's teardown
            self._sigterm.release()
            self._sigterm = None

    def _close(self) -> None:
        self._step = None
        if self.monitor is not None:
            self.monitor.close()
