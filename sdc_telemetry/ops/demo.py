"""The demo job: a small DDP model on CPU ranks, one injected fault, the suspect named, and the response to it.

``run_rank`` is the per-rank training function (module level, so ``spawn_ranks`` can start it); ``expected`` says
which incident a fault plan must produce, so the CLI can exit 0 exactly when the outcome is what the flags predict.
``certify_plan`` picks the steps at which the ranks save certified checkpoints (some before the last replay audit
that passes before the incident, one after it) and the one the rollback rule must choose. ``DemoResponder`` is the
response half, run by the CLI's own process (never by the ranks): an authenticated responder whose "drain" is a
recorder standing in for ``scontrol``, a SQLite GPU ledger, and a drill screen after the drain.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
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

__all__ = ["DemoPlan", "DemoResponder", "run_rank", "expected", "certify_plan", "FAULTS", "DemoModel", "demo_loss"]

FAULTS = ("weight-bitflip", "grad-nan", "comm", "compute", "none")
_CHECK_OF = {"weight-bitflip": "weights", "grad-nan": "grad_local", "comm": "grad_reduced", "compute": "replay"}


@dataclass(frozen=True)
class DemoPlan:
    fault: str = "weight-bitflip"
    fault_rank: int = 2
    fault_step: int = 20
    steps: int = 40
    replay_every: int = 10
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
    checkpoint_dir: str | None = None  # rank 0 saves a certified checkpoint here at each of certify_steps
    certify_steps: tuple[int, ...] = (5, 10, 15)
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
    checkpoints: list[str] = []
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
            if plan.checkpoint_dir and step in plan.certify_steps:
                checkpoints.append(_save_certified(monitor, plan.checkpoint_dir, step, rank))
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
            "fired": faults.fired, "plan": asdict(plan), "checkpoints": checkpoints}


def _hsdp(model: nn.Module, world: int) -> nn.Module:
    """HSDP: fully_shard on a (world // 2 replicas, 2 shards) mesh, each block and the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    for name in ("embed", "block", "head"):
        fully_shard(model.get_submodule(name), mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _save_certified(monitor: SDCMonitor, directory: str, step: int, rank: int) -> str:
    """Certify on every rank (collective), save the checkpoint with its certificate from rank 0."""
    cert = monitor.certificate()
    path = os.path.join(directory, f"checkpoint-{step}.pt")
    # A full state dict: DDP's inner module, or the shards of a fully_shard-ed model gathered (every rank).
    state = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in monitor.module.state_dict().items()}
    if rank == 0:
        torch.save({"model": state, "sdc_certificate": cert.to_dict(), "step": step}, path)
        audit = "none yet" if cert.last_passing_audit is None else f"step {cert.last_passing_audit}"
        print(f"step {step}: checkpoint saved with its weight certificate ({len(cert.fingerprints)} tensors, last "
              f"passing replay audit {audit}): {path}", flush=True)
    return path


def _serve(plan: DemoPlan) -> None:
    """Keep the metrics endpoint up (training finished) until the stop file appears or ``serve_after`` passes."""
    deadline = time.monotonic() + plan.serve_after
    while time.monotonic() < deadline:
        if plan.stop_file and os.path.exists(plan.stop_file):
            return
        time.sleep(0.2)


def certify_plan(incident_step: int | None, replay_every: int, steps: int) -> tuple[tuple[int, ...], int | None]:
    """(steps at which the ranks save certified checkpoints, step of the one the rollback rule must choose).

    With the incident at step I and replay audits at the multiples of R, the last audit that can pass before the
    incident is A, the largest multiple of R below I. The ranks certify R/2 steps before A, at A (the checkpoint to
    resume from) and between A and I: that one is certified too (its replicas agree), but a compute fault can spread
    through the all-reduce unseen until the next audit, so the rule passes it over. Healthy run: one checkpoint
    half way, which must verify. No audit before the incident (replay off, or I = 0): nothing qualifies.
    """
    if incident_step is None:
        return ((steps // 2,) if steps > 0 else ()), None
    if replay_every <= 0 or incident_step <= 0:
        return (), None
    audit = (incident_step - 1) // replay_every * replay_every
    end = min(incident_step, steps)
    picks = {audit - max(1, replay_every // 2), audit, (audit + incident_step + 1) // 2}
    return tuple(sorted(s for s in picks if 0 <= s < end)), audit if audit < end else None


# -- the response half, run by the demo's own process ---------------------------------------------------------------

# A harmless stand-in for `scontrol update NodeName={host_name} State=DRAIN ...`: appends its arguments (after the
# file name) as one JSON line to the file named by its first argument.
_RECORDER = "import json, sys; open(sys.argv[1], 'a').write(json.dumps(sys.argv[2:]) + chr(10))"


class DemoResponder:
    """The responder of a real deployment, on loopback, with the demo's stand-ins.

    A bearer token (``token_file``, mode 0600, what Alertmanager's ``credentials_file`` sends); the drain command is
    a recorder that appends its argv to ``drains`` (instead of ``scontrol``); strikes go to a SQLite ledger in
    ``workdir``; after the drain it runs ``sdc-telemetry screen`` on ``cpu_workers`` CPU worker processes with
    ``--drill-fault drill_device`` (a drill: the screen flips one bit in that worker's results, standing in for the
    faulty GPU) recording into the same ledger under the paged host's name.
    """

    def __init__(self, workdir: str | Path, *, drill_device: int, cpu_workers: int = 3) -> None:
        import secrets

        from sdc_telemetry.ops.respond import Responder

        self.workdir = Path(workdir)
        self.token = secrets.token_hex(16)
        self.token_file = self.workdir / "responder.token"
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.token + "\n")
        self.drains = self.workdir / "drained.jsonl"
        self.ledger_url = f"sqlite:///{self.workdir / 'ledger.sqlite3'}"
        self.drill_device = drill_device
        self.cpu_workers = max(cpu_workers, drill_device + 1)
        py = shlex.quote(sys.executable)
        recorder = (f"{py} -c {shlex.quote(_RECORDER)} {shlex.quote(str(self.drains))} "
                    "drain {host_name} rank={rank} gpu={hw_id} alert={alertname}")
        self.screen_command = (f"{py} -m sdc_telemetry.ops.cli screen --cpu-workers {self.cpu_workers} "
                               f"--drill-fault {drill_device} --ledger {shlex.quote(self.ledger_url)} "
                               "--host-name {host_name}")
        self.responder = Responder(recorder, bearer_token=self.token, ledger=self.ledger_url,
                                   state_file=self.workdir / "respond-state.json", timeout_s=30.0,
                                   screen_command=self.screen_command, screen_timeout_s=180.0)

    @property
    def url(self) -> str:
        """Where Alertmanager posts (``/alerts``)."""
        return f"{self.responder.url}/alerts"

    def __enter__(self) -> DemoResponder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.responder.close()

    def post(self, alerts: list[dict[str, Any]], *, token: str | None) -> int:
        """POST an Alertmanager (version 4) notification of ``alerts``, with ``token`` as bearer token or without
        one; the HTTP status."""
        import urllib.error
        import urllib.request

        body = json.dumps({"version": "4", "status": "firing", "receiver": "responder",
                           "alerts": [{"status": "firing", **a} for a in alerts]}).encode()
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(self.url, data=body, method="POST", headers=headers)  # noqa: S310 - loopback
        try:
            with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310 - our loopback responder
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)

    def drained(self) -> list[list[str]]:
        """Every drain the recorder ran, in order (its arguments)."""
        if not self.drains.exists():
            return []
        return [json.loads(line) for line in self.drains.read_text().splitlines() if line.strip()]

    def wait_drain(self, timeout: float) -> list[str] | None:
        """The first drain; None when none ran within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            done = self.drained()
            if done:
                return done[0]
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def wait_screen(self, timeout: float) -> bool:
        """Wait until a screen started after a drain has finished (and recorded its result); False on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            health = self.responder.health()
            if health["screens_passed"] + health["screens_failed"] >= 1:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)
