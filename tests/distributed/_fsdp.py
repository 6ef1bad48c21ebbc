"""Rank side of the FSDP2 / HSDP tests: a small MLP sharded with fully_shard on a 1-D or a (replicate, shard) mesh."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import sdc_telemetry as sdc
from sdc_telemetry.faults import FaultInjector, flip_bit

from ._scenarios import Recorder


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 32)
        self.l2 = nn.Linear(32, 32)
        self.drop = nn.Dropout(0.1)  # replay must restore the RNG
        self.l3 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(self.drop(torch.relu(self.l2(torch.relu(self.l1(x))))))


def loss_fn(module: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(module(x).float(), y)


def _build(shape: tuple[int, ...], mixed: bool | str = False) -> nn.Module:
    torch.manual_seed(0)
    model = MLP()
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    kw: dict[str, Any] = {"mesh": mesh}
    if mixed == "fp16":  # fp16 compute and reduction: FSDP divides the gradients before the reduce-scatter
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)
    elif mixed:  # bf16 compute, fp32 gradient reduction
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model.l1, model.l2, model.l3):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def run_one(rank: int, shape: tuple[int, ...], sc: dict[str, Any]) -> dict[str, Any]:
    model = _build(shape, sc.get("mixed", False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    faults = FaultInjector(model, opt)
    if sc.get("perturb"):
        faults.perturb_output(**sc["perturb"])
    if sc.get("state_flip"):  # memory corruption of one rank's optimizer state (its own shard's Adam moment)
        faults.flip_state_bit(**sc["state_flip"])
    if sc.get("corrupt_update"):  # a faulty unit in one rank's optimizer kernel, from a step on
        faults.corrupt_update(**sc["corrupt_update"])
    recorder = Recorder()
    monitor = None
    if sc.get("monitor", True):
        monitor = sdc.SDCMonitor(model, opt, loss_fn=loss_fn, observer=recorder,
                                 config=sdc.SDCConfig(metrics_port=None, nvml=False, **sc.get("config", {})))
    gen = torch.Generator().manual_seed(100 + rank)
    torch.manual_seed(1000 + rank)  # dropout differs per rank: the replay must use the origin's RNG state
    for k in range(sc.get("steps", 6)):
        batch = (torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen))
        flip = sc.get("flip")
        if flip and flip["step"] == k and rank == flip["rank"]:  # memory corruption of this rank's shard
            flip_bit(dict(model.named_parameters())[flip["param"]].to_local(), flip["index"], flip["bit"])
        nan = sc.get("nan")
        if nan and nan["step"] == k and rank == nan["rank"]:
            batch[0][0, 0] = float("nan")
        if monitor is not None:
            with monitor.step(batch) as st:
                st.backward(loss_fn(model, batch))
            if sc.get("guard") and not st.finite:  # the documented guard: no update from non-finite gradients
                opt.zero_grad()
                continue
        else:
            loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()
    if monitor is not None:
        monitor.close()
    faults.close()
    return {"incidents": [(i.step, i.check, list(i.suspect_ranks), i.evidence.get("verdict"))
                          for i in (monitor.incidents if monitor else [])],
            "evidence": [i.evidence for i in (monitor.incidents if monitor else [])],
            "counts": recorder.counts(), "errors": recorder.errors,
            "weights": {n: p.to_local().detach().clone() for n, p in model.named_parameters()}}


def run_fsdp(rank: int, world: int, shape: tuple[int, ...], scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for sc in scenarios:
        out.append(run_one(rank, shape, sc))
        dist.barrier()
    return out
