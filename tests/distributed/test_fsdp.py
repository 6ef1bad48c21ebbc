"""FSDP2 and HSDP (fully_shard on a 1-D or a (replicate, shard) mesh) on gloo CPU ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sdc_telemetry.testing import spawn_ranks

from ._fsdp import run_fsdp
from ._scenarios import VERDICTS, on_path

HSDP = {
    "flip": {"config": {"replay_every": 0}, "steps": 5,
             "flip": {"rank": 3, "step": 3, "param": "l2.weight", "index": 7, "bit": 12}},
    "nan": {"config": {"replay_every": 0}, "steps": 4, "nan": {"rank": 4, "step": 2}, "guard": True},
    "compute": {"config": {"replay_every": 3}, "steps": 5,
                "perturb": {"rank": 1, "step": 1, "module": "l2", "relative": 1e-3}},
    "nan_then_audit": {"config": {"replay_every": 2}, "steps": 4, "nan": {"rank": 4, "step": 1}, "guard": True},
    "healthy": {"config": {"replay_every": 3}, "steps": 30},
    "on": {"config": {"replay_every": 2}, "steps": 20},
    "off": {"monitor": False, "steps": 20},
}


@pytest.fixture(scope="module", params=VERDICTS)
def hsdp(request: pytest.FixtureRequest) -> dict[str, Any]:
    """One spawn of 6 ranks on a (3 replicas, 2 shards) mesh running every HSDP scenario, once per verdict path."""
    results = spawn_ranks(run_fsdp, 6, ((3, 2), on_path(list(HSDP.values()), request.param)), timeout=600)
    return dict(zip(HSDP, zip(*results, strict=True), strict=True))


def _same(per_rank: tuple[dict[str, Any], ...]) -> list[Any]:
    assert all(r["incidents"] == per_rank[0]["incidents"] for r in per_rank)
    return per_rank[0]["incidents"]  # type: ignore[no-any-return]


def test_hsdp_shard_bit_flip_found_by_weights_on_that_rank(hsdp: dict[str, Any]) -> None:
    """A flipped bit in rank 3's shard is named by the weight check at that step: by the vote among its shard's
    replicas and by rank 3's own at-rest comparison."""
    assert _same(hsdp["flip"])[0] == (3, "weights", [3], "at_rest")


def test_hsdp_nan_in_one_batch_is_data_after_a_triggered_audit(hsdp: dict[str, Any]) -> None:
    """A NaN in rank 4's batch shows in its reduce-scatter input only; the triggered audit (every rank recomputes
    through the sharded model) gets the same NaN on rank 4's partner: verdict data, no suspect."""
    assert _same(hsdp["nan"])[0] == (2, "grad_local", [], "data")


def test_hsdp_late_data_verdict_then_a_scheduled_audit(hsdp: dict[str, Any]) -> None:
    """A NaN in rank 4's batch at step 1 and an audit at step 2: (deferred) step 1's replay in lockstep through the
    sharded model runs just before step 2's, which still passes on every rank."""
    assert _same(hsdp["nan_then_audit"]) == [(1, "grad_local", [], "data")]
    for r in hsdp["nan_then_audit"]:
        assert r["counts"]["replay"] == {"pass": 2} and not r["errors"]


def test_hsdp_compute_fault_found_by_replay(hsdp: dict[str, Any]) -> None:
    """Rank 1 computes wrong from step 1: the next audit (step 3) names it."""
    assert _same(hsdp["compute"])[0][:3] == (3, "replay", [1])


def test_hsdp_healthy_run_is_silent_and_audited(hsdp: dict[str, Any]) -> None:
    """30 healthy steps with replay every 3: no incident, every audit and weight check passed on every rank."""
    for r in hsdp["healthy"]:
        assert not r["incidents"] and not r["errors"]
        assert r["counts"]["replay"] == {"pass": 10} and r["counts"]["weights"] == {"pass": 30}
        assert r["counts"]["grad_local"] == {"pass": 30}


def test_hsdp_replay_changes_nothing(hsdp: dict[str, Any]) -> None:
    """After 20 steps the shards are bitwise equal with the monitor (replay every 2) on and off."""
    for on, off in zip(hsdp["on"], hsdp["off"], strict=True):
        assert not on["incidents"]
        assert all(torch.equal(on["weights"][n], off["weights"][n]) for n in off["weights"])


