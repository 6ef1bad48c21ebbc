"""The few collectives the checks use, on the device the process group's backend needs."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["collective_device", "gather_rows", "gather_objects", "group_ranks"]


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """CUDA for NCCL groups (the current device), CPU for gloo and others."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_rows(row: torch.Tensor, group: dist.ProcessGroup | None) -> list[list[int]]:
    """All-gather one 1-D int64 row per rank; every rank gets all rows as Python ints (one host sync)."""
    device = collective_device(group)
    row = row.to(device=device, dtype=torch.int64).contiguous()
    out = torch.empty((dist.get_world_size(group), row.numel()), dtype=torch.int64, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out.view(-1), row, group=group)
    return out.tolist()  # type: ignore[no-any-return]


def gather_objects(obj: object, group: dist.ProcessGroup | None) -> list[object]:
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global rank of each position of the group."""
    return [dist.get_global_rank(group, i) if group is not None else i for i in range(dist.get_world_size(group))]
