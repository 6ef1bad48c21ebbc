"""Rank-side code of the reduce-phase checksum tests: the trust scenarios, plus how many reductions the DDP
layout's checksum compared in each (the check ran, not only passed)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

import sdc_telemetry as sdc

from . import _scenarios


class _Counted(sdc.SDCMonitor):
    """An SDCMonitor that remembers the last instance built on this rank."""

    last: sdc.SDCMonitor | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _Counted.last = self


def run_counted(rank: int, world: int, scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each scenario's result (``_scenarios.run_one``) with ``reduction_checks``: reductions compared by the
    checksum (0 where it did not run)."""
    real = sdc.SDCMonitor
    sdc.SDCMonitor = _Counted  # type: ignore[misc]  # what _scenarios.run_one builds (it reads sdc.SDCMonitor)
    out = []
    try:
        for sc in scenarios:
            _Counted.last = None
            result = _scenarios.run_one(rank, sc)
            monitor = _Counted.last
            result["reduction_checks"] = getattr(monitor.layout, "reduction_checks", 0) if monitor else 0
            out.append(result)
            dist.barrier()
    finally:
        sdc.SDCMonitor = real  # type: ignore[misc]
    return out
