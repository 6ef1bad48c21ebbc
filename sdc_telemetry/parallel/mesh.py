"""N-D parallelism on a DeviceMesh: tensor and context parallelism with FSDP2/HSDP over the data-parallel dims.

The model is what torchtitan builds: ``parallelize_module`` over ``mesh["tp"]`` (DTensor tensor parallelism),
optionally context parallelism over ``mesh["cp"]``, then ``fully_shard`` over the data-parallel dims
(``mesh["dp_shard"]``, ``mesh["dp_replicate", "dp_shard"]``, or a flattened ``dp_shard_cp``). The world mesh comes
from the parameters (the root of their DTensor meshes) or from ``SDCMonitor(..., mesh=world_mesh)``; a context
parallel dimension never shows in the parameters' placements, so a mesh with ``cp`` must be passed explicitly.

What each check compares (``parallel.coordinates``):

- ``grad_local``: each FSDP parameter group's reduce-scatter input is tapped as in ``parallel.fsdp``: the local
  gradients of this rank's tensor-parallel shard, before the data-parallel reduction. ``grad_reduced``: the reduced
  shards are compared among the ranks that hold the same shard (same pp/dp_shard/cp/tp coordinate).
- ``weights``: among the ``dp_replicate`` replicas of each shard key: their digests are compared within their
  replica group, and the status vector carries one flag (its size does not depend on the mesh).
- ``replay``: the ranks of a partner data-parallel replica recompute the origin replica's micro-batches together,
  every tp/cp coordinate at once (their tensor- and context-parallel collectives line up within the replica, the
  FSDP all-gathers across replicas), and each coordinate compares its local gradients and loss with the origin's
  same coordinate. RNG states travel coordinate to coordinate: DTensor's parallel RNG tracker (torch 2.13) keeps
  its offsets in the device generator, which travels with the micro-batch (older torch kept a copy of its own:
  refused, ``check_torch``).

Expert parallelism (experts sharded over an ``ep`` dim that splits ``dp_shard``, ``parallel.experts``): the mesh
passed is the dense one; the experts' ``ep`` mesh is read from their parameters, and their FSDP groups shard over
``dp_shard // ep``.

Refused by name: pipeline dims without ``pipeline=`` (``parallel.pipeline``), expert parallelism with tensor,
context or pipeline parallelism, tensor parallelism without ``fully_shard`` (DDP over DTensor parameters),
``fully_shard`` over one data-parallel rank (no dp_shard nor dp_replicate dimension of 2 or more: nothing is
reduced), parameters sharded on another dim than 0 (a ``shard_placement_fn``). A
dp_shard of 1 with dp_replicate replicas is covered: FSDP copies the gradients instead of reduce-scattering them,
and the tap reads them at that copy (``fsdp._OneRankShards``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sdc_telemetry.parallel.base import LayoutError, world_ranks
from sdc_telemetry.parallel.coordinates import DIMS, Coordinates, canonical, check_dims
from sdc_telemetry.parallel.fsdp import FSDP, FSDPLayout, fsdp_groups

__all__ = ["MeshLayout", "is_nd", "world_mesh", "fsdp_layout"]


def _dtensor_params(model: torch.nn.Module) -> list[Any]:
    from torch.distributed.tensor import DTensor

    return [p for p in model.parameters() if isinstance(p, DTensor)]


def world_mesh(model: torch.nn.Module) -> Any:
    """The root DeviceMesh of the model's DTensor parameters (one for all), or ``LayoutError``."""
    params = _dtensor_params(model)
    if not params:
        raise LayoutError("no DTensor parameters: pass mesh= or apply fully_shard/parallelize_module first")
    roots = {_key(r): r for r in (p.device_mesh._get_root_mesh() for p in params)}
    if len(roots) != 1:
        raise LayoutError(f"the parameters live on {len(roots)} different root device meshes "
                          f"({', '.join(str(k[2]) for k in roots)}): build every parallelism from one world mesh "
                          "(init_device_mesh) and slice it, or pass mesh=")
    root = next(iter(roots.values()))
    if set(canonical(root.mesh_dim_names or ())) <= set(DIMS):
        return root
    # The root is a flat mesh the named one was unflattened from (torchtitan's "world"): the parameters' own mesh
    # with the most dimensions named as DIMS, when it spans every rank, is the named mesh (the experts' sparse mesh,
    # with its efsdp and ep dims, is not).
    named = [m for m in {id(p.device_mesh): p.device_mesh for p in params}.values()
             if set(canonical(m.mesh_dim_names or ())) <= set(DIMS)]
    meshes = sorted(named, key=lambda m: -m.ndim)
    if meshes and meshes[0].size() == dist.get_world_size():
        return meshes[0]
    return root


