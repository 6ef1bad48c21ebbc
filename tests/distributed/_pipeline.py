"""Rank side of the pipeline-parts tests: a two-stage MLP on a (dp=2, pp=2) mesh of 4 gloo ranks, stage modules
DDP-wrapped or fully_shard-ed over their data-parallel group."""

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
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
)
from torch.nn.parallel import DistributedDataParallel

from sdc_telemetry.core.fingerprint import fingerprint
from sdc_telemetry.parallel.base import LayoutError
from sdc_telemetry.parallel.pipeline import PipelineStageLayout, pipeline_step, rng_state

CPU = torch.device("cpu")
MICRO = 4
STEPS = 3


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, target)


def build(stage: int) -> nn.Module:
    """Stage 0: Linear, ReLU, Dropout (the rerun must use the origin's RNG); stage 1: Linear, ReLU, Linear."""
    torch.manual_seed(0)
    if stage == 0:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1))
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * replica + step)
    return torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)


def bits(t: torch.Tensor) -> list[int]:
    local = getattr(t, "to_local", None)  # an FSDP2 shard (DTensor): its local part
    t = local() if local is not None else t
    return t.detach().contiguous().view(-1).view(torch.int32).tolist()  # type: ignore[no-any-return]


class Sink:
    """A GradSink that keeps, per tap call, the fingerprint rows (and clones) of the local gradients it is handed."""

    detail = True
    generation = 0

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = 0
        self.failed = 0
        self.rows = torch.zeros((n, 1), dtype=torch.int64)
        self.local: list[torch.Tensor | None] = [None] * n

    def note_call(self, key: int) -> None:
        self.calls += 1

    def store(self, index: list[int], grads: list[torch.Tensor], fp_grads: list[torch.Tensor] | None = None) -> None:
        rows = fingerprint(fp_grads if fp_grads is not None else grads)
        for j, i in enumerate(index):
            self.rows[i] = rows[j]
            self.local[i] = grads[j].detach().clone()

    def fail(self) -> None:
        self.failed += 1

    def measure_local(self) -> None:
        pass


def _mesh() -> Any:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))


