"""Step-time overhead of the checks on multi-rank CPU DDP (gloo) training of a small GPT.

    python benchmarks/overhead.py            # 2 ranks, ~10M-parameter GPT, 4 interleaved rounds (~3 minutes)
    python benchmarks/overhead.py --quick    # tiny model, one short round (the smoke test)

Configurations, run interleaved in the same process group (A B C D E, then E D C B A, ...):
no monitor; gradient checks only; gradient checks + weights every step; + replay every 50; + replay every 10.
Each segment wraps the same module in a fresh DDP (a DDP instance takes one comm hook, and the monitor installs its
own), builds the monitor, runs ``warmup`` untimed steps and ``steps`` timed ones, then closes the monitor. Every
segment holds the same number of replay audits (``steps`` is a multiple of every replay period).

Reported: step time of each configuration as a ratio to the baseline segment of the same round, median and
interquartile range over rounds; the cost of one replay audit in baseline steps (audit step minus the median
non-audit step of the same segment). Targets: gradient checks + weights every step <= 1.01x the baseline; replay every
N adds at most 1.1/N of a step (one audit costs <= 1.1 steps).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GPT, iqr, lm_loss, load_warning, median, param_count, table, token_batches, write_json

import sdc_telemetry as sdc
from sdc_telemetry.testing import spawn_ranks

TARGET_WEIGHTS = 1.01
TARGET_AUDIT_STEPS = 1.1

MODEL = {"vocab": 8192, "dim": 384, "layers": 4, "heads": 6, "seq": 64}
QUICK_MODEL = {"vocab": 128, "dim": 32, "layers": 1, "heads": 2, "seq": 8}


def configurations(replay_every: Sequence[int]) -> list[tuple[str, dict[str, Any] | None]]:
    """(label, SDCConfig fields or None for no monitor), in interleaving order."""
    out: list[tuple[str, dict[str, Any] | None]] = [
        ("no monitor", None),
        ("grad checks", {"weights_every": 0, "replay_every": 0}),
        ("grad + weights/1", {"weights_every": 1, "replay_every": 0}),
    ]
    out += [(f"grad + weights/1 + replay/{n}", {"weights_every": 1, "replay_every": n}) for n in replay_every]
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _segment(module: torch.nn.Module, optimizer: torch.optim.Optimizer, fields: dict[str, Any] | None,
             batches: list[tuple[torch.Tensor, torch.Tensor]], warmup: int, device: torch.device
             ) -> tuple[list[float], int]:
    """Per-step seconds of the timed steps of one configuration, and the incidents seen (0 when healthy)."""
    ddp = DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
    monitor = None
    if fields is not None:
        monitor = sdc.SDCMonitor(ddp, optimizer, loss_fn=lm_loss,
                                 config=sdc.SDCConfig(metrics_port=None, nvml=False, **fields))
    times: list[float] = []
    dist.barrier()
    for i, batch in enumerate(batches):
        if i == warmup:
            _sync(device)
            dist.barrier()
        start = time.perf_counter()
        if monitor is not None:
            with monitor.step(batch) as step:
                step.backward(lm_loss(ddp, batch))
        else:
            lm_loss(ddp, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    incidents = 0
    if monitor is not None:
        incidents = len(monitor.incidents)
        monitor.close()
    # Drop the wrapper before the next one: a live DDP reducer keeps its autograd hooks on the module's parameters.
    del monitor, ddp
    gc.collect()
    return times, incidents


def _rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    device = torch.device(spec["device"])
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    module = GPT(**spec["model"]).to(device)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    batches = [(x.to(device), y.to(device)) for x, y in
               token_batches(spec["warmup"] + spec["steps"], spec["batch"], spec["model"]["seq"],
                             spec["model"]["vocab"], seed=1000 + rank)]
    configs = configurations(spec["replay_every"])
    rounds: list[dict[str, Any]] = []
    for r in range(spec["rounds"]):
        order = configs if r % 2 == 0 else configs[::-1]
        seg: dict[str, Any] = {}
        for label, fields in order:
            times, incidents = _segment(module, optimizer, fields, batches, spec["warmup"], device)
            seg[label] = {"step_s": times, "incidents": incidents}
        rounds.append(seg)
    parts = _component_costs(module, optimizer, batches[0], device) if rank == 0 else {}
    return {"rounds": rounds, "params": param_count(module), "components_ms": parts}


def _component_costs(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> dict[str, float]:
    """Single-rank costs of the passes the checks add, next to the step's own parts (milliseconds, median of 5)."""
    params = [p for p in module.parameters() if p.requires_grad]

    def ms(fn: Any) -> float:
        fn()
        _sync(device)
        out = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            out.append((time.perf_counter() - t0) * 1e3)
        return median(out)

    def fwd_bwd() -> None:
        optimizer.zero_grad(set_to_none=True)
        lm_loss(module, batch).backward()

    parts = {"forward+backward (one rank, no DDP)": ms(fwd_bwd)}
    grads = [p.grad for p in params if p.grad is not None]
    parts["fingerprint(params) (weights check)"] = ms(lambda: sdc.fingerprint(params))
    parts["fingerprint(grads) (comm hook)"] = ms(lambda: sdc.fingerprint(grads))
    parts["_foreach_norm(grads) (comm hook, reduced norms)"] = ms(lambda: torch._foreach_norm(grads))
    parts["torch.sum per grad (one read, reference)"] = ms(lambda: [g.sum() for g in grads])
    parts["AdamW step"] = ms(optimizer.step)
    return parts


