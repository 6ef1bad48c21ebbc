"""A rank of ``torchrun`` running the documented stop recipe for a framework: ``hf`` (an SDCTrainer, a tiny GPT-2)
or ``lightning`` (an SDCCallback, a tiny LightningModule), one weight bit flipped on the last rank at step 1.

    python -m torch.distributed.run --nproc-per-node 2 --standalone _torchrun_frameworks.py hf
"""

from __future__ import annotations

import logging
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist

import sdc_telemetry as sdc
from sdc_telemetry.faults import flip_bit

CONFIG = sdc.SDCConfig.from_env(weights_every=1, replay_every=2, on_suspect="raise")


def hf() -> None:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

    from sdc_telemetry.transformers import SDCTrainer

    transformers.logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)

    class FlipWeightBit(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if dist.get_rank() == dist.get_world_size() - 1 and state.global_step == 1:
                flip_bit(kwargs["model"].transformer.h[0].attn.c_attn.weight.data, index=7, bit=11)

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (48, 12), generator=torch.Generator().manual_seed(0))
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=64))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, per_device_train_batch_size=2, max_steps=4,
                                 report_to="none", logging_strategy="no", save_strategy="no", disable_tqdm=True,
                                 ddp_backend="gloo")
        trainer = SDCTrainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids],
                             callbacks=[FlipWeightBit()], sdc_config=CONFIG)
        with sdc.exit_on_sdc(trainer):  # the documented recipe
            trainer.train()
    print("train() ended without incident", flush=True)


def lightning() -> None:
    import lightning.pytorch as pl
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from sdc_telemetry.lightning import SDCCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class FlipWeightBit(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_rank == trainer.world_size - 1 and trainer.global_step == 1:
                flip_bit(pl_module.net[0].weight.data, index=5, bit=12)

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(96, 8, generator=gen), torch.randint(0, 3, (96,), generator=gen)),
                        batch_size=4)
    callback = SDCCallback(config=CONFIG)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[callback, FlipWeightBit()])
    with sdc.exit_on_sdc(callback):  # the documented recipe
        trainer.fit(Tiny(), loader)
    print("fit() ended without incident", flush=True)


if __name__ == "__main__":
    {"hf": hf, "lightning": lightning}[sys.argv[1]]()
