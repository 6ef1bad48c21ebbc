"""Seeded fault-injection campaign: which check catches which fault, on the right rank, how fast, and false alarms.

    python benchmarks/campaign.py                 # 240 trials on 3 gloo ranks (~2 minutes)
    python benchmarks/campaign.py --seed 7 --trials 600
    python benchmarks/campaign.py --quick         # a handful of trials (the smoke test)

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
from sdc_telemetry.faults import FaultInjector
from sdc_telemetry.testing import RankFailed, spawn_ranks

CHECKS = ("grad_local", "grad_reduced", "replay", "weights")
KINDS = ("healthy", "weight_bitflip", "nonfinite_grad", "reduced_grad", "compute_persistent", "compute_transient",
         "row_swap", "nan_every_rank")
NAN_KIND = "nan_every_rank"  # not a hardware fault: every rank sees the same NaN
TINY_GPT = {"vocab": 64, "dim": 32, "layers": 2, "heads": 2, "seq": 16, "dropout": 0.1}


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


def batches(model: str, steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if model == "gpt":
        return token_batches(steps, 4, TINY_GPT["seq"], TINY_GPT["vocab"], seed)
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)) for _ in range(steps)]


def loss_fn(model: str) -> Any:
    return lm_loss if model == "gpt" else cls_loss


def _targets(model: str) -> tuple[list[tuple[str, int, int]], list[str]]:
    """(parameter name, numel, rows) and perturbable module names of ``model``, as every rank sees them."""
    m = build(model, 0)
    params = [(n, p.numel(), p.shape[0] if p.dim() else 0) for n, p in m.named_parameters()]
    modules = [n for n, sub in m.named_modules() if n and isinstance(sub, (nn.Linear, nn.LayerNorm, nn.Embedding))]
    return params, modules


# -- plan -----------------------------------------------------------------------------------------------------------


def plan(trials: int, seed: int, world: int, steps: int) -> list[dict[str, Any]]:
    """The campaign: kinds stratified (each kind equally often, in random order), a GradScaler on every third trial
    of each kind, every other choice drawn at random."""
    rng = random.Random(seed)
    # i % 3 and i % len(KINDS) cycle independently: every kind gets the scaler on a third of its trials
    kinds = [(KINDS[i % len(KINDS)], i % 3 == 2) for i in range(trials)]
    rng.shuffle(kinds)
    targets = {m: _targets(m) for m in ("gpt", "mlp")}
    out = []
    for i, (kind, scaler) in enumerate(kinds):
        model = rng.choice(("gpt", "mlp"))
        if kind == NAN_KIND:
            model = "mlp"  # the GPT's inputs are token ids: a NaN goes into the MLP's float inputs
        params, modules = targets[model]
        t: dict[str, Any] = {"id": i, "kind": kind, "model": model, "scaler": scaler, "seed": rng.randrange(2**31),
                             "rank": rng.randrange(world), "step": rng.randrange(max(1, steps - 3))}
        if kind == "healthy":
            t["rank"], t["step"] = None, None
        elif kind == NAN_KIND:
            t["rank"] = None
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


def _digest(module: nn.Module) -> str:
    h = hashlib.sha1()
    for p in module.parameters():
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _trial(t: dict[str, Any], steps: int, replay_every: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    module = build(t["model"], t["seed"])
    ddp = DistributedDataParallel(module)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    inj = FaultInjector(ddp, opt)
    kind = t["kind"]
    if kind == "weight_bitflip":
        inj.flip_weight_bit(rank=t["rank"], step=t["step"], param=t["param"], index=t["index"], bit=t["bit"])
    elif kind == "row_swap":
        inj.swap_rows(rank=t["rank"], step=t["step"], param=t["param"], rows=(t["rows"][0], t["rows"][1]))
    elif kind == "nonfinite_grad":
        inj.nonfinite_grad(rank=t["rank"], step=t["step"], param=t["param"], index=t["index"],
                           value=float(t["value"]))
    elif kind == "reduced_grad":
        inj.corrupt_reduced_grad(rank=t["rank"], step=t["step"], index=t["index"], value=float(t["value"]))
    elif kind in ("compute_persistent", "compute_transient"):
        inj.perturb_output(rank=t["rank"], step=t["step"], module=t["module"], relative=t["relative"],
                           transient=kind == "compute_transient")
    fn = loss_fn(t["model"])
    monitor = sdc.SDCMonitor(ddp, opt, loss_fn=fn, comm_hook=inj.comm_hook, comm_state=None,
                             config=sdc.SDCConfig(weights_every=1, replay_every=replay_every, on_suspect="record",
                                                  metrics_port=None, nvml=False),
                             observer=sdc.Observer())
    # Ground truth beside the monitor: the flipped element on every rank, and whether the replicas' weights differ.
    step = 0
    truth: dict[str, Any] = {"diverged_steps": [], "flip": None, "flip_absorbed": None}
    elem = None
    if kind == "weight_bitflip":
        elem = dict(module.named_parameters())[t["param"]].detach().view(-1)

        def after_flip(*_: Any) -> None:
            if step == t["step"] and truth["flip"] is None and elem is not None:
                values: list[Any] = [None] * world
                dist.all_gather_object(values, float(elem[t["index"]]))
                truth["flip"] = {"faulty": values[t["rank"]],
                                 "healthy": values[(t["rank"] + 1) % world]}

        ddp.register_forward_pre_hook(after_flip)  # after the injector's own pre-hook: sees the flipped value

    def after_update() -> None:
        # Called by the loop, not an optimizer hook: a GradScaler skips optimizer.step() on overflow, and the truth
        # must still advance one step per training step.
        nonlocal step
        digests: list[Any] = [None] * world
        dist.all_gather_object(digests, _digest(module))
        if len(set(digests)) > 1:
            truth["diverged_steps"].append(step)
        if kind == "weight_bitflip" and step == t["step"] and elem is not None:
            bits: list[Any] = [None] * world
            dist.all_gather_object(bits, elem[t["index"]].view(1).view(torch.int32).item())
            truth["flip_absorbed"] = len(set(bits)) == 1
        step += 1

    scaler = torch.amp.GradScaler("cpu") if t.get("scaler") else None
    for batch in batches(t["model"], steps, seed=t["seed"] + 1 + rank):
        if kind == NAN_KIND and step == t["step"]:
            x, y = batch
            x = x.clone()
            x[0, 0] = math.nan  # the same NaN in every rank's batch: a bad sample, not a bad node
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
    return {"id": t["id"], "incidents": incidents, "fired": bool(inj.fired), **truth}


def _group(rank: int, world: int, trials: list[dict[str, Any]], steps: int, replay_every: int
           ) -> list[dict[str, Any]]:
    logging.getLogger("sdc_telemetry").setLevel(logging.CRITICAL)  # incidents are the point here: keep stderr quiet
    out = []
    for t in trials:
        try:
            out.append(_trial(t, steps, replay_every))
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
    return "effective" if kind != "healthy" else "healthy"


def score(trials: list[dict[str, Any]], results: dict[int, dict[str, Any]], steps: int, world: int,
          replay_every: int) -> dict[str, Any]:
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    healthy_rank_steps = 0
    false_by_check = dict.fromkeys(CHECKS, 0)
    by_scaler: dict[str, dict[str, Any]] = {}
    nan_runs = {"trials": 0, "numerics_recorded": 0, "false_suspect_incidents": 0}
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
        row["fired"] += int(r["fired"]) if t["kind"] != NAN_KIND else 1
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
            "by_scaler": by_scaler, "nan_every_rank": nan_runs, "errors": errors}


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


def run(trials: int = 240, seed: int = 0, world: int = 3, steps: int = 10, replay_every: int = 3,
        per_spawn: int = 30, timeout: float = 300.0, out_dir: str | Path | None = None, quiet: bool = False
        ) -> dict[str, Any]:
    """Run the campaign, print the tables, write ``campaign.json``; return the payload."""
    say = (lambda *_a: None) if quiet else print
    if (warn := load_warning()) is not None:
        say(warn)
    t0 = time.perf_counter()
    planned = plan(trials, seed, world, steps)
    results: dict[int, dict[str, Any]] = {}
    for start in range(0, len(planned), per_spawn):
        chunk = planned[start:start + per_spawn]
        try:
            per_rank = spawn_ranks(_group, world, args=(chunk, steps, replay_every), timeout=timeout)
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
              title=f"Fault-injection campaign: {trials} trials, seed {seed}, {world} ranks, {steps} steps each, "
                    f"weights_every=1, replay_every={replay_every}"))
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
               for kind in KINDS if kind != "healthy"]
              + [["false incidents per 1,000 healthy rank-steps",
                  *[_false_rate(s["by_scaler"][x]) for x in splits]]],
              title="Without and with a GradScaler (all classes of each kind)"))
    say()
    nan = s["nan_every_rank"]
    say(f"target: a NaN in every rank's batch names no suspect: {nan['false_suspect_incidents']} incidents naming a "
        f"suspect in {nan['trials']} trials ({nan['numerics_recorded']} recorded as numerics at the NaN step) -> "
        f"{'met' if nan['false_suspect_incidents'] == 0 else 'MISSED'}")
    say()
    if s["errors"]:
        say(f"{len(s['errors'])} trials failed to run: {s['errors'][:3]}")
    payload = {"trials": trials, "seed": seed, "world": world, "steps": steps, "replay_every": replay_every,
               "wall_s": wall, **s, "plan": planned, "results": [results.get(t["id"]) for t in planned]}
    path = write_json("campaign", payload, out_dir)
    say(f"wrote {path} ({wall:.0f} s)")
    return payload


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a handful of short trials: checks that it runs")
    p.add_argument("--trials", type=int, default=240)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--replay-every", type=int, default=3)
    p.add_argument("--per-spawn", type=int, default=30, help="trials per spawn of the ranks")
    p.add_argument("--out-dir", help="where campaign.json goes (default benchmarks/results)")
    a = p.parse_args(argv)
    if a.quick:
        run(trials=len(KINDS), seed=a.seed, steps=5, replay_every=2, per_spawn=len(KINDS), out_dir=a.out_dir)
    else:
        run(trials=a.trials, seed=a.seed, steps=a.steps, replay_every=a.replay_every, per_spawn=a.per_spawn,
            out_dir=a.out_dir)


if __name__ == "__main__":
    main()
