"""Hugging Face Accelerate training with sdc_telemetry: the loop as Accelerate's users write it
(``accelerator.accumulate``, ``accelerator.backward``, the prepared optimizer), plus one line per micro-batch.

    python -m torch.distributed.run --nproc-per-node 2 --standalone examples/accelerate_train.py --steps 8

``--accumulate N`` takes N micro-batches per optimizer step. ``--nan-at STEP`` puts a NaN into one sample of the
last rank's first micro-batch of optimizer step STEP (a bad sample, not a bad GPU): the monitor's triggered audit
finds that a partner recomputing the batch gets the same NaN (verdict ``data``, nobody named, training goes on), and
``skip_nonfinite=True`` skips that update on every rank, so the weights stay finite.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch import nn

import sdc_telemetry as sdc
from sdc_telemetry.accelerate import SDCAccelerate


def compute_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--nan-at", type=int, default=None, metavar="STEP")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=args.accumulate)
    torch.manual_seed(0)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 4))
    model, optimizer = accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    run = SDCAccelerate(accelerator, model, optimizer, loss_fn=compute_loss, skip_nonfinite=True,
                        config=sdc.SDCConfig.from_env(replay_every=4, on_suspect="raise"))
    rank, world = accelerator.process_index, accelerator.num_processes
    gen = torch.Generator().manual_seed(100 + rank)
    skipped = 0
    with sdc.exit_on_sdc(run):
        for index in range(args.steps * args.accumulate):
            x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)
            if args.nan_at is not None and index == args.nan_at * args.accumulate and rank == world - 1:
                x[0, 0] = float("nan")  # one bad sample in one rank's batch
            batch = (x.to(accelerator.device), y.to(accelerator.device))
            with accelerator.accumulate(model):
                run.micro_batch(batch)          # before the forward pass: the replay can recompute it
                loss = compute_loss(model, batch)
                accelerator.backward(loss)      # the checks run in the last micro-batch's backward
                if accelerator.sync_gradients and not run.finite:
                    skipped += 1                # optimizer.step() skips it, the same way on every rank
                optimizer.step()
                optimizer.zero_grad()
    run.close()
    finite = all(bool(torch.isfinite(p).all()) for p in net.parameters())
    if accelerator.is_main_process:
        verdicts = [(i.step, i.check, i.evidence.get("verdict"), list(i.suspect_ranks)) for i in run.incidents]
        print(f"{args.steps} steps; updates skipped: {skipped}; weights finite: {finite}; incidents: {verdicts}",
              flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
