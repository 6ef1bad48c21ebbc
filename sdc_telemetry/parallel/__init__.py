"""One Layout adapter per parallelism: the only place that knows what kind of model is being trained.

``layout_for(model, ...)`` picks the adapter; the monitor then asks the layout (``parallel.base.Layout``) and never
the model's type. Adapters: ``single`` (one process), ``ddp`` (DistributedDataParallel), ``fsdp`` (fully_shard on a
1-D mesh), ``hsdp`` (fully_shard on a 2-D (replicate, shard) mesh), ``mesh`` (N-D: tensor and context parallelism
with FSDP2/HSDP on one DeviceMesh), ``pipeline`` (``torch.distributed.pipelining`` stages, one or several per rank,
their modules DDP-wrapped or fully_shard-ed over their data-parallel group), ``deepspeed`` (a DeepSpeed engine,
ZeRO stages 0 to 3), ``megatron`` (Megatron-core's DistributedDataParallel, with its distributed optimizer and
tensor parallelism).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sdc_telemetry.parallel.base import GradSink, Layout, LayoutError

__all__ = ["layout_for", "Layout", "LayoutError", "GradSink"]


def layout_for(model: Any, *, replica_group: dist.ProcessGroup | None = None,
               comm_hook: Any = None, comm_state: Any = None, mesh: Any = None, pipeline: Any = None) -> Layout:
    """The adapter for ``model``, or a clear error naming what is not supported and how to fix it."""
    initialised = dist.is_available() and dist.is_initialized()
    if pipeline is not None and isinstance(model, (list, tuple)):
        model = torch.nn.ModuleList(model) if all(isinstance(m, torch.nn.Module) for m in model) else model
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (DistributedDataParallel-wrapped across ranks), got "
                        f"{type(model).__name__}")
    if pipeline is not None:
        if not initialised:
            raise RuntimeError("SDCMonitor(pipeline=...) needs the initialised process group of the pipeline")
        if replica_group is not None:
            raise ValueError("replica_group= is for DDP models; a pipeline stage's groups come from its schedule")
        from sdc_telemetry.parallel.pipeline import PipelineStageLayout

        layout = PipelineStageLayout(pipeline, mesh=mesh, comm_hook=comm_hook, comm_state=comm_state)
        given = list(model) if isinstance(model, torch.nn.ModuleList) else [model]
        runs = list(zip(layout.parts, layout.stage_modules, strict=True))
        if len(given) != len(runs) or any(g is not part and g is not module
                                          for g, (part, module) in zip(given, runs, strict=False)):
            what = (f"the schedule's stage module (the module of its PipelineStage: {type(layout.parts[0]).__name__})"
                    if len(runs) == 1 else f"the {len(runs)} stage modules this rank runs, in local stage order (a "
                    "list or nn.ModuleList: torchtitan's model_parts)")
            raise ValueError(f"with pipeline=schedule, model must be {what}; got "
                             + (f"{len(given)} module(s)" if len(given) != len(runs) else "other modules"))
        return layout
    from sdc_telemetry.parallel import deepspeed, fsdp
    from sdc_telemetry.parallel import mesh as nd

    if deepspeed.is_engine(model):
        if not initialised:
            raise RuntimeError("SDCMonitor needs DeepSpeed's initialised process group (deepspeed.init_distributed)")
        if comm_hook is not None or replica_group is not None or mesh is not None:
            raise ValueError("comm_hook=, replica_group= and mesh= do not apply to a DeepSpeed engine: its groups "
                             "come from the engine")
        return deepspeed.DeepSpeedZeRO(model)
    from sdc_telemetry.parallel import megatron

    if megatron.is_megatron_ddp(model):
        if not initialised:
            raise RuntimeError("SDCMonitor needs Megatron-core's initialised process groups")
        if comm_hook is not None or replica_group is not None or mesh is not None:
            raise ValueError("comm_hook=, replica_group= and mesh= do not apply to Megatron-core's "
                             "DistributedDataParallel: its groups come from the model")
        return megatron.MegatronDDP(model)

    if fsdp.is_fully_sharded(model) or (mesh is not None and initialised):
        if not initialised:
            raise RuntimeError("SDCMonitor needs the initialised process group of the fully_shard-ed model")
        if comm_hook is not None or replica_group is not None:
            raise ValueError("comm_hook= and replica_group= are for DDP models; a fully_shard-ed model's groups "
                             "come from its device mesh")
        if nd.is_nd(model, mesh):
            return nd.MeshLayout(model, mesh)
        mesh = fsdp.layout_of(model)
        if mesh.hsdp:
            from sdc_telemetry.parallel.hsdp import HSDP

            return HSDP(model, mesh)
        return fsdp.FSDP(model, mesh)
    if mesh is not None:
        raise ValueError("mesh= describes a model parallelised on a DeviceMesh (DTensor parameters); this model has "
                         "none")
    if nd.is_nd(model, None):
        raise LayoutError("the model has DTensor parameters (tensor parallelism) but no fully_shard: apply "
                          "fully_shard over the data-parallel dims (torchtitan's dp_shard) to every block and the root")
    if isinstance(model, DistributedDataParallel):
        if not initialised:
            raise RuntimeError("SDCMonitor needs an initialised process group for a DDP model: call "
                               "torch.distributed.init_process_group() first (torchrun sets up the environment)")
        from sdc_telemetry.parallel.ddp import DDP

        return DDP(model, replica_group=replica_group, comm_hook=comm_hook, comm_state=comm_state)
    if initialised and dist.get_world_size() > 1:
        raise TypeError(f"SDCMonitor needs a torch.nn.parallel.DistributedDataParallel model when "
                        f"torch.distributed runs {dist.get_world_size()} ranks, got {type(model).__name__}; "
                        "wrap it first: DistributedDataParallel(model)")
    if comm_hook is not None:
        raise ValueError("comm_hook= wraps a DDP all-reduce; a plain module has none")
    from sdc_telemetry.parallel.single import SingleProcess

    return SingleProcess(model)