def _key(mesh: Any) -> tuple[Any, ...]:
    """A mesh's identity as ranks and names (FSDP2 rebuilds a parameter's combined mesh as a new object)."""
    return tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh_dim_names or ())


def is_nd(model: torch.nn.Module, mesh: Any) -> bool:
    """An N-D layout (this adapter) rather than plain FSDP2/HSDP: an explicit mesh, or parameters on a mesh with a
    tp/cp/pp dimension, more than two dimensions, or several meshes."""
    if mesh is not None:
        return True
    params = _dtensor_params(model)
    if not params:
        return False
    meshes = {id(p.device_mesh): p.device_mesh for p in params}
    root = params[0].device_mesh._get_root_mesh()
    names = set(root.mesh_dim_names or ()).union(*(m.mesh_dim_names or () for m in meshes.values()))
    return len(meshes) > 1 or root.ndim > 2 or bool({"tp", "cp", "pp"} & names)


#: the first torch whose DTensor RNG tracker keeps its offsets in the device generator (which the replay ships);
#: before it the tracker held its own copy of the generator state, which the replay neither captures nor restores
MIN_TORCH = (2, 9)


def check_torch(version: str | None = None) -> None:
    """``LayoutError`` on a torch older than ``MIN_TORCH``: random ops under tensor parallelism (dropout on
    DTensors) would not reproduce in the replay, and every audit would mismatch."""
    from torch.torch_version import TorchVersion

    found = version if version is not None else str(torch.__version__)
    if TorchVersion(found) < MIN_TORCH:  # type: ignore[operator]  # TorchVersion compares with tuples
        raise LayoutError(f"N-D layouts (tensor and context parallelism) need torch >= "
                          f"{'.'.join(map(str, MIN_TORCH))}, this is {found}: its DTensor RNG tracker keeps a copy "
                          "of the generator state that the replay cannot reproduce; upgrade torch")


class MeshLayout(FSDP):
    """A fully_shard-ed model with tensor and/or context parallel dims on one world DeviceMesh."""

    name = "nd"

    def __init__(self, model: torch.nn.Module, mesh: Any = None, *, pipeline: bool = False) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        check_torch()
        ranks, rank = world_ranks()
        super(FSDP, self).__init__(model, model, None, ranks, rank)  # collectives on the default group
        if mesh is not None and not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh= must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
        root = mesh if mesh is not None else world_mesh(model)
        names = tuple(root.mesh_dim_names or ())
        check_dims(names)
        sizes = {n: root.size(i) for i, n in enumerate(canonical(names))}
        if sizes.get("pp", 1) > 1 and not pipeline:
            raise LayoutError("the mesh has a pipeline dimension 'pp': this module is one pipeline stage; pass the "
                              "schedule: SDCMonitor(stage_module, optimizer, pipeline=schedule, ...)")
        if root.size() != dist.get_world_size():
            raise LayoutError(f"the device mesh covers {root.size()} of {dist.get_world_size()} ranks: pass the world "
                              "mesh (every rank), not a slice of it")
        for p in _dtensor_params(model):
            if _key(p.device_mesh._get_root_mesh()) != _key(root._get_root_mesh()):
                raise LayoutError("a parameter lives on a device mesh outside the given mesh: pass the world mesh "
                                  "the model was parallelised on")
        from sdc_telemetry.parallel.fsdp import _fsdp_module_type

        fsdp_type = _fsdp_module_type()
        if fsdp_type is None or not isinstance(model, fsdp_type):
            raise LayoutError("tensor or context parallelism needs fully_shard over the data-parallel dims, applied "
                              "to the root module too (fully_shard(model) after its blocks); DistributedDataParallel "
                              "over DTensor parameters is not supported")
        if len(_dtensor_params(model)) != len(list(model.parameters())):
            raise LayoutError("every parameter must be a DTensor (a module left outside fully_shard is not supported)")
        from sdc_telemetry.parallel.experts import ExpertOutputs, expert_layout

        self.experts = expert_layout(model, sizes)
        ep = self.experts.size if self.experts is not None else 1
        self.mesh = fsdp_layout(fsdp_groups(model), sizes, ep=ep)
        self._tap = None
        coordinate = root.get_coordinate()
        assert coordinate is not None
        device = next(model.parameters()).device
        self.coordinates = Coordinates.gather(sizes, dict(zip(canonical(names), coordinate, strict=True)), device,
                                              ep=(ep, self.experts.index) if self.experts is not None else (1, 0))
        self.shard_of = list(self.coordinates.key_of)
        self.world_mesh = root
        self.name = " x ".join([d for d in DIMS if sizes.get(d, 1) > 1] + (["ep"] if ep > 1 else [])) or "nd"
        self._outputs = None if self.experts is None else \
            ExpertOutputs(self.experts.modules, self.experts.parents, self.experts.names, self.world)

    @property
    def replicas(self) -> bool:
        return bool(self.coordinates.replicas > 1)

    @property
    def weight_replicas(self) -> bool:
        return bool(self.coordinates.sizes["dp_replicate"] > 1)

    def weights_off_reason(self) -> str | None:
        if self.weight_replicas:
            return None
        return ("no dp_replicate dimension: every shard of this mesh is held by one rank, so the weight check has "
                "nothing to compare and is off (a dp_replicate dimension of 2 or more adds replicas)")

    @property
    def digest_keys(self) -> int:
        return int(self.coordinates.keys)

    @property
    def digest_key(self) -> int:
        return int(self.coordinates.key_of[self.position])

    def stage_outputs(self) -> Any:
        """Expert parallelism: the recorder of each MoE layer's tokens sent and experts' outputs (the replay names the
        first that differs); None otherwise."""
        return self._outputs

    def describe(self) -> str:
        return f"{self.name} over {self.world} ranks ({self.coordinates.describe()})"


