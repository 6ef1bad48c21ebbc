"""Pipeline stages (``torch.distributed.pipelining``) with data parallelism: the stage's coordinate, the step, the
replay's rerun of a schedule step, and the Layout adapter of a stage.

A rank runs one stage of a pipeline (``PipelineStage`` in a ``ScheduleGPipe`` or ``Schedule1F1B``) or several
(``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``: stage i on pp rank i mod pp), and each stage module is
DDP-wrapped over its data-parallel group or ``fully_shard``-ed over it. A *replica* is one data-parallel index: the
ranks of one pp group. Ranks with the same pp rank hold the same parameters (DDP) or the same shards of them (FSDP2),
so weights are compared per pp rank (and shard) across the replicas, gradients are checked per rank (every local
stage module tapped), and the replay reruns a whole schedule step of one replica's micro-batches on the ranks of
another (every stage at once: the stage-to-stage sends line up within the partner's pp group). Each forward's output
is fingerprinted with its stage index, so a forward fault is named at its stage even when a rank runs several.

What torch 2.13's pipelining does with a step (read from its source, checked by the tests):

- ``schedule.step(*inputs, target=, losses=)`` splits the batch into ``n_microbatches`` chunks; the first stage
  takes the inputs, the last the target, and ``losses`` (a list, cleared and filled on the last stage only) receives
  one loss tensor per micro-batch. Each micro-batch's backward is ``torch.autograd.backward``: gradients accumulate
  into the stage parameters' ``.grad`` (micro-batch 0 first). After the last backward the schedule divides
  ``.grad`` by ``n_microbatches`` (``scale_grads=True``, the default): the local gradients a tap sees are the
  undivided sums.
- DDP stage modules: every forward and every backward but the last run under ``no_sync()``; the stage calls
  ``reducer.prepare_for_backward`` itself before the last micro-batch's backward, so DDP's all-reduce (and a comm hook:
  ``parallel.ddp``'s tap) runs once per step and stage module, during its last micro-batch's backward, on the
  accumulated local gradients. Under ``ScheduleGPipe`` and the multi-stage schedules, without
  ``find_unused_parameters=True``, the second step fails inside DDP's bucket rebuild (``params_.size() ==
  rebuilt_param_indices_.size() INTERNAL ASSERT FAILED``, reducer.cpp; the same without the monitor); with it, the
  gradients are those of a plain all-reduce. ``Schedule1F1B`` runs without the flag.
- Multi-stage schedules (``_PipelineScheduleRuntime``) run a per-rank action list: after a stage's last backward a
  ``REDUCE_GRAD`` action calls its ``perform_reduce_grad`` (FSDP2's post-backward, then the division by the
  micro-batch count), once per stage and step.
- FSDP2 stage modules: each backward runs with gradient sync and resharding off; after the last one the schedule
  calls every parameter group's ``post_backward`` with sync on: one reduce-scatter per group per step
  (``parallel.fsdp``'s tap) of the accumulated unsharded gradients.
- State a step leaves: ``stage.output_chunks`` (the last stage's outputs), ``stage.bwd_cache`` (the input gradients
  sent back), the receive buffers (the last micro-batch's activations and gradients), the schedule's
  ``_internal_losses`` (emptied) and the first step's lazily built metadata (shapes of the stage's inputs and
  outputs: a rerun needs micro-batches of the same shapes).

Covered: one stage per rank (``ScheduleGPipe``, ``Schedule1F1B``) or several (``ScheduleInterleaved1F1B``,
``ScheduleLoopedBFS``; with fully_shard-ed stage modules ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``
and ``ScheduleDualPipeV`` (a forward and a backward overlapped in one action), whose split weight backward assigns
``.grad`` without autograd's accumulation: the rerun captures the gradients at FSDP's reduce-scatter,
``fsdp.capture_grads``), stage modules DDP-wrapped (over the dp group) or ``fully_shard``-ed on a 1-D dp mesh or a
2-D (replicate, shard) mesh, tensor parallelism inside fully_shard-ed stage modules (``parallelize_module`` over the
world mesh's ``tp``, ``mesh=`` given: the shard key is then (pp, dp_shard, tp) and the replay's rerun runs each
stage's tp collectives), or plain modules when there is one replica. Refused by name: DDP stage modules under a
zero-bubble schedule (DDP's reducer never sees its weight gradients), forward-only schedules and schedules without
``loss_fn``, custom or loaded schedules, a rank's stages out of the schedule's order or wrapped differently, stage
modules sharing parameters, one ``comm_hook`` for several DDP stage modules, a stage module that is neither
DDP-wrapped nor fully_shard-ed with several replicas, DDP over tensor-parallel (DTensor) parameters, context
parallelism inside a stage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sdc_telemetry.core.collective import gather_rows, group_ranks
from sdc_telemetry.core.fingerprint import fingerprint
from sdc_telemetry.parallel.base import GradSink, Layout, LayoutError, world_ranks
from sdc_telemetry.parallel.coordinates import Coordinates, canonical
from sdc_telemetry.parallel.fsdp import local_shard
from sdc_telemetry.parallel.outputs import StageOutputs

__all__ = ["PipelineStageLayout", "StageCoordinate", "RerunResult", "stages_of", "stage_module", "coordinate",
           "pipeline_step", "rerun", "rng_state", "SUPPORTED_SCHEDULES"]

#: the schedules covered: one stage per rank, or several (interleaved, looped, and with fully_shard-ed stage modules
#: the zero-bubble schedules, DualPipeV among them, that split each backward into input and weight parts)
SUPPORTED_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
                       "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
_SINGLE = ("ScheduleGPipe", "Schedule1F1B")
#: split backward: weight gradients by torch.autograd.grad, assigned to .grad (no autograd accumulation, no DDP hook)
_ZERO_BUBBLE = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
_MULTI = ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS", *_ZERO_BUBBLE)
_DP_DIMS = ("dp_replicate", "dp_shard", "dp")
_INNER = ("cp", "tp")  # dims inside a stage (a replica's slots), with fully_shard-ed stage modules


def _schedules() -> Any:
    from torch.distributed.pipelining import schedules

    return schedules


def stages_of(schedule: Any) -> list[Any]:
    """The ``PipelineStage``s a supported schedule runs on this rank, in local stage order (one for ``ScheduleGPipe``
    and ``Schedule1F1B``, several for the interleaved, looped and zero-bubble schedules), or ``LayoutError``
    naming what is not covered (forward-only, no loss function, a custom or loaded schedule)."""
    s = _schedules()
    name = type(schedule).__name__
    ours = type(schedule).__module__ == s.__name__
    if isinstance(schedule, s.PipelineScheduleMulti):
        if name not in _MULTI or not ours:
            raise LayoutError(f"{name} is not supported: the monitor knows the actions of "
                              f"{', '.join(SUPPORTED_SCHEDULES)} only (a custom or loaded schedule may split or "
                              "reorder the backward it taps and reruns)")
        stages = list(schedule._stages)
    elif isinstance(schedule, s.PipelineScheduleSingle):
        if name not in _SINGLE or not ours:
            raise LayoutError(f"{name} is not supported: the monitor knows the micro-batch order of "
                              f"{', '.join(SUPPORTED_SCHEDULES)} only (a forward-only or custom schedule has no "
                              "backward it can tap or rerun)")
        stages = [schedule._stage]
    else:
        raise LayoutError(f"pipeline= needs a torch.distributed.pipelining schedule ({', '.join(SUPPORTED_SCHEDULES)}),"
                          f" got {name}")
    if getattr(schedule, "_loss_fn", None) is None:
        raise LayoutError(f"{name} was built without loss_fn: a forward-only pipeline has no gradients to check; "
                          "pass loss_fn=... to the schedule")
    if any(getattr(stage, "dw_builder", None) is not None for stage in stages):
        raise LayoutError("a PipelineStage with dw_builder= (a deferred weight backward) is not supported")
    return stages


def stage_module(submod: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """The unwrapped stage module and how it is data-parallel: ``"ddp"``, ``"fsdp"`` or ``"plain"``."""
    from sdc_telemetry.parallel import fsdp

    if isinstance(submod, DistributedDataParallel):
        return submod.module, "ddp"
    if fsdp.is_fully_sharded(submod):
        from torch.distributed.tensor import DTensor

        meshes = {_mesh_key(p.device_mesh): p.device_mesh for p in submod.parameters() if isinstance(p, DTensor)}
        roots = {_mesh_key(m._get_root_mesh()) for m in meshes.values()}  # (dp_shard) and (dp_shard, tp) slices
        if len(roots) > 1:
            raise LayoutError("a stage module's parameters live on several device meshes: build its tensor and "
                              "data parallelism on slices of one world mesh (init_device_mesh, then mesh['tp'], "
                              "mesh['dp_shard'])")
        return submod, "fsdp"
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in submod.parameters()):
        raise LayoutError("a stage module with DTensor (tensor-parallel) parameters must be fully_shard-ed over its "
                          "data-parallel dims: DistributedDataParallel over DTensor parameters is not supported")
    return submod, "plain"


def _mesh_key(mesh: Any) -> tuple[Any, ...]:
    """Equal meshes, not the same objects: their dim names and ranks."""
    return (mesh.mesh_dim_names, tuple(mesh.mesh.flatten().tolist()))


def _stage_modules(stages: Sequence[Any]) -> tuple[list[torch.nn.Module], str]:
    """Every local stage's unwrapped module, and their one data-parallel kind (the stages of a rank are wrapped
    alike)."""
    found = [stage_module(stage.submod) for stage in stages]
    kinds = {kind for _, kind in found}
    if len(kinds) > 1:
        raise LayoutError(f"this rank's stage modules are wrapped differently ({sorted(kinds)}): wrap every stage "
                          "module of a rank alike (all DDP, all fully_shard-ed)")
    return [m for m, _ in found], found[0][1]


def _local_stages(schedule: Any, stages: Sequence[Any]) -> tuple[list[list[int]], int]:
    """Every pp rank's stage indices (ascending) and this rank's pp rank, after checking that this rank holds
    exactly the stages the schedule maps to it, in order. No collective."""
    first = stages[0]
    size, pp_rank, count = len(group_ranks(first.group)), dist.get_rank(first.group), first.num_stages
    mapping = dict(getattr(schedule, "stage_index_to_group_rank", None) or {i: i for i in range(count)})
    by_rank: list[list[int]] = [sorted(i for i, r in mapping.items() if r == q) for q in range(size)]
    mine = [stage.stage_index for stage in stages]
    if any((stage.group is not first.group and group_ranks(stage.group) != group_ranks(first.group))
           or stage.num_stages != count for stage in stages) \
            or len(mapping) != count or mine != by_rank[pp_rank] or any(len(b) != len(mine) for b in by_rank):
        raise LayoutError(f"stages {mine} of {count} on pp-group rank {pp_rank} of {size}: the schedule maps stages "
                          f"{by_rank[pp_rank] if pp_rank < len(by_rank) else []} here; give the schedule this rank's "
                          "stages in ascending order, the same number on every pp rank")
    return by_rank, pp_rank


@dataclass(frozen=True)
class StageCoordinate:
    """Where this rank sits: its place in the pipeline (pp rank, and the stages it runs) and its data-parallel index
    (its replica)."""

    stage: int                              # pp rank (= the stage index with one stage per rank)
    stages: int                             # pp ranks (= pipeline stages with one stage per rank)
    pp_group: dist.ProcessGroup | None      # this replica's ranks, one per pp rank
    dp: int                                 # data-parallel index: the replica
    replicas: int                           # data-parallel size
    dp_group: dist.ProcessGroup | None      # the ranks of this pp rank in every replica (None: dp == 1 or unknown)
    dims: tuple[tuple[str, int], ...] = ()  # the coordinate as named mesh dims, for evidence
    stage_map: tuple[tuple[int, ...], ...] = ()  # every pp rank's pipeline stages, ascending

    @property
    def indices(self) -> tuple[int, ...]:
        """The pipeline stages this rank runs, ascending."""
        return self.stage_map[self.stage] if self.stage_map else (self.stage,)

    def as_dict(self) -> dict[str, int]:
        """The coordinate for ``evidence["coordinate"]``, e.g. ``{"pp": 1, "dp_replicate": 0}`` (``pp``: the pp
        rank)."""
        return {"pp": self.stage, **dict(self.dims)}


def coordinate(schedule: Any, *, dp_group: dist.ProcessGroup | None = None, mesh: Any = None) -> StageCoordinate:
    """This rank's pp rank, stages and data-parallel index. The data-parallel group comes from ``mesh`` (a DeviceMesh
    with a ``pp`` dim and one of ``dp_replicate``/``dp_shard``/``dp``), from ``dp_group``, or from the stage modules
    (DDP's process group, FSDP2's mesh). No collective."""
    stages = stages_of(schedule)
    by_rank, pp_rank = _local_stages(schedule, stages)
    stage = stages[0]
    modules, kind = _stage_modules(stages)
    pp_ranks = group_ranks(stage.group)
    stage_map = tuple(tuple(b) for b in by_rank)
    dims: tuple[tuple[str, int], ...] = ()
    if mesh is not None:
        raw = tuple(mesh.mesh_dim_names or ())
        names = canonical(raw)  # torchtitan's dense mesh calls dp_shard 'fsdp'
        size = {n: mesh.size(i) for i, n in enumerate(names)}
        other = [n for n in names if n not in ("pp", *_INNER) and n not in _DP_DIMS]
        dp_names = [n for n in names if n in _DP_DIMS and size[n] > 1]
        inner = [n for n in _INNER if size.get(n, 1) > 1]
        if "pp" not in names or other or (kind != "fsdp" and (inner or len(dp_names) > 1)):
            raise LayoutError(f"mesh dims {raw}: a pipeline stage's mesh here is 'pp' with data-parallel dims "
                              f"({', '.join(_DP_DIMS)}; several, and 'cp' and 'tp', with fully_shard-ed stage "
                              f"modules); other dims ({other or 'none'}) are not covered by the pipeline adapter")
        if group_ranks(mesh.get_group("pp")) != pp_ranks:
            raise LayoutError(f"the mesh's pp group {group_ranks(mesh.get_group('pp'))} is not the stage's group "
                              f"{pp_ranks}")
        if kind != "fsdp" and dp_names:
            dp_group = mesh.get_group(raw[names.index(dp_names[0])])
            # a replicated stage (DDP) is torchtitan's dp_replicate, whatever the mesh calls its dp dim
            dims = (("dp_replicate" if dp_names[0] == "dp" else dp_names[0], dist.get_rank(dp_group)),)
    if kind == "fsdp":
        lay = _fsdp_layout(modules, mesh)
        # Context parallelism: fully_shard over the flattened dp_shard x cp ranks, whose cp ranks compute one
        # micro-batch together (a replica's slots), not data-parallel replicas: those come from the mesh's dp_shard.
        cp = size.get("cp", 1) if mesh is not None else 1
        folded = cp > 1 and lay.shard_size == size.get("dp_shard", 1) * cp
        shards = lay.shard_size // cp if folded else lay.shard_size
        shard_index = (mesh.get_local_rank(raw[names.index("dp_shard")]) if "dp_shard" in names else 0) \
            if folded else lay.shard_index
        replicas = shards * lay.replicas
        if mesh is not None and (held := math.prod(size[n] for n in names if n in _DP_DIMS)) != replicas:
            raise LayoutError(f"the stage modules are fully_shard-ed over {replicas} data-parallel ranks but the "
                              f"mesh's data-parallel dims hold {held}")
        rep = dist.get_rank(lay.replicate_group) if lay.replicate_group is not None else 0
        dp = rep * shards + shard_index
        dims = ((("dp_replicate", rep),) if lay.hsdp else ()) + (("dp_shard", shard_index),)
        for n in _INNER:  # the replica's slots inside a stage: cp, then tp (torchtitan's order)
            if mesh is not None and size.get(n, 1) > 1:
                dims += ((n, mesh.get_local_rank(raw[names.index(n)])),)
        if dp_group is not None and dist.get_world_size(dp_group) != replicas:
            raise LayoutError(f"the stage module is fully_shard-ed over {replicas} data-parallel ranks but the "
                              f"data-parallel group has {dist.get_world_size(dp_group)}")
        if dp_group is None and not lay.hsdp:
            dp_group = lay.shard_group if not folded else \
                mesh.get_group(raw[names.index("dp_shard")]) if shards > 1 else None
        return StageCoordinate(pp_rank, len(pp_ranks), stage.group, dp, replicas, dp_group, dims, stage_map)
    if kind == "ddp":
        for st in stages:
            assert isinstance(st.submod, DistributedDataParallel)
            ddp_group = st.submod.process_group
            if dp_group is not None and group_ranks(dp_group) != group_ranks(ddp_group):
                raise LayoutError(f"the stage module is DDP-wrapped over ranks {group_ranks(ddp_group)} but the "
                                  f"data-parallel group is {group_ranks(dp_group)}: wrap it over its data-parallel "
                                  "group")
            dp_group = ddp_group
    if dp_group is None:
        return StageCoordinate(pp_rank, len(pp_ranks), stage.group, 0, 1, None, (), stage_map)
    dp_ranks = group_ranks(dp_group)
    if set(dp_ranks) & set(pp_ranks) != {dist.get_rank()}:
        raise LayoutError(f"the data-parallel group {dp_ranks} and the pp group {pp_ranks} must meet in this rank "
                          "only")
    dp = dist.get_rank(dp_group)
    if mesh is None:
        dims = (("dp_replicate", dp),)
    return StageCoordinate(pp_rank, len(pp_ranks), stage.group, dp, len(dp_ranks), dp_group, dims, stage_map)


def _fsdp_layout(modules: Sequence[torch.nn.Module], mesh: Any = None) -> Any:
    """The FSDP2 layout of a rank's fully_shard-ed stage modules: one module's, or several on the same mesh with
    their parameter groups together (each stage module is its own fully_shard root, as torchtitan shards them).
    Tensor-parallel stage modules (their parameters on a (data-parallel, 'tp') mesh) take it from FSDP's own mesh
    info, checked against the world ``mesh`` (which must then be given)."""
    from dataclasses import replace

    from sdc_telemetry.parallel import fsdp

    if mesh is None and any("cp" in canonical(p.device_mesh._get_root_mesh().mesh_dim_names or ())
                            for m in modules for p in m.parameters() if hasattr(p, "device_mesh")):
        raise LayoutError("context parallelism inside pipeline stages needs the world mesh (its cp ranks are slots "
                          "of a replica, not replicas): SDCMonitor(model_parts, optimizer, pipeline=schedule, "
                          "mesh=world_mesh)")
    cp = mesh is not None and "cp" in (names := canonical(mesh.mesh_dim_names or ())) and \
        mesh.size(names.index("cp")) > 1
    if cp or any("tp" in (p.device_mesh.mesh_dim_names or ()) for m in modules for p in m.parameters()
                 if hasattr(p, "device_mesh")):
        from sdc_telemetry.parallel import mesh as nd

        if mesh is None:
            raise LayoutError("tensor parallelism inside pipeline stages needs the world mesh: "
                              "SDCMonitor(model_parts, optimizer, pipeline=schedule, mesh=world_mesh)")
        nd.check_torch()
        sizes = {n: mesh.size(i) for i, n in enumerate(canonical(mesh.mesh_dim_names))}
        return nd.fsdp_layout([g for m in modules for g in fsdp.fsdp_groups(m)], sizes)
    lays = [fsdp.layout_of(m) for m in modules]
    first = lays[0]
    for lay in lays[1:]:
        replicate = [group_ranks(x.replicate_group) if x.replicate_group is not None else None
                     for x in (lay, first)]
        if (group_ranks(lay.shard_group), lay.shard_index, lay.replicas) != \
                (group_ranks(first.shard_group), first.shard_index, first.replicas) or replicate[0] != replicate[1]:
            raise LayoutError("this rank's stage modules are fully_shard-ed on different meshes: shard every stage "
                              "module of a rank on the same data-parallel mesh")
    return first if len(lays) == 1 else replace(first, groups=tuple(g for lay in lays for g in lay.groups))


def pipeline_step(schedule: Any, stage_is_first: bool, stage_is_last: bool, *inputs: Any, target: Any = None,
                  **kwargs: Any) -> list[torch.Tensor] | None:
    """``schedule.step`` with what this stage needs: ``inputs`` on the first stage (ignored elsewhere, so every
    stage can run the same loop), ``target`` and a losses list on the last; model ``kwargs`` on every stage.
    Returns the per-micro-batch losses on the last stage, else None."""
    if stage_is_last and target is None:
        raise ValueError("the last pipeline stage needs target= (the schedule's loss_fn(output, target))")
    if stage_is_last:
        losses: list[torch.Tensor] = []
        schedule.step(*(inputs if stage_is_first else ()), target=target, losses=losses, **kwargs)
        return losses
    schedule.step(*(inputs if stage_is_first else ()), **kwargs)
    return None


def rng_state(device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's RNG states (CPU, and the CUDA device's where ``device`` is one): capture them before a step, on
    every stage, for the partner's rerun of that step."""
    dev = device if device is not None and device.type == "cuda" else None
    return torch.get_rng_state(), (torch.cuda.get_rng_state(dev) if dev is not None else None)


