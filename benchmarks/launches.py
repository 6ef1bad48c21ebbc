"""Device operations the monitor adds to one healthy step, per parameter tensor: what a GPU would launch.

    python benchmarks/launches.py            # 2 gloo ranks, DDP, a 12-layer GPT: 150 parameter tensors
    python benchmarks/launches.py --quick    # 2 layers (the smoke test)

A GPU pays a few microseconds for every kernel launch, whatever the data, so the monitor's cost at real parameter
counts is bounded by how many operations it launches, not only by bandwidth. On this CPU-only machine the count is
taken on the schedule GPUs use (``SDC_SCHEDULE=gpu``: a bucket's checksum in a few large operations, not in
cache-sized pieces; ``SDC_FINGERPRINT_KERNEL=triton``: every tensor's fingerprint in one Triton kernel, run by
Triton's interpreter on CPU tensors): the same values, the operations a GPU would get.

Counted with ``torch.profiler`` over every thread (DDP's reduction callbacks included): the outermost ATen operations
of one step, view and metadata operations excluded (they launch nothing), plus the Triton kernels the monitor
launched (``core/fingerprint_kernel.launches``: the profiler sees no Triton launch). The monitor's share is the
monitored step's count minus the same model's unmonitored step (DDP's own all-reduce and averaging), taken on the
same ranks after three warm-up steps each (the last on the counted schedule: the fingerprint kernel's tile tables,
built once per set of tensors, are then reused as in any later step). Checks: gradient checks (local and reduced)
and the weight vote with the at-rest check every step (Adam's moments included), replay off. Target: at most 1.0
operation per parameter tensor. The count with the CPU schedule (what runs on this machine) is reported next to it.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Both must be set before torch and triton are imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GPT, lm_loss, table, token_batches, write_json

import sdc_telemetry as sdc
from sdc_telemetry.core import fingerprint_kernel
from sdc_telemetry.testing import spawn_ranks

TARGET = 1.0
MODEL = {"vocab": 128, "dim": 32, "layers": 12, "heads": 2, "seq": 16}  # 150 tensors: counts are per tensor
QUICK_MODEL = {"vocab": 64, "dim": 32, "layers": 2, "heads": 2, "seq": 8}
# Operations that only make or reinterpret a tensor's metadata (or allocate without writing): no kernel.
NO_LAUNCH = {"view", "reshape", "_reshape_alias", "as_strided", "slice", "select", "detach", "t", "transpose",
             "expand", "unsqueeze", "squeeze", "alias", "flatten", "empty", "empty_strided", "empty_like", "resize_",
             "split", "split_with_sizes", "narrow", "unbind", "permute", "lift_fresh", "_unsafe_view", "view_as",
             "unflatten", "chunk", "contiguous", "result_type", "detach_", "set_", "lift", "expand_as",
             "resolve_conj", "resolve_neg", "_has_compatible_shallow_copy_type", "record_stream", "is_nonzero",
             "item", "_local_scalar_dense", "to", "is_same_size", "size", "stride", "numel", "dim"}


def _outermost(prof: Any) -> collections.Counter[str]:
    """Outermost ATen operations by name (an operation inside another one is part of it), no-launch ones left out."""
    out: collections.Counter[str] = collections.Counter()
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        parent, nested = e.cpu_parent, False
        while parent is not None:
            # inside another operation, or inside a Triton launch (counted as one; the interpreter copies tensors)
            if parent.name.startswith("aten::") or parent.name == fingerprint_kernel.LAUNCH:
                nested = True
                break
            parent = parent.cpu_parent
        name = e.name.removeprefix("aten::")
        if not nested and name not in NO_LAUNCH:
            out[name] += 1
    return out


def _count(schedule: str, model: dict[str, int]) -> dict[str, Any]:
    """One healthy step's operations, unmonitored and monitored, on this rank with ``schedule`` (gpu or cpu)."""
    os.environ["SDC_SCHEDULE"] = schedule
    kernel = "triton" if schedule == "gpu" else "torch"
    counts: dict[str, collections.Counter[str]] = {}
    tensors = 0
    incidents = 0
    checked: dict[str, str] = {}
    for label, fields in (("unmonitored", None), ("monitored", {"weights_every": 1, "replay_every": 0,
                                                                 "update_every": 0})):
        torch.manual_seed(0)
        module = GPT(**model, dropout=0.0)
        tensors = sum(1 for _ in module.parameters())
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        ddp = DistributedDataParallel(module)
        recorder = _Recorder()
        monitor = sdc.SDCMonitor(ddp, optimizer, loss_fn=lm_loss, observer=recorder, config=sdc.SDCConfig(
            metrics_port=None, nvml=False, **fields)) if fields else None
        batches = token_batches(4, 4, model["seq"], model["vocab"], seed=dist.get_rank())
        os.environ["SDC_FINGERPRINT_KERNEL"] = "torch"  # warm-up: the interpreter is slow, the rows are the same
        for batch in batches[:2]:
            _step(ddp, optimizer, monitor, batch)
        os.environ["SDC_FINGERPRINT_KERNEL"] = kernel
        _step(ddp, optimizer, monitor, batches[2])  # the kernel's tile tables are built once, then reused
        dist.barrier()
        launched = fingerprint_kernel.launches[0]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _step(ddp, optimizer, monitor, batches[3])
        counts[label] = _outermost(prof)
        counts[label]["triton kernel"] += fingerprint_kernel.launches[0] - launched
        if monitor is not None:
            incidents = len(monitor.incidents)
            checked = recorder.last
            monitor.close()
    added = collections.Counter({k: counts["monitored"][k] - counts["unmonitored"].get(k, 0)
                                 for k in {*counts["monitored"], *counts["unmonitored"]}})
    # By name, an operation can move: with a Python comm hook DDP copies a gradient into its bucket (copy_) where
    # its own hook multiplies it in (mul): the total is the difference of the totals.
    return {"tensors": tensors, "unmonitored": sum(counts["unmonitored"].values()),
            "monitored": sum(counts["monitored"].values()),
            "added": sum(counts["monitored"].values()) - sum(counts["unmonitored"].values()),
            "by_operation": {k: v for k, v in added.most_common() if v}, "incidents": incidents, "results": checked}


