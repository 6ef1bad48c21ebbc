"""Rank side of the Hugging Face Trainer tests: several ``train()`` runs of a tiny GPT-2 in one process group."""

from __future__ import annotations

import logging
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

import sdc_telemetry as sdc
from sdc_telemetry.faults import flip_bit
from sdc_telemetry.transformers import SDCTrainer

from ._ranks import ResultCounter, each_in_turn, summary


class FlipWeightBit(TrainerCallback):
    """Flips one bit of the first attention weight on ``rank`` before the first micro-batch of step ``step``."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if dist.get_rank() == self.rank and state.global_step == self.step:
            flip_bit(kwargs["model"].transformer.h[0].attn.c_attn.weight.data, index=7, bit=11)


class NaNGradient(TrainerCallback):
    """Makes one element of one local gradient NaN on ``rank`` in the first backward of step ``step`` (the rank's
    computation, not its data: a partner recomputing the micro-batch gets finite gradients)."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if dist.get_rank() != self.rank or state.global_step != self.step:
            return
        weight = kwargs["model"].transformer.h[0].mlp.c_fc.weight

        def once(grad: torch.Tensor) -> torch.Tensor:
            handle.remove()
            grad = grad.clone()
            grad.view(-1)[3] = float("nan")
            return grad

        handle = weight.register_hook(once)


def _dataset() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (48, 12), generator=gen)
    return [{"input_ids": row, "labels": row} for row in ids]


def train(config: sdc.SDCConfig, *, accumulate: int = 1, steps: int = 4, flip: tuple[int, int] | None = None,
          token_normalised: bool = True, save_dir: str | None = None, nan_grad: tuple[int, int] | None = None,
          skip_nonfinite: bool = False) -> dict[str, Any]:
    """One train(); with ``save_dir`` (the same on every rank), the Trainer saves checkpoint-N every 2 steps there."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=64))
    counter = ResultCounter()
    with tempfile.TemporaryDirectory(prefix="sdc-hf-") as tmp:
        saving = {"save_strategy": "steps", "save_steps": 2} if save_dir else {"save_strategy": "no"}
        args = TrainingArguments(output_dir=save_dir or tmp, use_cpu=True, per_device_train_batch_size=2,
                                 gradient_accumulation_steps=accumulate, max_steps=steps, learning_rate=1e-3,
                                 report_to="none", logging_strategy="no", disable_tqdm=True,
                                 dataloader_num_workers=0, seed=0, **saving)
        trainer = SDCTrainer(model=model, args=args, train_dataset=_dataset(),
                             callbacks=[*([FlipWeightBit(*flip)] if flip else []),
                                        *([NaNGradient(*nan_grad)] if nan_grad else [])],
                             sdc_config=config, sdc_observer=counter, sdc_skip_nonfinite=skip_nonfinite)
        if not token_normalised:  # the Trainer then divides each micro-batch's loss by the accumulation steps
            trainer.model_accepts_loss_kwargs = False
        raised = None
        try:
            trainer.train()
        except sdc.SDCDetected as e:
            raised = e
    monitor = trainer.sdc_monitor
    assert monitor is not None
    return summary(monitor.incidents, counter, raised, global_step=trainer.state.global_step,
                   closed=monitor.closed, model_type=type(monitor.model).__name__,
                   weights_finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()),
                   verdicts=[i.evidence.get("verdict") for i in monitor.incidents])


def run(rank: int, world: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    transformers.logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    return each_in_turn(train, runs)
