"""Expert parallelism: a mixture-of-experts model with its experts sharded over an ``ep`` dim (torchtitan's layout:
the sparse mesh (dp_replicate, efsdp, ep) splits dp_shard, tokens move by all-to-all), FSDP2 over the rest."""

from __future__ import annotations

from typing import Any

import pytest

from sdc_telemetry.testing import spawn_ranks

from ._ep import run_ep
from ._scenarios import VERDICTS, on_path

# dp_shard 4 split into efsdp 2 x ep 2: two replicas of two expert slots, no replica of any shard
SHAPE = (1, 4, 2)
SCENARIOS = {
    "healthy": {"config": {"replay_every": 2}, "steps": 6},
    "off": {"monitor": False, "steps": 6},
    # rank 3's experts compute wrongly once (inside the experts, before the combine sends their results back)
    "expert": {"config": {"replay_every": 3}, "steps": 4,
               "perturb": {"rank": 3, "step": 0, "module": "m1.routed.experts", "relative": 1e-3, "first": True,
                           "transient": True}},
    # the same, persistent: two replicas cannot say which of them is wrong
    "expert_persistent": {"config": {"replay_every": 3}, "steps": 4,
                          "perturb": {"rank": 3, "step": 0, "module": "m1.routed.experts", "relative": 1e-3,
                                      "first": True}},
    # rank 2's dense layer norm computes wrongly once: the tokens it sends to the experts differ
    "dense": {"config": {"replay_every": 3}, "steps": 4,
              "perturb": {"rank": 2, "step": 0, "module": "m2.norm", "relative": 1e-3, "transient": True}},
    "flip": {"config": {"replay_every": 0}, "steps": 4,
             "flip": {"rank": 1, "step": 2, "param": "m2.routed.experts.w1", "index": 5, "bit": 12}},
    "nan": {"config": {"replay_every": 0}, "steps": 4, "nan": {"rank": 0, "step": 2}},
    "update": {"config": {"replay_every": 0, "update_every": 1}, "steps": 5,
               "corrupt_update": {"rank": 1, "step": 2, "index": 2, "relative": 1e-3}},
    # torchtitan 0.3's form: one fully_shard per MoE block, the experts a second parameter group on the efsdp mesh
    "one_module": {"config": {"replay_every": 2}, "steps": 4, "one_module": True,
                   "perturb": {"rank": 1, "step": 2, "module": "m2.routed.experts", "relative": 1e-3, "first": True,
                               "transient": True}},
    # expert 3 (rank 1's and rank 3's second local expert) never receives a token
    "starved": {"config": {"replay_every": 2}, "steps": 4, "starve": 3},
    # dp_replicate 2 x dp_shard 2 with ep 2: the experts are replicated, one rank's shard each (efsdp 1)
    "replicated": {"config": {"replay_every": 2}, "steps": 6, "shape": (2, 2, 2)},
    "replicated_flip": {"config": {"replay_every": 0}, "steps": 4, "shape": (2, 2, 2),
                        "flip": {"rank": 2, "step": 2, "param": "m1.routed.experts.w2", "index": 1, "bit": 12}},
}


@pytest.fixture(scope="module", params=VERDICTS)
def ep(request: pytest.FixtureRequest) -> dict[str, Any]:
    """One spawn of 4 ranks running every scenario, once per verdict path."""
    results = spawn_ranks(run_ep, 4, (*SHAPE, on_path(list(SCENARIOS.values()), request.param)), timeout=600)
    return dict(zip(SCENARIOS, zip(*results, strict=True), strict=True))


def _same(per_rank: tuple[dict[str, Any], ...]) -> list[Any]:
    assert all(r["incidents"] == per_rank[0]["incidents"] for r in per_rank)
    return per_rank[0]["incidents"]  # type: ignore[no-any-return]


def test_expert_parallel_healthy_run_counts_every_check_and_changes_nothing(ep: dict[str, Any]) -> None:
    """Every check passes on every rank (the replay of a partner ep group through its own all-to-alls included), and
    training is bitwise the unmonitored one."""
    for r, off in zip(ep["healthy"], ep["off"], strict=True):
        assert r["incidents"] == [] and r["errors"] == []
        assert r["counts"] == {"grad_local": {"pass": 6}, "grad_reduced": {"pass": 6}, "replay": {"pass": 3},
                               "weights": {"skipped": 1, "pass": 5}, "update": {"pass": 3}}, r["counts"]
        assert r["losses"] == off["losses"]
        assert all(r["weights"][n].equal(w) for n, w in off["weights"].items())
    assert ep["healthy"][0]["layout"].startswith("dp_shard x ep over 4 ranks")


