"""Pipeline parallelism with data parallelism: SDCMonitor(stage_module, optimizer, pipeline=schedule) on gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest

from sdc_telemetry.testing import spawn_ranks

from ._pp import run_pp, stage_hosts
from ._scenarios import VERDICTS, on_path

SCENARIOS = {
    "healthy": {"config": {"replay_every": 2}, "steps": 5},
    "off": {"monitor": False, "steps": 5},
    "flip": {"config": {"replay_every": 0}, "steps": 4,
             "faults": {"flip_weight_bit": {"rank": 3, "step": 2, "param": "2.weight", "index": 3, "bit": 12}}},
    "compute": {"config": {"replay_every": 3}, "steps": 4,
                "faults": {"perturb_output": {"rank": 2, "step": 0, "module": "0", "relative": 1e-3}}},
    "backward": {"config": {"replay_every": 3}, "steps": 4,
                 "faults": {"perturb_input_grad": {"rank": 3, "step": 0, "module": "0", "relative": 1e-3}}},
    "tolerance_compute": {"config": {"replay_every": 3, "mode": "tolerance", "tolerance": 1e-3}, "steps": 4,
                          "noise": 1e-6,
                          "faults": {"perturb_output": {"rank": 2, "step": 0, "module": "0", "relative": 1e-2}}},
    "fsdp": {"config": {"replay_every": 2}, "steps": 4, "kind": "fsdp"},
    "fsdp_compute": {"config": {"replay_every": 2}, "steps": 3, "kind": "fsdp",
                     "faults": {"perturb_output": {"rank": 5, "step": 0, "module": "0", "relative": 1e-3}}},
    # Several stages per rank: four stages, stages (0, 2) on pp rank 0 and (1, 3) on pp rank 1.
    "interleaved": {"config": {"replay_every": 2}, "steps": 5, "schedule": "interleaved"},
    "interleaved_off": {"monitor": False, "steps": 5, "schedule": "interleaved"},
    "interleaved_compute": {"config": {"replay_every": 3}, "steps": 4, "schedule": "interleaved",
                            "faults": {"perturb_output": {"rank": 2, "step": 0, "module": "1.0", "relative": 1e-3}}},
    "interleaved_flip": {"config": {"replay_every": 0}, "steps": 4, "schedule": "interleaved",
                         "faults": {"flip_weight_bit": {"rank": 3, "step": 2, "param": "1.2.weight", "index": 5,
                                                        "bit": 12}}},
    "looped_fsdp": {"config": {"replay_every": 2}, "steps": 4, "schedule": "looped", "kind": "fsdp",
                    "faults": {"perturb_output": {"rank": 5, "step": 2, "module": "0.0", "relative": 1e-3}}},
    # Zero-bubble (split input and weight backward), fully_shard-ed stage modules.
    "zero_bubble_fsdp": {"config": {"replay_every": 2}, "steps": 4, "schedule": "zero_bubble", "kind": "fsdp",
                         "faults": {"perturb_output": {"rank": 5, "step": 2, "module": "0.0", "relative": 1e-3}}},
    "zbv": {"config": {"replay_every": 2}, "steps": 4, "schedule": "zbv", "kind": "fsdp"},
    "zbv_off": {"monitor": False, "steps": 4, "schedule": "zbv", "kind": "fsdp"},
    "zbv_compute": {"config": {"replay_every": 2}, "steps": 4, "schedule": "zbv", "kind": "fsdp",
                    "faults": {"perturb_output": {"rank": 3, "step": 2, "module": "1.0", "relative": 1e-3}}},
    "dualpipev_compute": {"config": {"replay_every": 2}, "steps": 4, "schedule": "dualpipev", "kind": "fsdp",
                          "faults": {"perturb_output": {"rank": 3, "step": 2, "module": "1.0", "relative": 1e-3}}},
}


@pytest.fixture(scope="module", params=VERDICTS)
def pp(request: pytest.FixtureRequest) -> dict[str, Any]:
    """One spawn of 6 ranks: 2 pipeline stages x 3 data-parallel replicas, each stage on a host of its own, every
    scenario in turn, once per verdict path."""
    results = spawn_ranks(run_pp, 6, (on_path(list(SCENARIOS.values()), request.param),), timeout=600,
                          rank_env=stage_hosts)
    return dict(zip(SCENARIOS, zip(*results, strict=True), strict=True))


def _same(per_rank: tuple[dict[str, Any], ...]) -> list[Any]:
    assert all(r["incidents"] == per_rank[0]["incidents"] for r in per_rank)
    return per_rank[0]["incidents"]  # type: ignore[no-any-return]


def test_pp_dp_healthy_run_counts_every_check_and_changes_nothing(pp: dict[str, Any]) -> None:
    """DDP stages under GPipe: gradient checks and weights pass every step on every stage, the replay of a partner
    replica's schedule step passes, and training (losses, weights) is bitwise that of the unmonitored run.

    torch 2.13's DDP stage all-reduces the last stage's bucket twice in the first step, so the step-0 audit is
    skipped (a repeated reduction), said once; the step-2 and step-4 audits run."""
    _healthy_and_unchanged(pp["healthy"], pp["off"])


def _healthy_and_unchanged(runs: tuple[dict[str, Any], ...], off: tuple[dict[str, Any], ...]) -> None:
    """Every check counted as passing on every rank (5 steps: the step-0 audit skipped, two replays), nothing found,
    and losses and weights bitwise those of the unmonitored run."""
    for r, plain in zip(runs, off, strict=True):
        assert r["incidents"] == [] and r["errors"] == []
        counts = r["counts"]
        assert counts["grad_local"] == {"pass": 5} and counts["grad_reduced"] == {"pass": 5}
        assert counts["weights"] == {"pass": 5} and counts["replay"].get("pass") == 2, counts
        assert "error" not in counts["replay"] and "fail" not in counts["replay"]
        assert r["losses"] == plain["losses"]
        assert all(r["weights"][n].equal(w) for n, w in plain["weights"].items())


def test_pp_dp_weight_flip_named_with_stage_and_replica(pp: dict[str, Any]) -> None:
    """A bit flipped in rank 3's (stage 1, replica 1) weights: voted among the three replicas of stage 1, and seen
    at rest by rank 3 itself."""
    assert _same(pp["flip"]) == [(2, "weights", [3], "at_rest", {"pp": 1, "dp_replicate": 1}, False, None)]


def test_pp_dp_compute_fault_found_by_replaying_the_schedule_and_named_at_its_stage(pp: dict[str, Any]) -> None:
    """A compute fault in stage 0 of replica 1 (rank 2) changes both stages' gradients and the loss of that replica:
    the partner replica's rerun of its schedule step, with the referee round, finds replica 1 at the first audit
    that runs (step 3: the step-0 audit of a DDP stage is skipped, see above), and the stage outputs name stage 0,
    the first whose output differs: rank 2 alone, on its host, not an ambiguous page across the replica's two."""
    step, check, suspects, verdict, coordinate, ambiguous, stage = _same(pp["compute"])[0]
    assert (step, check, suspects, verdict) == (3, "replay", [2], "persistent")
    assert coordinate == {"pp": 0, "dp_replicate": 1} and not ambiguous and stage == [0, "output"]


