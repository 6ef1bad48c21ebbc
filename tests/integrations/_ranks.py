"""Rank-side helpers shared by the integration tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import sdc_telemetry as sdc


class ResultCounter(sdc.Observer):
    """Counts each check's results on this rank, as ``sdc_checks_total`` would."""

    def __init__(self) -> None:
        self.results: Counter[tuple[str, str]] = Counter()

    def report(self, report: sdc.StepReport) -> None:
        for check, result in report.results.items():
            self.results[check, result] += 1


def each_in_turn(train: Callable[..., dict[str, Any]], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``train(**kwargs)`` for each run in turn, every rank together (a barrier after each)."""
    out = []
    for kwargs in runs:
        out.append(train(**kwargs))
        dist.barrier()
    return out


def batches(rank: int, count: int, nan_at: tuple[int, int] | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` micro-batches of 8 samples (16 features, 4 classes) for ``rank``; ``nan_at`` (rank, index): one bad
    sample in that rank's micro-batch (data, not hardware)."""
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for i in range(count):
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        if nan_at is not None and nan_at == (rank, i):
            x[0, 0] = float("nan")
        out.append((x, y))
    return out


def launcher_env(world: int) -> Any:
    """Per-rank environment that makes Lightning and Accelerate take the already initialised process group as a
    torchrun launch (processes created outside, nothing to spawn)."""
    def env(rank: int) -> dict[str, str]:
        return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "sdc-integration-test", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29999"}
    return env


def summary(incidents: list[sdc.Incident], observer: ResultCounter, raised: sdc.SDCDetected | None,
            **extra: Any) -> dict[str, Any]:
    return {"incidents": [(i.step, i.check, list(i.suspect_ranks)) for i in incidents],
            "results": dict(observer.results),
            "raised": (raised.incident.step, raised.incident.check, list(raised.incident.suspect_ranks))
            if raised is not None else None,
            **extra}


def assert_healthy_and_replayed(results: list[dict[str, Any]], steps: int = 4, audits: int = 2,
                                certificates: int = 0) -> None:
    """Every rank: no incident, nothing raised, ``steps`` optimizer steps, ``audits`` replay passes, weights and
    grad_local passing every step (and weights once more for each of ``certificates``, which check the weights
    first), and no failed, errored or skipped check."""
    for rank, r in enumerate(results):
        assert r["raised"] is None and r["incidents"] == [], f"rank {rank}: {r}"
        assert r["global_step"] == steps
        assert r["results"].get(("replay", "pass")) == audits, f"rank {rank}: {r['results']}"
        assert r["results"].get(("weights", "pass")) == steps + certificates
        assert r["results"].get(("grad_local", "pass")) == steps
        assert not any(res in ("fail", "error", "skipped") for _, res in r["results"])


def verify_cli(path: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    """``sdc-telemetry verify-checkpoint PATH`` through the installed command."""
    return subprocess.run([str(Path(sys.executable).parent / "sdc-telemetry"), "verify-checkpoint", os.fspath(path)],
                          capture_output=True, text=True, timeout=120, check=False)