def _step(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer, monitor: sdc.SDCMonitor | None,
          batch: Any) -> None:
    if monitor is not None:
        with monitor.step(batch) as s:
            s.backward(lm_loss(ddp, batch))
    else:
        lm_loss(ddp, batch).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class _Recorder(sdc.Observer):
    def __init__(self) -> None:
        self.last: dict[str, str] = {}

    def report(self, report: Any) -> None:
        if report.counts_step:
            self.last = dict(report.results)


def _rank(rank: int, world: int, model: dict[str, int]) -> dict[str, Any]:
    return {schedule: _count(schedule, model) for schedule in ("gpu", "cpu")}


def run(world: int = 2, model: dict[str, int] | None = None, out_dir: str | Path | None = None,
        quiet: bool = False) -> dict[str, Any]:
    say = (lambda *_a: None) if quiet else print
    model = model or MODEL
    per_rank = spawn_ranks(_rank, world, args=(model,), timeout=900)
    rows, summary = [], {}
    for schedule in ("gpu", "cpu"):
        r = per_rank[0][schedule]
        per_tensor = r["added"] / r["tensors"]
        summary[schedule] = {**r, "per_tensor": per_tensor}
        rows.append([schedule, r["tensors"], r["unmonitored"], r["monitored"], r["added"], f"{per_tensor:.2f}",
                     ", ".join(f"{k} {v}" for k, v in list(r["by_operation"].items())[:8])])
    say(table(["schedule", "parameter tensors", "step unmonitored", "step monitored", "added by the monitor",
               "added per tensor", "most added (operation count)"], rows,
              title=f"Device operations of one healthy DDP step ({world} gloo ranks, GPT {model}; gradient checks, "
                    "weights every step with Adam's moments and the at-rest check)"))
    gpu = summary["gpu"]
    ok = gpu["per_tensor"] <= TARGET and gpu["incidents"] == 0 and gpu["results"].get("weights") == "pass"
    say(f"target: at most {TARGET:g} kernel-launching operation per parameter tensor on the GPU schedule: "
        f"{gpu['per_tensor']:.2f} (checks of the counted step: {gpu['results']}) -> {'met' if ok else 'MISSED'}")
    payload = {"world": world, "model": model, "target": TARGET, **summary}
    say(f"wrote {write_json('launches', payload, out_dir)}")
    return payload


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a 2-layer GPT: checks that it runs")
    p.add_argument("--out-dir", help="where the JSON goes (default benchmarks/results)")
    a = p.parse_args(argv)
    run(model=QUICK_MODEL if a.quick else MODEL, out_dir=a.out_dir)


if __name__ == "__main__":
    main()
