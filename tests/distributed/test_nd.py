"""N-D parallelism: DTensor tensor parallelism with FSDP2 and HSDP on one DeviceMesh (torchtitan's dim names)."""

from __future__ import annotations

from typing import Any

import pytest

from sdc_telemetry.testing import spawn_ranks

from ._nd import run_nd
from ._scenarios import VERDICTS, on_path

HSDP_TP = ((2, 2, 2), ("dp_replicate", "dp_shard", "tp"))
HSDP_TP_SCENARIOS = {
    "healthy": {"config": {"replay_every": 2}, "steps": 6},
    # a healthy step's bytes: step 1 would audit step 0's update (update_every follows replay_every): off here
    "bytes": {"config": {"replay_every": 1000, "update_every": 0}, "steps": 4, "count_bytes": True},
    "flip": {"config": {"replay_every": 0}, "steps": 4,
             "flip": {"rank": 5, "step": 2, "param": "b1.up.weight", "index": 3, "bit": 12}},
    "compute": {"config": {"replay_every": 3}, "steps": 4,
                "perturb": {"rank": 6, "step": 0, "module": "b2.up", "relative": 1e-3}},
    "off": {"monitor": False, "steps": 6},
}
SMALL = ((1, 2, 2), ("dp_replicate", "dp_shard", "tp"))
SMALL_SCENARIOS = {
    # a healthy step's bytes: step 1 would audit step 0's update (update_every follows replay_every): off here
    "bytes": {"config": {"replay_every": 1000, "update_every": 0}, "steps": 4, "count_bytes": True},
    # two replicas of a mesh with 2 shard keys (HSDP, dp_shard 2), against HSDP_TP's 4 keys on 8 ranks
    "bytes_replicas": {"config": {"replay_every": 1000, "update_every": 0}, "steps": 4, "count_bytes": True,
                       "shape": (2, 2), "names": ("dp_replicate", "dp_shard")},
    "sequence_parallel": {"config": {"replay_every": 2}, "steps": 4, "shape": (2, 2), "names": ("dp_shard", "tp"),
                          "sequence_parallel": True},
    # two micro-batches a step: FSDP sums the norms' partial gradients over both before redistributing them
    "sequence_parallel_accumulate": {"config": {"replay_every": 2}, "steps": 4, "shape": (2, 2),
                                     "names": ("dp_shard", "tp"), "sequence_parallel": True, "micro": 2},
    "fsdp_tp": {"config": {"replay_every": 2}, "steps": 4, "shape": (2, 2), "names": ("dp_shard", "tp"),
                "explicit_mesh": True,
                "perturb": {"rank": 3, "step": 0, "module": "b1.down", "relative": 1e-3, "transient": True}},
    # dp_replicate=1: no replica of any shard; the at-rest check and the update audit stand in for the vote
    "flip": {"config": {"replay_every": 0}, "steps": 4, "shape": (2, 2), "names": ("dp_shard", "tp"),
             "flip": {"rank": 3, "step": 2, "param": "b1.up.weight", "index": 3, "bit": 12}},
    "update": {"config": {"replay_every": 0, "update_every": 1}, "steps": 5, "shape": (2, 2),
               "names": ("dp_shard", "tp"), "corrupt_update": {"rank": 1, "step": 2, "index": 2, "relative": 1e-3}},
}


@pytest.fixture(scope="module", params=VERDICTS)
def hsdp_tp(request: pytest.FixtureRequest) -> dict[str, Any]:
    """One spawn of 8 ranks on a (dp_replicate 2, dp_shard 2, tp 2) mesh running every scenario, once per verdict
    path."""
    scenarios = on_path(list(HSDP_TP_SCENARIOS.values()), request.param)
    results = spawn_ranks(run_nd, 8, (*HSDP_TP, scenarios), timeout=600)
    return dict(zip(HSDP_TP_SCENARIOS, zip(*results, strict=True), strict=True))


@pytest.fixture(scope="module", params=VERDICTS)
def small(request: pytest.FixtureRequest) -> dict[str, Any]:
    """One spawn of 4 ranks: the same N-D layout with one replica, and FSDP x TP with an explicit mesh, once per
    verdict path."""
    results = spawn_ranks(run_nd, 4, (*SMALL, on_path(list(SMALL_SCENARIOS.values()), request.param)), timeout=400)
    return dict(zip(SMALL_SCENARIOS, zip(*results, strict=True), strict=True))


def _same(per_rank: tuple[dict[str, Any], ...]) -> list[Any]:
    assert all(r["incidents"] == per_rank[0]["incidents"] for r in per_rank)
    return per_rank[0]["incidents"]  # type: ignore[no-any-return]


def test_hsdp_tp_healthy_run_counts_every_check_and_changes_nothing(hsdp_tp: dict[str, Any]) -> None:
    """2x2x2: every check passes on every rank (replay included, no error), and training is bitwise unmonitored."""
    for r, off in zip(hsdp_tp["healthy"], hsdp_tp["off"], strict=True):
        assert r["incidents"] == [] and r["errors"] == []
        # two replicas: the updates of steps 0, 2, 4 are audited (at steps 1, 3, 5)
        assert r["counts"] == {"grad_local": {"pass": 6}, "grad_reduced": {"pass": 6}, "weights": {"pass": 6},
                               "replay": {"pass": 3}, "update": {"pass": 3}}, r["counts"]
        assert r["losses"] == off["losses"]
        assert all(r["weights"][n].equal(w) for n, w in off["weights"].items())
    assert hsdp_tp["healthy"][0]["layout"].startswith("dp_replicate x dp_shard x tp")


