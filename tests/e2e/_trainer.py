"""Rank side of the end-to-end test (module level, so spawned ranks can import it).

Each rank trains a small DDP model for ``plan.steps`` steps, ``plan.step_delay`` seconds apart, serving metrics on
``plan.base_port + rank`` with a ``FakeNVML`` GPU whose uuid is the rank's ``hw_id`` (so SDC and GPU series join on
``host_name, hw_id``). With a fault planned, rank ``fault_rank`` gets a weight bit flip at ``fault_step`` and its GPU
reports an XID at the same moment. After training every rank keeps serving until ``plan.stop_file`` exists (or
``plan.linger_s`` passes), so that Prometheus scrapes what happened.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sdc_telemetry as sdc
from sdc_telemetry.faults import FaultInjector
from sdc_telemetry.sinks.nvml import FakeNVML


@dataclass(frozen=True)
class Plan:
    job: str
    base_port: int
    stop_file: str
    steps: int = 20
    step_delay: float = 0.2
    fault_rank: int | None = None
    fault_step: int = 6
    linger_s: float = 90.0


def host_of(rank: int) -> str:
    """Ranks 0-1 on node-a, the others on node-b (through SDC_HOST_NAME)."""
    return "node-a" if rank < 2 else "node-b"


def loss_fn(module: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(module(x), y)


def train(rank: int, world: int, plan: Plan) -> dict[str, Any]:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    faults = FaultInjector(ddp, opt)
    if plan.fault_rank is not None:
        faults.flip_weight_bit(rank=plan.fault_rank, step=plan.fault_step, param="0.weight", index=3, bit=10)
    identity = sdc.RankIdentity.local()
    gpu = FakeNVML.for_demo(identity.hw_id)
    config = sdc.SDCConfig(weights_every=1, replay_every=2, on_suspect="record", metrics_port=plan.base_port,
                           metrics_host="127.0.0.1", job_name=plan.job)
    monitor = sdc.SDCMonitor(ddp, opt, loss_fn=loss_fn, config=config, nvml=gpu)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(plan.steps):
        if step == plan.fault_step and rank == plan.fault_rank:
            gpu.inject_xid(79)
        batch = (torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen))
        with monitor.step(batch) as st:
            st.backward(loss_fn(ddp, batch))
        opt.step()
        opt.zero_grad()
        time.sleep(plan.step_delay)
    deadline = time.monotonic() + plan.linger_s
    while not os.path.exists(plan.stop_file) and time.monotonic() < deadline:
        time.sleep(0.1)
    monitor.close()
    faults.close()
    return {"identity": identity.to_dict(), "fired": list(faults.fired),
            "incidents": [(i.step, i.check, i.suspect_ranks) for i in monitor.incidents]}


def raise_and_page(rank: int, world: int, alertmanager_url: str, base_port: int) -> dict[str, Any]:
    """A weight flip on rank 2 with on_suspect="raise" and a direct push to Alertmanager; nobody scrapes the ranks.
    Returns when the incident was raised and how long the stop recipe (close, then return) took on this rank."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    faults = FaultInjector(ddp, opt)
    faults.flip_weight_bit(rank=2, step=4, param="0.weight", index=3, bit=10)
    config = sdc.SDCConfig(weights_every=1, replay_every=0, on_suspect="raise", metrics_port=base_port,
                           metrics_host="127.0.0.1", job_name="direct-page", alertmanager_url=alertmanager_url,
                           nvml=False)
    monitor = sdc.SDCMonitor(ddp, opt, config=config)
    gen = torch.Generator().manual_seed(100 + rank)
    raised_at = None
    try:
        for _ in range(20):
            batch = (torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen))
            with monitor.step(batch) as st:
                st.backward(loss_fn(ddp, batch))
            opt.step()
            opt.zero_grad()
    except sdc.SDCDetected as e:
        raised_at = time.time()
        monitor.close()
        faults.close()
        return {"raised_at": raised_at, "returned_at": time.time(), "step": e.incident.step,
                "exit_code": e.exit_code}
    monitor.close()
    return {"raised_at": None}
