"""N-D parallelism: step-time overhead and audit cost on TP x DP (and PP x DP), and a detection campaign on TP x DP.

    python benchmarks/nd.py                       # HSDP x TP (2x2x2, 8 gloo ranks), then PP x DP (2x2, 4 ranks),
                                                  # PP x DP interleaved (2 stages a rank), PP x FSDP x TP (8 ranks)
    python benchmarks/nd.py --layout pp_dp        # one layout: hsdp_tp, fsdp_tp (dp_shard 2 x tp 2), pp_dp or
                                                  # pp_interleaved, pp_tp (pp 2 x dp_shard 2 x tp 2; it and
                                                  # fsdp_tp have no weight replicas: shards checked at rest),
                                                  # pp_rep_tp (pp 2 x dp_replicate 2 x tp 2: the 4-D mesh with
                                                  # dp_shard 1, weights voted across the replicas)
    python benchmarks/nd.py --quick               # tiny model, two short rounds of both layouts (the smoke test)
    python benchmarks/nd.py --campaign            # fault campaign on HSDP x TP (8 gloo ranks)
    python benchmarks/nd.py --campaign --quick    # one trial of each fault class (the smoke test)

Model: a small GPT whose attention (separate q, k, v projections: column parallel; output projection: row
parallel) and MLP (up: column parallel, down: row parallel) are split over ``mesh["tp"]`` with
``parallelize_module``, then every block and the root are ``fully_shard``-ed over the data-parallel dims
(torchtitan's order and dim names). Embeddings, norms and the head stay replicated over tp. PP x DP: the same GPT
(without tensor parallelism) cut into two pipeline stages (embeddings and the first half of the blocks; the rest,
the final norm and the head) on a ``(dp_replicate 2, pp 2)`` mesh, each stage module DDP-wrapped over its
data-parallel group (``find_unused_parameters=True``, which torch 2.13's schedules need), a ``ScheduleGPipe`` of
4 micro-batches, and ``SDCMonitor(stage, optimizer, pipeline=schedule, mesh=mesh)`` with
``step.pipeline_step(x, target=y)``; the baseline calls ``schedule.step`` itself. PP x DP interleaved: the same
GPT cut into four stages, two per pp rank (stages q and q + 2 on pp rank q), each DDP-wrapped, a
``ScheduleInterleaved1F1B`` of 4 micro-batches, and ``SDCMonitor([stage_a, stage_b], optimizer, pipeline=schedule,
mesh=mesh)``. PP x FSDP x TP: the TP GPT cut into two stages on a ``(pp 2, dp_shard 2, tp 2)`` mesh, each stage's
blocks tensor-parallel and fully_shard-ed over dp_shard, a ``Schedule1F1B``. PP x HSDP x TP: the same on a
``(pp 2, dp_replicate 2, dp_shard 1, tp 2)`` mesh (torchtitan's dp_replicate x tp x pp), HSDP over
``("dp_replicate", "dp_shard")``: the local gradients are read at FSDP's copy, the weights voted across replicas.

Overhead: configurations, each its own copy of the same model (same seed, own optimizer; the monitor wraps a
model's reduce-scatter, so copies cannot be shared): unmonitored (the baseline); gradient checks + weights every
step; + replay every 10. After warm-up the configurations take turns one segment of ``segment`` steps at a time
(A B C, then C B A, ...), ``rounds`` times. Reported per configuration: the median over rounds of (segment median
step / baseline segment median step of the same round), with the interquartile range, every monitored check result
counted (they must all pass). Audit cost, in healthy steps: (time of an audit step - median non-audit step of its
segment) / the baseline's median step of the same round. Step times are the slowest rank's.

Campaign (``--campaign``): on HSDP x TP (``dp_replicate 2 x dp_shard 2 x tp 2``), with
``SDCConfig(weights_every=1, replay_every=2, on_suspect="record")``, each trial trains a tiny TP GPT for ``steps``
steps with one fault on a random rank at a random step: a weight bit flip in that rank's local (dp_shard x tp)
shard (``FaultInjector.flip_weight_bit``, sign / exponent / mantissa bit), a persistent compute fault (a module's
output scaled by 1 + r, r in 1e-2 .. 1e-5: ``perturb_output``), or a bit flip in one element of a local gradient in
that step's backward (sign / exponent / mantissa). Healthy trials inject nothing. Several trials share one spawn.
A fault is detected when an incident comes at or after its step; the rank is named when it is among the first
incident's suspects, the replica is right when every suspect is in the faulty rank's replica (the same
dp_replicate/dp_shard coordinate: a compute fault spreads to its tp partners through the row-parallel
all-reduce); the coordinate is right when the incident's ``evidence["coordinate"]`` is a suspect's coordinate and
has the faulty rank's data-parallel coordinate. Incidents before the fault step, and in healthy trials, are false.
Gradient bit flips are injected on the unsharded (tp-local) gradient FSDP2 reduce-scatters (a hook on the
parameter FSDP2 computes with), since the sharded parameter's own gradient hooks never run under FSDP2.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import iqr, lm_loss, load_warning, median, param_count, table, token_batches, write_json

import sdc_telemetry as sdc
from sdc_telemetry.faults import FaultInjector, flip_bit
from sdc_telemetry.testing import spawn_ranks

MODEL = {"vocab": 2048, "dim": 192, "layers": 4, "heads": 4, "seq": 32}
QUICK_MODEL = {"vocab": 128, "dim": 32, "layers": 2, "heads": 2, "seq": 8}
CAMPAIGN_MODEL = {"vocab": 64, "dim": 32, "layers": 2, "heads": 2, "seq": 8}
LAYOUTS: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
    "hsdp_tp": ((2, 2, 2), ("dp_replicate", "dp_shard", "tp")),
    "fsdp_tp": ((2, 2), ("dp_shard", "tp")),
    "pp_dp": ((2, 2), ("dp_replicate", "pp")),
    "pp_interleaved": ((2, 2), ("dp_replicate", "pp")),
    "pp_tp": ((2, 2, 2), ("pp", "dp_shard", "tp")),
    "pp_rep_tp": ((2, 2, 1, 2), ("pp", "dp_replicate", "dp_shard", "tp")),
}
TITLES = {"hsdp_tp": "HSDP x TP (dp_replicate 2 x dp_shard 2 x tp 2, 8 gloo ranks)",
          "fsdp_tp": "FSDP x TP (dp_shard 2 x tp 2, 4 gloo ranks)",
          "pp_dp": "PP x DP (2 stages x 2 DDP replicas, ScheduleGPipe, 4 gloo ranks)",
          "pp_interleaved": "PP x DP interleaved (4 stages, 2 a rank x 2 DDP replicas, ScheduleInterleaved1F1B, "
                            "4 gloo ranks)",
          "pp_tp": "PP x FSDP x TP (pp 2 x dp_shard 2 x tp 2, Schedule1F1B, 8 gloo ranks)",
          "pp_rep_tp": "PP x HSDP x TP (pp 2 x dp_replicate 2 x dp_shard 1 x tp 2, Schedule1F1B, 8 gloo ranks)"}
PIPELINES = ("pp_dp", "pp_interleaved", "pp_tp", "pp_rep_tp")
MICRO = 4  # pipeline micro-batches per step
REPLAY_EVERY = 10
QUICK_REPLAY_EVERY = 4


def configs(replay_every: int = REPLAY_EVERY) -> list[tuple[str, dict[str, Any] | None]]:
    """The timed configurations: the baseline first."""
    return [("no monitor", None),
            ("grad + weights/1", {"weights_every": 1, "replay_every": 0}),
            (f"grad + weights/1 + replay/{replay_every}", {"weights_every": 1, "replay_every": replay_every})]


CONFIGS = configs()
TP_PLAN = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "proj": RowwiseParallel(),
           "fc": ColwiseParallel(), "out": RowwiseParallel()}


# -- model ----------------------------------------------------------------------------------------------------------


class TPBlock(nn.Module):
    """Pre-LayerNorm block, laid out for tensor parallelism as Megatron/torchtitan do: q, k, v column parallel (each
    tp rank holds ``heads / tp`` heads), the attention output projection row parallel, MLP up column / down row."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.ln1 = nn.LayerNorm(dim)
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (lin(h).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, -1)))
        return x + self.drop(self.out(nn.functional.gelu(self.fc(self.ln2(x)))))  # type: ignore[no-any-return]


