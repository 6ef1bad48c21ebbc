"""Rank side of the context-parallel monitor tests: the CP model of ``_cp`` trained with an SDCMonitor on its mesh."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import sdc_telemetry as sdc
from sdc_telemetry.faults import FaultInjector

from ._cp import train
from ._scenarios import Recorder


def run_cp(rank: int, world: int, scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each scenario: ``config`` for the monitor (passed mesh= the world mesh: the parameters' flattened
    dp_shard_cp mesh hides the cp dim), and an optional transient ``perturb`` of one rank's module output."""
    out = []
    for sc in scenarios:
        recorder = Recorder()
        held: list[Any] = []

        def factory(model: torch.nn.Module, opt: torch.optim.Optimizer, loss_fn: Any, mesh: Any,
                    sc: dict[str, Any] = sc, recorder: Recorder = recorder, held: list[Any] = held) -> Any:
            if sc.get("perturb"):
                faults = FaultInjector(model, opt)
                faults.perturb_output(**sc["perturb"])
                held.append(faults)
            return sdc.SDCMonitor(model, opt, loss_fn=loss_fn, mesh=mesh, observer=recorder,
                                  config=sdc.SDCConfig(metrics_port=None, nvml=False, **sc.get("config", {})))

        result = train(rank, sc.get("steps", 4), factory)
        for faults in held:
            faults.close()
        out.append({"incidents": [(i.step, i.check, list(i.suspect_ranks), i.evidence.get("verdict"),
                                   i.evidence.get("coordinate"), bool(i.evidence.get("ambiguous")))
                                  for i in result["incidents"]],
                    "counts": recorder.counts(), "errors": recorder.errors, "losses": result["losses"]})
        dist.barrier()
    return out