def fsdp_layout(groups: list[tuple[Any, Any]], sizes: dict[str, int], ep: int = 1) -> FSDPLayout:
    """The FSDP2 layout of a tensor- or context-parallel model's parameter groups (``fsdp_groups``; a pipeline
    stage's, or several stage modules' together) on a mesh of dims ``sizes``: the shard and replicate groups come
    from FSDP's own mesh info (the parameters' placements mix data- and tensor-parallel dims, which
    ``fsdp.layout_of`` refuses), after checking they are the mesh's data-parallel dims. ``ep``: the experts' groups
    (their parameters on an ``ep`` mesh) shard over ``dp_shard // ep`` (efsdp); the layout is the dense groups'."""
    experts = [g for g in groups if ep > 1 and _on_ep_mesh(g[1])]
    dense = [g for g in groups if g not in experts] or groups
    info = dense[0][1].mesh_info
    if any(pg.mesh_info.shard_mesh_size != info.shard_mesh_size for _, pg in dense):
        raise LayoutError("FSDP parameter groups shard over different mesh dimensions: not supported")
    efsdp = sizes.get("dp_shard", 1) // ep
    for module, pg in experts:
        if pg.mesh_info.shard_mesh_size != efsdp or getattr(pg.mesh_info, "replicate_mesh_size", 1) != \
                sizes.get("dp_replicate", 1):
            raise LayoutError(f"{type(module).__name__}'s experts shard over {pg.mesh_info.shard_mesh_size} ranks: "
                              f"apply fully_shard to the experts on the sparse mesh's efsdp dim ({efsdp} ranks: "
                              "dp_shard // ep), with dp_replicate where the mesh has it")
    if info.shard_mesh_size < 2 and getattr(info, "replicate_mesh_size", 1) < 2:
        raise LayoutError("fully_shard over one data-parallel rank reduces nothing (no dp_shard nor dp_replicate "
                          "dimension of 2 or more): there are no gradients of other ranks to check")
    allowed = {sizes.get("dp_shard", 1), sizes.get("dp_shard", 1) * sizes.get("cp", 1)}
    if info.shard_mesh_size not in allowed:
        held = " or ".join(str(n) for n in sorted(allowed))
        raise LayoutError(f"fully_shard shards over {info.shard_mesh_size} ranks, but the mesh's dp_shard "
                          f"(x cp) dims hold {held}: apply fully_shard on mesh['dp_shard'] (or the flattened "
                          "dp_shard_cp), or on mesh['dp_replicate', 'dp_shard']")
    replicate = getattr(info, "replicate_process_group", None)
    replicas = getattr(info, "replicate_mesh_size", 1)
    if replicas != sizes.get("dp_replicate", 1):
        raise LayoutError(f"fully_shard replicates over {replicas} ranks but the mesh's dp_replicate dim is "
                          f"{sizes.get('dp_replicate', 1)}: apply fully_shard on mesh['dp_replicate', 'dp_shard']")
    return FSDPLayout(shard_group=info.shard_process_group, shard_size=info.shard_mesh_size,
                      shard_index=info.shard_mesh_rank, replicate_group=replicate, replicas=replicas,
                      groups=tuple(groups))


def _on_ep_mesh(pg: Any) -> bool:
    """An FSDP parameter group of experts: its parameters are DTensors on a mesh with an ``ep`` dim."""
    return "ep" in tuple(pg.fsdp_params[0].sharded_param.device_mesh.mesh_dim_names or ())
