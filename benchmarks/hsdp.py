"""Step-time overhead of the checks on HSDP: fully_shard on a (3 replicas, 2 shards) mesh of 6 gloo CPU ranks.

    python benchmarks/hsdp.py            # a small GPT, 6 interleaved rounds (~3 minutes on 2 cores)
    python benchmarks/hsdp.py --quick    # tiny model, two short rounds (the smoke test)

Configurations, each its own copy of the same model (same seed, own optimizer; the monitor wraps a model's
reduce-scatter, so copies cannot be shared): the FSDP2 model unmonitored (the baseline); gradient checks + weights
every step; + replay every 10. After warm-up, the configurations take turns one segment of ``segment`` steps at a
time (A B C, then C B A, ...), ``rounds`` times. Reported per configuration: the median over rounds of (segment
median step / baseline segment median step of the same round), with the interquartile range. Every monitored check
must pass: the results the monitor reports are counted.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GPT, iqr, lm_loss, load_warning, median, param_count, table, token_batches, write_json

import sdc_telemetry as sdc
from sdc_telemetry.testing import spawn_ranks

MODEL = {"vocab": 2048, "dim": 192, "layers": 3, "heads": 3, "seq": 32}
QUICK_MODEL = {"vocab": 128, "dim": 32, "layers": 1, "heads": 2, "seq": 8}
CONFIGS: list[tuple[str, dict[str, Any] | None]] = [
    ("FSDP2 HSDP, no monitor", None),
    ("grad + weights/1", {"weights_every": 1, "replay_every": 0}),
    ("grad + weights/1 + replay/10", {"weights_every": 1, "replay_every": 10}),
]


class _Tally(sdc.Observer):
    def __init__(self) -> None:
        self.results: dict[str, int] = {}

    def report(self, report: sdc.StepReport) -> None:
        for check, result in report.results.items():
            key = f"{check}:{result}"
            self.results[key] = self.results.get(key, 0) + 1


class _Copy:
    def __init__(self, spec: dict[str, Any], fields: dict[str, Any] | None, mesh: Any) -> None:
        torch.manual_seed(0)
        self.model = GPT(**spec["model"])
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.tally = _Tally()
        self.monitor = None if fields is None else sdc.SDCMonitor(
            self.model, self.opt, loss_fn=lm_loss, observer=self.tally,
            config=sdc.SDCConfig(metrics_port=None, nvml=False, **fields))

    def train(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        start = time.perf_counter()
        if self.monitor is not None:
            with self.monitor.step(batch) as st:
                st.backward(lm_loss(self.model, batch))
        else:
            lm_loss(self.model, batch).backward()
        self.opt.step()
        self.opt.zero_grad()
        return time.perf_counter() - start


def _rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    torch.set_flush_denormal(True)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    copies = [_Copy(spec, fields, mesh) for _, fields in CONFIGS]
    m = spec["model"]
    batches = token_batches(spec["steps"], spec["batch"], m["seq"], m["vocab"], seed=100 + rank)
    it = iter(batches)
    for c in copies:
        for _ in range(spec["warmup"]):
            c.train(next(it))
    rounds = []
    for r in range(spec["rounds"]):
        order = list(range(len(copies)))[:: 1 if r % 2 == 0 else -1]
        seg: dict[int, float] = {}
        for i in order:
            dist.barrier()
            seg[i] = median([copies[i].train(next(it)) for _ in range(spec["segment"])])
        rounds.append([seg[i] for i in range(len(copies))])
    for c in copies:
        if c.monitor is not None:
            assert not c.monitor.incidents, c.monitor.incidents
            c.monitor.close()
    return {"rounds": rounds, "results": [c.tally.results for c in copies],
            "params": param_count(copies[0].model) * 2 // world}


def run(model: dict[str, int] | None = None, rounds: int = 6, segment: int = 10, warmup: int = 3, batch: int = 4,
        world: int = 6, out_dir: str | None = None, say: Any = print) -> dict[str, Any]:
    model = model or MODEL
    spec = {"model": model, "rounds": rounds, "segment": segment, "warmup": warmup, "batch": batch,
            "steps": warmup * len(CONFIGS) + rounds * segment * len(CONFIGS)}
    if (warning := load_warning()) is not None:
        say(warning)
    results = spawn_ranks(_rank, world, args=(spec,), timeout=1800, pg_timeout=600)
    slowest = [max(r["rounds"][k][i] for r in results) for k in range(rounds) for i in range(len(CONFIGS))]
    per_round = [slowest[k * len(CONFIGS):(k + 1) * len(CONFIGS)] for k in range(rounds)]
    rows = []
    summary = {}
    for i, (label, _) in enumerate(CONFIGS):
        ratios = [rnd[i] / rnd[0] for rnd in per_round]
        lo, hi = iqr(ratios)
        step_ms = median([rnd[i] for rnd in per_round]) * 1e3
        checks = ", ".join(f"{k} {v}" for k, v in sorted(results[0]["results"][i].items())) or "-"
        rows.append([label, f"{step_ms:.1f}", f"{median(ratios):.3f}", f"{lo:.3f}-{hi:.3f}", checks])
        summary[label] = {"step_ms": step_ms, "ratio": median(ratios), "iqr": [lo, hi],
                          "results": results[0]["results"][i]}
    say(table(["configuration", "step ms (slowest rank)", "ratio (median)", "IQR", "check results on rank 0"], rows,
              title=f"HSDP ({world // 2} replicas x 2 shards, {world} gloo ranks), GPT {model}, "
                    f"{rounds} rounds of {segment}-step segments"))
    payload = {"model": model, "world": world, "summary": summary}
    path = write_json("hsdp", payload, out_dir)
    say(f"wrote {path}")
    return payload


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, two short rounds (smoke test)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--segment", type=int, default=10)
    p.add_argument("--out-dir", default=None, help="directory for the JSON result (default: benchmarks/results)")
    args = p.parse_args(argv)
    if args.quick:
        run(QUICK_MODEL, rounds=2, segment=3, warmup=1, out_dir=args.out_dir)
    else:
        run(rounds=args.rounds, segment=args.segment, out_dir=args.out_dir)


if __name__ == "__main__":
    main()