@dataclass
class RerunResult:
    """A rerun's result on one stage: the per-micro-batch losses (last stage, else None) and each parameter's
    accumulated local gradient (undivided by the micro-batch count, as the tap sees it; FSDP2: unsharded)."""

    losses: list[torch.Tensor] | None
    grads: list[torch.Tensor | None]

    def rows(self) -> torch.Tensor:
        """Per parameter, the fingerprint row (``core.fingerprint``) of its gradient; 0 where it had none."""
        present = [(i, g) for i, g in enumerate(self.grads) if g is not None]
        out = torch.zeros((len(self.grads), 1), dtype=torch.int64)
        if present:
            rows = fingerprint([g for _, g in present]).cpu()
            out = torch.zeros((len(self.grads), rows.shape[1]), dtype=torch.int64)
            out[[i for i, _ in present]] = rows
        return out


def _recv_buffers(stage: Any) -> list[torch.Tensor]:
    out = []
    for infos in list(stage.args_recv_info.values()) + list(stage.grad_recv_info.values()):
        for info in infos:
            buf = getattr(info, "buffer", None)
            if isinstance(buf, torch.Tensor):
                out.append(buf)
    return out


@contextmanager
def _preserved(schedule: Any, stages: Sequence[Any], modules: Sequence[torch.nn.Module], device: torch.device
               ) -> Iterator[None]:
    """Everything a schedule step changes, as it was before, whatever happens: ``.grad`` (the same tensors), RNG,
    buffers, every local stage's caches and receive buffers, ``scale_grads`` and the stage modules."""
    params = [p for m in modules for p in m.parameters()]
    grads = [p.grad for p in params]
    cpu_rng, dev_rng = rng_state(device)
    buffers = [(b, b.detach().clone()) for m in modules for b in m.buffers()]
    recv = [(b, b.detach().clone(), b.grad) for stage in stages for b in _recv_buffers(stage)]
    caches = [(stage, {k: dict(getattr(stage, k)) for k in ("fwd_cache", "bwd_cache", "backward_state", "dw_runner")})
              for stage in stages]
    kept = [(stage, list(stage.output_chunks), stage.submod, stage.has_backward) for stage in stages]
    internal = list(schedule._internal_losses)
    scale = schedule.scale_grads
    try:
        yield
    except BaseException:
        _drop_runtime_leftovers(schedule, stages)
        raise
    finally:
        schedule.scale_grads = scale
        schedule._internal_losses[:] = internal
        for stage, outputs, submod, has_backward in kept:
            stage.output_chunks[:] = outputs
            stage.submod, stage.has_backward = submod, has_backward
        for stage, saved_caches in caches:
            for k, saved in saved_caches.items():
                d = getattr(stage, k)
                d.clear()
                d.update(saved)
        with torch.no_grad():
            for b, saved_b in buffers:
                b.copy_(saved_b)
            for b, saved_r, g in recv:
                b.copy_(saved_r)
                b.grad = g
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        torch.set_rng_state(cpu_rng)
        if dev_rng is not None:
            torch.cuda.set_rng_state(dev_rng, device)


