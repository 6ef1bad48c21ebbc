"""A training process as users run it, single-process and on 2 gloo ranks with DDP, with every sink on (metrics
endpoint, incident log, Alertmanager push configured): prints, as JSON, which forbidden modules each process loaded
and how many checks passed. Run as a script (spawned ranks re-import only this file, torch and sdc_telemetry)."""

from __future__ import annotations

import json
import socket
import sys
import tempfile
from typing import Any

import torch
from torch import nn

FORBIDDEN = ("grafanalib", "yaml", "sdc_telemetry.ops")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _train(model: nn.Module, module: nn.Module, incident_dir: str) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry

    import sdc_telemetry as sdc

    registry = CollectorRegistry()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)

    def loss_fn(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return m(batch).square().mean()

    config = sdc.SDCConfig(weights_every=1, replay_every=2, metrics_port=_free_port(), metrics_host="127.0.0.1",
                           incident_dir=incident_dir, nvml=False, alertmanager_url=f"http://127.0.0.1:{_free_port()}")
    monitor = sdc.SDCMonitor(model, opt, loss_fn=loss_fn, config=config, registry=registry)
    torch.manual_seed(0)
    for _ in range(3):
        batch = torch.randn(4, 8)
        with monitor.step(batch) as step:
            step.backward(loss_fn(model, batch))
        opt.step()
        opt.zero_grad()
    cert = monitor.certificate()
    passes = {s.labels["check"]: s.value for m in registry.collect() for s in m.samples
              if s.name == "sdc_checks_total" and s.labels.get("result") == "pass"}
    monitor.close()
    return {"forbidden": sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN or m.startswith(FORBIDDEN)),
            "passes": passes, "incidents": len(monitor.incidents), "certified": len(cert.fingerprints)}


def ddp_rank(rank: int, world: int, incident_dir: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    return _train(DistributedDataParallel(module), module, incident_dir)


def main() -> None:
    from sdc_telemetry.testing import spawn_ranks

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        single = _train(module, module, tmp)
        ranks = spawn_ranks(ddp_rank, 2, (tmp,), timeout=120)
    print(json.dumps({"single": single, "ddp": ranks}))


if __name__ == "__main__":
    main()
