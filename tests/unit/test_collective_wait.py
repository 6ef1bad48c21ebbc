"""Waiting for a collective through its future (never a host busy-wait on NCCL under TORCH_NCCL_BLOCKING_WAIT)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sdc_telemetry.core.collective import wait_work
from sdc_telemetry.testing import spawn_ranks


class _Work:
    def __init__(self, future: bool) -> None:
        self.calls: list[str] = []
        self._future = future

    def get_future(self) -> Any:
        if not self._future:
            raise RuntimeError("this backend has no futures")
        work = self

        class _Future:
            def wait(self) -> None:
                work.calls.append("future.wait")

        return _Future()

    def wait(self) -> None:
        self.calls.append("work.wait")


def test_wait_work_waits_through_the_future_and_falls_back_to_work_wait() -> None:
    with_future, without = _Work(True), _Work(False)
    wait_work(with_future)
    wait_work(without)
    assert with_future.calls == ["future.wait"] and without.calls == ["work.wait"]


def _rank(rank: int, world: int) -> list[float]:
    t = torch.tensor([float(rank + 1)])
    wait_work(dist.all_reduce(t, async_op=True))
    return t.tolist()


def test_wait_work_on_gloo_returns_the_reduced_value() -> None:
    """On a CPU backend the result is there when it returns."""
    assert spawn_ranks(_rank, 2) == [[3.0], [3.0]]
