"""Rank side of the metrics scrape test (module level, so spawned ranks can import it).

Each rank trains a small DDP model with a Prometheus endpoint on ``base_port + local_rank`` and a ``FakeNVML`` GPU
(uuid = the rank's ``hw_id``, so SDC and GPU series join on ``host_name, hw_id``). At each named pause the rank
writes ``<sync_dir>/ready-<pause>-<rank>`` and waits for ``<sync_dir>/go-<pause>``, so the test process can scrape
every endpoint over HTTP while the ranks are alive.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sdc_telemetry as sdc
from sdc_telemetry.faults import FaultInjector
from sdc_telemetry.sinks.nvml import FakeNVML

PAUSE_AFTER_STEP = {2: "before_fault"}  # step index -> pause name; "after_run" follows the last step
FAULT = {"rank": 2, "step": 3, "param": "0.weight", "index": 3, "bit": 10}
STEPS = 4


def loss_fn(module: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(module(x), y)


def _pause(sync_dir: Path, name: str, rank: int, timeout: float = 60.0) -> None:
    (sync_dir / f"ready-{name}-{rank}").touch()
    deadline = time.monotonic() + timeout
    while not (sync_dir / f"go-{name}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: nobody scraped at pause {name!r} within {timeout:.0f}s")
        time.sleep(0.02)


def run(rank: int, world: int, base_port: int, sync_dir: str, steps: int = STEPS,
        pauses: dict[int, str] | None = None, replay_every: int = 2, fault: bool = True) -> dict[str, Any]:
    pauses = PAUSE_AFTER_STEP if pauses is None else pauses
    sync = Path(sync_dir)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    faults = FaultInjector(ddp, opt)
    if fault:
        faults.flip_weight_bit(**FAULT)
    config = sdc.SDCConfig(weights_every=1, replay_every=replay_every, on_suspect="record", metrics_port=base_port,
                           metrics_host="127.0.0.1", job_name="scrape-test")
    identity = sdc.RankIdentity.local()
    monitor = sdc.SDCMonitor(ddp, opt, loss_fn=loss_fn, config=config, comm_hook=faults.comm_hook,
                             nvml=FakeNVML.for_demo(identity.hw_id))
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(steps):
        batch = (torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen))
        with monitor.step(batch) as st:
            st.backward(loss_fn(ddp, batch))
        opt.step()
        opt.zero_grad()
        if step in pauses:
            _pause(sync, pauses[step], rank)
    _pause(sync, "after_run", rank)
    monitor.close()
    faults.close()
    return {"identity": monitor.identity.to_dict(),
            "incidents": [(i.step, i.check, i.suspect_ranks) for i in monitor.incidents],
            "gpu_evidence": [i.evidence.get("gpu_counters", {}) for i in monitor.incidents]}
