"""Gradient accumulation under DDP with sdc_telemetry: ``no_sync()``, or nanoGPT's ``require_backward_grad_sync``.

    python -m torch.distributed.run --nproc-per-node 2 --standalone examples/ddp_accumulate.py --micro 4
    python -m torch.distributed.run --nproc-per-node 2 --standalone examples/ddp_accumulate.py --micro 4 --toggle

Each optimizer step is one ``monitor.step()``; every micro-batch is registered with ``step.micro_batch(mb)`` before
its forward pass and backpropagated with ``step.backward(loss, scale=1 / micro)``. Only the last micro-batch's
backward may all-reduce: the others run under ``model.no_sync()`` (or with the toggle set to False).
"""

from __future__ import annotations

import argparse
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sdc_telemetry as sdc


def compute_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--toggle", action="store_true", help="nanoGPT style: require_backward_grad_sync")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4)).to(device),
                                    device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = sdc.SDCConfig.from_env(replay_every=2, on_suspect="raise")
    monitor = sdc.SDCMonitor(model, optimizer, loss_fn=compute_loss, config=config)
    gen = torch.Generator().manual_seed(dist.get_rank())
    n = args.micro
    with sdc.exit_on_sdc(monitor):  # SDCDetected: every rank exits 75; closes the monitor when the loop ends
        for _ in range(args.steps):
            with monitor.step() as step:
                for micro_step in range(n):
                    x, y = torch.randn(8, 32, generator=gen), torch.randint(0, 4, (8,), generator=gen)
                    mb = (x.to(device), y.to(device))
                    step.micro_batch(mb)  # before the forward pass: captures the RNG state and the micro-batch
                    last = micro_step == n - 1
                    if args.toggle:  # nanoGPT: all-reduce on the last micro-batch only
                        model.require_backward_grad_sync = last
                        step.backward(compute_loss(model, mb), scale=1 / n)
                    else:
                        with nullcontext() if last else model.no_sync():
                            step.backward(compute_loss(model, mb), scale=1 / n)
            if step.finite:  # skip a non-finite update, the same way on every rank
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{args.steps} steps of {n} micro-batches ({'toggle' if args.toggle else 'no_sync'}) without incident")


if __name__ == "__main__":
    main()