def test_pp_backward_fault_named_at_the_stage_that_sent_the_wrong_gradient(pp: dict[str, Any]) -> None:
    """A compute fault in the backward of stage 1 of replica 1 (rank 3): the gradient its first layer passes back to
    the stage's input, which it sends to stage 0, is scaled; its own parameters' gradients are not. Every stage output
    matches and only stage 0's gradients differ, so without the sent gradients the page would name rank 2, a healthy
    rank on another host. Rank 3's sent gradients differ from its partners' reruns (a mismatch of its own), and the
    last stage whose sent gradient differs is stage 1: rank 3 alone."""
    assert any("gradient into 0's inputs" in f for f in pp["backward"][3]["fired"])
    step, check, suspects, verdict, coordinate, ambiguous, stage = _same(pp["backward"])[0]
    assert (step, check, suspects, verdict) == (3, "replay", [3], "persistent")
    assert coordinate == {"pp": 1, "dp_replicate": 1} and not ambiguous and stage == [1, "gradient_sent"]


def test_pp_tolerance_mode_under_gpu_noise_names_the_stage_by_its_output_norms(pp: dict[str, Any]) -> None:
    """Tolerance mode (what GPUs use), every layer's output noisy by 1e-6 per run: the same fault, 1e-2 in stage 0 of
    replica 1, is named at stage 0 from the stage outputs' norms (stage 0's differ beyond the threshold, so do the
    later stage's; the healthy replicas' differ by noise only), rank 2 alone."""
    step, check, suspects, verdict, coordinate, ambiguous, stage = _same(pp["tolerance_compute"])[0]
    assert (step, check, suspects, verdict, stage) == (3, "replay", [2], "persistent", [0, "output"])
    assert coordinate == {"pp": 0, "dp_replicate": 1} and not ambiguous


def test_pp_fsdp_stages_replay_passes_and_finds_a_compute_fault(pp: dict[str, Any]) -> None:
    """fully_shard-ed stages under 1F1B: healthy audits pass on every rank (every replica reruns at once, its
    all-gathers lining up), and a compute fault on rank 5 (stage 1, replica 2) is named at its stage: rank 5
    alone, stage 1's output being the first that differs."""
    for r in pp["fsdp"]:
        assert r["incidents"] == [] and r["errors"] == []
        assert r["counts"]["replay"] == {"pass": 2} and r["counts"]["grad_local"] == {"pass": 4}
    step, check, suspects, _, coordinate, ambiguous, stage = _same(pp["fsdp_compute"])[0]
    assert (step, check, suspects, stage) == (0, "replay", [5], [1, "output"]) and not ambiguous
    assert coordinate is not None and coordinate["dp_shard"] == 2