def test_fsdp_1d_faults_found_by_replay_and_at_rest() -> None:
    """A 1-D mesh of 4 (no replicas): replay names the rank with a compute fault; no replica holds a shard, so the
    weights are checked at rest by each rank: a bit flipped in one rank's shard after an update, or in its Adam
    moment, is named on that rank alone."""
    scenarios = [{"config": {"replay_every": 2}, "steps": 4,
                  "perturb": {"rank": 2, "step": 1, "module": "l1", "relative": 1e-3}},
                 {"config": {"replay_every": 2}, "steps": 6},
                 {"config": {"replay_every": 2}, "steps": 6, "mixed": True},
                 {"config": {"replay_every": 2, "mode": "tolerance"}, "steps": 6, "mixed": True,
                  "perturb": {"rank": 1, "step": 1, "module": "l1", "relative": 0.05}},
                 {"config": {"replay_every": 2}, "steps": 6, "mixed": "fp16"},
                 {"config": {"replay_every": 0}, "steps": 5,
                  "flip": {"rank": 1, "step": 3, "param": "l2.weight", "index": 7, "bit": 22}},
                 {"config": {"replay_every": 0}, "steps": 5,
                  "state_flip": {"rank": 3, "step": 2, "param": "l1.weight", "key": "exp_avg", "index": 4,
                                 "bit": 26}},
                 {"config": {"replay_every": 0, "update_every": 1}, "steps": 6,
                  "corrupt_update": {"rank": 2, "step": 2, "index": 3, "relative": 1e-3}}]
    faulty, healthy, mixed, mixed_faulty, fp16, flip, moment, update = zip(
        *spawn_ranks(run_fsdp, 4, ((4,), scenarios), timeout=300), strict=True)
    assert _same(faulty)[0][:3] == (2, "replay", [2])
    for r in healthy:  # every check counted: the weights at rest from the first update on; the updates of steps
        # 0, 2, 4 audited (update_every follows replay_every where nothing is replicated) at steps 1, 3, 5
        assert not r["incidents"] and not r["errors"]
        assert r["counts"]["replay"] == {"pass": 3} and r["counts"]["weights"] == {"skipped": 1, "pass": 5}
        assert r["counts"]["update"] == {"pass": 3}, r["counts"]
    assert _same(flip) == [(3, "weights", [1], "at_rest")]
    assert _same(moment) == [(2, "weights", [3], "at_rest")]
    # rank 2's optimizer computes one element wrong from step 2 on, its own updates and its recomputations alike
    # (persistent). At step 2 (the audit of update 1) it recomputes its origin's slice wrong: the origin's rerun and
    # a referee side with the origin, so rank 2 is named as the faulty partner; from the audit of update 2 on its
    # own update is wrong too (one episode). Rank 2 alone, never its origin.
    assert _same(update) == [(2, "update", [2], "persistent")]
    ev = update[0]["evidence"][0]
    assert ev["ambiguous"] is False and ev["update_step"] == 1
    [(origin, entry)] = ev["origins"].items()
    assert entry["fault"] == "partner" and entry["partner_rank"] == 2 and origin != "2"
    assert entry["referee_rank"] not in (2, int(origin)) and entry["differing_tensor_count"] >= 1
    for r in update:
        assert r["counts"]["update"] == {"pass": 1, "fail": 4} and not r["errors"], r["counts"]
        assert r["counts"]["weights"] == {"skipped": 1, "pass": 5}  # not at rest: the update itself was wrong
    # bf16 parameters, fp32 reduction: the replay reproduces the reduce-scatter input bit for bit, and in tolerance
    # mode a 5% compute fault is still named.
    for r in mixed:
        assert not r["incidents"] and r["counts"]["replay"] == {"pass": 3} and not r["errors"]
    assert _same(mixed_faulty)[0][:3] == (2, "replay", [1])
    # fp16 reduction: FSDP divides the gradients before the reduce-scatter; the replay divides the same way.
    for r in fp16:
        assert not r["incidents"] and r["counts"]["replay"] == {"pass": 3} and not r["errors"], r["counts"]


def test_hsdp_with_one_rank_shard_groups() -> None:
    """HSDP on a (3 replicas, 1 shard) mesh: FSDP never calls its reduce-scatter for a shard group of one rank (it
    copies the gradients, then all-reduces them across the replicas), and the monitor reads the local gradients at
    that copy. Healthy, in fp32 and with fp16 reduction (FSDP divides the copy before the all-reduce): every check
    passes and the replay reproduces them; a compute fault is named by the replay; training is bitwise unchanged."""
    scenarios = [{"config": {"replay_every": 2}, "steps": 6}, {"monitor": False, "steps": 6},
                 {"config": {"replay_every": 2}, "steps": 6, "mixed": "fp16"},
                 {"config": {"replay_every": 3}, "steps": 5,
                  "perturb": {"rank": 1, "step": 1, "module": "l2", "relative": 1e-3}}]
    results = spawn_ranks(run_fsdp, 3, ((3, 1), scenarios), timeout=600)
    for r in results:
        healthy, off, fp16, compute = r
        for run in (healthy, fp16):
            assert run["incidents"] == [] and run["errors"] == [], run
            assert run["counts"] == {"grad_local": {"pass": 6}, "grad_reduced": {"pass": 6},
                                     "weights": {"pass": 6}, "replay": {"pass": 3}}, run["counts"]
        assert all(healthy["weights"][n].equal(w) for n, w in off["weights"].items())
        assert compute["incidents"] == [(3, "replay", [1], "persistent")] and compute["errors"] == []