def _drop_runtime_leftovers(schedule: Any, stages: Sequence[Any]) -> None:
    """After a rerun that failed part-way under a multi-stage schedule: what its action loop leaves only when it
    stops early (pending receives, unshard handles, unsharded FSDP stages, backward counts), which the next real
    step would trip on ("Recv twice", "Unsharding the same stage twice"). Every rank of a failing rerun gets here."""
    for name in ("fwd_recv_ops", "bwd_recv_ops", "unshard_ops", "backward_counter"):
        pending = getattr(schedule, name, None)
        if isinstance(pending, dict):
            pending.clear()
    unsharded = getattr(schedule, "unsharded_stages", None)
    if isinstance(unsharded, set):
        from sdc_telemetry.parallel import fsdp

        fsdp_type = fsdp._fsdp_module_type()
        for stage in stages:
            if stage.stage_index in unsharded and fsdp_type is not None:
                for m in stage.submod.modules():
                    if isinstance(m, fsdp_type):
                        m.reshard()  # type: ignore[attr-defined]
        unsharded.clear()


def rerun(schedule: Any, *inputs: Any, target: Any = None, cpu_rng: torch.Tensor | None = None,
          dev_rng: torch.Tensor | None = None, had_grad: Sequence[bool] | None = None,
          params: Sequence[torch.nn.Parameter] | None = None, autocast: tuple[bool, torch.dtype] | None = None,
          fsdp_layout: Any = None, **kwargs: Any) -> RerunResult:
    """Rerun one schedule step for another replica's batch on this replica's ranks: every rank of this replica
    calls it at once, with the origin's batch (``inputs`` are used where stage 0 runs, ``target`` where the last
    stage runs) and the origin's same pp rank's RNG states (``rng_state()`` before its step).

    Guarantees: nothing is reduced across replicas (DDP: each stage runs its unwrapped module, so the reducer, its
    comm hook and its bucket rebuild never see the rerun; FSDP2: gradient sync off and each unsharded gradient is
    taken and dropped as it is accumulated, so no reduce-scatter runs); ``.grad`` (the same tensors), RNG states,
    buffers, the schedule's and the stages' state are as before; the next real step is bitwise that of a run
    without the rerun. Gradients are accumulated as the stage's backward does (``had_grad``: parameters whose
    ``.grad`` existed before the origin's step, where autograd added into zeros) and are not divided by the
    micro-batch count: the bits the origin's tap recorded. A DDP stage's replica may rerun alone; an FSDP2 stage's
    all-gathers span the data-parallel group, so every replica reruns at once (each another's batch).
    ``params``: whose gradients to return (default: the trainable parameters of every local stage module, in local
    stage order)."""
    stages = stages_of(schedule)
    modules, kind = _stage_modules(stages)
    params = list(params) if params is not None else [p for m in modules for p in m.parameters() if p.requires_grad]
    device = torch.device(stages[0].device)
    is_first, is_last = any(st.is_first for st in stages), any(st.is_last for st in stages)
    if had_grad is not None and len(had_grad) != len(params):
        raise ValueError(f"had_grad has {len(had_grad)} entries for {len(params)} parameters")
    losses: list[torch.Tensor] | None = [] if is_last else None
    if is_last and target is None:
        raise ValueError("the last stage's rerun needs the origin's target=")

    def run() -> None:
        with ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            if autocast is not None and autocast[0]:
                stack.enter_context(torch.autocast(device.type, dtype=autocast[1]))
            schedule.step(*(inputs if is_first else ()), target=target if is_last else None,
                          losses=losses, **kwargs)

    with _preserved(schedule, stages, modules, device):
        schedule.scale_grads = False  # the undivided sums, as tapped; the real .grad is never divided again
        if cpu_rng is not None:
            torch.set_rng_state(cpu_rng)
        if dev_rng is not None and device.type == "cuda":
            torch.cuda.set_rng_state(dev_rng, device)
        if kind == "fsdp":
            from sdc_telemetry.parallel import fsdp

            for m in modules:
                for p in m.parameters():
                    p.grad = None  # the sharded gradients (restored after): nothing is reduced into them anyway
            lay = fsdp_layout if fsdp_layout is not None else _fsdp_layout(modules)
            acc: list[torch.Tensor | None] = [None] * len(params)
            factors: list[float | None] = [None] * len(params)

            def take(i: int, grad: torch.Tensor, divide: float | None) -> None:
                prev = acc[i]
                acc[i] = grad if prev is None else prev.add_(grad)  # as FSDP accumulates the unsharded gradient
                factors[i] = divide

            # zero-bubble: weight gradients are assigned, never accumulated by autograd: captured at the reduction
            recompute = fsdp.capture_grads if type(schedule).__name__ in _ZERO_BUBBLE else fsdp.recompute_grads
            recompute(lay, params, run, take)
            for g, factor in zip(acc, factors, strict=True):
                if g is not None and factor is not None:
                    g.div_(factor)  # FSDP divides the reduce-scatter input first (fp16): what the tap saw
            grads = acc
        else:
            for stage, module in zip(stages, modules, strict=True):
                stage.submod = module  # DDP: no reducer, no comm hook, no bucket rebuild, no all-reduce
            for i, p in enumerate(params):
                p.grad = torch.zeros_like(p) if had_grad is not None and had_grad[i] else None
            run()
            grads = [p.grad for p in params]
    return RerunResult([loss.detach() for loss in losses] if losses is not None else None, grads)


