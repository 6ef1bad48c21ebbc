"""Cost of one replay audit on a nanoGPT-style step: gradient accumulation under ``no_sync()``, dropout, 2 gloo ranks.

    python benchmarks/audit.py            # the GPT of overhead.py, 4 micro-batches per step (~2 minutes)
    python benchmarks/audit.py --quick    # tiny model (the smoke test)

Each step accumulates ``micro`` micro-batches (all but the last under ``ddp.no_sync()``, loss scaled by 1/micro, as
nanoGPT does) and registers each with ``step.micro_batch()``, so that an audit ships and recomputes all of them. Two
copies of the same model (same seed, own optimizer and DDP wrapper) take turns one segment at a time, ``rounds``
times: no monitor (the baseline), and ``SDCConfig(weights_every=1, replay_every=N)``. The cost of one audit, in
baseline steps, is the audit step's time minus its segment's median non-audit step, over the baseline segment's
median step of the same round; the monitor's own timing of the replay (``StepReport.durations["replay"]``) is
reported beside it. Every audit must pass: a skipped or failed audit would measure nothing, so they are counted.
Target: one audit costs at most 1.1 baseline steps (the partner recomputes one step's forward and backward).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GPT, iqr, lm_loss, load_warning, median, param_count, table, token_batches, write_json

import sdc_telemetry as sdc
from sdc_telemetry.sinks.observer import StepReport
from sdc_telemetry.testing import spawn_ranks

TARGET_AUDIT_STEPS = 1.1
MODEL = {"vocab": 8192, "dim": 384, "layers": 4, "heads": 6, "seq": 64}  # overhead.py's GPT, dropout 0.1
QUICK_MODEL = {"vocab": 128, "dim": 32, "layers": 1, "heads": 2, "seq": 8}


class _Replays(sdc.Observer):
    """Counts the replay results and keeps the monitor's own replay durations (no metrics exporter)."""

    def __init__(self) -> None:
        self.results: dict[str, int] = {}
        self.seconds: list[float] = []

    def report(self, report: StepReport) -> None:
        if "replay" in report.results:
            result = report.results["replay"]
            self.results[result] = self.results.get(result, 0) + 1
            self.seconds.append(report.durations.get("replay", float("nan")))


