"""The demo job: a small DDP model on CPU ranks, one injected fault, the suspect named.

``run_rank`` is the per-rank training function (module level, so ``spawn_ranks`` can start it); ``expected`` says
which incident a fault plan must produce, so the CLI can exit 0 exactly when the outcome is what the flags predict.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sdc_telemetry.core.config import SDCConfig
from sdc_telemetry.core.identity import RankIdentity
from sdc_telemetry.core.incident import SDCDetected
from sdc_telemetry.faults import FaultInjector
from sdc_telemetry.monitor import SDCMonitor
from sdc_telemetry.sinks.nvml import FakeNVML
from sdc_telemetry.sinks.telemetry import Telemetry

__all__ = ["DemoPlan", "run_rank", "expected", "FAULTS", "DemoModel", "demo_loss"]

FAULTS = ("weight-bitflip", "grad-nan", "comm", "compute", "none")
_CHECK_OF = {"weight-bitflip": "weights", "grad-nan": "grad_local", "comm": "grad_reduced", "compute": "replay"}


@dataclass(frozen=True)
class DemoPlan:
    fault: str = "weight-bitflip"
    fault_rank: int = 2
    fault_step: int = 20
    steps: int = 40
    replay_every: int = 25
    on_suspect: str = "raise"
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    step_delay: float = 0.0
    serve_after: float = 0.0
    stop_file: str | None = None
    incident_dir: str | None = None
    progress_every: int = 5
    close_scrape_wait_s: float = 8.0  # close() lets Prometheus see the clean end at most this long (0 without one)
    alertmanager_url: str | None = None
    layout: str = "ddp"  # "ddp", or "hsdp": fully_shard on a (world // 2 replicas, 2 shards) mesh
    checkpoint_dir: str | None = None  # rank 0 saves a certified checkpoint here at certify_step
    certify_step: int = 10
    seed: int = 0


class DemoModel(nn.Module):
    """A small residual MLP classifier with LayerNorm and dropout (so replay must reproduce RNG state)."""

    def __init__(self, dim: int = 64, hidden: int = 256, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, hidden)
        self.block = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(0.1))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.block(h)
        out: torch.Tensor = self.head(h)
        return out


def demo_loss(module: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(module(x), y)


def expected(plan: DemoPlan) -> tuple[tuple[str, ...], int, int] | None:
    """(checks that may report it first, step, rank) of the incident the plan must produce; None when healthy.

    A weight bit flip lands before the step's forward pass, so the weight check at the end of that step sees it (a
    replay audit of the same step is skipped: it compares healthy replicas only).
    """
    if plan.fault == "none":
        return None
    step = plan.fault_step
    checks: tuple[str, ...] = (_CHECK_OF[plan.fault],)
    if plan.fault == "compute":
        step = -(-plan.fault_step // plan.replay_every) * plan.replay_every  # first audit at or after the fault
    return checks, step, plan.fault_rank


def _inject(faults: FaultInjector, plan: DemoPlan) -> None:
    r, s = plan.fault_rank, plan.fault_step
    if plan.fault == "weight-bitflip":
        faults.flip_weight_bit(rank=r, step=s, param="block.1.weight", index=123, bit=18)
    elif plan.fault == "grad-nan":
        faults.nonfinite_grad(rank=r, step=s, param="head.weight", index=7)
    elif plan.fault == "comm":
        faults.corrupt_reduced_grad(rank=r, step=s, index=5)
    elif plan.fault == "compute":
        faults.perturb_output(rank=r, step=s, module="block.2", relative=1e-4)


def run_rank(rank: int, world: int, plan: DemoPlan) -> dict[str, Any]:
    """Train ``plan.steps`` steps with one injected fault; return this rank's incidents and timings."""
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(message)s")
    torch.manual_seed(plan.seed)
    model = _hsdp(DemoModel(), world) if plan.layout == "hsdp" else DistributedDataParallel(DemoModel())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    faults = FaultInjector(model, opt)
    _inject(faults, plan)
    config = SDCConfig(weights_every=1, replay_every=plan.replay_every, on_suspect=plan.on_suspect,  # type: ignore[arg-type]
                       metrics_port=plan.metrics_port, metrics_host=plan.metrics_host, nvml=True,
                       incident_dir=plan.incident_dir, job_name="sdc-demo", alertmanager_url=plan.alertmanager_url)
    identity = RankIdentity.local()
    # The CPU demo's GPU counters are simulated.
    nvml = FakeNVML.for_demo(identity.hw_id) if not torch.cuda.is_available() else None
    telemetry = Telemetry(config, identity, nvml=nvml, close_scrape_wait_s=plan.close_scrape_wait_s)
    monitor = SDCMonitor(model, opt, loss_fn=demo_loss, config=config, observer=telemetry,
                         comm_hook=faults.comm_hook if plan.layout == "ddp" else None)
    gen = torch.Generator().manual_seed(1000 + rank)
    stopped: int | None = None
    checkpoint: str | None = None
    start = time.perf_counter()
    loss = torch.zeros(())
    try:
        for step in range(plan.steps):
            batch = (torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen))
            with monitor.step(batch) as st:
                loss = demo_loss(model, batch)
                st.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if plan.checkpoint_dir and step == plan.certify_step:
                checkpoint = _save_certified(monitor, model, plan.checkpoint_dir, step, rank)
            if rank == 0 and plan.progress_every and (step + 1) % plan.progress_every == 0:
                rate = (step + 1) / (time.perf_counter() - start)
                print(f"step {step + 1:4d}/{plan.steps}  loss {loss.item():.4f}  incidents {len(monitor.incidents)}"
                      f"  {rate:.1f} steps/s", flush=True)
            if plan.step_delay:
                time.sleep(plan.step_delay)
    except SDCDetected as e:
        stopped = e.incident.step
        if rank == 0:
            print(f"every rank stopped at step {stopped}: {e}", flush=True)
    elapsed = time.perf_counter() - start
    if plan.serve_after:
        _serve(plan)
    dist.barrier()
    monitor.close()
    faults.close()
    return {"incidents": [i.to_dict() for i in monitor.incidents], "stopped_at": stopped, "elapsed_s": elapsed,
            "fired": faults.fired, "plan": asdict(plan), "checkpoint": checkpoint}


def _hsdp(model: nn.Module, world: int) -> nn.Module:
    """HSDP: fully_shard on a (world // 2 replicas, 2 shards) mesh, each block and the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    for name in ("embed", "block", "head"):
        fully_shard(model.get_submodule(name), mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _save_certified(monitor: SDCMonitor, model: nn.Module, directory: str, step: int, rank: int) -> str:
    """Certify on every rank (collective), save the checkpoint with its certificate from rank 0."""
    cert = monitor.certificate()
    path = os.path.join(directory, f"checkpoint-{step}.pt")
    # A full state dict: DDP's inner module, or the shards of a fully_shard-ed model gathered (every rank).
    state = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in monitor.module.state_dict().items()}
    if rank == 0:
        torch.save({"model": state, "sdc_certificate": cert.to_dict(), "step": step}, path)
        print(f"step {step}: checkpoint saved with its weight certificate ({len(cert.fingerprints)} tensors): {path}",
              flush=True)
    return path


def _serve(plan: DemoPlan) -> None:
    """Keep the metrics endpoint up (training finished) until the stop file appears or ``serve_after`` passes."""
    deadline = time.monotonic() + plan.serve_after
    while time.monotonic() < deadline:
        if plan.stop_file and os.path.exists(plan.stop_file):
            return
        time.sleep(0.2)