def test_interleaved_schedule_healthy_counts_every_check_and_changes_nothing(pp: dict[str, Any]) -> None:
    """``ScheduleInterleaved1F1B`` with two DDP stage modules per rank (``SDCMonitor(model_parts, ...)``): both stage
    modules' gradients are tapped (one DDP each), weights pass per pp rank across the three replicas, the partner
    replica's rerun of the whole schedule step passes, and training is bitwise that of the unmonitored run."""
    assert all("pipeline stages" in r["layout"] and "ScheduleInterleaved1F1B" in r["layout"]
               for r in pp["interleaved"])
    _healthy_and_unchanged(pp["interleaved"], pp["interleaved_off"])


def test_interleaved_compute_fault_named_at_its_stage_not_its_rank(pp: dict[str, Any]) -> None:
    """A compute fault in stage 2 (pp rank 0's second stage) of replica 1: stages 2 and 3 differ, stage 1 does not,
    so both ranks of the replica see a differing output and only the per-stage marks tell them apart: rank 2 alone,
    at stage 2."""
    step, check, suspects, verdict, coordinate, ambiguous, stage = _same(pp["interleaved_compute"])[0]
    assert (step, check, suspects, verdict, stage) == (3, "replay", [2], "persistent", [2, "output"])
    assert coordinate == {"pp": 0, "dp_replicate": 1} and not ambiguous


def test_interleaved_weight_flip_named_on_its_rank(pp: dict[str, Any]) -> None:
    """A bit flipped in stage 3's weights on rank 3 (pp rank 1, replica 1): named there alone, at rest."""
    assert _same(pp["interleaved_flip"]) == [(2, "weights", [3], "at_rest", {"pp": 1, "dp_replicate": 1}, False,
                                              None)]


def test_looped_schedule_with_fsdp_stages_passes_then_names_a_fault(pp: dict[str, Any]) -> None:
    """``ScheduleLoopedBFS`` with two fully_shard-ed stage modules per rank: the step-0 audit passes on every rank
    (every replica reruns at once), then a compute fault from step 2 in stage 1 of replica 2 (rank 5) is named at
    stage 1."""
    for r in pp["looped_fsdp"]:
        assert r["errors"] == [] and r["counts"]["replay"].get("pass") == 1, r["counts"]
        assert r["counts"]["grad_local"] == {"pass": 4}
    step, check, suspects, _, coordinate, ambiguous, stage = _same(pp["looped_fsdp"])[0]
    assert (step, check, suspects, stage) == (2, "replay", [5], [1, "output"]) and not ambiguous
    assert coordinate is not None and coordinate["pp"] == 1 and coordinate["dp_shard"] == 2


def test_zero_bubble_schedules_with_fsdp_stages_pass_and_name_a_fault_at_its_stage(pp: dict[str, Any]) -> None:
    """The zero-bubble schedules split each backward into an input part and a weight part computed with
    torch.autograd.grad and assigned to ``.grad``; with fully_shard-ed stage modules the tap still reads each
    stage's accumulated local gradients at its one reduce-scatter, and the rerun captures them there (no autograd
    accumulation to hook). ``ScheduleZBVZeroBubble`` (the V mapping: stages 0 and 3 on pp rank 0, 1 and 2 on pp rank
    1) trains bitwise as unmonitored with every check passing; a fault in stage 2 (pp rank 1's second stage) of
    replica 1 is named on rank 3 at stage 2; under ``ScheduleInterleavedZeroBubble`` a fault in stage 1 of replica 2
    is named on rank 5 at stage 1, after a healthy audit passed on every rank."""
    for rank, (r, off) in enumerate(zip(pp["zbv"], pp["zbv_off"], strict=True)):
        assert r["incidents"] == [] and r["errors"] == [] and "ScheduleZBVZeroBubble" in r["layout"]
        assert f"pipeline stages {[0, 3] if rank % 2 == 0 else [1, 2]} of 4" in r["layout"], r["layout"]
        assert r["counts"]["replay"] == {"pass": 2} and r["counts"]["grad_local"] == {"pass": 4}, r["counts"]
        assert r["losses"] == off["losses"]
        assert all(r["weights"][n].equal(w) for n, w in off["weights"].items())
    assert _same(pp["zbv_compute"]) == [(2, "replay", [3], "persistent", {"pp": 1, "dp_shard": 1}, False,
                                         [2, "output"])]
    for r in pp["zero_bubble_fsdp"] + pp["dualpipev_compute"]:
        assert r["errors"] == [] and r["counts"]["replay"] == {"pass": 1, "fail": 1}, r["counts"]
    assert _same(pp["zero_bubble_fsdp"]) == [(2, "replay", [5], "persistent", {"pp": 1, "dp_shard": 2}, False,
                                              [1, "output"])]


def test_dualpipev_with_fsdp_stages_passes_then_names_a_fault_at_its_stage(pp: dict[str, Any]) -> None:
    """``ScheduleDualPipeV`` (the V mapping, a forward and a backward overlapped in one action, split backward):
    the step-0 audit passes on every rank, then a fault in stage 2 of replica 1 is named on rank 3, at stage 2."""
    assert all("ScheduleDualPipeV" in r["layout"] for r in pp["dualpipev_compute"])
    assert _same(pp["dualpipev_compute"]) == [(2, "replay", [3], "persistent", {"pp": 1, "dp_shard": 1}, False,
                                               [2, "output"])]
