"""Rank side of the Lightning tests: several ``Trainer.fit`` runs in one process group."""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import sdc_telemetry as sdc
from sdc_telemetry.faults import flip_bit
from sdc_telemetry.lightning import SDCCallback

from ._ranks import ResultCounter, summary


class TinyModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class FlipWeightBit(pl.Callback):
    """Flips one bit of the first weight on ``rank`` before the forward pass of optimizer step ``step``."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            flip_bit(pl_module.net[0].weight.data, index=5, bit=12)
            self.step = -1  # once


class NaNInBatch(pl.Callback):
    """Puts a NaN into one sample of ``rank``'s batch of optimizer step ``step`` (a bad sample, not hardware)."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            batch[0][0, 0] = float("nan")
            self.step = -1  # once


def _loader() -> DataLoader[Any]:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 8, generator=gen), torch.randint(0, 3, (96,), generator=gen))
    return DataLoader(data, batch_size=4)  # the trainer adds a DistributedSampler: each rank its own batches


def fit(world: int, config: sdc.SDCConfig, *, accumulate: int = 1, steps: int = 4,
        flip: tuple[int, int] | None = None, checkpoint_dir: str | None = None, nan: tuple[int, int] | None = None,
        skip_nonfinite: bool = False) -> dict[str, Any]:
    """One fit; with ``checkpoint_dir``, a ModelCheckpoint saves every 2 optimizer steps (ckpt-<global_step>.ckpt)."""
    torch.manual_seed(0)
    counter = ResultCounter()
    callback = SDCCallback(config=config, observer=counter, skip_nonfinite=skip_nonfinite)
    callbacks: list[pl.Callback] = [FlipWeightBit(*flip)] if flip else []
    if nan:
        callbacks.append(NaNInBatch(*nan))
    module = TinyModule()
    if checkpoint_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, filename="ckpt-{step}", auto_insert_metric_name=False,
                                         every_n_train_steps=2, save_top_k=-1))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=steps,
                         accumulate_grad_batches=accumulate, callbacks=[*callbacks, callback], logger=False,
                         enable_checkpointing=checkpoint_dir is not None, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0)
    raised = None
    try:
        trainer.fit(module, _loader())
    except sdc.SDCDetected as e:
        raised = e
    assert callback.monitor is not None
    return summary(callback.monitor.incidents, counter, raised, global_step=trainer.global_step,
                   closed=callback.monitor.closed, model_type=type(callback.monitor.model).__name__,
                   weights_finite=all(bool(torch.isfinite(p).all()) for p in module.parameters()),
                   verdicts=[i.evidence.get("verdict") for i in callback.monitor.incidents])


def run(rank: int, world: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    out = []
    for kwargs in runs:
        out.append(fit(world, **kwargs))
        dist.barrier()
    return out
