"""Context parallelism inside pipeline stages: pp 2 x dp_shard 2 x cp 2 on 8 gloo ranks, each stage module's
attention context-parallel over ``cp`` (torch's ``_ContextParallel`` SDPA style) and the stage module ``fully_shard``-ed
over the flattened ``dp_shard_cp`` (torchtitan's layout without dp_replicate and tp), under Schedule1F1B. Each cp rank
trains on its chunk of its replica's sequences; each stage on a host of its own (ranks 0-3 stage 0, 4-7 stage 1)."""

from __future__ import annotations

from typing import Any

import pytest

from sdc_telemetry.testing import spawn_ranks

from ._pp import pp_hosts, run_pp
from ._scenarios import on_path

TRANSIENT = {"perturb_output": {"rank": 5, "step": 2, "module": "block.mlp.0", "relative": 1e-3, "transient": True}}
SCENARIOS = {
    "healthy": {"config": {"replay_every": 2}, "steps": 4},
    "off": {"monitor": False, "steps": 4},
    "compute": {"config": {"replay_every": 2}, "steps": 4, "faults": TRANSIENT},
}


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    """One spawn of 8 ranks: every scenario on the immediate verdict path, the compute fault on the deferred one."""
    scenarios = on_path(list(SCENARIOS.values()), "immediate") + on_path([SCENARIOS["compute"]], "deferred")
    names = [*SCENARIOS, "compute_deferred"]
    results = spawn_ranks(run_pp, 8, ([{**sc, "cp": True} for sc in scenarios],), timeout=900, rank_env=pp_hosts)
    return dict(zip(names, zip(*results, strict=True), strict=True))


def test_pp_cp_healthy_counts_every_check_and_changes_nothing(runs: dict[str, Any]) -> None:
    """Every rank's local gradients (before the dp_shard_cp reduce-scatter) and reduced shards pass each step, the
    at-rest check and the update audit pass, the partner replica's rerun of the whole schedule step (each cp rank its
    own chunk, the K/V all-gathers of the cp attention inside each stage, the sends between stages) passes, and
    training is bitwise that of the unmonitored run. The cp ranks are slots of one replica: 2 replicas, not 4."""
    for r, off in zip(runs["healthy"], runs["off"], strict=True):
        assert r["incidents"] == [] and r["errors"] == []
        assert "fsdp over 2 replica(s)" in r["layout"] and "pp=2 x dp_shard=2 x cp=2" in r["layout"], r["layout"]
        counts = r["counts"]
        assert counts["grad_local"] == {"pass": 4} and counts["grad_reduced"] == {"pass": 4}, counts
        assert counts["replay"] == {"pass": 2} and counts["weights"] == {"skipped": 1, "pass": 3}, counts
        assert counts["update"] == {"pass": 2}, counts
        assert r["losses"] == off["losses"]
        assert all(r["weights"][n].equal(w) for n, w in off["weights"].items())


@pytest.mark.parametrize("path", ["", "_deferred"])
def test_pp_cp_compute_fault_named_at_its_stage_on_its_cp_group(runs: dict[str, Any], path: str) -> None:
    """A transient compute fault on rank 5 (stage 1, dp_shard 0, cp 1) reaches its cp partner (rank 4) through the
    attention's K/V exchange; stage 1's output is the first that differs, so the page names stage 1's two cp ranks of
    that replica, both on stage 1's host: not ambiguous. The other replica's ranks and stage 0 are not named."""
    per_rank = runs["compute" + path]
    assert any("output of block.mlp.0" in f for f in per_rank[5]["fired"])
    assert all(r["incidents"] == per_rank[0]["incidents"] and r["errors"] == [] for r in per_rank)
    assert per_rank[0]["incidents"] == [(2, "replay", [4, 5], "transient", {"pp": 1, "dp_shard": 0, "cp": 0}, False,
                                         [1, "output"])]