class TPGPT(nn.Module):
    """Token + position embeddings, ``layers`` TP blocks, final LayerNorm and an (untied) head."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(TPBlock(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))  # type: ignore[no-any-return]


def build_tp(spec: dict[str, int], mesh: Any, seed: int = 0) -> TPGPT:
    """Tensor parallelism over ``mesh["tp"]`` first, then fully_shard over the data-parallel dims."""
    torch.manual_seed(seed)
    model = TPGPT(**spec)
    if spec["heads"] % mesh["tp"].size():
        raise ValueError(f"heads={spec['heads']} must be a multiple of tp={mesh['tp'].size()}")
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], TP_PLAN)
    dp = mesh[tuple(n for n in mesh.mesh_dim_names if n.startswith("dp"))]
    for block in model.blocks:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor parameter."""
    return p.to_local() if hasattr(p, "to_local") else p  # type: ignore[no-any-return]


def dp_index(mesh: Any) -> int:
    """The data-parallel index: every tp coordinate of one replica trains on the same batch."""
    coord = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate(), strict=True))
    shard = mesh["dp_shard"].size() if "dp_shard" in mesh.mesh_dim_names else 1
    return int(coord.get("dp_replicate", 0) * shard + coord.get("dp_shard", 0))


class Stage(nn.Module):
    """One pipeline stage of the same GPT: stage 0 the embeddings and the first half of the blocks, the last stage
    the other blocks, the final LayerNorm and the head."""

    def __init__(self, spec: dict[str, int], stage: int, stages: int, dropout: float = 0.1) -> None:
        super().__init__()
        full = TPGPT(**spec, dropout=dropout)
        per = -(-spec["layers"] // stages)
        self.first, self.last = stage == 0, stage == stages - 1
        self.tok: nn.Module | None = full.tok if self.first else None
        self.pos: nn.Module | None = full.pos if self.first else None
        self.drop: nn.Module | None = full.drop if self.first else None
        self.blocks = nn.ModuleList(list(full.blocks)[stage * per:(stage + 1) * per])
        self.ln: nn.Module | None = full.ln if self.last else None
        self.head: nn.Module | None = full.head if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None and self.pos is not None and self.drop is not None:
            x = self.drop(self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device)))
        for block in self.blocks:
            x = block(x)
        if self.ln is not None and self.head is not None:
            x = self.head(self.ln(x))
        return x  # type: ignore[no-any-return]


