"""Rank side of the pipeline tests: SDCMonitor on a two-stage pipeline (torch.distributed.pipelining) with
data-parallel replicas, the stage modules DDP-wrapped over their data-parallel group or fully_shard-ed over it."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.nn.parallel import DistributedDataParallel

import sdc_telemetry as sdc
from sdc_telemetry.faults import FaultInjector
from sdc_telemetry.testing import emulate_gpu_numerics

from ._pipeline import build
from ._pipeline import loss_fn as loss_fn
from ._scale import _count_monitor_bytes
from ._scenarios import Recorder

CPU = torch.device("cpu")
MICRO = 4


def build_looped(stage: int) -> nn.Module:
    """Four stages, two per pp rank under an interleaved or looped schedule (stage i on pp rank i % 2): stage 0
    Linear, ReLU, Dropout; stages 1 and 2 Linear, ReLU; stage 3 Linear, ReLU, Linear."""
    torch.manual_seed(stage)
    if stage == 0:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1))
    if stage == 3:
        return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU())


def run_one(rank: int, replicas: int, sc: dict[str, Any]) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (replicas, 2), mesh_dim_names=("dp_replicate", "pp"))
    dp, pp = rank // 2, rank % 2
    kind, looped = sc.get("kind", "ddp"), sc.get("schedule")
    # One stage per rank, or stages pp and pp + 2 of four (interleaved, looped, zero-bubble), or pp and 3 - pp
    # (zbv, dualpipev: the V schedules' mapping, stages 0 and 3 on pp rank 0)
    indices = [pp] if looped is None else [pp, 3 - pp] if looped in ("zbv", "dualpipev") else [pp, pp + 2]
    parts = [build(pp)] if looped is None else [build_looped(i) for i in indices]
    wrapped_parts: list[nn.Module] = []
    for part in parts:
        if kind == "ddp":
            # find_unused_parameters=True: torch 2.13's GPipe and multi-stage schedules trip DDP's bucket rebuild
            # without it
            wrapped_parts.append(DistributedDataParallel(part, process_group=mesh.get_group("dp_replicate"),
                                                         find_unused_parameters=True))
        else:
            fully_shard(part, mesh=mesh["dp_replicate"])
            wrapped_parts.append(part)
    stages = [PipelineStage(w, i, 2 * len(indices), CPU, group=mesh.get_group("pp"))
              for w, i in zip(wrapped_parts, indices, strict=True)]
    if looped is None:
        stage = stages[0]
        schedule: Any = (ScheduleGPipe if kind == "ddp" else Schedule1F1B)(stage, MICRO, loss_fn=loss_fn)
    else:
        schedule = {"interleaved": ScheduleInterleaved1F1B, "looped": ScheduleLoopedBFS,
                    "zero_bubble": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
                    "dualpipev": ScheduleDualPipeV}[looped](
            stages, MICRO, loss_fn=loss_fn)
    first, last = any(st.is_first for st in stages), any(st.is_last for st in stages)
    module = parts[0] if looped is None else nn.ModuleList(parts)
    wrapped = wrapped_parts[0] if looped is None else wrapped_parts
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    faults = FaultInjector(module, opt)
    if sc.get("noise"):  # GPU-like run-to-run noise in every layer's output (tolerance mode's setting)
        emulate_gpu_numerics(module, noise=sc["noise"], seed=100 + rank)
    for kind, args in sc.get("faults", {}).items():
        if args["rank"] == rank:  # the stage modules differ: only the target rank's names the parameter
            getattr(faults, kind)(**args)
    recorder = Recorder()
    monitor = None
    if sc.get("monitor", True):
        monitor = sdc.SDCMonitor(wrapped, opt, pipeline=schedule, mesh=mesh, observer=recorder,
                                 config=sdc.SDCConfig(metrics_port=None, nvml=False, **sc.get("config", {})))
    torch.manual_seed(7 + rank)  # dropout draws differ per rank: the replay must take the origin's RNG state
    tally: dict[str, int] = {}
    steps = sc.get("steps", 4)

    def before(k: int) -> None:
        if sc.get("count_bytes") and k == 1:
            _count_monitor_bytes(tally)

    losses = _train(monitor, schedule, opt, dp, steps, first, last, before)
    return {**_result(monitor, faults, recorder, module), "losses": losses,
            "bytes": {k: v // max(steps - 1, 1) for k, v in tally.items()}}


def _batch(dp: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``dp``'s batch of step ``k``: 8 samples of 8 features, 4 classes."""
    gen = torch.Generator().manual_seed(1000 * dp + k)
    return torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)


