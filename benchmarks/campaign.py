"""Seeded fault-injection campaign: which check catches which fault, on the right rank, how fast, and false alarms.

    python benchmarks/campaign.py                 # 240 trials on 3 gloo ranks (~2 minutes)
    python benchmarks/campaign.py --seed 7 --trials 600
    python benchmarks/campaign.py --quick         # a handful of trials (the smoke test)
    python benchmarks/campaign.py --layout hsdp --trials 70   # HSDP: 6 ranks, (3 replicas x 2 shards)

Each trial trains a small model (a tiny GPT or an MLP, both with dropout) for ``steps`` steps on 3 ranks with
``SDCConfig(weights_every=1, replay_every=3, on_suspect="record")`` and, unless it is a healthy run, one fault drawn at
random through the public ``sdc_telemetry.faults.FaultInjector`` API: kind, rank, step, tensor or module, element,
bit, value or magnitude, or two swapped rows of a weight (a permutation: same values, wrong places). One kind is not
a hardware fault: a NaN in every rank's batch at one step (the MLP, whose inputs are floats), which must be recorded
as a ``numerics`` event and never name a suspect. A third of the trials of every kind train with a
``torch.amp.GradScaler("cpu")`` (``step.backward(loss, scaler=scaler)``, ``scaler.step(opt)``, ``scaler.update()``).
Several trials share one spawn of the ranks.

Outcome classes are decided from ground truth measured beside the monitor (never from the monitor's verdict):
- weight bit flip: ``to non-finite`` when the flipped value is NaN or Inf; ``absorbed by the update`` when, after the
  fault step's optimizer update, the faulty rank's element equals the healthy replicas' again (rounding swallowed the
  flip: nothing lasting is left to detect, only the one forward pass used the wrong value); ``effective`` otherwise.
- compute fault (an output scaled by 1 + r): ``no-op`` when 1 + r rounds to 1 in float32 (nothing changes);
  a transient one is ``off audit step`` when it hits a step that replay does not audit (by design, replay samples).
- reduced-gradient corruption with a finite value: ``no weight divergence`` when the replicas' weights (SHA-1 of a
  host copy, all-gathered each step) never differ within the trial.
- row swap: ``rows equal (no-op)`` when the replicas' weights do not differ after the fault step (the two rows held
  the same values, as a freshly initialised LayerNorm's do).
Classes that cannot change the outcome, or sit outside what a check samples, are reported on their own rows.

HSDP (``--layout hsdp``): 6 gloo ranks on a ``(3 replicas, 2 shards)`` device mesh; every submodule that holds
parameters (the MLP's Linears, the GPT's blocks) and then the root are sharded with ``fully_shard``, and the monitor
takes the sharded model as it is. Rank r holds shard ``r % 2``; its replicas are the ranks with the same shard index.
Weight bit flips and row swaps hit this rank's local shard (element and rows are drawn from the local shard of the
faulty rank), and the ground truth compares each shard among its replicas. One more kind: a NaN in one rank's batch
(the MLP), which ``grad_local`` must name from that rank's reduce-scatter input. The DDP-only kinds (``nonfinite_grad``
through parameter hooks, ``reduced_grad`` through the DDP comm hook) are not run, and the output says so.

Scoring: a fault is detected when any incident comes at or after its step; latency is the first such incident's step
minus the fault's step; the attribution is right when that first verdict names the faulty rank alone. Per check,
``first / any`` counts the trials where the check was among the first verdicts / raised an incident at all after the
fault (later incidents are often consequences: a NaN update makes the next local gradients NaN). Incidents before
the fault step, and all incidents of healthy runs, are false incidents; so is any incident naming a suspect after a
NaN on every rank (a false suspect). A second table splits detection and false incidents by GradScaler use; with a
scaler, a non-finite local gradient is an expected overflow (the scaler skips the step on every rank), so the monitor
records a ``numerics`` event instead of naming the rank: detected, never attributed.
"""

from __future__ import annotations

import argparse
import hashlib
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
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GPT, lm_loss, load_warning, median, table, token_batches, write_json

import sdc_telemetry as sdc
from sdc_telemetry.faults import FaultInjector, swap_rows
from sdc_telemetry.testing import RankFailed, spawn_ranks

CHECKS = ("grad_local", "grad_reduced", "replay", "weights")
KINDS = ("healthy", "weight_bitflip", "nonfinite_grad", "reduced_grad", "compute_persistent", "compute_transient",
         "row_swap", "nan_every_rank")
