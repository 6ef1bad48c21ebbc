"""DistributedDataParallel: every rank holds the whole model; gradients are all-reduced bucket by bucket.

Local gradients are read in a comm hook that wraps the all-reduce (the user's hook, or DDP's default one on DDP's
own process group, so that averaging stays bit-identical to unmonitored training): the hook measures the bucket,
then runs the wrapped all-reduce. Reduced gradients are ``.grad`` after backward. Every rank of the replica group
(``replica_group``, default the DDP model's process group) holds a replica of every tensor; the replay recomputes
a partner's micro-batches with plain autograd on the unwrapped module (no collective).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sdc_telemetry.core.collective import group_ranks
from sdc_telemetry.parallel.base import GradSink, Layout

__all__ = ["DDP", "CommHook", "CommHookState", "comm_hook"]

GradBucket = Any  # torch.distributed.GradBucket (a pybind class the type checker cannot see)
CommHook = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass
class CommHookState:
    """State handed to DDP with the hook: what to measure into and which all-reduce to wrap."""

    sink: GradSink
    inner_hook: CommHook
    inner_state: Any
    index: dict[int, int]
    enabled: bool = True


def comm_hook(state: CommHookState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Measure the bucket's local gradients, then run the wrapped all-reduce hook (the user's or DDP's default)."""
    if state.enabled:
        try:
            state.sink.note_call(bucket.index())
            # Parameters frozen after DDP was built still sit in its buckets: they are not checked.
            pairs = [(state.index[id(p)], g) for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)
                     if id(p) in state.index]
            if pairs:
                state.sink.store([i for i, _ in pairs], [g for _, g in pairs])
        except Exception:  # noqa: BLE001 - reported through the status vector; the all-reduce must still happen
            state.sink.fail()
    return state.inner_hook(state.inner_state, bucket)


# DDP compares the annotations with the real classes; postponed (string) annotations would fail that check.
comm_hook.__annotations__ = {}


class DDP(Layout):
    name = "ddp"
    distributed = True
    reduces = True

    def __init__(self, model: DistributedDataParallel, *, replica_group: dist.ProcessGroup | None = None,
                 comm_hook: CommHook | None = None, comm_state: Any = None) -> None:
        group = replica_group if replica_group is not None else model.process_group
        super().__init__(model, model.module, group, group_ranks(group), dist.get_rank())
        self._ddp = model
        self._hook, self._hook_state_arg = comm_hook, comm_state
        self._state: CommHookState | None = None

    def install(self, sink: GradSink) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        inner = self._hook if self._hook is not None else default_hooks.allreduce_hook
        # DDP's own group, whatever replica_group is: the monitor must not change how gradients are averaged.
        inner_state = self._hook_state_arg if self._hook is not None else self._ddp.process_group
        index = {id(p): i for i, p in enumerate(p for p in self.module.parameters() if p.requires_grad)}
        self._state = CommHookState(sink, inner, inner_state, index)
        try:
            self._ddp.register_comm_hook(self._state, comm_hook)
        except RuntimeError as e:
            raise ValueError("the DDP model already has a communication hook; the monitor must wrap it to see local "
                             "gradients before the all-reduce. Register none, and pass yours as "
                             "SDCMonitor(..., comm_hook=your_hook, comm_state=your_state)") from e

    def after_backward(self, sink: GradSink) -> None:
        """The comm hook measured every bucket during backward."""

    def disable(self) -> None:
        # DDP cannot remove a comm hook: it stays registered and only forwards to the wrapped all-reduce.
        if self._state is not None:
            self._state.enabled = False