def test_a_fault_in_one_ranks_experts_is_named_on_that_rank(ep: dict[str, Any]) -> None:
    """Rank 3's experts compute wrongly: their results reach rank 2 through the combine, so both ranks of its
    replica disagree with the partner replica; their records of the first MoE layer name rank 3 alone (its
    experts' output differs, every rank's tokens matched)."""
    [incident] = _same(ep["expert"])
    assert incident[:4] == (0, "replay", [3], "transient"), incident
    assert incident[4] == {"dp_replicate": 0, "dp_shard": 3, "ep": 1} and not incident[6]
    assert incident[5] == "m1.routed.experts"


def test_a_persistent_expert_fault_with_two_replicas_is_narrowed_to_its_slot(ep: dict[str, Any]) -> None:
    """Persistent, with two replicas: each reproduces itself, so which replica is wrong stays ambiguous, but the
    first MoE layer's records narrow it to the same expert slot of both (ranks 1 and 3), not all four ranks."""
    [incident] = _same(ep["expert_persistent"])
    assert incident[:4] == (0, "replay", [1, 3], "persistent") and incident[5] == "m1.routed.experts", incident
    assert incident[6]


def test_a_dense_fault_is_named_at_the_tokens_its_rank_sends(ep: dict[str, Any]) -> None:
    """Rank 2's second layer norm computes wrongly: the tokens it sends to the second MoE layer's experts differ
    first, so rank 2 is named, not the rank whose experts received them."""
    [incident] = _same(ep["dense"])
    assert incident[:4] == (0, "replay", [2], "transient") and incident[5] == "m2.routed.experts", incident
    assert not incident[6]


def test_expert_weights_checked_without_and_with_replicas(ep: dict[str, Any]) -> None:
    """A bit flipped in rank 1's expert shard is named by its at-rest comparison (no replica holds it); with two
    replicas of the experts the flip on rank 2 is named on rank 2 alone."""
    assert [i[:4] for i in _same(ep["flip"])] == [(2, "weights", [1], "at_rest")]
    assert [i[:4] for i in _same(ep["replicated_flip"])] == [(2, "weights", [2], "at_rest")]


def test_a_wrong_update_of_an_expert_shard_is_named_by_the_update_audit(ep: dict[str, Any]) -> None:
    update = _same(ep["update"])
    assert update[0][:4] == (2, "update", [1], "persistent"), update


def test_a_nan_in_one_batch_is_data(ep: dict[str, Any]) -> None:
    """A NaN in rank 0's batch reaches the experts of the other ranks its tokens go to; the triggered audit's partner
    replica recomputes the same NaNs: data, nobody named."""
    assert _same(ep["nan"])[0][:4] == (2, "grad_local", [], "data")


def test_replicated_experts_vote_and_replay(ep: dict[str, Any]) -> None:
    """dp_replicate 2 x dp_shard 2, ep 2 (each expert shard on one rank of each replica: FSDP copies its gradients
    instead of reduce-scattering them): the weight vote runs from the first step, every audit passes."""
    for r in ep["replicated"]:
        assert r["incidents"] == [] and r["errors"] == []
        assert r["counts"]["weights"] == {"pass": 6} and r["counts"]["replay"] == {"pass": 3}, r["counts"]
        assert r["counts"]["grad_local"] == {"pass": 6}


def test_experts_in_a_second_parameter_group_of_their_block(ep: dict[str, Any]) -> None:
    """torchtitan 0.3 shards each MoE block with one fully_shard whose shard_placement_fn puts the experts on the
    efsdp mesh: two parameter groups in one FSDP module, each tapped and recomputed on its own. The audit of step 0
    passes; rank 1's experts computing wrongly at step 2 are named at the second MoE layer."""
    [incident] = _same(ep["one_module"])
    assert incident[:4] == (2, "replay", [1], "transient") and incident[5] == "m2.routed.experts", incident
    assert not incident[6]
    for r in ep["one_module"]:
        assert r["errors"] == [] and r["counts"]["replay"] == {"pass": 1, "fail": 1}, r["counts"]
        assert r["counts"]["grad_local"] == {"pass": 4}, r["counts"]


def test_an_expert_that_receives_no_token_passes(ep: dict[str, Any]) -> None:
    """Expert 3 never receives a token (its slice of the experts' weights gets a zero gradient, as torchtitan's
    grouped experts give it): every check passes, the replay audits included, on every rank."""
    for r in ep["starved"]:
        assert r["incidents"] == [] and r["errors"] == []
        assert r["counts"]["replay"] == {"pass": 2} and r["counts"]["grad_local"] == {"pass": 4}, r["counts"]