def summarise(rounds: list[dict[str, Any]], replay_every: Sequence[int], warmup: int) -> dict[str, Any]:
    """Ratios to the baseline per round, their median and IQR, and the cost of one replay audit."""
    labels = [label for label, _ in configurations(replay_every)]
    base = labels[0]
    weights_label = labels[2]
    per_config: dict[str, Any] = {}
    for label in labels:
        ratios = [sum(r[label]["step_s"]) / sum(r[base]["step_s"]) for r in rounds]
        means = [sum(r[label]["step_s"]) / len(r[label]["step_s"]) for r in rounds]
        q1, q3 = iqr(ratios)
        per_config[label] = {"ratio_median": median(ratios), "ratio_q1": q1, "ratio_q3": q3, "ratios": ratios,
                             "step_ms_median": 1e3 * median(means),
                             "incidents": sum(r[label]["incidents"] for r in rounds)}
    replay: dict[str, Any] = {}
    for n in replay_every:
        label = f"grad + weights/1 + replay/{n}"
        audit_costs: list[float] = []
        added: list[float] = []
        for r in rounds:
            steps = r[label]["step_s"]
            base_step = median(r[base]["step_s"])
            audit = [t for i, t in enumerate(steps) if (warmup + i) % n == 0]
            plain = [t for i, t in enumerate(steps) if (warmup + i) % n != 0]
            audit_costs += [(t - median(plain)) / base_step for t in audit] if plain else []
            mean = sum(steps) / len(steps)
            mean_w = sum(r[weights_label]["step_s"]) / len(r[weights_label]["step_s"])
            added.append((mean - mean_w) / (sum(r[base]["step_s"]) / len(r[base]["step_s"])))
        q1, q3 = iqr(audit_costs)
        replay[str(n)] = {"audit_cost_steps_median": median(audit_costs), "audit_cost_q1": q1, "audit_cost_q3": q3,
                          "audits": len(audit_costs), "added_fraction_median": median(added),
                          "added_fraction_iqr": list(iqr(added)), "target_added_fraction": TARGET_AUDIT_STEPS / n,
                          "met": median(audit_costs) <= TARGET_AUDIT_STEPS}
    w = per_config[weights_label]
    return {"configs": per_config, "replay": replay,
            "targets": {"weights_ratio": w["ratio_median"], "weights_target": TARGET_WEIGHTS,
                        "weights_met": w["ratio_median"] <= TARGET_WEIGHTS,
                        "replay_met": all(v["met"] for v in replay.values())}}


