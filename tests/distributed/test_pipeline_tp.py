"""Tensor parallelism inside pipeline stages: pp 2 x dp_shard 2 x tp 2 on 8 gloo ranks, each stage module
``parallelize_module``-d over ``tp`` and ``fully_shard``-ed over ``dp_shard`` (torchtitan's layout without
dp_replicate), one stage a rank under Schedule1F1B or two under ScheduleInterleaved1F1B. Each stage on a host of
its own (ranks 0-3 hold stage 0, 4-7 stage 1)."""

from __future__ import annotations

from typing import Any

import pytest

from sdc_telemetry.testing import spawn_ranks

from ._pp import pp_hosts, run_pp
from ._scenarios import on_path

TRANSIENT = {"perturb_output": {"rank": 5, "step": 2, "module": "0", "relative": 1e-3, "transient": True}}
SCENARIOS = {
    "healthy": {"config": {"replay_every": 2}, "steps": 4},
    "off": {"monitor": False, "steps": 4},
    "compute": {"config": {"replay_every": 2}, "steps": 4, "faults": TRANSIENT},
    "flip": {"config": {"replay_every": 0}, "steps": 4,
             "faults": {"flip_weight_bit": {"rank": 6, "step": 2, "param": "2.weight", "index": 3, "bit": 12}}},
    "interleaved_compute": {"config": {"replay_every": 2}, "steps": 4, "schedule": "interleaved",
                            "faults": {"perturb_output": {"rank": 2, "step": 2, "module": "1.0", "relative": 1e-3,
                                                          "transient": True}}},
}
DEFERRED = ("compute", "interleaved_compute")  # the replay's findings on the other verdict path too
# pp 2 x dp_replicate 2 x tp 2 (dp_shard 1): HSDP stage modules whose shard groups are one rank
REPLICATED = {f"replicated_{k}": {**SCENARIOS[k], "replicate": True} for k in ("healthy", "off", "compute", "flip")}


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    """One spawn of 8 ranks: every scenario on the immediate verdict path, the replay's on the deferred one, and the
    replicated layout's."""
    scenarios = on_path(list(SCENARIOS.values()), "immediate") + on_path([SCENARIOS[k] for k in DEFERRED],
                                                                         "deferred") + list(REPLICATED.values())
    names = list(SCENARIOS) + [f"{k}_deferred" for k in DEFERRED] + list(REPLICATED)
    results = spawn_ranks(run_pp, 8, ([{**sc, "tp": True} for sc in scenarios],), timeout=900, rank_env=pp_hosts)
    return dict(zip(names, zip(*results, strict=True), strict=True))


def _same(per_rank: tuple[dict[str, Any], ...]) -> list[Any]:
    assert all(r["incidents"] == per_rank[0]["incidents"] for r in per_rank)
    return per_rank[0]["incidents"]  # type: ignore[no-any-return]


def test_pp_tp_healthy_counts_every_check_and_changes_nothing(runs: dict[str, Any]) -> None:
    """Every rank's local gradients (its tp shard, before the dp_shard reduce-scatter) and reduced shards pass each
    step, its shards pass the at-rest check from the first update on, the partner replica's rerun of the whole
    schedule step (tp collectives inside each stage, sends between stages) passes, and training is bitwise that of
    the unmonitored run."""
    for r, off in zip(runs["healthy"], runs["off"], strict=True):
        assert r["incidents"] == [] and r["errors"] == []
        assert "pp=2 x dp_shard=2 x tp=2" in r["layout"], r["layout"]
        counts = r["counts"]
        assert counts["grad_local"] == {"pass": 4} and counts["grad_reduced"] == {"pass": 4}, counts
        assert counts["replay"] == {"pass": 2} and counts["weights"] == {"skipped": 1, "pass": 3}, counts
        assert r["losses"] == off["losses"]
        assert all(r["weights"][n].equal(w) for n, w in off["weights"].items())


@pytest.mark.parametrize("path", ["", "_deferred"])
def test_pp_tp_compute_fault_named_at_its_stage_on_its_tp_group(runs: dict[str, Any], path: str) -> None:
    """A transient compute fault on rank 5 (stage 1, dp_shard 0, tp 1) reaches its tp partner (rank 4) through the
    row-parallel all-reduce and stage 0 of the replica through backward; stage 1's output is the first that differs,
    so the page names stage 1's two tp ranks, both on stage 1's host: not ambiguous."""
    assert any("output of 0" in f for f in runs["compute" + path][5]["fired"])
    assert _same(runs["compute" + path]) == [(2, "replay", [4, 5], "transient", {"pp": 1, "dp_shard": 0, "tp": 0},
                                              False, [1, "output"])]


def test_pp_tp_weight_flip_named_with_its_coordinate(runs: dict[str, Any]) -> None:
    """A bit flipped in rank 6's local shard of a row-parallel weight (stage 1, dp_shard 1, tp 0): no replica holds
    that shard, and the at-rest check names rank 6 alone with its coordinate."""
    assert _same(runs["flip"]) == [(2, "weights", [6], "at_rest", {"pp": 1, "dp_shard": 1, "tp": 0}, False, None)]


@pytest.mark.parametrize("path", ["", "_deferred"])
def test_pp_tp_interleaved_fault_named_at_its_stage(runs: dict[str, Any], path: str) -> None:
    """Two tensor-parallel stage modules a rank (stages 0 and 2 on pp rank 0): a transient fault in stage 2 on rank 2
    is named at stage 2, on the tp ranks of that stage in that replica (ranks 2 and 3); healthy audits passed first
    on every rank."""
    for r in runs["interleaved_compute" + path]:
        assert r["errors"] == [] and r["counts"]["replay"] == {"pass": 1, "fail": 1}, r["counts"]
    assert _same(runs["interleaved_compute" + path]) == [
        (2, "replay", [2, 3], "transient", {"pp": 0, "dp_shard": 1, "tp": 0}, False, [2, "output"])]


def test_pp_tp_dp_replicate_without_dp_shard(runs: dict[str, Any]) -> None:
    """pp 2 x dp_replicate 2 x tp 2, torchtitan's ``dp_replicate x tp x pp`` (dp_shard 1: FSDP never calls its
    reduce-scatter and copies the gradients, then all-reduces them across the replicas): the local gradients are read
    at that copy. Healthy: every check passes, the weight vote runs from the first step (every shard has a replica),
    training is bitwise that of the unmonitored run. A transient compute fault on rank 5 is named at stage 1 on its
    tp ranks; a bit flipped in rank 6's weights is named on rank 6 alone (the at-rest check referees the two
    replicas)."""
    for r, off in zip(runs["replicated_healthy"], runs["replicated_off"], strict=True):
        assert r["incidents"] == [] and r["errors"] == []
        assert "pp=2 x dp_replicate=2 x dp_shard=1 x tp=2" in r["layout"], r["layout"]
        counts = r["counts"]
        assert counts["grad_local"] == {"pass": 4} and counts["grad_reduced"] == {"pass": 4}, counts
        assert counts["replay"] == {"pass": 2} and counts["weights"] == {"pass": 4}, counts
        assert r["losses"] == off["losses"]
        assert all(r["weights"][n].equal(w) for n, w in off["weights"].items())
    assert _same(runs["replicated_compute"]) == [
        (2, "replay", [4, 5], "transient", {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "tp": 0}, False,
         [1, "output"])]
    assert _same(runs["replicated_flip"]) == [
        (2, "weights", [6], "at_rest", {"pp": 1, "dp_replicate": 1, "dp_shard": 0, "tp": 0}, False, None)]