NAN_KIND = "nan_every_rank"  # not a hardware fault: every rank sees the same NaN
NAN_ONE = "nan_one_rank"  # HSDP only: a NaN in one rank's batch, named by grad_local
HSDP_KINDS = ("healthy", "weight_bitflip", "compute_persistent", "compute_transient", "row_swap", NAN_ONE, NAN_KIND)
HSDP_MESH = (3, 2)  # (replicas, shards): rank r holds shard r % 2
HSDP_SKIPPED = {
    "nonfinite_grad": "injected through per-parameter gradient hooks before DDP's buckets; on HSDP a NaN in one "
                      "rank's batch (nan_one_rank) covers a non-finite local gradient",
    "reduced_grad": "injected through a DDP comm hook; FSDP2 has no comm hook to corrupt the reduced gradient with",
}
LAYOUTS = ("ddp", "hsdp")
TINY_GPT: dict[str, Any] = {"vocab": 64, "dim": 32, "layers": 2, "heads": 2, "seq": 16, "dropout": 0.1}


# -- models ---------------------------------------------------------------------------------------------------------


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 8))


def cls_loss(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(module(x), y)


def build(model: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return GPT(**TINY_GPT) if model == "gpt" else mlp()


def shard(module: nn.Module, mesh: Any) -> nn.Module:
    """``fully_shard`` each submodule that holds parameters (the MLP's Linears, the GPT's blocks), then the root (which
    keeps the GPT's embeddings, final LayerNorm and tied head)."""
    from torch.distributed.fsdp import fully_shard

    parts = module.blocks if isinstance(module, GPT) else module.children()
    for part in parts:
        if next(part.parameters(), None) is None:
            continue  # GELU, Dropout
        fully_shard(part, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def kinds_of(layout: str) -> tuple[str, ...]:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return KINDS if layout == "ddp" else HSDP_KINDS


def batches(model: str, steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if model == "gpt":
        return token_batches(steps, 4, TINY_GPT["seq"], TINY_GPT["vocab"], seed)
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)) for _ in range(steps)]


def loss_fn(model: str) -> Any:
    return lm_loss if model == "gpt" else cls_loss


def _targets(model: str, shard_index: int = 0, shards: int = 1
             ) -> tuple[list[tuple[str, int, int]], list[str]]:
    """(parameter name, numel, rows) of each parameter's shard ``shard_index`` of ``shards`` (dim 0 split as
    ``fully_shard`` splits it, by ``torch.chunk``; the whole parameter for one shard), and perturbable module
    names of ``model``."""
    m = build(model, 0)
    params = []
    for n, p in m.named_parameters():
        chunks = torch.empty(p.shape, device="meta").chunk(shards) if p.dim() else (p,)
        local = chunks[shard_index] if shard_index < len(chunks) else torch.empty(0, device="meta")
        params.append((n, local.numel(), local.shape[0] if local.dim() else 0))
    modules = [n for n, sub in m.named_modules() if n and isinstance(sub, (nn.Linear, nn.LayerNorm, nn.Embedding))]
    return params, modules


# -- plan -----------------------------------------------------------------------------------------------------------


def plan(trials: int, seed: int, world: int, steps: int, layout: str = "ddp") -> list[dict[str, Any]]:
    """The campaign: kinds stratified (each kind equally often, in random order), a GradScaler on every third trial
    of each kind, every other choice drawn at random. On HSDP, elements and rows are drawn in the faulty rank's
    local shard."""
    kind_list = kinds_of(layout)
    shards = HSDP_MESH[1] if layout == "hsdp" else 1
    if world % shards:
        raise ValueError(f"world {world} is not a multiple of {shards} shards")
    rng = random.Random(seed)
    # i % 3 and i % len(kinds) cycle independently (len(kinds) is not a multiple of 3): every kind gets the scaler
    # on a third of its trials
    kinds = [(kind_list[i % len(kind_list)], i % 3 == 2) for i in range(trials)]
    rng.shuffle(kinds)
    targets = {(m, s): _targets(m, s, shards) for m in ("gpt", "mlp") for s in range(shards)}
    out = []
    for i, (kind, scaler) in enumerate(kinds):
        model = rng.choice(("gpt", "mlp"))
        if kind in (NAN_KIND, NAN_ONE):
            model = "mlp"  # the GPT's inputs are token ids: a NaN goes into the MLP's float inputs
        t: dict[str, Any] = {"id": i, "kind": kind, "model": model, "scaler": scaler, "seed": rng.randrange(2**31),
                             "rank": rng.randrange(world), "step": rng.randrange(max(1, steps - 3))}
        params, modules = targets[model, t["rank"] % shards]
        if kind == "healthy":
            t["rank"], t["step"] = None, None
        elif kind == NAN_KIND:
            t["rank"] = None
        elif kind == NAN_ONE:
            pass  # the rank and step drawn above
        elif kind == "weight_bitflip":
            name, numel, _ = rng.choice(params)
            t.update(param=name, index=rng.randrange(numel), bit=rng.randrange(32))
        elif kind == "row_swap":
            name, _, rows = rng.choice([p for p in params if p[2] >= 2])
            i_row, j_row = rng.sample(range(rows), 2)
            t.update(param=name, rows=[i_row, j_row])
        elif kind == "nonfinite_grad":
            name, numel, _ = rng.choice(params)
            t.update(param=name, index=rng.choice([None, rng.randrange(numel)]),
                     value=rng.choice(["nan", "inf", "-inf"]))
        elif kind == "reduced_grad":
            total = sum(n for _, n, _ in params)
            t.update(index=rng.randrange(total), value=rng.choice(["nan", "inf", "-inf", "0.0", "1.0", "1e-3"]))
        else:
            t.update(module=rng.choice(modules), relative=10 ** rng.uniform(-8, -2))
        out.append(t)
    return out


# -- one trial (on every rank) --------------------------------------------------------------------------------------


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``fully_shard``-ed (DTensor) parameter; a plain tensor as it is."""
    to_local = getattr(p, "to_local", None)
    return to_local() if to_local is not None else p  # type: ignore[no-any-return]


def _digest(module: nn.Module) -> str:
    h = hashlib.sha1()
    for p in module.parameters():
        h.update(_local(p).detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _replicas_differ(values: list[Any], shards: int) -> bool:
    """Some shard's value differs among its replicas (ranks ``s, s + shards, ...``); one shard: among all ranks."""
    return any(len(set(values[s::shards])) > 1 for s in range(shards))


def _trial(t: dict[str, Any], steps: int, replay_every: int, mesh: Any = None) -> dict[str, Any]:
    """One trial on every rank: DDP, or fully_shard on ``mesh`` (HSDP) when one is given."""
    rank, world = dist.get_rank(), dist.get_world_size()
    module = build(t["model"], t["seed"])
    shards = 1 if mesh is None else mesh.size(1)
    ddp = DistributedDataParallel(module) if mesh is None else shard(module, mesh)  # what trains: the wrapped model
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    inj = FaultInjector(ddp, opt)
    kind = t["kind"]
    swapped: list[str] = []
    if kind == "weight_bitflip":
        inj.flip_weight_bit(rank=t["rank"], step=t["step"], param=t["param"], index=t["index"], bit=t["bit"])
    elif kind == "row_swap" and mesh is None:
        inj.swap_rows(rank=t["rank"], step=t["step"], param=t["param"], rows=(t["rows"][0], t["rows"][1]))
    elif kind == "row_swap":
        # FaultInjector.swap_rows indexes the whole (DTensor) parameter; the rows drawn are rows of the local shard
        local = _local(dict(module.named_parameters())[t["param"]])

        def swap(*_: Any) -> None:
            if rank == t["rank"] and step == t["step"] and not swapped:
                swap_rows(local.data, t["rows"][0], t["rows"][1])
                swapped.append(f"rows {t['rows']} of {t['param']}'s local shard swapped at step {step}")

        ddp.register_forward_pre_hook(swap)
    elif kind == "nonfinite_grad":
        inj.nonfinite_grad(rank=t["rank"], step=t["step"], param=t["param"], index=t["index"],
                           value=float(t["value"]))
    elif kind == "reduced_grad":
        inj.corrupt_reduced_grad(rank=t["rank"], step=t["step"], index=t["index"], value=float(t["value"]))
    elif kind in ("compute_persistent", "compute_transient"):
        inj.perturb_output(rank=t["rank"], step=t["step"], module=t["module"], relative=t["relative"],
                           transient=kind == "compute_transient")
    fn = loss_fn(t["model"])
    ddp_only: dict[str, Any] = {"comm_hook": inj.comm_hook, "comm_state": None} if mesh is None else {}
    monitor = sdc.SDCMonitor(ddp, opt, loss_fn=fn, **ddp_only,
                             config=sdc.SDCConfig(weights_every=1, replay_every=replay_every, on_suspect="record",
                                                  metrics_port=None, nvml=False),
                             observer=sdc.Observer())
    # Ground truth beside the monitor: the flipped element on every rank, and whether the replicas' weights differ.
    step = 0
    truth: dict[str, Any] = {"diverged_steps": [], "flip": None, "flip_absorbed": None}
    elem = None
    if kind == "weight_bitflip":
        elem = _local(dict(module.named_parameters())[t["param"]]).detach().view(-1)
        # on HSDP the index is into the faulty rank's shard: other shards may be shorter
        here = t["index"] < elem.numel() and rank % shards == t["rank"] % shards

        def after_flip(*_: Any) -> None:
            if step == t["step"] and truth["flip"] is None and elem is not None:
                values: list[Any] = [None] * world
                dist.all_gather_object(values, float(elem[t["index"]]) if here else None)
                truth["flip"] = {"faulty": values[t["rank"]],
                                 "healthy": values[(t["rank"] + shards) % world]}  # a replica of the same shard

        ddp.register_forward_pre_hook(after_flip)  # after the injector's own pre-hook: sees the flipped value

    def after_update() -> None:
        # Called by the loop, not an optimizer hook: a GradScaler skips optimizer.step() on overflow, and the truth
        # must still advance one step per training step.
        nonlocal step
        digests: list[Any] = [None] * world
        dist.all_gather_object(digests, _digest(module))
        if _replicas_differ(digests, shards):
            truth["diverged_steps"].append(step)
        if kind == "weight_bitflip" and step == t["step"] and elem is not None:
            bits: list[Any] = [None] * world
            dist.all_gather_object(bits, elem[t["index"]].view(1).view(torch.int32).item() if here else None)
            truth["flip_absorbed"] = len(set(bits[t["rank"] % shards::shards])) == 1
        step += 1

    scaler = torch.amp.GradScaler("cpu") if t.get("scaler") else None
    for batch in batches(t["model"], steps, seed=t["seed"] + 1 + rank):
        if kind == NAN_KIND and step == t["step"]:
            x, y = batch
            x = x.clone()
            x[0, 0] = math.nan  # the same NaN in every rank's batch: a bad sample, not a bad node
            batch = (x, y)
        if kind == NAN_ONE and step == t["step"] and rank == t["rank"]:
            x, y = batch
            x = x.clone()
            x[0, 0] = math.nan  # one rank's input: its local gradient goes non-finite, the others' do not
            batch = (x, y)
        with monitor.step(batch) as st:
            st.backward(fn(ddp, batch), scaler=scaler)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        after_update()
    monitor.close()
    inj.close()
    incidents = [{"step": i.step, "last_step": i.last_step, "check": i.check, "suspects": list(i.suspect_ranks),
                  "verdict": i.evidence.get("verdict"), "ambiguous": bool(i.evidence.get("ambiguous", False))}
                 for i in monitor.incidents]
    return {"id": t["id"], "incidents": incidents, "fired": bool(inj.fired or swapped), **truth}


def _group(rank: int, world: int, trials: list[dict[str, Any]], steps: int, replay_every: int, layout: str = "ddp"
           ) -> list[dict[str, Any]]:
    logging.getLogger("sdc_telemetry").setLevel(logging.CRITICAL)  # incidents are the point here: keep stderr quiet
    mesh = None
    if layout == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // HSDP_MESH[1], HSDP_MESH[1]), mesh_dim_names=("replicate", "shard"))
    out = []
    for t in trials:
        try:
            out.append(_trial(t, steps, replay_every, mesh))
        except Exception as e:  # same plan on every rank: a planning error happens on all of them alike
            out.append({"id": t["id"], "error": f"{type(e).__name__}: {e}"})
    return out


# -- scoring --------------------------------------------------------------------------------------------------------


def classify(t: dict[str, Any], r: dict[str, Any], replay_every: int) -> str:
    """The outcome class of a trial (see the module docstring), from ground truth only."""
    kind = t["kind"]
    if kind == "weight_bitflip":
        flip = r.get("flip") or {}
        faulty = flip.get("faulty")
        if faulty is not None and not math.isfinite(faulty):
            return "to non-finite"
        return "absorbed by the update" if r.get("flip_absorbed") else "effective"
    if kind in ("compute_persistent", "compute_transient"):
        if float(torch.tensor(1 + t["relative"], dtype=torch.float32)) == 1.0:
            return "no-op (1 + r rounds to 1)"
        if kind == "compute_transient" and t["step"] % replay_every:
            return "off audit step"
        return "effective"
    if kind == "reduced_grad" and math.isfinite(float(t["value"])):
        return "finite value" if r.get("diverged_steps") else "finite, no weight divergence"
    if kind == "row_swap":
        return "effective" if any(s >= t["step"] for s in r.get("diverged_steps", [])) else "rows equal (no-op)"
    if kind == NAN_KIND:
        return "numerics (not a fault)"
    if kind == NAN_ONE and t.get("scaler"):
        return "GradScaler: expected overflow"  # recorded as numerics, never attributed
    return "effective" if kind != "healthy" else "healthy"


def score(trials: list[dict[str, Any]], results: dict[int, dict[str, Any]], steps: int, world: int,
          replay_every: int) -> dict[str, Any]:
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    healthy_rank_steps = 0
    false_by_check = dict.fromkeys(CHECKS, 0)
    by_scaler: dict[str, dict[str, Any]] = {}
    nan_runs = {"trials": 0, "numerics_recorded": 0, "false_suspect_incidents": 0}
    nan_one = {"trials_without_scaler": 0, "named_by_grad_local": 0}
    errors = []
    for t in trials:
        r = results.get(t["id"])
        if r is None or "error" in r:
            errors.append({"id": t["id"], "error": (r or {}).get("error", "no result (harness failure)")})
            continue
        fault_step = t["step"] if t["kind"] != "healthy" else steps
        healthy_rank_steps += fault_step * world
        split = by_scaler.setdefault("with GradScaler" if t.get("scaler") else "no scaler",
                                     {"healthy_rank_steps": 0, "false_incidents": 0, "kinds": {}})
        split["healthy_rank_steps"] += fault_step * world
        for inc in r["incidents"]:
            if inc["step"] < fault_step:
                false_by_check[inc["check"]] += 1
                split["false_incidents"] += 1
        after = [i for i in r["incidents"] if i["step"] >= fault_step]
        if t["kind"] == NAN_KIND:
            nan_runs["trials"] += 1
            nan_runs["numerics_recorded"] += int(any(i["verdict"] == "numerics" and i["step"] == fault_step
                                                     for i in after))
            nan_runs["false_suspect_incidents"] += sum(1 for i in after if i["suspects"])
        if t["kind"] == NAN_ONE and not t.get("scaler"):  # with a scaler, a NaN on one rank is an expected overflow
            nan_one["trials_without_scaler"] += 1
            nan_one["named_by_grad_local"] += int(any(i["check"] == "grad_local" and i["suspects"] == [t["rank"]]
                                                      and i["step"] == fault_step for i in after))
        if t["kind"] == "healthy":
            continue
        cls = classify(t, r, replay_every)
        k = split["kinds"].setdefault(t["kind"], {"injected": 0, "detected": 0, "right": 0})
        k["injected"] += 1
        k["detected"] += int(bool(after))
        first_step = min((i["step"] for i in after), default=None)
        k["right"] += int(any(i["suspects"] == [t["rank"]] for i in after if i["step"] == first_step))
        row = rows.setdefault((t["kind"], cls), {"injected": 0, "fired": 0, "detected": 0, "right": 0,
                                                  "ambiguous": 0, "latency": [],
                                                  "first_by_check": dict.fromkeys(CHECKS, 0),
                                                  "by_check": dict.fromkeys(CHECKS, 0)})
        row["injected"] += 1
        row["fired"] += int(r["fired"]) if t["kind"] not in (NAN_KIND, NAN_ONE) else 1  # a bad batch always "fires"
        for c in {i["check"] for i in after}:
            row["by_check"][c] += 1
        if not after:
            continue
        first_step = min(i["step"] for i in after)
        first = [i for i in after if i["step"] == first_step]
        row["detected"] += 1
        row["latency"].append(first_step - fault_step)
        for c in {i["check"] for i in first}:
            row["first_by_check"][c] += 1
        # right: the first verdict names the faulty rank alone; ambiguous: it names it among others
        if any(i["suspects"] == [t["rank"]] for i in first):
            row["right"] += 1
        elif any(t["rank"] in i["suspects"] for i in first):
            row["ambiguous"] += 1
    table_rows = []
    for (kind, cls), row in sorted(rows.items()):
        lat = row["latency"]
        table_rows.append({"kind": kind, "class": cls, **{k: v for k, v in row.items() if k != "latency"},
                           "latency_median": median(lat) if lat else None, "latency_max": max(lat) if lat else None,
                           "latencies": lat})
    per_1000 = {c: 1000 * n / healthy_rank_steps if healthy_rank_steps else None for c, n in false_by_check.items()}
    upper = {c: 1000 * poisson_upper(n, healthy_rank_steps) for c, n in false_by_check.items()}
    return {"rows": table_rows, "healthy_rank_steps": healthy_rank_steps, "false_incidents": false_by_check,
            "false_incidents_per_1000_rank_steps": per_1000,
            "false_incidents_per_1000_upper95": upper,
            "false_incidents_total_per_1000": 1000 * sum(false_by_check.values()) / max(healthy_rank_steps, 1),
            "by_scaler": by_scaler, "nan_every_rank": nan_runs, "nan_one_rank": nan_one, "errors": errors}


def _detected(k: dict[str, int] | None, kind: str) -> str:
    if not k:
        return "-"
    return f"{k['detected']}/{k['injected']} / {'n/a' if kind == NAN_KIND else k['right']}"


def _false_rate(split: dict[str, Any]) -> str:
    n, exposure = split["false_incidents"], split["healthy_rank_steps"]
    return f"{1000 * n / max(exposure, 1):.3g} ({n} in {exposure})"


def poisson_upper(k: int, exposure: float, confidence: float = 0.95) -> float:
    """One-sided upper confidence bound on a Poisson rate after ``k`` events in ``exposure`` (3/n when k = 0)."""
    if exposure <= 0:
        return math.nan

    def cdf(lam: float) -> float:
        term = total = math.exp(-lam)
        for i in range(1, k + 1):
            term *= lam / i
            total += term
        return total

    lo, hi = float(k), float(k) + 10.0 + 10.0 * math.sqrt(k + 1)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) > 1 - confidence else (lo, mid)
    return hi / exposure


