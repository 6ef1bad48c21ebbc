"""DistributedDataParallel: every rank holds the whole model; gradients are all-reduced bucket by bucket.

Local gradients are read in a comm hook that wraps the all-reduce (the user's hook, or ``allreduce_as_ddp`` on
DDP's own process group: DDP's built-in averaging reproduced bit for bit, so training is unchanged): the hook
measures the bucket, then runs the wrapped all-reduce. Reduced gradients are ``.grad`` after backward. Every rank
of the replica group (``replica_group``, default the DDP model's process group) holds a replica of every tensor;
the replay recomputes a partner's micro-batches with plain autograd on the unwrapped module (no collective).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sdc_telemetry.core.collective import group_ranks
from sdc_telemetry.parallel.base import GradSink, Layout

__all__ = ["DDP", "CommHook", "CommHookState", "comm_hook", "allreduce_as_ddp"]

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


@dataclass
class DDPScaling:
    """State of ``allreduce_as_ddp``: the group, and, with ``gradient_as_bucket_view``, where each parameter's
    gradient lived before backward (filled by a forward hook): a gradient accumulated in place in its bucket
    view is divided, a fresh one multiplied, as DDP's reducer does."""

    group: dist.ProcessGroup
    before: dict[int, int] = field(default_factory=dict)  # id(param) -> data_ptr of its .grad before backward


def allreduce_as_ddp(state: DDPScaling, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's built-in reduction, bit for bit, as a comm hook: the monitor must not change training.

    Without a hook DDP scales each gradient while copying it into the bucket, ``grad * (1 / W)`` with the factor a
    double scalar, or, where the gradient already was the bucket's view (``gradient_as_bucket_view`` with gradients
    kept between steps), ``view / W`` in place; then it sums. ``x * (1/W)`` and ``x / W`` differ in the last bit for
    many ``x`` when W is not a power of two, so ``default_hooks.allreduce_hook`` (which divides the whole bucket)
    drifts from unmonitored training at W=3."""
    world = state.group.size()
    buffer = bucket.buffer()
    views = bucket.gradients()
    aliased = [state.before.get(id(p)) == v.data_ptr() for p, v in zip(bucket.parameters(), views, strict=True)]
    if not any(aliased):
        buffer.mul_(1.0 / world)
    elif all(aliased):
        buffer.div_(world)
    else:
        for view, alias in zip(views, aliased, strict=True):
            if alias:
                view.div_(world)
            else:
                view.mul_(1.0 / world)
    work = dist.all_reduce(buffer, group=state.group, async_op=True)
    future: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda fut: fut.value()[0])
    return future


allreduce_as_ddp.__annotations__ = {}


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
        inner = self._hook if self._hook is not None else allreduce_as_ddp
        # DDP's own group, whatever replica_group is: the monitor must not change how gradients are averaged.
        inner_state = self._hook_state_arg if self._hook is not None else self._scaling()
        index = {id(p): i for i, p in enumerate(p for p in self.module.parameters() if p.requires_grad)}
        self._state = CommHookState(sink, inner, inner_state, index)
        try:
            self._ddp.register_comm_hook(self._state, comm_hook)
        except RuntimeError as e:
            raise ValueError("the DDP model already has a communication hook; the monitor must wrap it to see local "
                             "gradients before the all-reduce. Register none, and pass yours as "
                             "SDCMonitor(..., comm_hook=your_hook, comm_state=your_state)") from e

    def _scaling(self) -> DDPScaling:
        scaling = DDPScaling(self._ddp.process_group)
        if self._ddp.gradient_as_bucket_view:
            params = [p for p in self._ddp.parameters() if p.requires_grad]

            def note(*_: Any) -> None:
                scaling.before = {id(p): p.grad.data_ptr() for p in params if p.grad is not None}

            # After DDP's forward (which may rebuild its buckets and re-point gradients at the new views), before
            # backward. Stays registered after close(), like the comm hook that reads it.
            self._ddp.register_forward_hook(note)
        return scaling

    def after_backward(self, sink: GradSink) -> None:
        """The comm hook measured every bucket during backward."""

    def disable(self) -> None:
        # DDP cannot remove a comm hook: it stays registered and only forwards to the wrapped all-reduce.
        if self._state is not None:
            self._state.enabled = False

