"""Rank side of the expert-parallel tests: a mixture-of-experts model laid out as torchtitan lays it out.

The experts of each MoE layer are one module holding every expert's weights as 3-D tensors (torchtitan's
GroupedExperts); expert parallelism shards them on dim 0 over the ``ep`` dim of a sparse mesh
(``dp_replicate, efsdp, ep``, unflattened from the world as torchtitan's ParallelDims does), and their parent
(torchtitan's RoutedExperts) sends each token to the rank of its expert (an all-to-all of the counts, then of the
tokens), runs the local experts and sends the results back. ``fully_shard`` then shards the experts over ``efsdp`` (and
replicates them over ``dp_replicate``) and the dense parameters over the dense mesh's data-parallel dims.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

import sdc_telemetry as sdc
from sdc_telemetry.faults import FaultInjector, flip_bit

from ._scenarios import Recorder

DIM, HIDDEN, EXPERTS = 16, 24, 4


class Experts(nn.Module):
    """Every expert's two matrices (torchtitan's GroupedExperts); ``forward(tokens, counts)``: the tokens sorted by
    expert, ``counts`` tokens each. Every expert runs, one without tokens on an empty slice (its gradient is then
    zeros, as section 8 of the design expects)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * DIM ** -0.5)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * HIDDEN ** -0.5)

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        w1, w2 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2))
        outs, start = [], 0
        for e, n in enumerate(counts):
            x = tokens[start:start + n]
            outs.append(torch.relu(x @ w1[e]) @ w2[e])
            start += n
        return torch.cat(outs)


class RoutedExperts(nn.Module):
    """torchtitan's RoutedExperts, small: dispatch the tokens to their experts' ranks (an all-to-all of the counts,
    then of the tokens), run the local experts, combine the results back. Without an ep group: the experts alone."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = Experts()
        self.ep: Any = None

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.ep is None:
            return self.experts(tokens, counts.tolist())  # type: ignore[no-any-return]
        group, size = self.ep.get_group(), self.ep.size()
        local = EXPERTS // size
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)  # how many tokens each rank sends to my experts
        send = counts.view(size, local).sum(1).tolist()
        recv = received.view(size, local).sum(1).tolist()
        got = dist_fn.all_to_all_single(torch.empty(sum(recv), DIM, dtype=tokens.dtype), tokens, recv, send,
                                        group=group)
        # the received tokens come by source rank, then by local expert: sort them by local expert
        per = received.view(size, local).tolist()
        starts = [sum(map(sum, per[:r])) for r in range(size)]
        order = [i for e in range(local) for r, row in enumerate(per)
                 for i in range(starts[r] + sum(row[:e]), starts[r] + sum(row[:e + 1]))]
        index = torch.tensor(order, dtype=torch.long)
        out = self.experts(got[index], [sum(row[e] for row in per) for e in range(local)])
        back = torch.empty_like(out).index_copy(0, index, out)
        return dist_fn.all_to_all_single(torch.empty(sum(send), DIM, dtype=out.dtype), back, send, recv,  # type: ignore[no-any-return]
                                         group=group)


class MoE(nn.Module):
    """Top-1 routing over ``EXPERTS`` experts, the gate applied to the expert's output."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.routed = RoutedExperts()
        self.starved: int | None = None  # an expert the router never picks (it receives no token on any rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.norm(x).reshape(-1, DIM)
        logits = self.router(flat)
        if self.starved is not None:
            logits = logits.index_fill(1, torch.tensor([self.starved]), -1e4)
        gate, idx = torch.softmax(logits, dim=-1).max(dim=-1)
        order = torch.argsort(idx, stable=True)
        out = self.routed(flat[order], torch.bincount(idx, minlength=EXPERTS))
        out = out[torch.argsort(order)] * gate[:, None]
        return x + out.reshape(x.shape)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, DIM)
        self.m1 = MoE()
        self.m2 = MoE()
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.m2(self.m1(self.inp(x))))  # type: ignore[no-any-return]


def loss_fn(module: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    out = module(x)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def expert_parallel(routed: RoutedExperts, ep: Any) -> None:
    """The expert weights sharded on dim 0 over ``ep`` (DTensors), the dispatch over its group."""
    for name, p in list(routed.experts.named_parameters(recurse=False)):
        routed.experts.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), ep, [Shard(0)])))
    routed.ep = ep