def _train(monitor: Any, schedule: Any, opt: torch.optim.Optimizer, dp: int, steps: int, first: bool, last: bool,
           before: Any = None, batch: Any = _batch) -> list[list[float] | None]:
    """The training loop of every pipeline scenario: the replica's batch of each step (``batch(dp, k)``: the same on
    every rank of a replica, or each cp rank's chunk of it), one schedule step (through the monitor when there is
    one), the update. Returns the last stage's per-micro-batch losses of each step (None elsewhere)."""
    losses: list[list[float] | None] = []
    for k in range(steps):
        x, y = batch(dp, k)
        if before is not None:
            before(k)
        if monitor is not None:
            with monitor.step((x, y)) as st:
                out = st.pipeline_step(x, target=y)
        else:
            out = [] if last else None
            schedule.step(*((x,) if first else ()), **({"target": y, "losses": out} if last else {}))
        losses.append([float(t.detach()) for t in out] if out is not None else None)
        opt.step()
        opt.zero_grad()
    if monitor is not None:
        monitor.close()
    return losses


def _result(monitor: Any, faults: FaultInjector, recorder: Recorder, module: nn.Module) -> dict[str, Any]:
    """What a scenario's assertions read: each incident as (step, check, suspects, verdict, coordinate, ambiguous,
    [stage, found by] or None), the layout, the faults fired, the check counts and errors, the local weights."""
    faults.close()
    return {"incidents": [(i.step, i.check, list(i.suspect_ranks), i.evidence.get("verdict"),
                           i.evidence.get("coordinate"), bool(i.evidence.get("ambiguous")),
                           [i.evidence["stage"], i.evidence["stage_found_by"]] if "stage" in i.evidence else None)
                          for i in (monitor.incidents if monitor else [])],
            "layout": monitor.layout.describe() if monitor else None, "fired": list(faults.fired),
            "counts": recorder.counts(), "errors": recorder.errors,
            "weights": {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
                        for n, p in module.named_parameters()}}


def stage_hosts(rank: int) -> dict[str, str]:
    """Each pipeline stage on a host of its own (rank r runs stage r % 2): every replica spans two hosts."""
    return {"SDC_HOST_NAME": f"node{rank % 2}"}