# -- driver ---------------------------------------------------------------------------------------------------------


def run(trials: int = 240, seed: int = 0, world: int | None = None, steps: int = 10, replay_every: int = 3,
        per_spawn: int = 30, timeout: float = 300.0, out_dir: str | Path | None = None, quiet: bool = False,
        layout: str = "ddp") -> dict[str, Any]:
    """Run the campaign, print the tables, write ``campaign.json`` (``campaign_hsdp.json`` for HSDP); return the
    payload. ``world`` defaults to 3 ranks for DDP and 6 (3 replicas x 2 shards) for HSDP."""
    say = (lambda *_a: None) if quiet else print
    kinds = kinds_of(layout)
    world = world or (3 if layout == "ddp" else HSDP_MESH[0] * HSDP_MESH[1])
    if (warn := load_warning()) is not None:
        say(warn)
    t0 = time.perf_counter()
    planned = plan(trials, seed, world, steps, layout)
    results: dict[int, dict[str, Any]] = {}
    for start in range(0, len(planned), per_spawn):
        chunk = planned[start:start + per_spawn]
        try:
            per_rank = spawn_ranks(_group, world, args=(chunk, steps, replay_every, layout), timeout=timeout)
        except RankFailed as e:  # a hung or crashed group is reported, and the campaign goes on
            for t in chunk:
                results[t["id"]] = {"id": t["id"], "error": f"RankFailed: {str(e)[:2000]}"}
            continue
        for i, t in enumerate(chunk):
            merged = dict(per_rank[0][i])  # verdicts are collective: rank 0's list is every rank's list
            if "error" not in merged:
                merged["fired"] = any(per_rank[r][i].get("fired") for r in range(world))
            results[t["id"]] = merged
    wall = time.perf_counter() - t0
    s = score(planned, results, steps, world, replay_every)

    rows = []
    for r in s["rows"]:
        det = r["detected"]
        right = "n/a" if r["kind"] == NAN_KIND else f"{r['right']}/{det}" if det else "-"
        rows.append([r["kind"], r["class"], r["injected"], r["fired"], f"{det}/{r['injected']}", right, r["ambiguous"],
                     "-" if r["latency_median"] is None else f"{r['latency_median']:g} / {r['latency_max']}",
                     *[f"{r['first_by_check'][c]} / {r['by_check'][c]}" for c in CHECKS]])
    say(table(["fault", "class", "injected", "fired", "detected", "right rank alone", "ambiguous incl. right",
               "latency steps (median / max)", *[f"{c}: first / any" for c in CHECKS]], rows,
              title=f"Fault-injection campaign: {trials} trials, seed {seed}, {world} ranks{_layout(layout, world)}, "
                    f"{steps} steps each, weights_every=1, replay_every={replay_every}"))
    say()
    say(table(["check", "false incidents", "healthy rank-steps", "per 1,000 rank-steps", "95% upper bound"],
              [[c, s["false_incidents"][c], s["healthy_rank_steps"],
                s["false_incidents_per_1000_rank_steps"][c] or 0.0, s["false_incidents_per_1000_upper95"][c]]
               for c in CHECKS],
              title="False incidents (healthy runs and the steps before each fault)"))
    say()
    splits = sorted(s["by_scaler"])
    say(table(["fault", *[f"{x}: detected / right rank alone" for x in splits]],
              [[kind, *[_detected(s["by_scaler"][x]["kinds"].get(kind), kind) for x in splits]]
               for kind in kinds if kind != "healthy"]
              + [["false incidents per 1,000 healthy rank-steps",
                  *[_false_rate(s["by_scaler"][x]) for x in splits]]],
              title="Without and with a GradScaler (all classes of each kind)"))
    say()
    nan = s["nan_every_rank"]
    say(f"target: a NaN in every rank's batch names no suspect: {nan['false_suspect_incidents']} incidents naming a "
        f"suspect in {nan['trials']} trials ({nan['numerics_recorded']} recorded as numerics at the NaN step) -> "
        f"{'met' if nan['false_suspect_incidents'] == 0 else 'MISSED'}")
    if layout == "hsdp":
        one = s["nan_one_rank"]
        n_one = one["trials_without_scaler"]
        verdict = "n/a (no such trial)" if not n_one else "met" if one["named_by_grad_local"] == n_one else "MISSED"
        say(f"target: a NaN in one rank's batch (no GradScaler) is named by grad_local alone at the NaN step: "
            f"{one['named_by_grad_local']}/{n_one} -> {verdict}")
        for kind, why in HSDP_SKIPPED.items():
            say(f"not run on HSDP: {kind} ({why})")
    say()
    if s["errors"]:
        say(f"{len(s['errors'])} trials failed to run: {s['errors'][:3]}")
    if layout == "ddp":
        del s["nan_one_rank"]  # no such kind on DDP
    payload = {"trials": trials, "seed": seed, "world": world, "steps": steps, "replay_every": replay_every,
               "wall_s": wall, **s, "plan": planned, "results": [results.get(t["id"]) for t in planned]}
    if layout == "hsdp":
        payload.update(layout="hsdp", mesh=[world // HSDP_MESH[1], HSDP_MESH[1]], skipped=HSDP_SKIPPED)
    path = write_json("campaign" if layout == "ddp" else "campaign_hsdp", payload, out_dir)
    say(f"wrote {path} ({wall:.0f} s)")
    return payload


def _layout(layout: str, world: int) -> str:
    return "" if layout == "ddp" else f" (HSDP: {world // HSDP_MESH[1]} replicas x {HSDP_MESH[1]} shards, fully_shard)"


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a handful of short trials: checks that it runs")
    p.add_argument("--layout", choices=LAYOUTS, default="ddp",
                   help="ddp: 3 ranks, DistributedDataParallel; hsdp: 6 ranks, fully_shard on a (3, 2) mesh")
    p.add_argument("--trials", type=int, default=240)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--replay-every", type=int, default=3)
    p.add_argument("--per-spawn", type=int, default=30, help="trials per spawn of the ranks")
    p.add_argument("--out-dir", help="where campaign.json goes (default benchmarks/results)")
    a = p.parse_args(argv)
    if a.quick:
        n = len(kinds_of(a.layout))
        run(trials=n, seed=a.seed, steps=5, replay_every=2, per_spawn=n, out_dir=a.out_dir, layout=a.layout)
    else:
        run(trials=a.trials, seed=a.seed, steps=a.steps, replay_every=a.replay_every, per_spawn=a.per_spawn,
            out_dir=a.out_dir, layout=a.layout)


if __name__ == "__main__":
    main()