class _Copy:
    def __init__(self, spec: dict[str, Any], monitored: bool) -> None:
        torch.manual_seed(0)
        self.module = GPT(**spec["model"])
        self.ddp = DistributedDataParallel(self.module)
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-4)
        self.replays = _Replays()
        self.monitor = sdc.SDCMonitor(
            self.ddp, self.opt, loss_fn=lm_loss, observer=self.replays,
            config=sdc.SDCConfig(weights_every=1, replay_every=spec["replay_every"], metrics_port=None, nvml=False),
        ) if monitored else None
        self.steps = 0

    def train(self, micro: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        start = time.perf_counter()
        n = len(micro)
        with self.monitor.step() if self.monitor is not None else nullcontext() as step:
            for i, mb in enumerate(micro):
                if step is not None:
                    step.micro_batch(mb)
                with nullcontext() if i == n - 1 else self.ddp.no_sync():
                    loss = lm_loss(self.ddp, mb)
                    if step is not None:
                        step.backward(loss, scale=1 / n)
                    else:
                        (loss / n).backward()  # type: ignore[no-untyped-call]
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1
        return time.perf_counter() - start


def _rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    torch.set_flush_denormal(True)  # see overhead.py: subnormal floats would slow x86 down step after step
    plain, monitored = _Copy(spec, False), _Copy(spec, True)
    m = spec["model"]
    steps = spec["warmup"] + spec["segment"] * spec["rounds"]
    flat = token_batches(steps * spec["micro"], spec["batch"], m["seq"], m["vocab"], seed=2000 + rank)
    batches = [flat[i * spec["micro"]:(i + 1) * spec["micro"]] for i in range(steps)]
    for copy in (plain, monitored):
        for b in batches[:spec["warmup"]]:
            copy.train(b)
    monitored.replays.results.clear()
    monitored.replays.seconds.clear()
    rounds = []
    for r in range(spec["rounds"]):
        seg: dict[str, Any] = {}
        for label, copy in (("plain", plain), ("monitored", monitored))[::1 if r % 2 == 0 else -1]:
            first = copy.steps
            dist.barrier()
            seg[label] = {"first_step": first,
                          "step_s": [copy.train(b) for b in batches[copy.steps:copy.steps + spec["segment"]]]}
        rounds.append(seg)
    assert monitored.monitor is not None
    incidents = len(monitored.monitor.incidents)
    monitored.monitor.close()
    return {"rounds": rounds, "replay_results": monitored.replays.results,
            "replay_seconds": monitored.replays.seconds, "incidents": incidents, "params": param_count(plain.module)}


def summarise(rounds: list[dict[str, Any]], replay_every: int, replay_seconds: Sequence[float]) -> dict[str, Any]:
    """Per-round audit costs in baseline steps, their median and IQR; the steady per-step ratio."""
    costs, steady, base = [], [], []
    for r in rounds:
        b = median(r["plain"]["step_s"])
        seg = r["monitored"]
        audit = [t for i, t in enumerate(seg["step_s"]) if (seg["first_step"] + i) % replay_every == 0]
        other = [t for i, t in enumerate(seg["step_s"]) if (seg["first_step"] + i) % replay_every]
        costs += [(t - median(other)) / b for t in audit]
        steady.append(median(other) / b)
        base.append(b)
    q1, q3 = iqr(costs)
    own = [s / median(base) for s in replay_seconds]
    cost = median(costs)
    return {"audits": len(costs), "audit_cost_steps_median": cost, "audit_cost_q1": q1, "audit_cost_q3": q3,
            "audit_costs": costs, "replay_duration_steps_median": median(own) if own else float("nan"),
            "steady_ratio_median": median(steady), "baseline_step_ms": 1e3 * median(base),
            "ratio_incl_audits": median(steady) + cost / replay_every, "met": cost <= TARGET_AUDIT_STEPS}


def run(model: dict[str, int] | None = None, micro: int = 4, batch: int = 4, replay_every: int = 5, segment: int = 10,
        rounds: int = 4, warmup: int = 2, world: int = 2, timeout: float = 900.0, out_dir: str | Path | None = None,
        quiet: bool = False) -> dict[str, Any]:
    """Run the interleaved measurement, print the table and the target line, write ``audit.json``."""
    if replay_every < 2 or (segment * rounds) % replay_every:
        raise ValueError(f"replay_every must be >= 2 (audit steps are compared with plain ones) and divide segment x "
                         f"rounds = {segment * rounds}, got {replay_every}")
    say = (lambda *_a: None) if quiet else print
    if (warn := load_warning()) is not None:
        say(warn)
    spec: dict[str, Any] = {"model": dict(model or MODEL), "micro": micro, "batch": batch, "replay_every": replay_every,
            "segment": segment, "rounds": rounds, "warmup": warmup}
    t0 = time.perf_counter()
    results = spawn_ranks(_rank, world, args=(spec,), timeout=timeout, pg_timeout=timeout)
    wall = time.perf_counter() - t0
    r0 = results[0]
    s = summarise(r0["rounds"], replay_every, r0["replay_seconds"])
    m = spec["model"]
    say(table(["baseline step ms", "audits", "replay results", "one audit, baseline steps (median)", "IQR",
               "monitor's replay time, steps", "non-audit step ratio", "ratio incl. audits", "incidents"],
              [[s["baseline_step_ms"], s["audits"], ", ".join(f"{k} {v}" for k, v in r0["replay_results"].items()),
                s["audit_cost_steps_median"], f"{s['audit_cost_q1']:.2f}-{s['audit_cost_q3']:.2f}",
                s["replay_duration_steps_median"], s["steady_ratio_median"], s["ratio_incl_audits"],
                r0["incidents"]]],
              title=f"Replay audit cost: {world} gloo ranks, GPT {r0['params'] / 1e6:.1f}M params (dim {m['dim']}, "
                    f"{m['layers']} layers, dropout 0.1), {micro} micro-batches of {batch}x{m['seq']} tokens under "
                    f"no_sync, weights every step, replay every {replay_every}; {rounds} rounds x {segment} steps"))
    say()
    say(f"target: one audit <= {TARGET_AUDIT_STEPS} baseline steps: {s['audit_cost_steps_median']:.2f} -> "
        f"{'met' if s['met'] else 'MISSED'}")
    payload = {"spec": spec, "world": world, "params": r0["params"], "wall_s": wall, **s,
               "replay_results": r0["replay_results"], "incidents": r0["incidents"], "rounds": r0["rounds"]}
    path = write_json("audit", payload, out_dir)
    say(f"wrote {path} ({wall:.0f} s)")
    return payload


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, two short rounds: checks that it runs")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--replay-every", type=int, default=5)
    p.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    p.add_argument("--out-dir", help="where audit.json goes (default benchmarks/results)")
    a = p.parse_args(argv)
    if a.quick:
        run(model=QUICK_MODEL, micro=2, batch=2, replay_every=2, segment=4, rounds=2, warmup=1, out_dir=a.out_dir)
    else:
        run(micro=a.micro, replay_every=a.replay_every, rounds=a.rounds, out_dir=a.out_dir)


if __name__ == "__main__":
    main()
