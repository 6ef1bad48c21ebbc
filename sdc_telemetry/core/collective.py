"""The few collectives the monitor uses, on the device the process group's backend needs.

The healthy path uses ``agree``: one all-reduce of a fixed-size int64 vector that gives every rank the MAX and the
MIN of each field over the group (flags OR/AND, digests equal or not); sharded layouts compare weight digests within
each shard's replicas first (``disagreement``, two int64 per rank). Per-rank rows (``gather_rows``,
``gather_objects``) are gathered only when a field disagrees, on a replay audit, or at set-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["collective_device", "agree", "disagreement", "wait_work", "sum_counts", "gather_rows", "gather_objects",
           "gather_ragged", "group_ranks", "Agreement"]


def collective_device(group: dist.ProcessGroup | None, device: torch.device | None = None) -> torch.device:
    """CUDA for NCCL groups (``device``, the model's GPU, when it is one; else the current device), CPU for gloo
    and others. The model's device matters: a rank that never called ``torch.cuda.set_device`` has GPU 0 current."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        if device is not None and device.type == "cuda":
            return device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Agreement:
    """MAX and MIN over the group of one int64 vector, from one all-reduce of ``[v, ~v]`` with MAX
    (``max(~v) == ~min(v)``, and ``~`` never overflows, unlike negation).

    On CUDA the result is copied to pinned host memory behind an event and read by ``result()`` later (at the next
    step boundary), so the training thread never waits for the GPU on the healthy path. ``group=None`` with no
    process group (one process): the vector is its own MAX and MIN.
    """

    def __init__(self, vec: torch.Tensor, group: dist.ProcessGroup | None, distributed: bool = True,
                 local: torch.Tensor | None = None) -> None:
        self.size = vec.numel()
        # This rank's own float64 values (gradient norms for telemetry), read back with the verdict.
        self._local = local.detach().to(torch.float64) if local is not None else torch.zeros(0, dtype=torch.float64)
        vec = vec.to(torch.int64)
        both = _max_and_not_min(vec, group) if distributed else torch.cat([vec, torch.bitwise_not(vec)])
        self._event: torch.cuda.Event | None = None
        if both.is_cuda or self._local.is_cuda:
            host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            host.copy_(both, non_blocking=True)
            local_host = torch.empty(self._local.shape, dtype=torch.float64, pin_memory=True)
            local_host.copy_(self._local, non_blocking=True)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            # On the stream of the copies (the agreement's device, which is also where this rank's values live).
            self._event.record(torch.cuda.current_stream(both.device if both.is_cuda else self._local.device))
            both, self._local = host, local_host
        self._both = both
        self._result: tuple[list[int], list[int]] | None = None

    def ready(self) -> bool:
        return self._event is None or bool(self._event.query())  # type: ignore[no-untyped-call]

    def _wait(self) -> None:
        # One step later the event has long completed: query() reads a flag and never blocks; synchronize() is the
        # fallback for a verdict wanted at once (audits, on-demand checks).
        if self._event is not None and not self._event.query():  # type: ignore[no-untyped-call]
            self._event.synchronize()

    def local(self) -> list[float]:
        """This rank's own values passed as ``local``."""
        self._wait()
        return [float(x) for x in self._local.tolist()]

    def result(self) -> tuple[list[int], list[int]]:
        """(MAX, MIN) per field as Python ints."""
        if self._result is None:
            self._wait()
            values: list[int] = self._both.tolist()
            self._result = values[:self.size], [~x for x in values[self.size:]]
        return self._result


def disagreement(value: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """1 (a 0-d int64 tensor on ``value``'s device) where the ranks of ``group`` hold different values of the 0-d or
    one-element int64 ``value``, else 0: the MAX of ``[v, ~v]`` over the group, compared on the device, so the host
    never waits for it on a GPU. Collective over ``group``."""
    both = _max_and_not_min(value.reshape(1).to(torch.int64), group)
    return (both[0] != torch.bitwise_not(both[1])).to(device=value.device, dtype=torch.int64)


def _max_and_not_min(vec: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[MAX(v), ~MIN(v)]`` over the group from one all-reduce of ``[v, ~v]`` with MAX, on the group's device."""
    both = torch.cat([vec, torch.bitwise_not(vec)]).to(collective_device(group, vec.device))
    wait_work(dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group, async_op=True))
    return both


def wait_work(work: Any) -> None:
    """Wait for a collective the way that never blocks the host on CUDA: through its future (NCCL: the current
    stream waits for the work's events). ``Work.wait()`` busy-waits the host where ``TORCH_NCCL_BLOCKING_WAIT`` is
    set, as clusters often do. CPU backends are done when it returns; a work without a future is waited on."""
    try:
        future = work.get_future()
    except (AttributeError, RuntimeError, NotImplementedError):  # a backend without futures
        work.wait()
        return
    future.wait()


def agree(vec: torch.Tensor, group: dist.ProcessGroup | None, distributed: bool = True
          ) -> tuple[list[int], list[int]]:
    """(MAX, MIN) of ``vec`` over the group, read now (on ``vec``'s device when the backend can use it)."""
    return Agreement(vec, group, distributed).result()


def sum_counts(counts: Sequence[int], group: dist.ProcessGroup | None, device: torch.device | None = None
               ) -> list[int]:
    """Element-wise SUM of a fixed-size count vector over the group (a histogram, a tally)."""
    t = torch.tensor(list(counts), dtype=torch.int64, device=collective_device(group, device))
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.tolist()  # type: ignore[no-any-return]


def gather_rows(row: torch.Tensor, group: dist.ProcessGroup | None, device: torch.device | None = None
                ) -> list[list[int]]:
    """All-gather one 1-D int64 row per rank; every rank gets all rows as Python ints (one host sync). ``device``:
    the model's device (the row's own device when it is on a GPU)."""
    device = collective_device(group, device if device is not None else row.device)
    row = row.to(device=device, dtype=torch.int64).contiguous()
    out = torch.empty((dist.get_world_size(group), row.numel()), dtype=torch.int64, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out.view(-1), row, group=group)
    return out.tolist()  # type: ignore[no-any-return]


def gather_ragged(row: torch.Tensor, group: dist.ProcessGroup | None, device: torch.device | None = None
                  ) -> list[list[int]]:
    """``gather_rows`` for rows whose length differs by rank (pipeline stages hold different parameters): one MAX
    agreement of the lengths, then the rows padded to the longest, each returned at its own length."""
    wire = collective_device(group, device if device is not None else row.device)
    high, _ = agree(torch.tensor([row.numel()], dtype=torch.int64, device=wire), group)
    padded = torch.zeros(high[0] + 1, dtype=torch.int64, device=wire)
    padded[0] = row.numel()
    padded[1:1 + row.numel()] = row.to(device=wire, dtype=torch.int64).reshape(-1)
    return [r[1:1 + r[0]] for r in gather_rows(padded, group, wire)]


def gather_objects(obj: object, group: dist.ProcessGroup | None) -> list[object]:
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global rank of each position of the group."""
    return [dist.get_global_rank(group, i) if group is not None else i for i in range(dist.get_world_size(group))]