def run(world: int = 2, model: dict[str, int] | None = None, batch: int = 4, steps: int = 50, warmup: int = 3,
        rounds: int = 4, replay_every: Sequence[int] = (50, 10), device: str = "cpu", timeout: float = 1500.0,
        out_dir: str | Path | None = None, quiet: bool = False) -> dict[str, Any]:
    """Run the interleaved measurement on ``world`` gloo ranks, print the table, write ``overhead.json``."""
    bad = [n for n in replay_every if n <= 0 or steps % n]
    if bad:
        raise ValueError(f"steps={steps} must be a multiple of every replay period, not of {bad}")
    spec = {"model": dict(model or MODEL), "batch": batch, "steps": steps, "warmup": warmup, "rounds": rounds,
            "replay_every": list(replay_every), "device": device}
    say = (lambda *_a: None) if quiet else print
    if (warn := load_warning()) is not None:
        say(warn)
    t0 = time.perf_counter()
    results = spawn_ranks(_rank, world, args=(spec,), timeout=timeout)
    wall = time.perf_counter() - t0
    summary = summarise(results[0]["rounds"], replay_every, warmup)
    base_ms = summary["configs"]["no monitor"]["step_ms_median"]
    m = spec["model"]
    desc = (f"{world} ranks (gloo, {device}, 1 thread each), GPT {results[0]['params'] / 1e6:.1f}M params "
            f"(dim {m['dim']}, {m['layers']} layers, vocab {m['vocab']}), batch {batch}x{m['seq']} tokens per rank, "
            f"{rounds} rounds x {steps} timed steps per configuration")
    rows = []
    for label, c in summary["configs"].items():
        rows.append([label, c["step_ms_median"], c["ratio_median"], f"{c['ratio_q1']:.3f}-{c['ratio_q3']:.3f}",
                     c["incidents"]])
    say(table(["configuration", "step ms (median)", "ratio to baseline (median)", "IQR", "incidents"], rows,
              title="Step-time overhead: " + desc))
    say()
    say(table(["replay every", "audit cost in steps (median)", "IQR", "audits", "added per step (segments)",
               "target added per step", "met"],
              [[n, v["audit_cost_steps_median"], f"{v['audit_cost_q1']:.2f}-{v['audit_cost_q3']:.2f}", v["audits"],
                v["added_fraction_median"], v["target_added_fraction"], "yes" if v["met"] else "NO"]
               for n, v in summary["replay"].items()], title="Replay cost"))
    say()
    comp = results[0]["components_ms"]
    say(table(["pass (rank 0, single process)", "ms", "fraction of baseline step"],
              [[k, v, v / base_ms] for k, v in comp.items()], title="Where the time goes"))
    say()
    t = summary["targets"]
    say(f"target: grad + weights every step <= {TARGET_WEIGHTS}x baseline: {t['weights_ratio']:.3f}x -> "
        f"{'met' if t['weights_met'] else 'MISSED'}")
    for n, v in summary["replay"].items():
        cost = v["audit_cost_steps_median"]
        say(f"target: replay every {n} adds <= {TARGET_AUDIT_STEPS}/{n} = {v['target_added_fraction']:.3f} of a "
            f"step: one audit costs {cost:.2f} steps -> {cost / int(n):.4f} per step -> "
            f"{'met' if v['met'] else 'MISSED'}")
    payload = {"spec": spec, "world": world, "params": results[0]["params"], "wall_s": wall, **summary,
               "components_ms": comp, "rounds": results[0]["rounds"]}
    path = write_json("overhead", payload, out_dir)
    say(f"wrote {path} ({wall:.0f} s)")
    return payload


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, one short round: checks that it runs")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=50, help="timed steps per segment (a multiple of 50 and 10)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (ranks share the GPUs round-robin; gloo)")
    p.add_argument("--out-dir", help="where overhead.json goes (default benchmarks/results)")
    a = p.parse_args(argv)
    if a.quick:
        run(world=2, model=QUICK_MODEL, batch=2, steps=4, warmup=1, rounds=2, replay_every=(4, 2), device=a.device,
            out_dir=a.out_dir)
    else:
        run(world=a.world, batch=a.batch, steps=a.steps, rounds=a.rounds, device=a.device, out_dir=a.out_dir)


if __name__ == "__main__":
    main()
