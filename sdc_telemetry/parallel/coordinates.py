"""Mesh coordinates of N-D parallel layouts: which ranks form a replica, which hold the same shard.

Dimension names are torchtitan's: ``pp`` (pipeline stage), ``dp_replicate`` (data-parallel replicas that hold the
same shards), ``dp_shard`` (data-parallel ranks that shard the parameters: FSDP), ``cp`` (context parallel: one
micro-batch's sequence split across ranks), ``tp`` (tensor parallel).

Two derived indices drive every check:

- **replica**: the data-parallel index ``(dp_replicate, dp_shard)``. The ranks with the same replica index compute
  one micro-batch together (every pp/cp/tp coordinate), so a replay pairs replicas: the ranks of one replica
  recompute another replica's micro-batches, each coordinate the same coordinate's. Under expert parallelism
  (``parallel.experts``) the ``ep`` ranks that split a ``dp_shard`` group exchange tokens, so they are one replica's
  slots: the replica is ``(dp_replicate, efsdp)`` with ``efsdp = dp_shard // ep``.
- **shard key**: ``(pp, dp_shard, cp, tp)``. Ranks with the same key hold the same parameter shard: the weight vote
  and the reduced-gradient comparison run among them, which are the ``dp_replicate`` replicas of the shard.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from sdc_telemetry.core.collective import gather_rows
from sdc_telemetry.parallel.base import LayoutError

__all__ = ["DIMS", "ALIASES", "Coordinates", "canonical", "check_dims"]

#: the dimension names understood, outermost first (torchtitan's order)
DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
_REPLICA = ("dp_replicate", "efsdp")  # efsdp: dp_shard // ep (dp_shard without expert parallelism)
_SHARD = ("pp", "dp_shard", "cp", "tp")
_SLOT = ("pp", "cp", "tp", "ep")
_WHY = {"ep": "expert parallelism's sparse mesh: pass the dense mesh (dp_replicate, dp_shard or fsdp, ...); the "
              "experts' ep dim is read from their parameters",
        "efsdp": "expert parallelism's sparse mesh: pass the dense mesh (dp_replicate, dp_shard or fsdp, ...)",
        "etp": "expert tensor parallelism", "dp": "a plain 'dp' dimension: name it dp_replicate or dp_shard",
        "world": "a flat 'world' mesh the others were unflattened from: pass mesh= the mesh with named dims "
                 "(torchtitan: the dense mesh of its ParallelDims)"}


#: other names for a dimension: torchtitan's ``fsdp`` dim (its dp_shard, with cp folded in) is read as dp_shard
ALIASES = {"fsdp": "dp_shard"}


def canonical(names: Sequence[str]) -> tuple[str, ...]:
    """The dimension names with aliases resolved (``fsdp`` -> ``dp_shard``)."""
    return tuple(ALIASES.get(n, n) for n in names)


def check_dims(names: Sequence[str] | None) -> None:
    """Refuse, by name, mesh dimensions this monitor does not cover."""
    names = canonical(names or ())
    if not names:
        raise LayoutError("the device mesh has no dimension names: name its dimensions with torchtitan's names "
                          f"{', '.join(DIMS)} (init_device_mesh(..., mesh_dim_names=...))")
    for n in names:
        if n not in DIMS:
            why = _WHY.get(n, "an unknown dimension")
            raise LayoutError(f"mesh dimension {n!r} is not supported ({why}); supported: {', '.join(DIMS)}")
    if len(set(names)) != len(names):
        raise LayoutError(f"mesh dimension names repeat: {tuple(names)}")


@dataclass(frozen=True)
class Coordinates:
    """Every position's coordinate (gathered once at set-up), with the derived replica and shard-key indices."""

    sizes: dict[str, int]                     # dimension -> size (every name of DIMS; 1 where absent)
    mine: dict[str, int]                      # this rank's coordinate (the dimensions present)
    present: tuple[str, ...]                  # the dimensions of the mesh, in DIMS order
    of: tuple[dict[str, int], ...]            # by group position: its coordinate
    replica_of: tuple[int, ...]               # by group position: its replica index
    key_of: tuple[int, ...]                   # by group position: its shard key

    @classmethod
    def gather(cls, sizes: Mapping[str, int], mine: Mapping[str, int], device: torch.device,
               ep: tuple[int, int] = (1, 0)) -> Coordinates:
        """Collective on the default group (set-up, once): every rank's coordinate. ``ep``: the expert-parallel size
        and this rank's index in it (``parallel.experts``), when the experts are sharded over ranks."""
        check_dims(list(sizes))
        sizes = {ALIASES.get(d, d): v for d, v in sizes.items()}
        mine = {**{ALIASES.get(d, d): v for d, v in mine.items()}, "ep": ep[1]}
        full = {d: int(sizes.get(d, 1)) for d in DIMS}
        full.update(ep=ep[0], efsdp=full["dp_shard"] // ep[0])
        dims = (*DIMS, "ep")
        row = torch.tensor([int(mine.get(d, 0)) for d in dims], dtype=torch.int64)
        rows = gather_rows(row, None, device)
        present = tuple(d for d in dims if d in sizes or (d == "ep" and ep[0] > 1))
        of = tuple({d: r[i] for i, d in enumerate(dims) if d in present} for r in rows)
        if any(c.get("dp_shard", 0) % ep[0] != c.get("ep", 0) for c in of):
            raise LayoutError("the ep dim is not the innermost part of dp_shard (ep index = dp_shard index mod ep on "
                              "every rank): build the sparse mesh (dp_replicate, efsdp, ep) by unflattening the "
                              "world as torchtitan's ParallelDims does")
        replica_of = tuple(_flat({**c, "efsdp": c.get("dp_shard", 0) // ep[0]}, _REPLICA, full) for c in of)
        key_of = tuple(_flat(c, _SHARD, full) for c in of)
        seen = {(replica_of[p], key_of[p]) for p in range(len(of))}
        if len(seen) != len(of):
            raise LayoutError("two ranks claim the same mesh coordinate: the mesh does not describe this job")
        return cls(full, {d: int(mine.get(d, 0)) for d in present}, present, of, replica_of, key_of)

    @property
    def replicas(self) -> int:
        """Data-parallel replicas (dp_replicate x dp_shard, over ep under expert parallelism): the units a replay
        pairs."""
        return self.sizes["dp_replicate"] * self.sizes["efsdp"]

    @property
    def keys(self) -> int:
        """Distinct shard keys (pp x dp_shard x cp x tp): one digest replica group each."""
        return self.sizes["pp"] * self.sizes["dp_shard"] * self.sizes["cp"] * self.sizes["tp"]

    def slot_of(self, position: int) -> int:
        """The coordinate of ``position`` within its replica (pp, cp, tp, ep): the same slot in every replica."""
        return _flat(self.of[position], _SLOT, self.sizes)

    def describe(self) -> str:
        return " x ".join(f"{d}={self.sizes[d]}" for d in self.present)


def _flat(coord: Mapping[str, int], dims: Sequence[str], sizes: Mapping[str, int]) -> int:
    out = 0
    for d in dims:
        out = out * sizes[d] + coord.get(d, 0)
    return out
