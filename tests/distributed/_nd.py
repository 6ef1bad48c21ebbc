"""Rank side of the N-D tests: DTensor tensor parallelism (parallelize_module) with FSDP2/HSDP on one DeviceMesh."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import sdc_telemetry as sdc
from sdc_telemetry.faults import FaultInjector, flip_bit

from ._scale import _count_monitor_bytes
from ._scenarios import Recorder


class Block(nn.Module):
    """A transformer-style MLP block: column-parallel up, row-parallel down, a norm replicated over tp."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b1 = Block()
        self.b2 = Block()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b2(self.b1(x)))  # type: ignore[no-any-return]


def loss_fn(module: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    out = module(x)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def build(shape: tuple[int, ...], names: tuple[str, ...], sequence_parallel: bool = False
          ) -> tuple[nn.Module, Any]:
    """torchtitan's order: tensor parallelism on mesh['tp'], then fully_shard over the data-parallel dims.
    ``sequence_parallel``: the norms run on sequence shards (their weights' gradients are partial sums over tp, as in
    torchtitan's plan), the blocks' inputs and outputs sharded on the sequence dim."""
    torch.manual_seed(0)
    model = Model()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    if "tp" in names:  # an HSDP mesh (dp dims only) has no tensor parallelism
        tp = mesh["tp"]
        if sequence_parallel:
            parallelize_module(model, tp, {
                "b1": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                         use_local_output=True),
                "b2": PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),))})
        for block in (model.b1, model.b2):
            plan: dict[str, Any] = {"up": ColwiseParallel(), "down": RowwiseParallel()}
            if sequence_parallel:
                plan = {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                        "down": RowwiseParallel(output_layouts=Shard(1))}
            parallelize_module(block, tp, plan)
    dp = mesh[tuple(n for n in names if n.startswith("dp"))]
    for block in (model.b1, model.b2):
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, mesh


def _dp_index(mesh: Any) -> int:
    """The data-parallel index: ranks of one replica (every tp coordinate) train on the same batch."""
    names = mesh.mesh_dim_names
    coord = dict(zip(names, mesh.get_coordinate(), strict=True))
    return coord.get("dp_replicate", 0) * mesh["dp_shard"].size() + coord.get("dp_shard", 0)


def run_one(rank: int, shape: tuple[int, ...], names: tuple[str, ...], sc: dict[str, Any]) -> dict[str, Any]:
    model, mesh = build(shape, names, sc.get("sequence_parallel", False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    faults = FaultInjector(model, opt)
    if sc.get("perturb"):
        faults.perturb_output(**sc["perturb"])
    if sc.get("corrupt_update"):  # a faulty unit in one rank's optimizer kernel, from a step on
        faults.corrupt_update(**sc["corrupt_update"])
    recorder = Recorder()
    monitor = None
    if sc.get("monitor", True):
        monitor = sdc.SDCMonitor(model, opt, loss_fn=loss_fn, observer=recorder,
                                 mesh=mesh if sc.get("explicit_mesh") else None,
                                 config=sdc.SDCConfig(metrics_port=None, nvml=False, **sc.get("config", {})))
    gen = torch.Generator().manual_seed(100 + _dp_index(mesh))
    tally: dict[str, int] = {}
    steps = sc.get("steps", 6)
    losses = []
    for k in range(steps):
        batch = (torch.randn(4, 4, 16, generator=gen), torch.randint(0, 4, (4, 4), generator=gen))
        flip = sc.get("flip")
        if flip and flip["step"] == k and rank == flip["rank"]:  # memory corruption of this rank's local shard
            flip_bit(dict(model.named_parameters())[flip["param"]].to_local(), flip["index"], flip["bit"])
        if sc.get("count_bytes") and k == 1:  # step 0 is an audit step; count the healthy steps after it
            _count_monitor_bytes(tally)
        if monitor is not None and sc.get("micro"):  # gradient accumulation: FSDP syncs on the last micro-batch only
            with monitor.step() as st:
                for j in range(sc["micro"]):
                    mb = (batch[0][j::sc["micro"]], batch[1][j::sc["micro"]])
                    for m in model.modules():
                        if hasattr(m, "set_requires_gradient_sync"):
                            m.set_requires_gradient_sync(j == sc["micro"] - 1, recurse=False)
                    st.micro_batch(mb)
                    loss = loss_fn(model, mb)
                    st.backward(loss, scale=1 / sc["micro"])
        elif monitor is not None:
            with monitor.step(batch) as st:
                loss = loss_fn(model, batch)
                st.backward(loss)
        else:
            loss = loss_fn(model, batch)
            loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    if monitor is not None:
        monitor.close()
    faults.close()
    return {"incidents": [(i.step, i.check, list(i.suspect_ranks), i.evidence.get("verdict"),
                           i.evidence.get("coordinate"), bool(i.evidence.get("ambiguous")))
                          for i in (monitor.incidents if monitor else [])],
            "layout": monitor.layout.describe() if monitor else None,
            "counts": recorder.counts(), "errors": recorder.errors, "losses": losses,
            "bytes": {k: v // max(steps - 1, 1) for k, v in tally.items()},
            "weights": {n: p.to_local().detach().clone() for n, p in model.named_parameters()}}


def run_nd(rank: int, world: int, shape: tuple[int, ...], names: tuple[str, ...], scenarios: list[dict[str, Any]]
           ) -> list[dict[str, Any]]:
    out = []
    for sc in scenarios:
        if sc.get("shape"):
            out.append(run_one(rank, sc["shape"], sc["names"], sc))
        else:
            out.append(run_one(rank, shape, names, sc))
        dist.barrier()
    return out
