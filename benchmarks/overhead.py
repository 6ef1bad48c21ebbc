"""Step-time overhead of the checks on multi-rank CPU DDP (gloo) training of a small GPT.

    python benchmarks/overhead.py            # 2 ranks, 10M-parameter GPT, 10 interleaved rounds (~2-3 minutes)
    python benchmarks/overhead.py --quick    # tiny model, two short rounds (the smoke test)

Configurations: no monitor; (diagnostic) no monitor but DDP's default all-reduce registered as a Python comm hook, the
path the monitor's gradient hook wraps; (diagnostic, the floor) no monitor but one plain ``torch.sum`` of every local
gradient as it is accumulated, of every reduced gradient after backward and of every parameter after the update, the
least that checks reading each of those tensors in a pass of their own can cost; gradient checks only; gradient checks +
weights every step; + replay every 50; + replay every 10. Each configuration trains its own copy of the same model (same
seed, own optimizer, own DDP wrapper and monitor, built once: a DDP instance takes one comm hook, and two live DDP
wrappers of one module would both all-reduce it). After ``warmup`` untimed steps each, the configurations take turns in
the same process group, one segment of ``segment`` steps at a time (A B C D E F, then F E D C B A, ...), ``rounds``
times. A monitor keeps counting its own steps across segments, so replay every N audits every Nth step of its
configuration whatever the segments.

Reported, per configuration, as ratios to the baseline segment of the same round (median and interquartile range over
rounds): the per-step cost, from each segment's median step (robust to bursts of load from elsewhere on the
machine); and, for replay, the cost of one audit in baseline steps (audit step minus its segment's median step), so
that replay every N costs per-step ratio + audit cost / N. The plain mean over all timed steps is reported too, and
the same ratios of CPU time (the process's, every thread: what the checks compute, much less disturbed than wall
time when other work shares the machine; a rank waiting for its peer in a collective spends little CPU).
Targets: gradient checks + weights every step <= 1.02x the baseline; replay every N adds at most 1.1/N of a step (one
audit costs at most 1.1 baseline steps); the weights' at-rest check adds at most 0.01 of a step (the weights
configuration against the same without it); one update audit (update every N: the audit of step k's update runs in
step k+1) costs at most 0.3 baseline steps.

Before/after comparisons: the benchmark imports ``sdc_telemetry`` from ``PYTHONPATH`` when it is set (an older
checkout in a ``git worktree``), and records which library it measured (path and commit) in the JSON.
"""

from __future__ import annotations

import argparse
import subprocess
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

TARGET_WEIGHTS = 1.02
TARGET_AUDIT_STEPS = 1.1

MODEL = {"vocab": 8192, "dim": 384, "layers": 4, "heads": 6, "seq": 64}
QUICK_MODEL = {"vocab": 128, "dim": 32, "layers": 1, "heads": 2, "seq": 8}
BASELINE = "no monitor"
HOOK = "no monitor, Python allreduce comm hook"
FLOOR = "no monitor, one read each (floor)"
WEIGHTS = "grad + weights/1"
DEFERRED = "grad + weights/1, verdicts deferred"
NO_AT_REST = "grad + weights/1, at-rest check off"
TARGET_AT_REST = 0.01  # the at-rest check: at most 1% of a step on top of the other checks
TARGET_UPDATE_STEPS = 0.3  # one update audit: at most 0.3 baseline steps


