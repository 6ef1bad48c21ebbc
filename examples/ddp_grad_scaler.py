"""Mixed precision with a GradScaler under DDP with sdc_telemetry.

    python -m torch.distributed.run --nproc-per-node 2 --standalone examples/ddp_grad_scaler.py

``step.backward(loss, scale=1 / n, scaler=scaler)`` runs ``scaler.scale(loss * scale).backward()`` and records the
loss, so that the replay reproduces the same scaled gradients; then ``scaler.step(optimizer)`` as usual. The checks
run at the end of the ``with`` block, before ``scaler.step``: a scaler that skips the update on one rank (an
overflow) cannot make the ranks' checks diverge. On a GPU this runs fp16 autocast; on a CPU bf16 autocast with the
scaler still in the loop.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sdc_telemetry as sdc


def compute_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    with torch.autocast(x.device.type, dtype=torch.float16 if x.is_cuda else torch.bfloat16):
        logits = model(x)
    return nn.functional.cross_entropy(logits.float(), y)


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4)).to(device),
                                    device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device.type)
    config = sdc.SDCConfig.from_env(replay_every=2, on_suspect="raise")
    monitor = sdc.SDCMonitor(model, optimizer, loss_fn=compute_loss, config=config)
    gen = torch.Generator().manual_seed(dist.get_rank())
    with sdc.exit_on_sdc(monitor):  # SDCDetected: every rank exits 75; closes the monitor when the loop ends
        for _ in range(8):
            x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)
            batch = (x.to(device), y.to(device))
            with monitor.step(batch) as step:
                step.backward(compute_loss(model, batch), scaler=scaler)
            scaler.step(optimizer)  # may skip the update on overflow: the checks already ran
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print("8 mixed-precision steps with a GradScaler without incident")


if __name__ == "__main__":
    main()