def pp_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The schedule's ``loss_fn(output, target)``: next-token cross-entropy of one micro-batch."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def build_pp(spec: dict[str, int], mesh: Any, seed: int = 0, per_rank: int = 1
             ) -> tuple[nn.Module, Any, Any, bool, bool]:
    """This rank's stage modules (same seed on every rank: replicas start equal), each DDP-wrapped over its
    data-parallel group: one stage per pp rank under a ScheduleGPipe, or ``per_rank`` stages (stage i on pp rank
    i mod pp) under a ScheduleInterleaved1F1B. Returns (module, what the monitor takes, schedule, first, last):
    the module is the stage module or an ``nn.ModuleList`` of them; the monitor takes the DDP-wrapped stage module
    or the list of them in local stage order."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleInterleaved1F1B
    from torch.nn.parallel import DistributedDataParallel

    coord = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate(), strict=True))
    pp = mesh["pp"].size()
    stages = pp * per_rank
    if spec["layers"] < stages:
        raise ValueError(f"layers={spec['layers']} must be >= the {stages} pipeline stages")
    torch.manual_seed(seed)
    indices = [coord["pp"] + k * pp for k in range(per_rank)]
    modules = [Stage(spec, i, stages) for i in indices]
    # find_unused_parameters=True: torch 2.13's pipeline schedules trip DDP's bucket rebuild at the second step
    wrapped = [DistributedDataParallel(m, process_group=mesh.get_group("dp_replicate"), find_unused_parameters=True)
               for m in modules]
    built = [PipelineStage(w, i, stages, torch.device("cpu"), group=mesh.get_group("pp"))
             for w, i in zip(wrapped, indices, strict=True)]
    first, last = built[0].is_first, built[-1].is_last
    if per_rank == 1:
        return modules[0], wrapped[0], ScheduleGPipe(built[0], MICRO, loss_fn=pp_loss), first, last
    return nn.ModuleList(modules), wrapped, ScheduleInterleaved1F1B(built, MICRO, loss_fn=pp_loss), first, last


def build_pp_tp(spec: dict[str, int], mesh: Any, seed: int = 0) -> tuple[nn.Module, nn.Module, Any, bool, bool]:
    """This rank's stage of the TP GPT: its blocks tensor-parallel over ``mesh["tp"]`` (the plan of ``build_tp``),
    then the blocks and the stage fully_shard-ed over ``mesh["dp_shard"]`` (HSDP over ``mesh["dp_replicate",
    "dp_shard"]`` when the mesh has dp_replicate), a Schedule1F1B over ``mesh["pp"]``. Returns (module, what the
    monitor takes, schedule, first, last)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    pp = mesh.get_local_rank("pp")
    stages = mesh["pp"].size()
    if spec["heads"] % mesh["tp"].size():
        raise ValueError(f"heads={spec['heads']} must be a multiple of tp={mesh['tp'].size()}")
    torch.manual_seed(seed)
    module = Stage(spec, pp, stages)
    dp = mesh["dp_replicate", "dp_shard"] if "dp_replicate" in mesh.mesh_dim_names else mesh["dp_shard"]
    for block in module.blocks:
        parallelize_module(block, mesh["tp"], TP_PLAN)
        fully_shard(block, mesh=dp)
    fully_shard(module, mesh=dp)
    stage = PipelineStage(module, pp, stages, torch.device("cpu"), group=mesh.get_group("pp"))
    return module, module, Schedule1F1B(stage, MICRO, loss_fn=pp_loss), stage.is_first, stage.is_last


# -- overhead -------------------------------------------------------------------------------------------------------


class _Tally(sdc.Observer):
    def __init__(self) -> None:
        self.results: dict[str, int] = {}
        self.replayed = False  # the last step report had a replay result (an audit step)
        self.errors: list[str] = []

    def report(self, report: sdc.StepReport) -> None:
        if not report.counts_step:
            return
        self.replayed = "replay" in report.results
        self.errors += list(report.errors)
        for check, result in report.results.items():
            key = f"{check}:{result}"
            self.results[key] = self.results.get(key, 0) + 1


