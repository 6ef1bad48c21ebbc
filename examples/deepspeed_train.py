"""DeepSpeed training with sdc_telemetry: the loop as DeepSpeed's users write it (``deepspeed.initialize`` with a
config, ``engine(batch)``, ``engine.backward(loss)``, ``engine.step()`` after every micro-batch), plus one line per
micro-batch.

    python -m torch.distributed.run --nproc-per-node 2 --standalone examples/deepspeed_train.py --steps 8 --zero 2

On a machine without a GPU it runs on DeepSpeed's CPU accelerator (gloo). ``--accumulate N`` takes N micro-batches
per optimizer step. ``--nan-at STEP`` puts a NaN into one sample of the last rank's first micro-batch of step STEP
(a bad sample: verdict ``data``, nobody named, training goes on). ``--wrong-update STEP`` makes the last rank's
optimizer kernel write one element of its ZeRO partition 1e-3 off from step STEP on (a faulty unit no other rank
sees: ZeRO all-gathers the wrong value into every replica): the update audit names that rank and every rank leaves
with exit code 75.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported: it picks its accelerator once

import deepspeed

import sdc_telemetry as sdc
from sdc_telemetry.deepspeed import SDCDeepSpeed
from sdc_telemetry.faults import FaultInjector


def compute_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--zero", type=int, default=2, choices=(0, 1, 2, 3), help="ZeRO stage")
    parser.add_argument("--nan-at", type=int, default=None, metavar="STEP")
    parser.add_argument("--wrong-update", type=int, default=None, metavar="STEP")
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    ds_config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": args.accumulate,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                 "zero_optimization": {"stage": args.zero}, "steps_per_print": 10**6}
    torch.manual_seed(0)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 4))
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=ds_config)
    run = SDCDeepSpeed(engine, loss_fn=compute_loss,
                       config=sdc.SDCConfig.from_env(replay_every=4, on_suspect="raise"))
    rank, world = engine.global_rank, engine.world_size
    if args.wrong_update is not None:  # a test of the update audit: the torch optimizer inside ZeRO, on one rank
        inner = engine.optimizer.optimizer if args.zero else engine.optimizer
        FaultInjector(engine.module, inner).corrupt_update(rank=world - 1, step=args.wrong_update, index=3)
    gen = torch.Generator().manual_seed(100 + rank)
    with sdc.exit_on_sdc(run):
        for index in range(args.steps * args.accumulate):
            x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)
            if args.nan_at is not None and index == args.nan_at * args.accumulate and rank == world - 1:
                x[0, 0] = float("nan")  # one bad sample in one rank's batch
            batch = (x.to(engine.device), y.to(engine.device))
            run.micro_batch(batch)      # before the forward pass: the replay can recompute it
            loss = compute_loss(engine, batch)
            engine.backward(loss)       # the checks run in the backward of the step's last micro-batch
            engine.step()
    run.close()
    if rank == 0:
        verdicts = [(i.step, i.check, i.evidence.get("verdict"), list(i.suspect_ranks)) for i in run.incidents]
        print(f"{args.steps} steps at ZeRO stage {args.zero}; incidents: {verdicts}", flush=True)
    engine.destroy()


if __name__ == "__main__":
    main()
