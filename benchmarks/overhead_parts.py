"""Where the healthy step's overhead goes: the gradient checks with parts of the DDP hook switched off (diagnostic).

    python benchmarks/overhead_parts.py            # 2 ranks, the 10M-parameter GPT of overhead.py, 10 rounds
    python benchmarks/overhead_parts.py --quick    # tiny model, two short rounds (the smoke test)

One monitored DDP model (``SDCConfig(weights_every=0, replay_every=0)``: the gradient checks) and one unmonitored copy
train in the same process group; segments of ``segment`` steps take turns as in ``overhead.py`` (A B C ..., then
backwards), and per round each variant's median step is divided by the unmonitored one's (wall time, and the CPU time
of the process, every thread: less disturbed by other work on the machine). The variants switch parts
of the monitor's comm hook off by patching them for the segment (the monitor object is the same):

- ``all on``: the gradient checks as shipped;
- ``reduced pass off``: S' and the reduced norms are not taken when a bucket's reduction returns (the checksum round is
  then not compared);
- ``local side off``: the local norms and chunk sums are not taken before each bucket's all-reduce (DDP's scaling
  still runs; the checksum then mismatches and the monitor records incidents: expected here);
- ``both off``: neither (what the hook, the status all-reduce and the per-step bookkeeping cost by themselves).

This is a diagnostic, not a target: the patched variants are not something a user can run. ``overhead.py`` measures
the shipped configurations.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import iqr, load_warning, median, table, token_batches, write_json
from overhead import MODEL, QUICK_MODEL, _Run

from sdc_telemetry.parallel import ddp
from sdc_telemetry.testing import spawn_ranks

VARIANTS = ("all on", "reduced pass off", "local side off", "both off")


@contextmanager
def switched_off(variant: str) -> Iterator[None]:
    """Patch the parts ``variant`` switches off for the duration of a segment."""
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    if variant in ("reduced pass off", "both off"):
        patch(ddp.ReduceChecksum, "reduced", lambda self, index, value, views=None: None)
    if variant in ("local side off", "both off"):
        patch(ddp, "_norms", lambda flat, ranges: [torch.zeros((), device=flat.device) for _ in ranges])
        patch(ddp, "_sums", lambda flat, c0, c1, *_: (torch.zeros(c1 - c0, dtype=torch.float64,
                                                                   device=flat.device),) * 2)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def _rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    torch.set_flush_denormal(True)  # as overhead.py: step times of the training, not of subnormal arithmetic
    device = torch.device("cpu")
    runs = {"none": _Run(spec, None, device), "grad": _Run(spec, {"weights_every": 0, "replay_every": 0}, device)}
    steps = spec["warmup"] + spec["segment"] * spec["rounds"] * len(VARIANTS)
    batches = token_batches(steps, spec["batch"], spec["model"]["seq"], spec["model"]["vocab"], seed=1000 + rank)

    def step(name: str) -> tuple[float, float]:
        """(wall seconds, CPU seconds of this process, every thread) of one step."""
        run = runs[name]
        return run.train(batches[run.step % len(batches)], device)

    for name in runs:
        for _ in range(spec["warmup"]):
            step(name)
    order: list[str] = ["baseline", *VARIANTS]
    ratios: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu_ratios: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(spec["rounds"]):
        wall: dict[str, float] = {}
        cpu: dict[str, float] = {}
        for label in (order if r % 2 == 0 else order[::-1]):
            dist.barrier()
            with switched_off(label) if label != "baseline" else nullcontext():
                times = [step("none" if label == "baseline" else "grad") for _ in range(spec["segment"])]
            wall[label], cpu[label] = median([w for w, _ in times]), median([c for _, c in times])
        for v in VARIANTS:
            ratios[v].append(wall[v] / wall["baseline"])
            cpu_ratios[v].append(cpu[v] / cpu["baseline"])
    monitor = runs["grad"].monitor
    assert monitor is not None
    monitor.close()
    return {"ratios": ratios, "cpu_ratios": cpu_ratios, "incidents": len(monitor.incidents)}


def run(world: int = 2, model: dict[str, int] | None = None, batch: int = 4, segment: int = 8, rounds: int = 10,
        warmup: int = 3, timeout: float = 1800.0, out_dir: str | Path | None = None,
        say: Callable[..., None] = print) -> dict[str, Any]:
    spec = {"model": dict(model or MODEL), "batch": batch, "segment": segment, "rounds": rounds, "warmup": warmup}
    if (warn := load_warning()) is not None:
        say(warn)
    t0 = time.perf_counter()
    results = spawn_ranks(_rank, world, args=(spec,), timeout=timeout)
    rows, out = [], {}
    for v in VARIANTS:
        per_rank = [median(r["ratios"][v]) for r in results]
        cpu_rank = [median(r["cpu_ratios"][v]) for r in results]
        q1, q3 = iqr(results[0]["ratios"][v])
        out[v] = {"ratio_median_per_rank": per_rank, "rank0_iqr": [q1, q3], "rank0_ratios": results[0]["ratios"][v],
                  "cpu_ratio_median_per_rank": cpu_rank, "rank0_cpu_iqr": list(iqr(results[0]["cpu_ratios"][v]))}
        rows.append([v, " / ".join(f"{x:.3f}" for x in per_rank), f"{q1:.3f}-{q3:.3f}",
                     " / ".join(f"{x:.3f}" for x in cpu_rank)])
    say(table(["gradient checks, variant", "step ratio to unmonitored (median; rank 0 / rank 1)", "rank 0 IQR",
               "CPU-time ratio (rank 0 / rank 1)"],
              rows, title=f"Overhead by part of the DDP hook: {world} ranks, {rounds} rounds x {segment} steps"))
    # The local side switched off zeroes the chunk sums: the checksum then mismatches, which shows the patch took.
    payload = {"spec": spec, "world": world, "variants": out, "incidents": results[0]["incidents"],
               "wall_s": time.perf_counter() - t0}
    path = write_json("overhead_parts", payload, out_dir)
    say(f"wrote {path}")
    return payload


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, two short rounds (the smoke test)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--segment", type=int, default=8)
    p.add_argument("--out-dir", default=None)
    a = p.parse_args(argv)
    if a.rounds < 1 or a.segment < 1:
        p.error("--rounds and --segment must be at least 1")
    if a.quick:
        return run(model=QUICK_MODEL, batch=2, segment=2, rounds=2, warmup=1, out_dir=a.out_dir)
    return run(rounds=a.rounds, segment=a.segment, out_dir=a.out_dir)


if __name__ == "__main__":
    main()