class _Copy:
    def __init__(self, spec: dict[str, Any], fields: dict[str, Any] | None, mesh: Any) -> None:
        self.tally = _Tally()
        config = sdc.SDCConfig(metrics_port=None, nvml=False, **(fields or {}))
        self.schedule: Any = None
        if spec["layout"] in PIPELINES:
            self.model, wrapped, self.schedule, self.first, self.last = build_pp_tp(spec["model"], mesh) \
                if spec["layout"] in ("pp_tp", "pp_rep_tp") else build_pp(spec["model"], mesh,
                                                           per_rank=2 if spec["layout"] == "pp_interleaved" else 1)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
            self.monitor = None if fields is None else sdc.SDCMonitor(
                wrapped, self.opt, pipeline=self.schedule, mesh=mesh, observer=self.tally, config=config)
            return
        self.model = build_tp(spec["model"], mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.monitor = None if fields is None else sdc.SDCMonitor(
            self.model, self.opt, loss_fn=lm_loss, observer=self.tally, config=config)

    def train(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, bool]:
        self.tally.replayed = False
        start = time.perf_counter()
        x, y = batch
        if self.schedule is not None and self.monitor is not None:
            with self.monitor.step(batch) as st:
                st.pipeline_step(x, target=y)
        elif self.schedule is not None:
            losses: list[torch.Tensor] = []
            self.schedule.step(*((x,) if self.first else ()),
                               **({"target": y, "losses": losses} if self.last else {}))
        elif self.monitor is not None:
            with self.monitor.step(batch) as st:
                st.backward(lm_loss(self.model, batch))
        else:
            lm_loss(self.model, batch).backward()  # type: ignore[no-untyped-call]
        self.opt.step()
        self.opt.zero_grad()
        return time.perf_counter() - start, self.tally.replayed


def _overhead_rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    torch.set_flush_denormal(True)
    shape, names = LAYOUTS[spec["layout"]]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    copies = [_Copy(spec, fields, mesh) for _, fields in configs(spec["replay_every"])]
    m = spec["model"]
    replica = dp_index(mesh) if spec["layout"] not in ("pp_dp", "pp_interleaved") \
        else int(mesh["dp_replicate"].get_local_rank())
    it = iter(token_batches(spec["steps"], spec["batch"], m["seq"], m["vocab"], seed=100 + replica))
    for c in copies:
        for _ in range(spec["warmup"]):
            c.train(next(it))
    for c in copies:
        c.tally.results.clear()
    rounds: list[list[list[tuple[float, bool]]]] = []
    for r in range(spec["rounds"]):
        order = list(range(len(copies)))[:: 1 if r % 2 == 0 else -1]
        seg: dict[int, list[tuple[float, bool]]] = {}
        for i in order:
            dist.barrier()
            seg[i] = [copies[i].train(next(it)) for _ in range(spec["segment"])]
        rounds.append([seg[i] for i in range(len(copies))])
    incidents = []
    layout = None
    for c in copies:
        if c.monitor is not None:
            incidents += [f"{i.check} at step {i.step}: {list(i.suspect_ranks)}" for i in c.monitor.incidents]
            layout = c.monitor.layout.describe()
            c.monitor.close()
    return {"rounds": rounds, "results": [c.tally.results for c in copies], "incidents": incidents,
            "errors": [e for c in copies for e in c.tally.errors], "layout": layout,
            "params_per_rank": sum(_local(p).numel() for p in copies[0].model.parameters()),  # this stage's
            "params": param_count(TPGPT(**m))}


def summarise(per_rank: list[dict[str, Any]], n_configs: int) -> dict[str, Any]:
    """Per configuration: ratios (median, IQR) against the baseline of the same round; audit costs in healthy steps
    for the configurations that replayed. Times per step are the slowest rank's."""
    rounds = len(per_rank[0]["rounds"])
    steps: list[list[list[tuple[float, bool]]]] = []  # [round][config] -> (slowest time, audited) per step
    for k in range(rounds):
        steps.append([[(max(r["rounds"][k][i][j][0] for r in per_rank), any(r["rounds"][k][i][j][1] for r in per_rank))
                       for j in range(len(per_rank[0]["rounds"][k][i]))] for i in range(n_configs)])
    out = []
    for i in range(n_configs):
        base = [median([t for t, _ in rnd[0]]) for rnd in steps]
        seg = [median([t for t, _ in rnd[i]]) for rnd in steps]
        ratios = [s / b for s, b in zip(seg, base, strict=True)]
        healthy = [median([t for t, a in rnd[i] if not a] or [math.nan]) for rnd in steps]
        healthy_ratios = [h / b for h, b in zip(healthy, base, strict=True)]
        costs = [(t - h) / b for rnd, h, b in zip(steps, healthy, base, strict=True) for t, a in rnd[i] if a]
        lo, hi = iqr(ratios)
        c_lo, c_hi = iqr(costs) if costs else (math.nan, math.nan)
        out.append({"step_ms": 1e3 * median(seg), "ratio": median(ratios), "iqr": [lo, hi],
                    "ratio_non_audit_steps": median(healthy_ratios), "audits": len(costs),
                    "audit_cost_steps": median(costs) if costs else None, "audit_cost_iqr": [c_lo, c_hi],
                    "audit_costs": costs, "baseline_step_ms": 1e3 * median(base)})
    return {"configs": out}


def run_overhead(layout: str = "hsdp_tp", model: dict[str, int] | None = None, rounds: int = 6, segment: int = 10,
                 warmup: int = 3, batch: int = 4, replay_every: int = REPLAY_EVERY, say: Any = print
                 ) -> dict[str, Any]:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    if segment < 2 or segment % replay_every:
        raise ValueError(f"segment must be a multiple of replay_every={replay_every} (one audit per "
                         f"{replay_every} steps in every segment), got {segment}")
    model = model or MODEL
    shape, _ = LAYOUTS[layout]
    world = math.prod(shape)
    timed = configs(replay_every)
    spec = {"layout": layout, "model": model, "rounds": rounds, "segment": segment, "warmup": warmup, "batch": batch,
            "replay_every": replay_every, "steps": warmup * len(timed) + rounds * segment * len(timed)}
    if (warning := load_warning()) is not None:
        say(warning)
    t0 = time.perf_counter()
    per_rank = spawn_ranks(_overhead_rank, world, args=(spec,), timeout=1800, pg_timeout=600)
    wall = time.perf_counter() - t0
    s = summarise(per_rank, len(timed))
    rows, summary = [], {}
    for (label, _), c, res in zip(timed, s["configs"], per_rank[0]["results"], strict=True):
        checks = ", ".join(f"{k} {v}" for k, v in sorted(res.items())) or "-"
        cost = "-" if c["audit_cost_steps"] is None else (
            f"{c['audit_cost_steps']:.2f} ({c['audit_cost_iqr'][0]:.2f}-{c['audit_cost_iqr'][1]:.2f})")
        rows.append([label, f"{c['step_ms']:.1f}", f"{c['ratio']:.3f}", f"{c['iqr'][0]:.3f}-{c['iqr'][1]:.3f}",
                     cost, checks])
        summary[label] = {**c, "results": res}
    say(table(["configuration", "step ms (slowest rank)", "ratio (median)", "IQR", "audit cost, steps (IQR)",
               "check results on rank 0"], rows,
              title=f"{TITLES[layout]}, {'GPT' if layout in PIPELINES else 'TP GPT'} {model}, "
                    f"{rounds} rounds of {segment}-step segments"))
    errors = sorted({e for r in per_rank for e in r["errors"]})
    incidents = sorted({e for r in per_rank for e in r["incidents"]})
    if errors or incidents:
        say(f"errors: {errors}; incidents: {incidents}")
    say(f"{wall:.0f} s wall")
    payload = {"layout": layout, "mesh": dict(zip(LAYOUTS[layout][1], shape, strict=True)),
               "monitor_layout": per_rank[0]["layout"], "model": model, "world": world,
               "params": per_rank[0]["params"], "params_per_rank": per_rank[0]["params_per_rank"],
               "rounds": rounds, "segment": segment, "replay_every": replay_every, "summary": summary,
               "errors": errors, "incidents": incidents,
               "wall_s": wall}
    return payload



# -- campaign -------------------------------------------------------------------------------------------------------

CAMPAIGN_LAYOUT = "hsdp_tp"
CAMPAIGN_LAYOUTS = ("hsdp_tp", "pp_rep_tp")  # the 3-D mesh, and the 4-D one with a pipeline (dp_shard 1)
CAMPAIGN_REPLAY_EVERY = 2
HOSTS = 2  # ranks look like 2 hosts of 4 (SDC_HOST_NAME): one dp_replicate replica per host, tp inside a host
BITS = {"sign": [31], "exponent": list(range(23, 31)), "mantissa": list(range(0, 23))}
RELATIVES = {"1e-2": 1e-2, "1e-3": 1e-3, "1e-4": 1e-4, "1e-5": 1e-5}
FAULT_KINDS = ([f"weight_{b}" for b in BITS] + [f"compute_{r}" for r in RELATIVES] + [f"grad_{b}" for b in BITS])
KINDS = ("healthy", *FAULT_KINDS)


def _campaign_targets(stage: int | None = None, stages: int = 1) -> tuple[list[str], list[str]]:
    """Parameter names and perturbable module names of the campaign's model, or of its pipeline ``stage``."""
    m: nn.Module = TPGPT(**CAMPAIGN_MODEL) if stage is None else Stage(CAMPAIGN_MODEL, stage, stages)
    params = [n for n, _ in m.named_parameters()]
    modules = [n for n, sub in m.named_modules() if isinstance(sub, (nn.Linear, nn.LayerNorm, nn.Embedding))]
    return params, modules


QUICK_KINDS = ("healthy", "weight_mantissa", "compute_1e-3", "grad_sign")


def plan(trials_per_kind: int, seed: int, steps: int, world: int, kinds: Sequence[str] = KINDS,
         layout: str = "hsdp_tp") -> list[dict[str, Any]]:
    """``trials_per_kind`` trials of each kind in random order; rank, step, tensor, element and bit drawn at random
    (under a pipeline, the tensor or module among those of the rank's stage). Fault steps lie in 1 .. steps - 2 (a
    persistent fault then meets at least one audit before the end)."""
    if steps < 4:
        raise ValueError(f"steps must be >= 4 (a fault step between the first step and an audit), got {steps}")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown fault kinds {unknown}; known: {list(KINDS)}")
    rng = random.Random(seed)
    shape, names = LAYOUTS[layout]
    drawn = [k for k in kinds for _ in range(trials_per_kind)]
    rng.shuffle(drawn)
    out = []
    for i, kind in enumerate(drawn):
        t: dict[str, Any] = {"id": i, "kind": kind, "seed": rng.randrange(2**31), "steps": steps,
                             "rank": rng.randrange(world), "step": rng.randrange(1, steps - 1)}
        stage = coordinate_of(t["rank"], layout)["pp"] if "pp" in names else None
        params, modules = _campaign_targets(stage, shape[names.index("pp")] if "pp" in names else 1)
        weights = [n for n in params if n.endswith("weight")]
        if kind == "healthy":
            t["rank"], t["step"] = None, None
        elif kind.startswith(("weight_", "grad_")):
            family = kind.split("_", 1)[1]
            t.update(param=rng.choice(params if kind.startswith("weight_") else weights), at=rng.random(),
                     bit=rng.choice(BITS[family]))
        else:
            t.update(module=rng.choice(modules), relative=RELATIVES[kind.removeprefix("compute_")])
        out.append(t)
    return out


class _Results(sdc.Observer):
    def __init__(self) -> None:
        self.replays: dict[int, str] = {}
        self.errors: list[str] = []

    def report(self, report: sdc.StepReport) -> None:
        if report.counts_step and "replay" in report.results:
            self.replays[report.step] = report.results["replay"]
        self.errors += list(report.errors)


def _grad_bit_flip(model: nn.Module, t: dict[str, Any], clock: list[int], fired: list[str]) -> Any:
    """Flip bit ``t["bit"]`` of one element of ``t["param"]``'s local gradient in the first backward of step
    ``t["step"]``. Under FSDP2 autograd computes with the unsharded parameter (tp-local under TP), which the module
    holds during its forward: a hook registered on it then sees the gradient before the reduce-scatter."""
    owner_name, _, attr = t["param"].rpartition(".")
    owner = model.get_submodule(owner_name)
    armed: list[Any] = []

    def flip(grad: torch.Tensor) -> torch.Tensor:
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        out = local.clone()
        index = min(int(t["at"] * out.numel()), out.numel() - 1)
        flip_bit(out, index, t["bit"])
        fired.append(f"bit {t['bit']} of {t['param']}.grad[{index}] at step {clock[0]}")
        for h in armed:
            h.remove()
        if hasattr(grad, "to_local"):
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(out, grad.device_mesh, grad.placements, run_check=False)  # type: ignore[attr-defined]
        return out

    def pre_forward(*_: Any) -> None:
        if clock[0] == t["step"] and not armed and not fired:
            armed.append(getattr(owner, attr).register_hook(flip))

    return owner.register_forward_pre_hook(pre_forward)


def _campaign_trial(t: dict[str, Any], mesh: Any, layout: str) -> dict[str, Any]:
    rank = dist.get_rank()
    schedule: Any = None
    if layout in PIPELINES:  # the rank's stage (fault targets were drawn among its own stage's)
        model, _, schedule, _, _ = build_pp_tp(CAMPAIGN_MODEL, mesh, seed=t["seed"])
    else:
        model = build_tp(CAMPAIGN_MODEL, mesh, seed=t["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inj = FaultInjector(model, opt)
    clock = [0]
    fired: list[str] = []
    flipped: dict[str, Any] = {}
    handles = []
    kind = t["kind"]
    faulty = rank == t["rank"]
    if kind.startswith("weight_") and (faulty or schedule is None):  # another stage has other parameter names
        local = _local(dict(model.named_parameters())[t["param"]])
        index = min(int(t["at"] * local.numel()), local.numel() - 1)
        if local.numel():
            inj.flip_weight_bit(rank=t["rank"], step=t["step"], param=t["param"], index=index, bit=t["bit"])

            def after_flip(*_: Any) -> None:  # registered after the injector's pre-hook: sees the flipped value
                if faulty and clock[0] == t["step"] and not flipped:
                    flipped["value"] = float(local.detach().reshape(-1)[index])

            handles.append(model.register_forward_pre_hook(after_flip))
    elif kind.startswith("grad_") and faulty:
        handles.append(_grad_bit_flip(model, t, clock, fired))
    elif kind.startswith("compute_") and (faulty or schedule is None):
        inj.perturb_output(rank=t["rank"], step=t["step"], module=t["module"], relative=t["relative"])
    recorder = _Results()
    config = sdc.SDCConfig(weights_every=1, replay_every=CAMPAIGN_REPLAY_EVERY, on_suspect="record",
                           metrics_port=None, nvml=False)
    monitor = sdc.SDCMonitor(model, opt, pipeline=schedule, mesh=mesh, observer=recorder, config=config) \
        if schedule is not None else sdc.SDCMonitor(model, opt, loss_fn=lm_loss, observer=recorder, config=config)
    m = CAMPAIGN_MODEL
    batch_size = 2 * MICRO if schedule is not None else 4
    for batch in token_batches(t["steps"], batch_size, m["seq"], m["vocab"], seed=t["seed"] + 1 + dp_index(mesh)):
        with monitor.step(batch) as st:
            if schedule is not None:
                st.pipeline_step(batch[0], target=batch[1])
            else:
                st.backward(lm_loss(model, batch))
        opt.step()
        opt.zero_grad()
        clock[0] += 1
    monitor.close()
    inj.close()
    for h in handles:
        h.remove()
    incidents = [{"step": i.step, "check": i.check, "suspects": list(i.suspect_ranks),
                  "verdict": i.evidence.get("verdict"), "ambiguous": bool(i.evidence.get("ambiguous", False)),
                  "coordinate": i.evidence.get("coordinate")} for i in monitor.incidents]
    return {"id": t["id"], "incidents": incidents, "fired": bool(inj.fired or fired), "flipped": flipped,
            "replays": {str(k): v for k, v in recorder.replays.items()}, "errors": sorted(set(recorder.errors))}


def _campaign_rank(rank: int, world: int, trials: list[dict[str, Any]], layout: str) -> list[dict[str, Any]]:
    logging.getLogger("sdc_telemetry").setLevel(logging.CRITICAL)  # incidents are the point: keep stderr quiet
    torch.set_flush_denormal(True)
    shape, names = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    out = []
    for t in trials:
        try:
            r = _campaign_trial(t, mesh, layout)
        except Exception as e:  # the same plan on every rank: a planning error happens on all of them alike
            r = {"id": t["id"], "error": f"{type(e).__name__}: {e}"}
        fired: list[Any] = [None] * world
        dist.all_gather_object(fired, (r.get("fired", False), r.get("flipped", {})))
        if "error" not in r:
            r["fired"] = any(f for f, _ in fired)
            r["flipped"] = next((v for _, v in fired if v), {})
        out.append(r)
        dist.barrier()
    return out


def coordinate_of(rank: int, layout: str = CAMPAIGN_LAYOUT) -> dict[str, int]:
    shape, names = LAYOUTS[layout]
    coord, rest = {}, rank
    for name, size in reversed(list(zip(names, shape, strict=True))):
        coord[name] = rest % size
        rest //= size
    return {n: coord[n] for n in names}


def _replica(coord: dict[str, int]) -> tuple[int, ...]:
    return tuple(v for k, v in coord.items() if k.startswith("dp"))


def _coordinate_right(incident: dict[str, Any], faulty: dict[str, int], layout: str = CAMPAIGN_LAYOUT) -> bool:
    """The incident's coordinate is one of its suspects' and, on every dim where the suspects agree, the faulty
    rank's: a 2-replica weight incident names the shard (dp_shard, tp) exactly, a replay incident the replica."""
    coord = incident["coordinate"]
    suspects = [coordinate_of(s, layout) for s in incident["suspects"]]
    if coord is None or coord not in suspects:
        return False
    return all(coord[d] == faulty[d] for d in coord if len({s[d] for s in suspects}) == 1)


def outcome_class(t: dict[str, Any], r: dict[str, Any]) -> str:
    """Ground truth: what a fault could leave for a check to find."""
    kind = t["kind"]
    if kind.startswith("weight_"):
        value = r.get("flipped", {}).get("value")
        if value is not None and not math.isfinite(value):
            return "to non-finite"
        return "flipped" if r.get("fired") else "not fired"
    if kind.startswith("grad_"):
        return "audit step" if t["step"] % CAMPAIGN_REPLAY_EVERY == 0 else "off audit step"
    return "persistent" if kind != "healthy" else "healthy"


def score(trials: list[dict[str, Any]], results: dict[int, dict[str, Any]], world: int,
          layout: str = CAMPAIGN_LAYOUT) -> dict[str, Any]:
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    healthy_rank_steps = false_incidents = 0
    false_by_check: dict[str, int] = {}
    errors = []
    for t in trials:
        r = results.get(t["id"])
        if r is None or "error" in r:
            errors.append({"id": t["id"], "kind": t["kind"], "error": (r or {}).get("error", "no result")})
            continue
        errors += [{"id": t["id"], "kind": t["kind"], "error": e} for e in r.get("errors", [])]
        fault_step = t["step"] if t["kind"] != "healthy" else t["steps"]
        healthy_rank_steps += fault_step * world
        for inc in r["incidents"]:
            if inc["step"] < fault_step:
                false_incidents += 1
                false_by_check[inc["check"]] = false_by_check.get(inc["check"], 0) + 1
        if t["kind"] == "healthy":
            continue
        cls = outcome_class(t, r)
        row = rows.setdefault((t["kind"], cls), {"injected": 0, "fired": 0, "detected": 0, "rank_named": 0,
                                                 "named_alone": 0, "replica_right": 0, "coordinate_right": 0,
                                                 "ambiguous": 0, "latency": [], "first_check": {}})
        row["injected"] += 1
        row["fired"] += int(r["fired"])
        after = [i for i in r["incidents"] if i["step"] >= fault_step]
        if not after:
            continue
        first_step = min(i["step"] for i in after)
        first = [i for i in after if i["step"] == first_step]
        row["detected"] += 1
        row["latency"].append(first_step - fault_step)
        for c in sorted({i["check"] for i in first}):
            row["first_check"][c] = row["first_check"].get(c, 0) + 1
        mine = coordinate_of(t["rank"], layout)
        named = [i for i in first if t["rank"] in i["suspects"]]
        row["rank_named"] += int(bool(named))
        row["named_alone"] += int(any(i["suspects"] == [t["rank"]] for i in first))
        row["ambiguous"] += int(any(i["ambiguous"] for i in named))
        row["replica_right"] += int(any(i["suspects"] and all(_replica(coordinate_of(s, layout)) == _replica(mine)
                                                              for s in i["suspects"]) for i in named))
        row["coordinate_right"] += int(any(_coordinate_right(i, mine, layout) for i in named))
    out_rows = []
    for (kind, cls), row in sorted(rows.items(), key=lambda kv: (KINDS.index(kv[0][0]), kv[0][1])):
        lat = row.pop("latency")
        out_rows.append({"kind": kind, "class": cls, **row, "detection_rate": row["detected"] / row["injected"],
                         "latency_median": median(lat) if lat else None, "latency_max": max(lat) if lat else None})
    return {"rows": out_rows, "healthy_rank_steps": healthy_rank_steps, "false_incidents": false_incidents,
            "false_incidents_by_check": false_by_check,
            "false_incidents_per_1000_rank_steps": 1000 * false_incidents / max(healthy_rank_steps, 1),
            "errors": errors}


def run_campaign(trials_per_kind: int = 6, steps: int = 6, seed: int = 0, spawns: int = 2,
                 kinds: Sequence[str] = KINDS, say: Any = print, layout: str = CAMPAIGN_LAYOUT) -> dict[str, Any]:
    if layout not in CAMPAIGN_LAYOUTS:
        raise ValueError(f"the campaign runs on {', '.join(CAMPAIGN_LAYOUTS)}, not {layout!r}")
    shape, names = LAYOUTS[layout]
    world = math.prod(shape)
    trials = plan(trials_per_kind, seed, steps, world, kinds, layout)
    spawns = max(1, min(spawns, len(trials)))
    groups = [trials[g::spawns] for g in range(spawns)]
    t0 = time.perf_counter()
    results: dict[int, dict[str, Any]] = {}
    for group in groups:
        per_rank = spawn_ranks(_campaign_rank, world, args=(group, layout), timeout=3600, pg_timeout=600,
                               rank_env=lambda r: {"SDC_HOST_NAME": f"host{r * HOSTS // world}"})
        for r in per_rank[0]:
            results[r["id"]] = r
    wall = time.perf_counter() - t0
    s = score(trials, results, world, layout)
    rows = []
    for row in s["rows"]:
        lat = "-" if row["latency_median"] is None else f"{row['latency_median']:g} / {row['latency_max']:g}"
        checks = ", ".join(f"{c} {n}" for c, n in sorted(row["first_check"].items())) or "-"
        rows.append([row["kind"], row["class"], row["injected"], f"{row['detected']}/{row['injected']}",
                     row["rank_named"], row["named_alone"], row["replica_right"], row["coordinate_right"],
                     row["ambiguous"], lat, checks])
    say(table(["fault", "class", "trials", "detected", "rank named", "named alone", "replica right",
               "coordinate right", "ambiguous", "latency med / max", "first check"], rows,
              title=f"Fault campaign on {TITLES[layout]}, {len(trials)} trials of {steps} steps, "
                    f"weights/1 + replay/{CAMPAIGN_REPLAY_EVERY}, seed {seed}"))
    say(f"false incidents: {s['false_incidents']} in {s['healthy_rank_steps']} healthy rank-steps "
        f"({s['false_incidents_by_check'] or 'none'}); errors: {len(s['errors'])}; {wall:.0f} s wall "
        f"in {spawns} spawn(s)")
    for e in s["errors"][:5]:
        say(f"  error in trial {e['id']} ({e['kind']}): {e['error']}")
    return {"layout": layout, "mesh": dict(zip(names, shape, strict=True)), "world": world,
            "hosts": HOSTS, "model": CAMPAIGN_MODEL, "steps": steps, "replay_every": CAMPAIGN_REPLAY_EVERY,
            "seed": seed, "trials": len(trials), "spawns": spawns, "wall_s": wall, **s,
            "plan": trials, "results": [results.get(t["id"]) for t in trials]}

# -- entry point ----------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, short rounds / one trial per class (smoke test)")
    p.add_argument("--campaign", action="store_true", help="the fault campaign on HSDP x TP instead of the overhead")
    p.add_argument("--layout", choices=["all", *sorted(LAYOUTS)], default="all",
                   help="the layout timed (all: hsdp_tp, pp_dp, pp_interleaved, then pp_tp and pp_rep_tp; --quick: "
                        "not those two)")
    p.add_argument("--trials", type=int, default=6, help="campaign trials per fault class")
    p.add_argument("--seed", type=int, default=0, help="campaign seed")
    p.add_argument("--spawns", type=int, default=2, help="campaign: process spawns the trials are grouped into")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--segment", type=int, default=10)
    p.add_argument("--out-dir", default=None, help="directory for the JSON result (default: benchmarks/results)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.campaign:
        layout = CAMPAIGN_LAYOUT if args.layout == "all" else args.layout
        c = (run_campaign(1, steps=4, spawns=1, kinds=QUICK_KINDS, seed=args.seed, layout=layout) if args.quick
             else run_campaign(args.trials, seed=args.seed, spawns=args.spawns, layout=layout))
        name = "nd_campaign" if layout == CAMPAIGN_LAYOUT else f"nd_campaign_{layout}"
        print(f"wrote {write_json(name, c, args.out_dir)}")
        return
    # --quick (the smoke test) leaves out pp_tp and pp_rep_tp, 8 more ranks each: tests/distributed/test_pipeline_tp.py
    # runs those layouts
    every = ["hsdp_tp", "pp_dp", "pp_interleaved"] + ([] if args.quick else ["pp_tp", "pp_rep_tp"])
    layouts = every if args.layout == "all" else [args.layout]
    results = {}
    for layout in layouts:
        batch = 8 if layout in PIPELINES else 4  # MICRO micro-batches per pipeline step
        if args.quick:
            quick = {**QUICK_MODEL, "layers": 4} if layout == "pp_interleaved" else QUICK_MODEL  # a layer a stage
            results[layout] = run_overhead(layout, quick, rounds=2, segment=QUICK_REPLAY_EVERY, warmup=1,
                                           batch=batch, replay_every=QUICK_REPLAY_EVERY)
        else:
            results[layout] = run_overhead(layout, rounds=args.rounds, segment=args.segment, batch=batch)
    payload = {"layouts": results, "wall_s": time.perf_counter() - t0}
    print(f"wrote {write_json('nd', payload, args.out_dir)}")

if __name__ == "__main__":
    main()