def configurations(replay_every: Sequence[int]) -> list[tuple[str, dict[str, Any] | None]]:
    """(label, SDCConfig fields or None for no monitor), in interleaving order."""
    out: list[tuple[str, dict[str, Any] | None]] = [
        (BASELINE, None),
        (HOOK, {}),  # diagnostic: what DDP's comm-hook path costs by itself (the monitor's checks run in one)
        (FLOOR, None),  # diagnostic: the least any check reading each tensor once can cost (see _Run)
        ("grad checks", {"weights_every": 0, "replay_every": 0}),
        (WEIGHTS, {"weights_every": 1, "replay_every": 0}),
        # The same checks with the verdict read one step later (no host wait on a GPU): on CPU the two cost the same
        # work, so the difference is what deciding before the update costs.
        (DEFERRED, {"weights_every": 1, "replay_every": 0, "verdicts": "deferred"}),
        # Diagnostic: the same without the at-rest check (the vote alone), so that its cost is the difference.
        (NO_AT_REST, {"weights_every": 1, "replay_every": 0, "_at_rest": False}),
    ]
    # Two ranks are two replicas: the update audit would follow replay_every; each is measured on its own.
    out += [(f"{WEIGHTS} + replay/{n}", {"weights_every": 1, "replay_every": n, "update_every": 0})
            for n in replay_every]
    out += [(f"{WEIGHTS} + update/{n}", {"weights_every": 1, "replay_every": 0, "update_every": n})
            for n in replay_every]
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Run:
    """One configuration's model copy, optimizer, DDP wrapper and monitor, alive for the whole benchmark."""

    def __init__(self, spec: dict[str, Any], fields: dict[str, Any] | None, device: torch.device,
                 floor: bool = False) -> None:
        torch.manual_seed(0)
        self.module = GPT(**spec["model"]).to(device)
        # The floor: what the healthy step's checks must read at the least, as plain reductions and nothing else
        # (no comm hook, no collective, no bookkeeping): every local gradient once as it is accumulated (before
        # DDP's reduction), every reduced gradient once after backward, every parameter once after the update:
        # one torch.sum each. A check that reads each tensor in a pass of its own cannot cost less.
        self.floor = floor
        self.reads = 0  # tensors the floor read (the smoke test checks that every one was)
        if floor:
            for p in self.module.parameters():
                p.register_post_accumulate_grad_hook(self._read_grad)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-4)
        self.ddp = DistributedDataParallel(self.module, device_ids=[device.index] if device.type == "cuda" else None)
        fields = dict(fields) if fields is not None else None
        at_rest = fields.pop("_at_rest", True) if fields else True
        self.monitor = None if not fields else sdc.SDCMonitor(
            self.ddp, self.optimizer, loss_fn=lm_loss, config=sdc.SDCConfig(metrics_port=None, nvml=False, **fields))
        if self.monitor is not None and not at_rest:  # diagnostic only: the vote without the at-rest check
            self.monitor._at_rest = None
            self.monitor._measurer._at_rest = None
        if fields == {}:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            self.ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        self.step = 0  # steps taken, = the monitor's step index of the next step

    def _read_grad(self, param: torch.Tensor) -> None:
        """The floor's read of a local gradient, as it is accumulated (before DDP's reduction)."""
        if param.grad is not None:
            param.grad.sum()
            self.reads += 1

    def train(self, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> tuple[float, float]:
        """One step: (wall seconds, CPU seconds of this process, every thread: robust to load from elsewhere)."""
        start, cpu = time.perf_counter(), time.process_time()
        if self.monitor is not None:
            with self.monitor.step(batch) as step:
                step.backward(lm_loss(self.ddp, batch))
        else:
            lm_loss(self.ddp, batch).backward()
        if self.floor:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.sum()
                    self.reads += 1
        self.optimizer.step()
        if self.floor:
            for p in self.module.parameters():
                p.detach().sum()
                self.reads += 1
        self.optimizer.zero_grad(set_to_none=True)
        _sync(device)
        self.step += 1
        return time.perf_counter() - start, time.process_time() - cpu


def _rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    # Within ~15 steps this model's activations or gradients reach subnormal floats, and x86 then runs its forward
    # and backward 5-7x slower, drifting from step to step: flush them to zero (as GPUs do) so that step times measure
    # the training, not the subnormal penalty.
    torch.set_flush_denormal(True)
    device = torch.device(spec["device"])
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    configs = configurations(spec["replay_every"])
    runs = {label: _Run(spec, fields, device, floor=label == FLOOR) for label, fields in configs}
    batches = [(x.to(device), y.to(device)) for x, y in
               token_batches(spec["warmup"] + spec["segment"] * spec["rounds"], spec["batch"],
                             spec["model"]["seq"], spec["model"]["vocab"], seed=1000 + rank)]
    for run in runs.values():
        for batch in batches[:spec["warmup"]]:
            run.train(batch, device)
    rounds: list[dict[str, Any]] = []
    for r in range(spec["rounds"]):
        order = configs if r % 2 == 0 else configs[::-1]
        seg: dict[str, Any] = {}
        for label, _ in order:
            run = runs[label]
            first = run.step
            _sync(device)
            dist.barrier()
            times = [run.train(batch, device) for batch in
                     batches[run.step:run.step + spec["segment"]]]
            seg[label] = {"first_step": first, "step_s": [w for w, _ in times], "cpu_s": [c for _, c in times]}
        rounds.append(seg)
    incidents = {label: len(run.monitor.incidents) if run.monitor is not None else 0 for label, run in runs.items()}
    verify_ms = _verify_weights_ms(runs[WEIGHTS], device)
    for run in runs.values():
        if run.monitor is not None:
            run.monitor.close()
    base = runs[BASELINE]
    parts = _component_costs(base.module, base.optimizer, batches[0], device) if rank == 0 else {}
    parts["monitor.verify_weights(): the whole weight check, collective (both ranks)"] = verify_ms
    floor = runs[FLOOR]
    return {"rounds": rounds, "params": param_count(base.module), "components_ms": parts, "incidents": incidents,
            "floor_reads_per_step": floor.reads / floor.step,
            "parameter_tensors": sum(1 for _ in base.module.parameters())}


def _verify_weights_ms(run: _Run, device: torch.device) -> float:
    """The whole weight check, collective, from ranks that enter it together (median of 5, milliseconds)."""
    assert run.monitor is not None
    out = []
    for _ in range(6):
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        run.monitor.verify_weights()
        _sync(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return median(out[1:])


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
    flat = torch.cat([g.reshape(-1) for g in grads])  # like a DDP bucket: one flat buffer
    parts["torch.sum of every gradient (one read: the reference pass)"] = ms(lambda: [g.sum() for g in grads])
    parts["sdc.fingerprint(parameters)"] = ms(lambda: sdc.fingerprint(params))
    parts["sdc.fingerprint(gradients)"] = ms(lambda: sdc.fingerprint(grads))
    parts["torch._foreach_norm(gradients)"] = ms(lambda: torch._foreach_norm(grads))
    parts["torch.linalg.vector_norm(one flat buffer of all gradients)"] = ms(lambda: torch.linalg.vector_norm(flat))
    # With any comm hook, DDP copies gradients into the buckets undivided and the hook divides them: one more pass.
    parts["div_ of every gradient (the averaging pass of allreduce_hook)"] = ms(lambda: torch._foreach_div_(grads, 1.0))
    parts["AdamW step"] = ms(optimizer.step)  # last: it moves the weights
    return parts


def library() -> dict[str, str]:
    """Which sdc_telemetry this run measured: its directory and the git commit checked out there."""
    where = Path(sdc.__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"path": str(where), "commit": commit or "unknown"}


def _audits(seg: dict[str, Any], n: int, key: str = "step_s", offset: int = 0) -> tuple[list[float], list[float]]:
    """(audit step times, other step times) of one segment of the replay-every-``n`` configuration (``offset`` 1:
    the update audit of step k runs in step k+1)."""
    audit, plain = [], []
    for i, t in enumerate(seg[key]):
        step = seg["first_step"] + i
        (audit if step % n == offset and step >= offset else plain).append(t)
    return audit, plain


def summarise(rounds: list[dict[str, Any]], replay_every: Sequence[int]) -> dict[str, Any]:
    """Per-round ratios to the baseline, their median and IQR, and the cost of one replay audit."""
    labels = [label for label, _ in configurations(replay_every)]
    period = {f"{WEIGHTS} + replay/{n}": n for n in replay_every}
    updates = {f"{WEIGHTS} + update/{n}": n for n in replay_every}
    period.update(updates)
    base_med = [median(r[BASELINE]["step_s"]) for r in rounds]
    base_cpu = [median(r[BASELINE]["cpu_s"]) for r in rounds]
    base_mean = sum(sum(r[BASELINE]["step_s"]) for r in rounds) / sum(len(r[BASELINE]["step_s"]) for r in rounds)
    per_config: dict[str, Any] = {}
    for label in labels:
        n = period.get(label)
        steady, audit_cost, cpu, cpu_audit = [], [], [], []
        for r, b, bc in zip(rounds, base_med, base_cpu, strict=True):
            offset = 1 if label in updates else 0
            audit, plain = _audits(r[label], n, offset=offset) if n else ([], r[label]["step_s"])
            steady.append(median(plain) / b)
            audit_cost += [(t - median(plain)) / b for t in audit]
            c_audit, c_plain = _audits(r[label], n, "cpu_s", offset) if n else ([], r[label]["cpu_s"])
            cpu.append(median(c_plain) / bc)
            cpu_audit += [(t - median(c_plain)) / bc for t in c_audit]
        q1, q3 = iqr(steady)
        mean = sum(sum(r[label]["step_s"]) for r in rounds) / sum(len(r[label]["step_s"]) for r in rounds)
        c: dict[str, Any] = {"step_ratio_median": median(steady), "step_ratio_q1": q1, "step_ratio_q3": q3,
                             "step_ratios": steady, "mean_ratio": mean / base_mean,
                             "step_ms_median": 1e3 * median([median(r[label]["step_s"]) for r in rounds]),
                             "cpu_ratio_median": median(cpu), "cpu_ratio_iqr": iqr(cpu),
                             "cpu_ms_median": 1e3 * median([median(r[label]["cpu_s"]) for r in rounds])}
        if n:
            a_q1, a_q3 = iqr(audit_cost)
            cost = median(audit_cost)
            target = TARGET_UPDATE_STEPS if label in updates else TARGET_AUDIT_STEPS
            c.update({"replay_every": n, "audits": len(audit_cost), "audit_cost_steps_median": cost,
                      "audit_cost_cpu_steps_median": median(cpu_audit), "kind": "update" if label in updates
                      else "replay", "audit_cost_q1": a_q1, "audit_cost_q3": a_q3, "audit_costs": audit_cost,
                      "ratio": median(steady) + cost / n, "added_per_step": cost / n,
                      "target_added_per_step": target / n, "target_audit_steps": target, "met": cost <= target})
        else:
            c["ratio"] = median(steady)
        per_config[label] = c
    w = per_config[WEIGHTS]
    at_rest = w["ratio"] - per_config[NO_AT_REST]["ratio"]
    return {"configs": per_config,
            "targets": {"weights_ratio": w["ratio"], "weights_target": TARGET_WEIGHTS,
                        "weights_met": w["ratio"] <= TARGET_WEIGHTS, "floor_ratio": per_config[FLOOR]["ratio"],
                        "at_rest_added": at_rest, "at_rest_target": TARGET_AT_REST,
                        "at_rest_met": at_rest <= TARGET_AT_REST,
                        "replay_met": all(c["met"] for c in per_config.values() if c.get("kind") == "replay"),
                        "update_met": all(c["met"] for c in per_config.values() if c.get("kind") == "update")}}


def run(world: int = 2, model: dict[str, int] | None = None, batch: int = 4, segment: int = 10, rounds: int = 10,
        warmup: int = 2, replay_every: Sequence[int] = (50, 10), device: str = "cpu", timeout: float = 1200.0,
        out_dir: str | Path | None = None, quiet: bool = False) -> dict[str, Any]:
    """Run the interleaved measurement on ``world`` gloo ranks, print the tables, write ``overhead.json``."""
    bad = [n for n in replay_every if n <= 0 or (segment * rounds) % n]
    if bad:
        raise ValueError(f"segment x rounds = {segment * rounds} timed steps must be a multiple of every replay "
                         f"period (so that each configuration is timed over whole periods), not of {bad}")
    spec = {"model": dict(model or MODEL), "batch": batch, "segment": segment, "rounds": rounds, "warmup": warmup,
            "replay_every": list(replay_every), "device": device}
    say = (lambda *_a: None) if quiet else print
    if (warn := load_warning()) is not None:
        say(warn)
    t0 = time.perf_counter()
    results = spawn_ranks(_rank, world, args=(spec,), timeout=timeout)
    wall = time.perf_counter() - t0
    summary = summarise(results[0]["rounds"], replay_every)
    incidents = results[0]["incidents"]
    m = spec["model"]
    lib = library()
    desc = (f"sdc_telemetry {lib['commit']}, {world} ranks (gloo, {device}, 1 thread each), "
            f"GPT {results[0]['params'] / 1e6:.1f}M params (dim {m['dim']}, {m['layers']} layers, vocab {m['vocab']}), "
            f"{batch}x{m['seq']} tokens per rank and "
            f"step, {rounds} rounds x {segment} steps per configuration")
    rows = []
    for label, c in summary["configs"].items():
        rows.append([label, c["step_ms_median"], c["step_ratio_median"],
                     f"{c['step_ratio_q1']:.3f}-{c['step_ratio_q3']:.3f}",
                     f"{c['audit_cost_steps_median']:.2f} ({c['audits']})" if "audits" in c else "-",
                     c["ratio"], c["mean_ratio"], c["cpu_ratio_median"],
                     f"{c['cpu_ratio_iqr'][0]:.3f}-{c['cpu_ratio_iqr'][1]:.3f}",
                     f"{c['audit_cost_cpu_steps_median']:.2f}" if "audits" in c else "-", incidents[label]])
    say(table(["configuration", "step ms (median)", "per-step ratio (median)", "per-step IQR",
               "audit cost, steps (audits)", "ratio incl. audits", "ratio of means", "CPU-time ratio (median)",
               "CPU-time IQR", "audit cost, CPU steps", "incidents"], rows,
              title="Step-time overhead: " + desc))
    say()
    base_ms = summary["configs"][BASELINE]["step_ms_median"]
    comp = results[0]["components_ms"]
    say(table(["pass (rank 0; one process unless noted)", "ms", "fraction of baseline step"],
              [[k, v, v / base_ms] for k, v in comp.items()], title="Where the time goes"))
    say()
    t = summary["targets"]
    say(f"target: grad + weights every step <= {TARGET_WEIGHTS}x baseline: {t['weights_ratio']:.3f}x -> "
        f"{'met' if t['weights_met'] else 'MISSED'} (the floor, one plain read of each local gradient, reduced "
        f"gradient and parameter: {t['floor_ratio']:.3f}x)")
    say(f"target: the at-rest check adds <= {TARGET_AT_REST:.2f} of a step on top of the vote: "
        f"{t['at_rest_added']:+.3f} -> {'met' if t['at_rest_met'] else 'MISSED'}")
    for c in summary["configs"].values():
        if "met" in c:
            n = c["replay_every"]
            say(f"target: {c['kind']} every {n} adds <= {c['target_audit_steps']}/{n} = "
                f"{c['target_added_per_step']:.3f} of a step: one audit costs {c['audit_cost_steps_median']:.2f} "
                f"steps -> {c['added_per_step']:.4f} per step -> {'met' if c['met'] else 'MISSED'}")
    payload = {"spec": spec, "library": lib, "world": world, "params": results[0]["params"], "wall_s": wall, **summary,
               "incidents": incidents, "components_ms": comp, "rounds": results[0]["rounds"],
               "floor_reads_per_step": results[0]["floor_reads_per_step"],
               "parameter_tensors": results[0]["parameter_tensors"]}
    path = write_json("overhead", payload, out_dir)
    say(f"wrote {path} ({wall:.0f} s)")
    return payload


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, two short rounds: checks that it runs")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--segment", type=int, default=10, help="steps per configuration and round")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (ranks share the GPUs round-robin; gloo)")
    p.add_argument("--replay-every", default="50,10",
                   help="replay periods, comma-separated (rounds x segment must be a multiple of each)")
    p.add_argument("--out-dir", help="where overhead.json goes (default benchmarks/results)")
    a = p.parse_args(argv)
    try:
        periods = tuple(int(x) for x in a.replay_every.split(",") if x.strip())
    except ValueError:
        p.error(f"--replay-every must be comma-separated whole numbers, not {a.replay_every!r}")
    if not periods or min(periods) < 1:
        p.error(f"--replay-every needs at least one period, each at least 1 (got {a.replay_every!r})")
    if a.batch < 1 or a.rounds < 1 or a.segment < 1:
        p.error("--batch, --rounds and --segment must be at least 1")
    if a.quick:
        run(world=2, model=QUICK_MODEL, batch=2, segment=4, rounds=2, warmup=1, replay_every=(4, 2),
            device=a.device, out_dir=a.out_dir)
    else:
        try:
            run(world=a.world, batch=a.batch, segment=a.segment, rounds=a.rounds, replay_every=periods,
                device=a.device, out_dir=a.out_dir)
        except ValueError as e:  # rounds x segment not a multiple of a replay period
            p.error(str(e))


if __name__ == "__main__":
    main()