def run_case(rank: int, mesh: Any, kind: str, schedule_cls: Any, rerun_at: int | None,
             fault: dict[str, int] | None) -> dict[str, Any]:
    """3 steps of PP x DP; at ``rerun_at`` the partner replica reruns the origin's step and compares."""
    dp, pp = rank // 2, rank % 2
    dp_group, pp_group = mesh.get_group("dp"), mesh.get_group("pp")
    module = build(pp)
    if kind == "ddp":
        wrapped: nn.Module = DistributedDataParallel(module, process_group=dp_group, find_unused_parameters=True)
    else:
        fully_shard(module, mesh=mesh["dp"])
        wrapped = module
    stage = PipelineStage(wrapped, pp, 2, CPU, group=pp_group)
    schedule = schedule_cls(stage, MICRO, loss_fn=loss_fn)
    layout = PipelineStageLayout(schedule, mesh=mesh)
    params = [p for p in module.parameters() if p.requires_grad]
    sink = Sink(len(params))
    layout.install(sink)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    step_now = [-1]
    if fault is not None and rank == fault["rank"]:
        def scale(_m: nn.Module, _i: Any, out: torch.Tensor) -> torch.Tensor:
            return out * (1 + 1e-3) if step_now[0] == fault["step"] else out
        module[0].register_forward_hook(scale)
    torch.manual_seed(7 + rank)  # dropout draws differ per rank: the rerun must take the origin's RNG state
    out: dict[str, Any] = {"losses": [], "reduced_plain": [], "mismatch": [], "taps": [], "rerun": None,
                           "coordinate": layout.coordinate.as_dict(), "shard_of": layout.shard_of,
                           "slots": (layout.digest_keys, layout.digest_key),
                           "weight_replicas": layout.weight_replicas, "replicas": layout.replicas}
    for step in range(STEPS):
        step_now[0] = step
        x, y = batch(dp, step)
        cpu_rng, _ = rng_state(CPU)
        calls = sink.calls
        losses = pipeline_step(schedule, stage.is_first, stage.is_last, x, target=y)
        out["taps"].append(sink.calls - calls)
        out["losses"].append([bits(t) for t in losses] if losses is not None else None)
        mismatch = layout.reduction_mismatch()
        out["mismatch"].append(None if mismatch is None else int(mismatch))
        if kind == "ddp":  # the reduced gradient vs a plain all-reduce of the tapped local ones
            same = True
            for p, loc in zip(params, sink.local, strict=True):
                assert loc is not None and p.grad is not None
                plain = loc.clone()
                dist.all_reduce(plain, group=dp_group)
                plain.div_(2).div_(MICRO)
                same = same and bits(plain) == bits(p.grad)
            out["reduced_plain"].append(same)
        if step == rerun_at:
            sent = (cpu_rng, sink.rows.clone(), out["losses"][-1])
            got: list[Any] = [None, None]
            dist.all_gather_object(got, sent, group=dp_group)
            origin = 0 if kind == "ddp" else 1 - dp  # DDP: replica 1 reruns alone; FSDP2: the replicas swap
            if kind == "fsdp" or dp == 1:
                before_grads = [(p.grad, bits(p.grad) if p.grad is not None else None) for p in module.parameters()]
                before_rng = torch.get_rng_state()
                chunks = list(stage.output_chunks)
                calls = sink.calls
                ox, oy = batch(origin, step)
                res = layout.rerun(ox, target=oy, cpu_rng=got[origin][0])
                rows = res.rows()
                out["rerun"] = {
                    "origin": origin,
                    "rows_equal": bool(torch.equal(rows, got[origin][1])),
                    "rows_own_equal": bool(torch.equal(rows, sink.rows)),
                    "losses_equal": (None if res.losses is None
                                     else [bits(t) for t in res.losses] == got[origin][2]),
                    "grad_untouched": all(p.grad is g and (g is None or bits(g) == b)
                                          for p, (g, b) in zip(module.parameters(), before_grads, strict=True)),
                    "rng_restored": bool(torch.equal(torch.get_rng_state(), before_rng)),
                    "outputs_kept": len(chunks) == len(stage.output_chunks)
                                    and all(a is b for a, b in zip(chunks, stage.output_chunks, strict=True)),
                    "taps_during_rerun": sink.calls - calls,
                    "internal_losses": len(schedule._internal_losses),
                }
        opt.step()
        opt.zero_grad()
    out["final"] = {n: bits(layout.local(p)) for n, p in module.named_parameters()}
    dist.barrier()
    return out


