"""Rank side of the pipeline tests: SDCMonitor on a two-stage pipeline (torch.distributed.pipelining) with
data-parallel replicas, the stage modules DDP-wrapped over their data-parallel group or fully_shard-ed over it."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from torch.nn.parallel import DistributedDataParallel

import sdc_telemetry as sdc
from sdc_telemetry.faults import FaultInjector
from sdc_telemetry.testing import emulate_gpu_numerics

from ._pipeline import build
from ._pipeline import loss_fn as loss_fn
from ._scale import _count_monitor_bytes
from ._scenarios import Recorder

CPU = torch.device("cpu")
MICRO = 4


def build_looped(stage: int) -> nn.Module:
    """Four stages, two per pp rank under an interleaved or looped schedule (stage i on pp rank i % 2): stage 0
    Linear, ReLU, Dropout; stages 1 and 2 Linear, ReLU; stage 3 Linear, ReLU, Linear."""
    torch.manual_seed(stage)
    if stage == 0:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1))
    if stage == 3:
        return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU())


def run_one(rank: int, replicas: int, sc: dict[str, Any]) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (replicas, 2), mesh_dim_names=("dp_replicate", "pp"))
    dp, pp = rank // 2, rank % 2
    kind, looped = sc.get("kind", "ddp"), sc.get("schedule")
    # One stage per rank, or (interleaved, looped) stages pp and pp + 2 of four
    indices = [pp] if looped is None else [pp, pp + 2]
    parts = [build(pp)] if looped is None else [build_looped(i) for i in indices]
    wrapped_parts: list[nn.Module] = []
    for part in parts:
        if kind == "ddp":
            # find_unused_parameters=True: torch 2.13's GPipe and multi-stage schedules trip DDP's bucket rebuild
            # without it
            wrapped_parts.append(DistributedDataParallel(part, process_group=mesh.get_group("dp_replicate"),
                                                         find_unused_parameters=True))
        else:
            fully_shard(part, mesh=mesh["dp_replicate"])
            wrapped_parts.append(part)
    stages = [PipelineStage(w, i, 2 * len(indices), CPU, group=mesh.get_group("pp"))
              for w, i in zip(wrapped_parts, indices, strict=True)]
    if looped is None:
        stage = stages[0]
        schedule: Any = (ScheduleGPipe if kind == "ddp" else Schedule1F1B)(stage, MICRO, loss_fn=loss_fn)
    else:
        schedule = {"interleaved": ScheduleInterleaved1F1B, "looped": ScheduleLoopedBFS}[looped](
            stages, MICRO, loss_fn=loss_fn)
    first, last = stages[0].is_first, stages[-1].is_last
    module = parts[0] if looped is None else nn.ModuleList(parts)
    wrapped = wrapped_parts[0] if looped is None else wrapped_parts
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    faults = FaultInjector(module, opt)
    if sc.get("noise"):  # GPU-like run-to-run noise in every layer's output (tolerance mode's setting)
        emulate_gpu_numerics(module, noise=sc["noise"], seed=100 + rank)
    for kind, args in sc.get("faults", {}).items():
        if args["rank"] == rank:  # the stage modules differ: only the target rank's names the parameter
            getattr(faults, kind)(**args)
    recorder = Recorder()
    monitor = None
    if sc.get("monitor", True):
        monitor = sdc.SDCMonitor(wrapped, opt, pipeline=schedule, mesh=mesh, observer=recorder,
                                 config=sdc.SDCConfig(metrics_port=None, nvml=False, **sc.get("config", {})))
    torch.manual_seed(7 + rank)  # dropout draws differ per rank: the replay must take the origin's RNG state
    tally: dict[str, int] = {}
    steps = sc.get("steps", 4)
    losses: list[list[float] | None] = []
    for k in range(steps):
        gen = torch.Generator().manual_seed(1000 * dp + k)
        x, y = torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        if sc.get("count_bytes") and k == 1:
            _count_monitor_bytes(tally)
        if monitor is not None:
            with monitor.step((x, y)) as st:
                out = st.pipeline_step(x, target=y)
        else:
            out = [] if last else None
            schedule.step(*((x,) if first else ()), **({"target": y, "losses": out} if last else {}))
        losses.append([float(t) for t in out] if out is not None else None)
        opt.step()
        opt.zero_grad()
    if monitor is not None:
        monitor.close()
    faults.close()
    local = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
             for n, p in module.named_parameters()}
    return {"incidents": [(i.step, i.check, list(i.suspect_ranks), i.evidence.get("verdict"),
                           i.evidence.get("coordinate"), bool(i.evidence.get("ambiguous")),
                           [i.evidence["stage"], i.evidence["stage_found_by"]] if "stage" in i.evidence else None)
                          for i in (monitor.incidents if monitor else [])],
            "layout": monitor.layout.describe() if monitor else None,
            "counts": recorder.counts(), "errors": recorder.errors, "losses": losses, "weights": local,
            "bytes": {k: v // max(steps - 1, 1) for k, v in tally.items()}}


def stage_hosts(rank: int) -> dict[str, str]:
    """Each pipeline stage on a host of its own (rank r runs stage r % 2): every replica spans two hosts."""
    return {"SDC_HOST_NAME": f"node{rank % 2}"}


def run_pp(rank: int, world: int, scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for sc in scenarios:
        out.append(run_one(rank, world // 2, sc))
        dist.barrier()
    return out