def test_hsdp_tp_weight_bit_flip_named_with_its_coordinate(hsdp_tp: dict[str, Any]) -> None:
    """A bit flipped in rank 5's local tp shard: the weight check of that step names it with its mesh coordinate.
    Two replicas alone cannot tell which one is right; rank 5's at-rest comparison can, so rank 5 alone is named."""
    assert [i[:4] for i in _same(hsdp_tp["flip"])] == [(2, "weights", [5], "at_rest")]
    *_, coordinate, ambiguous = _same(hsdp_tp["flip"])[0]
    assert coordinate is not None and coordinate["tp"] == 1 and coordinate["dp_shard"] == 0
    assert not ambiguous


def test_hsdp_tp_compute_fault_found_by_replay_on_its_replica(hsdp_tp: dict[str, Any]) -> None:
    """A compute fault on rank 6 spreads to its tp partner (rank 7) through the row-parallel all-reduce: the replay
    of a partner replica, coordinate by coordinate, names that replica's ranks (one host: not ambiguous)."""
    incidents = _same(hsdp_tp["compute"])
    assert incidents[0][:4] == (0, "replay", [6, 7], "persistent")
    assert incidents[0][4] == {"dp_replicate": 1, "dp_shard": 1, "tp": 0} and not incidents[0][5]


def test_fsdp_tp_compute_fault_found_by_replay_with_an_explicit_mesh(small: dict[str, Any]) -> None:
    """FSDP x TP (dp_shard 2, tp 2), mesh= passed: a transient compute fault on rank 3 spreads to its tp partner; the
    same-replica rerun does not reproduce the recorded step, so the replay names that replica's ranks (two replicas,
    and still not ambiguous: the origin could not reproduce itself)."""
    incidents = _same(small["fsdp_tp"])
    assert incidents[0][:4] == (0, "replay", [2, 3], "transient") and not incidents[0][5]
    assert incidents[0][4]["dp_shard"] == 1
    assert small["fsdp_tp"][0]["layout"].startswith("dp_shard x tp")


def test_nd_healthy_step_bytes_do_not_grow_with_world_size_or_shard_keys(hsdp_tp: dict[str, Any],
                                                                          small: dict[str, Any]) -> None:
    """Two replicas at W=8 with 4 shard keys (dp_shard 2 x tp 2) and at W=4 with 2 (HSDP, dp_shard 2): the monitor's
    collectives move the same bytes per rank on a healthy step, the fixed-size agreement (17 int64 fields, as
    [v, ~v]) and the digest compared within the shard's replicas (two int64). Without replicas (W=4, dp_shard 2 x
    tp 2) there is no weight vote: the agreement alone."""
    big, little = hsdp_tp["bytes"][0]["bytes"], small["bytes_replicas"][0]["bytes"]
    assert big and big == little, (big, little)
    assert all(r["bytes"] == big for r in [*hsdp_tp["bytes"], *small["bytes_replicas"]])
    assert big == {"all_reduce": 2 * 8 * 17 + 2 * 8, "calls": 2}, big
    assert all(r["bytes"] == {"all_reduce": 2 * 8 * 17, "calls": 1} for r in small["bytes"]), small["bytes"][0]


def test_the_digest_groups_of_a_small_mesh_agree_on_healthy_steps(small: dict[str, Any]) -> None:
    """The 2-key mesh's digest groups (ranks {0, 2} and {1, 3}) see no difference on healthy steps."""
    for r in small["bytes_replicas"]:
        assert r["incidents"] == [] and r["errors"] == []
        assert r["counts"]["weights"] == {"pass": 4}, r["counts"]


def test_sequence_parallel_norms_replay_as_fsdp_reduces_them(small: dict[str, Any]) -> None:
    """Sequence-parallel norms (torchtitan's plan): their weights' gradients are partial sums over tp that FSDP2 sums
    before its reduce-scatter; the replay reads its recomputed gradients the same way, so every audit passes (it was
    an error on every rank when the partial gradient was compared)."""
    for r in small["sequence_parallel"]:
        assert r["incidents"] == [] and r["errors"] == []
        # no replica of a shard (dp_shard x tp): the weights are checked at rest, from the first update on
        assert r["counts"] == {"grad_local": {"pass": 4}, "grad_reduced": {"pass": 4}, "replay": {"pass": 2},
                               "weights": {"skipped": 1, "pass": 3}, "update": {"pass": 2}}


def test_sequence_parallel_norms_replay_under_gradient_accumulation(small: dict[str, Any]) -> None:
    """The same with two micro-batches a step (gradient sync on the last one only): FSDP2 accumulates the norms'
    partial DTensor gradients over the micro-batches and redistributes the sum once (one all-reduce of a1 + a2); the
    replay does the same, so its bits are the tap's (redistributing each micro-batch's, as it did, rounds
    differently: every audit failed to reproduce in torchtitan's pp x tp job)."""
    for r in small["sequence_parallel_accumulate"]:
        assert r["incidents"] == [] and r["errors"] == []
        assert r["counts"]["replay"] == {"pass": 2} and r["counts"]["grad_local"] == {"pass": 4}, r["counts"]


def test_without_replicas_a_flip_at_rest_and_a_wrong_update_are_named(small: dict[str, Any]) -> None:
    """dp_shard x tp, no dp_replicate: a bit flipped in rank 3's tp shard after an update is named by its at-rest
    comparison with its coordinate; rank 1's optimizer computing one element wrong from step 2 on is named by the
    update audit (a referee sides with its partner), rank 1 alone."""
    [flip] = _same(small["flip"])
    assert flip[:4] == (2, "weights", [3], "at_rest") and flip[4] == {"dp_shard": 1, "tp": 1} and not flip[5]
    update = _same(small["update"])
    assert update[0][:4] == (2, "update", [1], "persistent") and not update[0][5], update