def single_stage_ddp(rank: int, find_unused: bool, own: list[Any]) -> str:
    """A one-stage GPipe pipeline per rank, its module DDP-wrapped over the world: 3 steps, or the error."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
                                  find_unused_parameters=find_unused)
    schedule = ScheduleGPipe(PipelineStage(ddp, 0, 1, CPU, group=own[rank]), MICRO, loss_fn=loss_fn)
    for step in range(STEPS):
        x, y = batch(rank, step)
        try:
            schedule.step(x, target=y, losses=[])
        except RuntimeError as e:
            cause = e.__cause__ or e
            return f"step {step}: {cause}"
    return "ok"


def refusals(rank: int, mesh: Any) -> dict[str, str]:
    """What PipelineStageLayout refuses, each by its message (no collective runs before a refusal)."""
    dp, pp = rank // 2, rank % 2
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    out: dict[str, str] = {}

    def attempt(name: str, make: Any) -> None:
        try:
            PipelineStageLayout(make(), mesh=mesh)
            out[name] = "accepted"
        except LayoutError as e:
            out[name] = str(e)

    def stages(indices: list[int]) -> list[Any]:
        return [PipelineStage(nn.Linear(4, 4), i, 4, CPU, group=pp_group) for i in indices]

    def ddp_stages(indices: list[int], find_unused: bool = True, wrap: tuple[bool, ...] = (True, True)) -> list[Any]:
        mods = [nn.Linear(4, 4) for _ in indices]
        return [PipelineStage(DistributedDataParallel(m, process_group=dp_group, find_unused_parameters=find_unused)
                              if w else m, i, 4, CPU, group=pp_group)
                for m, i, w in zip(mods, indices, wrap, strict=True)]

    attempt("interleaved_reversed", lambda: ScheduleInterleaved1F1B(ddp_stages([pp + 2, pp]), MICRO,
                                                                    loss_fn=loss_fn))
    attempt("interleaved_mixed", lambda: ScheduleInterleaved1F1B(ddp_stages([pp, pp + 2], wrap=(True, False)), MICRO,
                                                                 loss_fn=loss_fn))
    attempt("looped_without_find_unused", lambda: ScheduleLoopedBFS(ddp_stages([pp, pp + 2], find_unused=False),
                                                                    MICRO, loss_fn=loss_fn))
    attempt("zero_bubble_ddp", lambda: ScheduleInterleavedZeroBubble(ddp_stages([pp, pp + 2]), MICRO,
                                                                      loss_fn=loss_fn))
    interleaved = ScheduleInterleaved1F1B(ddp_stages([pp, pp + 2]), MICRO, loss_fn=loss_fn)
    parts = [stage.submod for stage in interleaved._stages]
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import sdc_telemetry as sdc

    for name, given, hook in (("parts_reversed", parts[::-1], None), ("parts_missing", parts[:1], None),
                              ("parts_one_comm_hook", parts, allreduce_hook)):
        try:
            sdc.SDCMonitor(given, torch.optim.SGD([p for m in parts for p in m.parameters()], lr=0.1),
                           pipeline=interleaved, mesh=mesh, config=sdc.SDCConfig(metrics_port=None, nvml=False),
                           comm_hook=hook, comm_state=dp_group if hook is not None else None)
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    plain = PipelineStage(build(pp), pp, 2, CPU, group=pp_group)
    attempt("plain_module", lambda: Schedule1F1B(plain, MICRO, loss_fn=loss_fn))
    ddp = DistributedDataParallel(build(pp), process_group=dp_group)
    ddp_stage = PipelineStage(ddp, pp, 2, CPU, group=pp_group)
    attempt("gpipe_without_find_unused", lambda: ScheduleGPipe(ddp_stage, MICRO, loss_fn=loss_fn))
    attempt("no_loss_fn", lambda: Schedule1F1B(ddp_stage, MICRO))
    try:  # the last stage without a target: refused before schedule.step (which would wait on stage 0)
        pipeline_step(Schedule1F1B(ddp_stage, MICRO, loss_fn=loss_fn), False, True, torch.zeros(8, 8))
        out["no_target"] = "accepted"
    except ValueError as e:
        out["no_target"] = str(e)
    out["dp"] = str(dp)
    return out


def run_pipeline(rank: int, world: int) -> dict[str, Any]:
    own = [dist.new_group([r]) for r in range(world)]
    mesh = _mesh()
    out: dict[str, Any] = {"refusals": refusals(rank, mesh)}
    out["single_gpipe"] = single_stage_ddp(rank, False, own)
    dist.barrier()
    out["single_gpipe_find_unused"] = single_stage_ddp(rank, True, own)
    dist.barrier()
    for kind, cls in (("ddp", ScheduleGPipe), ("fsdp", Schedule1F1B)):
        out[kind] = {"rerun": run_case(rank, mesh, kind, cls, 1, None),
                     "plain": run_case(rank, mesh, kind, cls, None, None),
                     "fault": run_case(rank, mesh, kind, cls, 1, {"rank": 1, "step": 1})}
    return out
