"""Context parallelism with FSDP2 over dp_shard x cp: each cp rank holds one chunk of a sequence (4 gloo ranks)."""

from __future__ import annotations

from typing import Any

import pytest

from sdc_telemetry.testing import spawn_ranks

from ._cp_runs import run_cp
from ._scenarios import VERDICTS, on_path

SCENARIOS = {
    "healthy": {"config": {"replay_every": 2}, "steps": 4},
    "transient": {"config": {"replay_every": 2}, "steps": 3,
                  "perturb": {"rank": 3, "step": 2, "module": "blocks.0.mlp", "relative": 1e-3, "transient": True}},
}


@pytest.fixture(scope="module", params=VERDICTS)
def cp(request: pytest.FixtureRequest) -> dict[str, Any]:
    """One spawn of 4 ranks on a (dp_shard 2, cp 2) mesh running both scenarios, once per verdict path."""
    results = spawn_ranks(run_cp, 4, (on_path(list(SCENARIOS.values()), request.param),), timeout=500)
    return dict(zip(SCENARIOS, zip(*results, strict=True), strict=True))


def test_cp_healthy_run_passes_every_check_with_the_replay_coordinate_by_coordinate(cp: dict[str, Any]) -> None:
    """The partner replica's cp ranks recompute the origin's same-cp chunks together (their K/V all-gathers line
    up): every audit passes, no errors, on every rank."""
    for r in cp["healthy"]:
        assert r["incidents"] == [] and r["errors"] == []
        assert r["counts"]["replay"] == {"pass": 2} and r["counts"]["grad_local"] == {"pass": 4}, r["counts"]


def test_cp_transient_compute_fault_names_the_origin_replica(cp: dict[str, Any]) -> None:
    """A transient fault on rank 3 (dp_shard 1, cp 1) spreads to its cp peer through K/V: the replay names replica
    1's ranks (it cannot reproduce its own step), with coordinates; one host, so not ambiguous."""
    incidents = cp["transient"][0]["incidents"]
    assert all(r["incidents"] == incidents for r in cp["transient"])
    step, check, suspects, verdict, coordinate, ambiguous = incidents[0]
    assert (step, check, verdict) == (2, "replay", "transient") and 3 in suspects and set(suspects) <= {2, 3}
    assert coordinate["dp_shard"] == 1 and not ambiguous
