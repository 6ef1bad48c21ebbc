"""Rank-side code of the scale tests: what the monitor's own collectives move on healthy steps."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import sdc_telemetry as sdc

from ._scenarios import Net, loss_fn

_WRAPPED = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "all_gather_object", "broadcast",
            "batch_isend_irecv", "gather", "reduce", "all_gather")


def _count_monitor_bytes(tally: dict[str, int]) -> None:
    """Wrap torch.distributed's collectives: count the bytes of calls made from sdc_telemetry's own modules."""
    for name in _WRAPPED:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def wrapper(*args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
            frame = sys._getframe(1)
            caller = frame.f_globals.get("__name__", "")
            # DDP's own gradient reduction, which the monitor's comm hook runs in DDP's place, is training's cost.
            if caller.startswith("sdc_telemetry") and frame.f_code.co_name != "allreduce_as_ddp":
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                # The reduce-phase checksum's sums, all-reduced right behind DDP's last gradient bucket.
                key = "checksum_" + _name if frame.f_code.co_name == "launch" else _name
                tally[key] = tally.get(key, 0) + sum(t.numel() * t.element_size() for t in tensors[:1])
                tally["calls"] = tally.get("calls", 0) + 1
            return _fn(*args, **kwargs)

        setattr(dist, name, wrapper)


def healthy_step_bytes(rank: int, world: int, steps: int) -> dict[str, int]:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(Net())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    monitor = sdc.SDCMonitor(ddp, opt, loss_fn=loss_fn, observer=sdc.Observer(),
                             config=sdc.SDCConfig(weights_every=1, replay_every=1000, update_every=0,
                                                  metrics_port=None, nvml=False))
    gen = torch.Generator().manual_seed(rank)
    tally: dict[str, int] = {}

    def one_step() -> None:
        batch = {"x": torch.randn(8, 16, generator=gen), "y": torch.randint(0, 4, (8,), generator=gen)}
        with monitor.step(batch) as step:
            step.backward(loss_fn(ddp, batch))
        opt.step()
        opt.zero_grad()

    one_step()  # step 0 is an audit step (0 % replay_every == 0): not a healthy-path step
    _count_monitor_bytes(tally)
    for _ in range(steps):
        one_step()
    assert not monitor.incidents
    monitor.close()
    return {k: v // steps for k, v in tally.items()}
