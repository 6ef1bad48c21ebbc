"""Raw DDP training with sdc_telemetry: the three lines, certified checkpoints, resume, and the stop recipe.

    python -m torch.distributed.run --nproc-per-node 2 --standalone examples/ddp_train.py --steps 20

On GPUs the same script runs under ``torchrun --nproc-per-node 8 examples/ddp_train.py`` (NCCL, one GPU per rank).
``--resume`` continues from the last checkpoint after checking its certificate. ``--flip-bit-at STEP`` is a fire
drill: it flips one weight bit on the last rank before step STEP; every rank then stops with exit code 75.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sdc_telemetry as sdc
from sdc_telemetry.faults import flip_bit


def compute_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--checkpoint", default="checkpoint.pt")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--flip-bit-at", type=int, default=None, metavar="STEP")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 4)).to(device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)

    start_step = 0
    if args.resume and os.path.exists(args.checkpoint):
        ckpt = torch.load(args.checkpoint, map_location=device)
        changed = sdc.WeightCertificate.from_dict(ckpt["sdc_certificate"]).verify(ckpt["model"])
        if changed:
            raise SystemExit(f"checkpoint {args.checkpoint} does not match its certificate: {changed}")
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_step = ckpt["step"] + 1
    model = DistributedDataParallel(net, device_ids=[device.index] if cuda else None)

    # SDC_METRICS_PORT, SDC_INCIDENT_DIR, SDC_ALERTMANAGER_URL... come from the environment.
    config = sdc.SDCConfig.from_env(weights_every=1, replay_every=5, on_suspect="raise")
    monitor = sdc.SDCMonitor(model, optimizer, loss_fn=compute_loss, config=config, start_step=start_step)
    gen = torch.Generator().manual_seed(1000 * start_step + rank)  # each rank its own data
    # One line for the stop: SDCDetected on any rank (a step, or certificate() at a checkpoint) closes the monitor
    # and exits with sdc.EXIT_SDC (75) on every rank, also when torchrun sends SIGTERM to ranks still stopping.
    with sdc.exit_on_sdc(monitor):
        for step in range(start_step, args.steps):
            x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)
            batch = (x.to(device), y.to(device))
            if step == args.flip_bit_at and rank == world - 1:
                flip_bit(net[0].weight.data, index=3, bit=20)  # fire drill: memory corruption between steps
            with monitor.step(batch) as s:
                s.backward(compute_loss(model, batch))
            if s.finite:  # the same answer on every rank: a bad sample's NaN never reaches the weights
                optimizer.step()
            optimizer.zero_grad()
            if (step + 1) % args.checkpoint_every == 0:
                cert = monitor.certificate()  # collective: every rank, never under `if rank == 0`
                if rank == 0:
                    torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                                "sdc_certificate": cert.to_dict()}, args.checkpoint)
    dist.destroy_process_group()  # the monitor was closed when the block ended
    if rank == 0:
        print(f"trained steps {start_step}..{args.steps - 1} without incident")


if __name__ == "__main__":
    main()