def run_pp(rank: int, world: int, scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every scenario in turn: pp 2 x dp_replicate (world / 2), or with ``"tp": True`` pp 2 x dp_shard 2 x tp 2, or
    with ``"cp": True`` pp 2 x dp_shard 2 x cp 2."""
    out = []
    for sc in scenarios:
        out.append(run_tp_one(rank, sc) if sc.get("tp") else run_cp_one(rank, sc) if sc.get("cp")
                   else run_one(rank, world // 2, sc))
        dist.barrier()
    return out


def build_tp(stage: int, stages: int, tp_mesh: Any) -> nn.Module:
    """A stage of an MLP with tensor parallelism inside it: a column-parallel Linear, ReLU, a row-parallel Linear
    (its output replicated over tp by the all-reduce), as torchtitan's ``parallelize_module`` lays out an MLP.
    No dropout: the tp ranks of a stage would draw different masks from their own generators."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(stage)
    module = nn.Sequential(nn.Linear(8 if stage == 0 else 16, 32), nn.ReLU(),
                           nn.Linear(32, 4 if stage == stages - 1 else 16))
    return parallelize_module(module, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def run_tp_one(rank: int, sc: dict[str, Any]) -> dict[str, Any]:
    """pp 2 x dp_shard 2 x tp 2 (torchtitan's dim order), or with ``"replicate"`` pp 2 x dp_replicate 2 x tp 2
    (dp_shard 1): each stage module tensor-parallel over ``tp`` and fully_shard-ed over ``dp_shard`` (HSDP over
    ``dp_replicate`` x ``dp_shard``), a Schedule1F1B (or two stages a rank under ScheduleInterleaved1F1B); the
    monitor takes the stage module (or the rank's stage modules) and the world mesh."""
    if sc.get("replicate"):  # pp 2 x dp_replicate 2 x tp 2, no dp_shard: HSDP whose shard groups are one rank
        mesh = init_device_mesh("cpu", (2, 2, 1, 2), mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
        dp_dim, dp_mesh = "dp_replicate", mesh["dp_replicate", "dp_shard"]
    else:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp_shard", "tp"))
        dp_dim, dp_mesh = "dp_shard", mesh["dp_shard"]
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank(dp_dim)
    interleaved = sc.get("schedule") == "interleaved"
    indices = [pp, pp + 2] if interleaved else [pp]
    parts = [build_tp(i, 2 * len(indices), mesh["tp"]) for i in indices]
    for part in parts:
        fully_shard(part, mesh=dp_mesh)
    stages = [PipelineStage(part, i, 2 * len(indices), CPU, group=mesh.get_group("pp"))
              for part, i in zip(parts, indices, strict=True)]
    schedule: Any = (ScheduleInterleaved1F1B(stages, MICRO, loss_fn=loss_fn) if interleaved
                     else Schedule1F1B(stages[0], MICRO, loss_fn=loss_fn))
    first, last = stages[0].is_first, stages[-1].is_last
    module = nn.ModuleList(parts) if interleaved else parts[0]
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    faults, recorder, monitor = _monitored(rank, sc, module, parts if interleaved else module, opt, schedule, mesh)
    losses = _train(monitor, schedule, opt, dp, sc.get("steps", 4), first, last)
    return {**_result(monitor, faults, recorder, module), "losses": losses}


def _monitored(rank: int, sc: dict[str, Any], module: nn.Module, parts: Any, opt: torch.optim.Optimizer,
               schedule: Any, mesh: Any) -> tuple[FaultInjector, Recorder, Any]:
    """The scenario's faults on ``module`` (those planned for this rank) and, unless ``"monitor": False``, an
    SDCMonitor of ``parts`` (the stage module or the rank's stage modules) on the world ``mesh``."""
    faults = FaultInjector(module, opt)
    for kind, args in sc.get("faults", {}).items():
        if args["rank"] == rank:
            getattr(faults, kind)(**args)
    recorder = Recorder()
    monitor = None
    if sc.get("monitor", True):
        monitor = sdc.SDCMonitor(parts, opt, pipeline=schedule, mesh=mesh, observer=recorder,
                                 config=sdc.SDCConfig(metrics_port=None, nvml=False, **sc.get("config", {})))
    return faults, recorder, monitor


def pp_hosts(rank: int) -> dict[str, str]:
    """Each pipeline stage of the pp x dp_shard x tp mesh on a host of its own (ranks 0-3 stage 0, 4-7 stage 1)."""
    return {"SDC_HOST_NAME": f"node{rank // 4}"}


class CPStage(nn.Module):
    """A stage of a causal LM with context parallelism inside it (``_cp``'s attention block): stage 0 embeds the
    tokens, the last stage ends in the LM head. Each cp rank holds a contiguous chunk of the sequence; its positions
    (and so its rows of the causal mask) are a buffer, so that the schedule splits only the batch dim."""

    def __init__(self, stage: int, stages: int, cp_rank: int, cp_size: int) -> None:
        from ._cp import DIM, SEQ, VOCAB, Block

        super().__init__()
        torch.manual_seed(stage)
        chunk = SEQ // cp_size
        self.register_buffer("positions", torch.arange(chunk) + cp_rank * chunk, persistent=False)
        self.register_buffer("keys", torch.arange(SEQ), persistent=False)
        self.first, self.last = stage == 0, stage == stages - 1
        if self.first:
            self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.block = Block()
        if self.last:
            self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (self.positions[:, None] >= self.keys[None, :])[None, None]
        if self.first:
            x = self.tok(x) + self.pos(self.positions)
        x = self.block(x, mask)
        return self.head(self.norm(x)) if self.last else x  # type: ignore[no-any-return]


def cp_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def run_cp_one(rank: int, sc: dict[str, Any]) -> dict[str, Any]:
    """pp 2 x dp_shard 2 x cp 2 (torchtitan's dim order): each stage module's attention context-parallel over
    ``cp`` (torch's ``_ContextParallel`` SDPA style, as ``_cp`` lays it out) and the stage module fully_shard-ed over
    the flattened ``dp_shard_cp``, a Schedule1F1B; the monitor takes the stage module and the world mesh. Each cp
    rank trains on its chunk of its replica's sequences."""
    from torch.distributed.tensor.experimental._attention import (
        _ContextParallel,
        _enable_context_parallel_dispatcher,
    )
    from torch.distributed.tensor.parallel import parallelize_module

    from ._cp import SEQ, VOCAB

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp_shard", "cp"))
    pp, dp, cp = (mesh.get_local_rank(n) for n in ("pp", "dp_shard", "cp"))
    _enable_context_parallel_dispatcher()
    part = CPStage(pp, 2, cp, 2)
    parallelize_module(part.block.attn, mesh["cp"],
                       _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA))
    fully_shard(part, mesh=mesh["dp_shard", "cp"]._flatten("dp_shard_cp"))
    stage = PipelineStage(part, pp, 2, CPU, group=mesh.get_group("pp"))
    schedule = Schedule1F1B(stage, MICRO, loss_fn=cp_loss)
    opt = torch.optim.AdamW(part.parameters(), lr=1e-2)
    faults, recorder, monitor = _monitored(rank, sc, part, part, opt, schedule, mesh)
    chunk = SEQ // 2

    def batch(d: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(1000 * d + k))
        own = slice(cp * chunk, (cp + 1) * chunk)
        return seq[:, :-1][:, own].contiguous(), seq[:, 1:][:, own].contiguous()

    losses = _train(monitor, schedule, opt, dp, sc.get("steps", 4), stage.is_first, stage.is_last, batch=batch)
    return {**_result(monitor, faults, recorder, part), "losses": losses}