def _per_parameter_mesh(experts: nn.Module, edp: Any, dp: Any) -> Any:
    """torchtitan 0.3's shard_placement_fn for a MoE block under expert parallelism: the experts' parameters on the
    efsdp mesh, the others on the dense data-parallel mesh."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    held = set(experts.parameters())
    expert_info, dense_info = _get_mesh_info(edp, None), _get_mesh_info(dp, None)
    return lambda p: ShardPlacementResult(placement=Shard(0), mesh_info=expert_info if p in held else dense_info)


def build(replicate: int, shard: int, ep: int, one_module: bool = False) -> tuple[nn.Module, Any]:
    """The model on a dense mesh (dp_replicate, dp_shard) and a sparse one (dp_replicate, efsdp, ep), both unflattened
    from the world mesh (torchtitan's ParallelDims)."""
    torch.manual_seed(0)
    model = Model()
    world = init_device_mesh("cpu", (replicate * shard,), mesh_dim_names=("world",))
    dense = world._unflatten(0, (replicate, shard), ("dp_replicate", "dp_shard"))
    sparse = world._unflatten(0, (replicate, shard // ep, ep), ("dp_replicate", "efsdp", "ep"))
    dp = dense["dp_replicate", "dp_shard"] if replicate > 1 else dense["dp_shard"]
    edp = sparse["dp_replicate", "efsdp"] if replicate > 1 else sparse["efsdp"]
    for moe in (model.m1, model.m2):
        expert_parallel(moe.routed, sparse["ep"])
        # (torchtitan also sets the experts' gradient divide factor to the dense one: a PREMUL_SUM, which gloo lacks)
        if one_module:  # torchtitan 0.3: one fully_shard per block, the experts on their own mesh (two groups)
            fully_shard(moe, mesh=dp, shard_placement_fn=_per_parameter_mesh(moe.routed.experts, edp, dp))
        else:  # the experts their own FSDP module on the efsdp mesh (torchtitan before 0.3)
            fully_shard(moe.routed.experts, mesh=edp)
            fully_shard(moe, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, dense


def run_one(rank: int, replicate: int, shard: int, ep: int, sc: dict[str, Any]) -> dict[str, Any]:
    model, mesh = build(replicate, shard, ep, sc.get("one_module", False))
    if sc.get("starve") is not None:
        model.m1.starved = model.m2.starved = sc["starve"]  # type: ignore[assignment]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    faults = FaultInjector(model, opt)
    if sc.get("corrupt_update"):
        faults.corrupt_update(**sc["corrupt_update"])
    recorder = Recorder()
    monitor = None
    if sc.get("monitor", True):
        monitor = sdc.SDCMonitor(model, opt, loss_fn=loss_fn, observer=recorder, mesh=mesh,
                                 config=sdc.SDCConfig(metrics_port=None, nvml=False, **sc.get("config", {})))
    if sc.get("perturb"):  # after the monitor: "first" puts it before every hook then registered (a kernel's fault)
        faults.perturb_output(**sc["perturb"])
    gen = torch.Generator().manual_seed(100 + rank)  # every rank its own batch: ep ranks are data-parallel ranks
    steps = sc.get("steps", 6)
    losses = []
    for k in range(steps):
        batch = (torch.randn(4, 4, 8, generator=gen), torch.randint(0, 4, (4, 4), generator=gen))
        if sc.get("nan") and sc["nan"]["step"] == k and rank == sc["nan"]["rank"]:
            batch[0][0, 0, 0] = float("nan")
        flip = sc.get("flip")
        if flip and flip["step"] == k and rank == flip["rank"]:
            flip_bit(dict(model.named_parameters())[flip["param"]].to_local(), flip["index"], flip["bit"])
        if monitor is not None:
            with monitor.step(batch) as st:
                loss = loss_fn(model, batch)
                st.backward(loss)
            if not st.finite:  # the documented guard: no update from non-finite gradients
                losses.append(float(loss.detach()))
                opt.zero_grad()
                continue
        else:
            loss = loss_fn(model, batch)
            loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    if monitor is not None:
        monitor.close()
    faults.close()
    return {"incidents": [(i.step, i.check, list(i.suspect_ranks), i.evidence.get("verdict"),
                           i.evidence.get("coordinate"), i.evidence.get("moe_layer"),
                           bool(i.evidence.get("ambiguous")))
                          for i in (monitor.incidents if monitor else [])],
            "layout": monitor.layout.describe() if monitor else None,
            "counts": recorder.counts(), "errors": recorder.errors, "losses": losses,
            "weights": {n: p.to_local().detach().clone() for n, p in model.named_parameters()}}


def run_ep(rank: int, world: int, replicate: int, shard: int, ep: int, scenarios: list[dict[str, Any]]
           ) -> list[dict[str, Any]]:
    out = []
    for sc in scenarios:
        out.append(run_one(rank, *sc.get("shape", (replicate, shard, ep)), sc))
        dist.barrier()
    return out
