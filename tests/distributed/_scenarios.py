"""Rank-side training scenarios for the distributed tests (module level, so spawned ranks can import them).

A scenario is a plain dict: which fault to plan, the monitor config, the number of steps and options. One spawn runs
several scenarios in a row on the same process group, each with a fresh model, DDP wrapper, optimizer and monitor.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import OrderedDict, namedtuple
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sdc_telemetry as sdc
import sdc_telemetry.faults
import sdc_telemetry.testing
from sdc_telemetry.faults import FaultInjector


class Net(nn.Module):
    """``checkpoint``: "reentrant" / "nonreentrant" activation checkpointing of a hidden block (with dropout inside,
    so the recomputation must replay the RNG); ``experts``: a two-expert layer whose second expert never gets a
    token (a trainable parameter without a gradient at every step: DDP needs find_unused_parameters=True)."""

    def __init__(self, batchnorm: bool = False, checkpoint: str | None = None, experts: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.BatchNorm1d(32) if batchnorm else nn.LayerNorm(32)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(32, 4)
        self.gain = nn.Parameter(torch.ones(4))  # used only through .sum(): its gradient is an expanded view
        self.checkpoint = checkpoint
        self.hidden = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.1)) if checkpoint else None
        self.experts = nn.ModuleList([nn.Linear(32, 32), nn.Linear(32, 32)]) if experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.act(self.norm(self.fc1(x))))
        if self.hidden is not None:
            h = torch.utils.checkpoint.checkpoint(self.hidden, h, use_reentrant=self.checkpoint == "reentrant")
        if self.experts is not None:
            route = (h[:, 0] > 1e9).long()  # every token to expert 0: expert 1 gets none
            out = torch.zeros_like(h)
            for i, expert in enumerate(self.experts):
                if bool((route == i).any()):  # an expert without tokens is not run (no gradient at all)
                    out = out + torch.where((route == i)[:, None], expert(h), torch.zeros_like(h))
            h = out
        return self.fc2(h) + 1e-3 * self.gain.sum()


def loss_fn(module: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(module(batch["x"]), batch["y"])


Pair = namedtuple("Pair", ["x", "y"])


def tuple_loss_fn(module: nn.Module, batch: Any) -> torch.Tensor:
    """A namedtuple batch whose fields the loss reads by name (the replayer must rebuild the namedtuple)."""
    return nn.functional.cross_entropy(module(batch.x), batch.y)


def weighted_loss_fn(module: nn.Module, batch: Any) -> torch.Tensor:
    """Per-sample loss weights carried by the batch (importance weights, curriculum): a batch can spike the loss."""
    losses = nn.functional.cross_entropy(module(batch["x"]), batch["y"], reduction="none")
    return (losses * batch["w"]).mean()


def broken_loss_fn(module: nn.Module, batch: Any) -> torch.Tensor:
    """A loss that only works inside the training wrapper (a common mistake): every replay fails."""
    if not isinstance(module, DistributedDataParallel):
        raise RuntimeError("this loss expects the DDP wrapper")
    return loss_fn(module, batch)


class Recorder(sdc.Observer):
    """Keeps every StepReport: what ran, with which result, on this rank."""

    def __init__(self) -> None:
        self.reports: list[sdc.StepReport] = []
        self.errors: list[str] = []

    def report(self, report: sdc.StepReport) -> None:
        self.reports.append(report)

    def internal_error(self, component: str) -> None:
        self.errors.append(component)

    def counts(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for r in self.reports:
            for check, result in r.results.items():
                out.setdefault(check, {}).setdefault(result, 0)
                out[check][result] += 1
        return out


def _plan(faults: FaultInjector, fault: dict[str, Any] | None) -> None:
    if not fault:
        return
    kind = fault["kind"]
    args = {k: v for k, v in fault.items() if k != "kind"}
    getattr(faults, kind)(**args)


def _state(model: nn.Module) -> dict[str, Any]:
    return {
        "grads": {n: p.grad.clone() if p.grad is not None else None for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "rng": torch.get_rng_state().clone(),
    }


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def eq(x: Any, y: Any) -> bool:
        return (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))

    return (all(eq(a["grads"][k], b["grads"][k]) for k in a["grads"])
            and all(torch.equal(a["buffers"][k], b["buffers"][k]) for k in a["buffers"])
            and torch.equal(a["rng"], b["rng"]))


def run_one(rank: int, sc: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(sc.get("seed", 0))
    device = torch.device(sc.get("device", "cpu"))  # "cuda": ranks share the GPU (scripts/attribution_check.py)
    net = Net(batchnorm=sc.get("batchnorm", False), checkpoint=sc.get("checkpoint"),
              experts=sc.get("experts", False)).to(device)
    ddp = DistributedDataParallel(net, find_unused_parameters=sc.get("find_unused", False),
                                  gradient_as_bucket_view=sc.get("bucket_view", False))
    if sc.get("freeze_after_wrap"):
        net.get_parameter(sc["freeze_after_wrap"]).requires_grad_(False)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    snapshots: list[dict[str, Any]] = []
    undisturbed: list[bool] = []
    if sc.get("watch_state"):  # before the update: what the monitor's work at the end of the step changed
        opt.register_step_pre_hook(lambda *_: snapshots.append(_state(net)))
    start_step = sc.get("start_step", 0)
    if sc.get("unmonitored"):  # the same training without the monitor: the reference for bitwise identity
        gen = torch.Generator().manual_seed(1000 + rank)
        for _ in range(sc.get("steps", 8)):
            batch = {"x": torch.randn(8, 16, generator=gen), "y": torch.randint(0, 4, (8,), generator=gen)}
            loss_fn(ddp, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=sc.get("set_to_none", True))
        return {"weights": {n: p.detach().clone() for n, p in net.named_parameters()}, "incidents": []}
    numerics = sc.get("gpu_numerics")  # emulated GPU arithmetic: run-to-run noise, one rank's kernels deviating
    if numerics:
        sdc.testing.emulate_gpu_numerics(net, noise=numerics["noise"], seed=100 + rank,
                                         bias=numerics.get("bias", 0.0) if rank == numerics.get("bias_rank") else 0.0,
                                         dither=numerics.get("dither", False))
    faults = FaultInjector(ddp, opt, start_step=start_step)
    _plan(faults, sc.get("fault"))
    _plan(faults, sc.get("fault2"))
    config = sdc.SDCConfig(**{"metrics_port": None, "nvml": False, **sc.get("config", {})})
    if sc.get("signature_by_rank"):  # a mixed cluster: "stack-{class}" per rank (default: rank % 2)
        os.environ["SDC_NUMERICS_SIGNATURE"] = f"stack-{sc.get('classes', {}).get(rank, rank % 2)}"
    benchmark_before = torch.backends.cudnn.benchmark
    if sc.get("cudnn_benchmark_rank") == rank:  # this rank lets cuDNN autotune: its kernels may differ
        torch.backends.cudnn.benchmark = True
    recorder = Recorder() if not sc.get("telemetry") else None
    chosen_loss = {"broken": broken_loss_fn, "tuple": tuple_loss_fn, "weighted": weighted_loss_fn}.get(
        sc.get("loss", ""), loss_fn)
    try:
        wants_loss = config.replay_every or sc.get("loss_always")
        monitor = sdc.SDCMonitor(ddp, opt, loss_fn=chosen_loss if wants_loss else None, config=config,
                                 comm_hook=None if sc.get("plain_hook") else faults.comm_hook, start_step=start_step,
                                 observer=recorder)
    except ValueError as e:
        return {"error": str(e)}
    finally:
        os.environ.pop("SDC_NUMERICS_SIGNATURE", None)
        torch.backends.cudnn.benchmark = benchmark_before
    if sc.get("watch_state"):
        opt.register_step_pre_hook(lambda *_: undisturbed.append(_same_state(snapshots[-1], _state(net))))
    gathers = [0]
    if monitor._weights is not None:  # counts the rare-path gathers of every rank's fingerprint table
        real_gather = monitor._weights.gather

        def counted_gather(table: torch.Tensor) -> Any:
            gathers[0] += 1
            return real_gather(table)

        monitor._weights.gather = counted_gather  # type: ignore[method-assign]
    stopped_in_step = None
    if sc.get("bad_batch"):
        try:
            with monitor.step({"x": torch.ones(2, 16), "meta": [1, object()]}):
                pass
        except TypeError as e:
            return {"error": str(e)}
        finally:
            monitor.close()
        return {"error": None}
    if sc.get("nested"):
        try:
            with monitor.step(), monitor.step():
                pass
        except RuntimeError as e:
            return {"error": str(e)}
        finally:
            monitor.close()
        return {"error": None}
    gen = torch.Generator().manual_seed(1000 + rank)
    raised_at, raised_after_s, closed_after_s = None, None, None
    raised_checks: list[str] = []
    accumulate = sc.get("accumulate", 1)
    no_sync = sc.get("no_sync", True)
    autocast = sc.get("autocast", False)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**8) if sc.get("scaler") else None
    verified: list[Any] = []
    skipped: list[int] = []
    start = time.monotonic()
    try:
        for k in range(start_step, start_step + sc.get("steps", 8)):
            micro = [{"x": torch.randn(8, 16, generator=gen).to(device),
                      "y": torch.randint(0, 4, (8,), generator=gen).to(device)} for _ in range(accumulate)]
            if sc.get("nan_all_step") == k:  # a bad batch on every rank: numerics, not hardware
                for mb in micro:
                    mb["x"][0, 0] = float("nan")
            nan_at = sc.get("nan_rank_at")
            if nan_at and rank == nan_at["rank"] and k == nan_at["step"]:  # one bad sample in one rank's batch
                micro[0]["x"][0, 0] = float("nan")
            if sc.get("loss") == "weighted":
                for mb in micro:
                    mb["w"] = torch.ones(8, device=device)
            hard = sc.get("heavy_batch_at")
            if hard and rank == hard["rank"] and k == hard["step"]:  # a heavy batch: its own data, not hardware
                micro[0]["w"].fill_(hard["weight"])
            nan_from = sc.get("nan_rank_from")
            if nan_from and rank == nan_from["rank"] and k >= nan_from["step"]:  # a rank that keeps computing NaN
                for mb in micro:
                    mb["x"][0, 0] = float("nan")
            if sc.get("batch_type") == "namedtuple":
                micro = [Pair(mb["x"], mb["y"]) for mb in micro]  # type: ignore[misc]
            elif sc.get("batch_type") == "ordereddict":
                micro = [OrderedDict(mb) for mb in micro]
            if accumulate == 1:
                with monitor.step(micro[0]) as step:
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):  # forward only
                        loss = chosen_loss(ddp, micro[0]) if sc.get("loss") != "broken" else loss_fn(ddp, micro[0])
                    step.backward(loss, scaler=scaler)
            else:
                with monitor.step() as step:
                    for i, mb in enumerate(micro):
                        step.micro_batch(mb)
                        last = i == accumulate - 1 or not no_sync
                        if sc.get("toggle_sync"):  # nanoGPT's way: sync only on the last micro-step
                            ddp.require_backward_grad_sync = last
                            step.backward(loss_fn(ddp, mb), scale=1 / accumulate, scaler=scaler)
                            continue
                        with contextlib.nullcontext() if last else ddp.no_sync():
                            step.backward(loss_fn(ddp, mb), scale=1 / accumulate, scaler=scaler)
            if sc.get("clip"):
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            if scaler is not None:
                before = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                if scaler.get_scale() < before:  # it found an overflow and skipped the update
                    faults.skipped_update()
            elif not sc.get("guard") or step.finite:  # the documented guard: no update from non-finite gradients
                opt.step()
            else:
                skipped.append(k)
                faults.skipped_update()
            opt.zero_grad(set_to_none=sc.get("set_to_none", True))
            swap = sc.get("swap_after")
            if swap and swap["step"] == k:  # corrupt right after the update, then ask before "saving"
                if rank == swap["rank"]:
                    sdc.faults.swap_rows(net.get_parameter(swap["param"]).data, *swap["rows"])
                inc = monitor.verify_weights()
                verified.append(None if inc is None else (inc.step, inc.check, list(inc.suspect_ranks)))
    except sdc.SDCDetected as e:
        stopped_in_step = monitor.current_step
        raised_at = e.incident.step
        raised_checks = [i.check for i in e.incidents]
        raised_after_s = time.monotonic() - start
        t = time.monotonic()
        monitor.close()
        closed_after_s = time.monotonic() - t
    certified = None
    if sc.get("certify_at_end") and stopped_in_step is None:  # every rank, as a checkpoint save would
        cert = monitor.certificate()
        certified = (cert.step, cert.verify(net.state_dict()))
    monitor.close()
    faults.close()
    return {
        "certified": certified,
        "incidents": [i.to_dict() for i in monitor.incidents],
        "raised_at": raised_at,
        "raised_checks": raised_checks,
        "stopped_in_step": stopped_in_step,
        "raised_after_s": raised_after_s,
        "closed_after_s": closed_after_s,
        "weights": {n: p.detach().clone() for n, p in net.named_parameters()},
        "undisturbed": undisturbed,
        "fired": faults.fired,
        "identity": monitor.identity.to_dict(),
        "counts": recorder.counts() if recorder else {},
        "errors": recorder.errors if recorder else [],
        "report_errors": [e for r in recorder.reports for e in r.errors] if recorder else [],
        "verified": verified,
        "mode": monitor.mode,
        "alone": monitor._replay.alone if monitor._replay is not None else None,
        "unconfirmed": monitor._replay.unconfirmed if monitor._replay is not None else 0,
        "thresholds": monitor._replay.thresholds if monitor._replay is not None else None,
        "audited": [r.replay.origin_rank for r in recorder.reports if r.replay is not None] if recorder else [],
        "steps_reported": [r.step for r in recorder.reports if r.counts_step] if recorder else [],
        "durations": [r.durations for r in recorder.reports] if recorder else [],
        "gathers": gathers[0],
        "skipped_updates": skipped,
        "weights_finite": all(bool(torch.isfinite(p).all()) for p in net.parameters()),
    }


VERDICTS = ("immediate", "deferred")


def on_path(scenarios: list[dict[str, Any]], verdicts: str) -> list[dict[str, Any]]:
    """The scenarios with ``SDCConfig(verdicts=...)`` set, so that one fixture runs them on either verdict path."""
    return [{**sc, "config": {**sc.get("config", {}), "verdicts": verdicts}} for sc in scenarios]


def run_scenarios(rank: int, world: int, scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for sc in scenarios:
        out.append(run_one(rank, sc))
        dist.barrier()
    return out