class _PartSink:
    """The ``GradSink`` one of several stage modules on a rank taps into: its parameter indices offset to their
    place among the rank's, its bucket keys kept apart from the other modules' (each stage module is its own DDP
    with its own bucket indices)."""

    def __init__(self, sink: GradSink, offset: int, part: int) -> None:
        self._sink, self._offset, self._key = sink, offset, part << 24
        norms = getattr(sink, "store_norms", None)
        if norms is not None:  # DDP's tap leaves a healthy step's norms to its all-reduce where the sink takes them
            self.store_norms = lambda index, values: norms([i + offset for i in index], values)

    @property
    def detail(self) -> bool:
        return self._sink.detail

    @property
    def generation(self) -> int:
        return self._sink.generation

    def note_call(self, key: int) -> None:
        self._sink.note_call(self._key + key)

    def store(self, index: list[int], grads: list[torch.Tensor], fp_grads: list[torch.Tensor] | None = None) -> None:
        self._sink.store([i + self._offset for i in index], grads, fp_grads)

    def fail(self) -> None:
        self._sink.fail()

    def measure_local(self) -> None:
        self._sink.measure_local()


class PipelineStageLayout(Layout):
    """The Layout of the pipeline stages a rank runs (one, or several under an interleaved or looped schedule), their
    modules DDP-wrapped or fully_shard-ed over their data-parallel group (or plain with one replica). It wraps the
    DDP or FSDP2 handling of the stage modules; what differs from those layouts:

    - ``module``: the stage module, or with several stages per rank an ``nn.ModuleList`` of them in local stage
      order (parameter names ``"0.…"``, ``"1.…"``); ``parts``: the stage modules as the schedule runs them;
    - ``group``/``ranks``: the whole world (the monitor's one status all-reduce spans every stage), not the DDP
      process group or FSDP mesh; ``shard_of`` (one class per position: pp rank, and shard index for FSDP2),
      ``digest_keys`` (pp ranks x shards) and ``digest_key`` give each (pp rank, shard) its own digest replica group,
      and ``weight_classes`` compares weights only among the replicas of the same (pp rank, shard), as HSDP does for
      shards;
    - ``weight_replicas``: DDP stages with several replicas, HSDP stages; not a 1-D FSDP2 stage (no replica of a
      shard) nor a plain stage;
    - ``replicas``: several data-parallel replicas (the replay's partners), whatever the stage module's wrapping;
    - ``install``/``after_backward``/``reduction_mismatch``/``disable``: each stage module's DDP comm hook (once per
      step, in its last micro-batch's backward) or FSDP2 reduce-scatter tap (once per step, after its last
      backward); a plain stage reads ``.grad`` after the step, already divided by the micro-batch count;
    - ``local``/``whole``: DDP: the tensors; FSDP2: ``to_local()``/``full_tensor()`` (collective within the stage's
      data-parallel group: every rank calls it at once);
    - ``lockstep`` is True and ``recompute(params, run_backward)`` refuses: a stage cannot run a micro-batch on its
      own (its inputs come from the previous stage), so the replay calls ``rerun(...)`` on every rank of the
      partner replica at once, with the origin's batch and the origin's same pp rank's RNG states;
    - ``coordinate``: this rank's ``StageCoordinate`` (``coordinate.as_dict()`` for the evidence).

    Construction is collective (one gather of every rank's coordinate over the world)."""

    name = "pipeline"
    distributed = True
    lockstep = True
    pipelined = True

    def __init__(self, schedule: Any, *, dp_group: dist.ProcessGroup | None = None, mesh: Any = None,
                 comm_hook: Any = None, comm_state: Any = None) -> None:
        self.schedule = schedule
        self.stages = stages_of(schedule)
        self.parts = [stage.submod for stage in self.stages]
        modules, self.kind = _stage_modules(self.stages)
        self.coordinate = coordinate(schedule, dp_group=dp_group, mesh=mesh)
        c = self.coordinate
        if self.kind == "plain" and c.replicas > 1:
            raise LayoutError(f"the stage module ({type(self.parts[0]).__name__}) has {c.replicas} data-parallel "
                              "replicas but is neither DistributedDataParallel-wrapped over its data-parallel group "
                              "nor fully_shard-ed: its gradients are never reduced, so replicas drift apart")
        if comm_hook is not None and self.kind != "ddp":
            raise ValueError("comm_hook= wraps a DDP all-reduce; this stage module is not DDP-wrapped")
        if comm_hook is not None and len(self.parts) > 1:
            raise ValueError(f"comm_hook= is one hook with one state, and this rank runs {len(self.parts)} "
                             "DDP-wrapped stage modules: a stateful hook (PowerSGD's error feedback per bucket "
                             "index) would mix their state; run several stages per rank with DDP's own all-reduce")
        ids = [id(p) for m in modules for p in m.parameters()]
        if len(set(ids)) != len(ids):
            raise LayoutError("this rank's stage modules share parameters (tied weights across stages): each stage "
                              "module must hold its own")
        self._ddp: list[Any] = []
        self._fsdp: Any = None
        self._tap: Any = None
        if self.kind == "ddp":
            from sdc_telemetry.parallel.ddp import DDP

            name = type(schedule).__name__
            if name in _ZERO_BUBBLE:
                raise LayoutError(f"{name} with DDP-wrapped stage modules is not supported: its weight backward "
                                  "computes gradients with torch.autograd.grad, which DDP's reducer (and the "
                                  "monitor's comm hook in it) never sees; fully_shard the stage modules")
            for submod in self.parts:
                assert isinstance(submod, DistributedDataParallel)
                if name != "Schedule1F1B" and not submod.find_unused_parameters:
                    raise LayoutError(f"a DDP-wrapped stage module under {name} needs "
                                      "DistributedDataParallel(..., find_unused_parameters=True): without it torch "
                                      "2.13 fails at the second step in DDP's bucket rebuild (reducer.cpp INTERNAL "
                                      "ASSERT params_.size() == rebuilt_param_indices_.size())")
                self._ddp.append(DDP(submod, comm_hook=comm_hook, comm_state=comm_state))
        elif self.kind == "fsdp":
            self._fsdp = _fsdp_layout(modules, mesh)
        self.reduces = self.kind != "plain"
        ranks, rank = world_ranks()
        module = modules[0] if len(modules) == 1 else torch.nn.ModuleList(modules)
        super().__init__(self.parts[0] if len(self.parts) == 1 else torch.nn.ModuleList(self.parts), module, None,
                         ranks, rank)
        self.stage_modules = modules
        device = next(module.parameters()).device
        dims = dict(c.dims)
        # the dims inside a stage (in c.dims when > 1): a replica's cp x tp slots
        inner = {n: mesh.size(list(canonical(mesh.mesh_dim_names)).index(n)) if n in dims else 1 for n in _INNER}
        cp, tp = inner["cp"], inner["tp"]
        shape = [c.stages, c.replicas, len(modules), cp, tp]
        rows = gather_rows(torch.tensor([c.stage, c.dp, dims.get("cp", 0), dims.get("tp", 0), *shape],
                                        dtype=torch.int64), None, device)
        seen = {tuple(r[:4]) for r in rows}
        if len(seen) != len(rows) or any(r[4:] != shape for r in rows) or len(rows) != math.prod(shape) // len(
                modules):
            raise LayoutError(f"the ranks' (pp rank, data-parallel index, cp rank, tp rank) {sorted(seen)} are not a "
                              f"{c.stages} x {c.replicas} x {cp} x {tp} grid over the {len(rows)} ranks, each with "
                              f"{len(modules)} stage(s)")
        # every position's pipeline stages (the same schedule maps the same stages to a pp rank in every replica)
        self.stages_of_position = [list(c.stage_map[r[0]]) for r in rows]
        self.dp_of_position = [r[1] for r in rows]
        # The mesh coordinates of every position (evidence, and the replay's pairing of replicas stage by stage).
        sizes = {"pp": c.stages}
        if self.kind == "fsdp":
            sizes["dp_shard"] = c.replicas // self._fsdp.replicas  # fully_shard's ranks over cp: not replicas
            if self._fsdp.replicas > 1:
                sizes["dp_replicate"] = self._fsdp.replicas
        elif c.replicas > 1:
            sizes["dp_replicate"] = c.replicas
        sizes.update({n: v for n, v in inner.items() if v > 1})
        mine = {d: v for d, v in c.as_dict().items() if d in sizes}
        self.coordinates = Coordinates.gather(sizes, mine, device)
        # the shard key (pp, dp_shard, tp): the ranks that hold the same tensors, whose weights are compared
        self.shard_of = list(self.coordinates.key_of)
        self._outputs: StageOutputs | None = None

    # -- who holds what ------------------------------------------------------------------------------------------

    @property
    def replicas(self) -> bool:
        return self.coordinate.replicas > 1

    @property
    def weight_replicas(self) -> bool:
        if self.kind == "ddp":
            return self.coordinate.replicas > 1
        return self.kind == "fsdp" and bool(self._fsdp.replicas > 1)

    def weights_off_reason(self) -> str | None:
        if self.weight_replicas:
            return None
        if self.kind == "fsdp":
            return ("each pipeline stage is fully_shard-ed without a dp_replicate dimension: no replica holds a "
                    "stage's shard, so the weight check has nothing to compare and is off (a (replicate, shard) mesh "
                    "has replicas)")
        return "one data-parallel replica per stage: weight and replay checks need several and are off"

    @property
    def digest_keys(self) -> int:
        return int(self.coordinates.keys)

    @property
    def digest_key(self) -> int:
        return int(self.coordinates.key_of[self.position])

    @property
    def digest_group(self) -> dist.ProcessGroup | None:
        """The replicas of this stage (DDP: its data-parallel group) or of its shard (HSDP: the replicate group)."""
        if self.kind == "fsdp":
            return self._fsdp.replicate_group  # type: ignore[no-any-return]
        return self.coordinate.dp_group if self.kind == "ddp" else None

    def weight_classes(self, classes: Sequence[int] | None) -> list[Any] | None:
        """Per position: (numerics class, stage x shard): weights are compared among replicas of the same stage
        (and shard) only."""
        assert self.shard_of is not None
        return [(classes[i] if classes is not None else 0, slot) for i, slot in enumerate(self.shard_of)]

    # -- where gradients are read --------------------------------------------------------------------------------

    def install(self, sink: GradSink, *, reduced_checks: bool = True) -> None:
        if len(self._ddp) == 1:
            self._ddp[0].install(sink, reduced_checks=reduced_checks)
        elif self._ddp:
            offset = 0
            for part, (ddp, module) in enumerate(zip(self._ddp, self.stage_modules, strict=True)):
                ddp.install(_PartSink(sink, offset, part), reduced_checks=reduced_checks)
                offset += sum(1 for p in module.parameters() if p.requires_grad)
        elif self._fsdp is not None:
            from sdc_telemetry.parallel.fsdp import GradTap

            params = [p for p in self.module.parameters() if p.requires_grad]
            self._tap = GradTap(self._fsdp, params, sink)

    def after_backward(self, sink: GradSink) -> None:
        """DDP and FSDP2 stages were tapped during the step; a plain stage's ``.grad`` is read now."""
        if self.kind == "plain":
            sink.measure_local()

    def reduction_mismatch(self) -> torch.Tensor | None:
        """Each DDP stage module's reduce-phase checksum, together (1 where any stage's says the reduced gradients
        are not the sum of the local ones)."""
        flags, failed = [], None
        for ddp in self._ddp:  # every stage module's round is settled, even after one fails
            try:
                flag = ddp.reduction_mismatch()
            except Exception as e:  # noqa: BLE001 - raised once every part was read
                failed = e
                continue
            if flag is not None:
                flags.append(flag)
        if failed is not None:
            raise failed
        if not flags:
            return None
        return flags[0] if len(flags) == 1 else torch.stack(flags).amax()

    def disable(self) -> None:
        for ddp in self._ddp:
            ddp.disable()
        if self._tap is not None:
            self._tap.enabled = False
        if self._outputs is not None:
            self._outputs.close()

    def stage_outputs(self) -> StageOutputs:
        if self._outputs is None:
            self._outputs = StageOutputs(self.stage_modules, self.stages_of_position)
        return self._outputs

    # -- reading tensors in place --------------------------------------------------------------------------------

    local = staticmethod(local_shard)

    def whole(self, named: Sequence[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in named:
            full = getattr(p, "full_tensor", None)  # FSDP2: gathered within the stage's dp group (collective)
            yield name, (full() if full is not None else p)

    # -- replay --------------------------------------------------------------------------------------------------

    def recompute(self, params: Sequence[torch.nn.Parameter], run_backward: Callable[[], None],
                  take: Callable[[int, torch.Tensor, float | None], None]) -> None:
        raise LayoutError("a pipeline stage cannot recompute a micro-batch by itself (its inputs come from the "
                          "previous stage): the replay reruns the schedule with layout.rerun(...) on every rank of "
                          "the partner replica at once")

    def rerun(self, *inputs: Any, target: Any = None, cpu_rng: torch.Tensor | None = None,
              dev_rng: torch.Tensor | None = None, had_grad: Sequence[bool] | None = None,
              params: Sequence[torch.nn.Parameter] | None = None,
              autocast: tuple[bool, torch.dtype] | None = None, **kwargs: Any) -> RerunResult:
        """``rerun(self.schedule, ...)`` (see there)."""
        return rerun(self.schedule, *inputs, target=target, cpu_rng=cpu_rng, dev_rng=dev_rng, had_grad=had_grad,
                     params=params, autocast=autocast, fsdp_layout=self._fsdp, **kwargs)

    @property
    def is_first(self) -> bool:
        """This rank runs stage 0 (it takes the inputs)."""
        return any(stage.is_first for stage in self.stages)

    @property
    def is_last(self) -> bool:
        """This rank runs the last stage (it takes the target and computes the losses)."""
        return any(stage.is_last for stage in self.stages)

    def step(self, *inputs: Any, target: Any = None, **kwargs: Any) -> list[torch.Tensor] | None:
        """``pipeline_step`` for this stage."""
        return pipeline_step(self.schedule, self.is_first, self.is_last, *inputs, target=target, **kwargs)

    def describe(self) -> str:
        c = self.coordinate
        where = (f"pipeline stage {c.stage} of {c.stages}" if len(self.stages) == 1 else
                 f"pipeline stages {list(c.indices)} of {self.stages[0].num_stages} on pp rank {c.stage} of {c.stages}")
        return (f"{where} ({type(self.schedule).__name__}), {self.kind} over {c.replicas} replica(s), "
                f"{self.world} rank(s) ({self.coordinates.describe()})")

