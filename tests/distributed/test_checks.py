"""Multi-rank (gloo, real processes) tests of the gradient, weight and replay checks under injected faults."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from sdc_telemetry.testing import spawn_ranks

from ._scenarios import VERDICTS, on_path, run_scenarios

NAN = math.nan


def _hosts(names: list[str]):  # type: ignore[no-untyped-def]
    return lambda r: {"SDC_HOST_NAME": names[r], "LOCAL_RANK": str(r % 2)}


def _first(result: dict[str, Any]) -> dict[str, Any]:
    assert result["incidents"], "expected an incident, got none"
    return result["incidents"][0]


def _verdicts(result: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [(i["step"], i["check"], tuple(i["suspect_ranks"]), i["evidence"].get("ambiguous"))
            for i in result["incidents"]]


def _assert_collective(per_rank: list[dict[str, Any]]) -> None:
    """Every rank reached the same verdicts at the same steps."""
    assert all(_verdicts(r) == _verdicts(per_rank[0]) for r in per_rank)


def _faults(world: int, bad: int) -> list[dict[str, Any]]:
    base = {"config": {"replay_every": 0, "on_suspect": "record"}, "steps": 6}
    return [
        {**base, "fault": {"kind": "flip_weight_bit", "rank": bad, "step": 3, "param": "fc1.weight", "index": 5,
                           "bit": 9}},
        {**base, "fault": {"kind": "nonfinite_grad", "rank": bad, "step": 2, "param": "fc2.weight", "index": 3}},
        {**base, "fault": {"kind": "corrupt_reduced_grad", "rank": bad, "step": 4, "index": 1, "value": math.inf}},
        {"config": {"replay_every": 2, "on_suspect": "record"}, "steps": 6,
         "fault": {"kind": "perturb_output", "rank": bad, "step": 3, "module": "act", "relative": 1e-3}},
        {"config": {"replay_every": 0, "on_suspect": "raise"}, "steps": 8,
         "fault": {"kind": "flip_weight_bit", "rank": bad, "step": 5, "param": "fc2.bias", "index": 1, "bit": 3}},
    ]


@pytest.mark.parametrize("verdicts", VERDICTS)
@pytest.mark.parametrize("world,bad", [(4, 2), (3, 1)])
def test_each_fault_is_caught_at_its_step_naming_the_rank(world: int, bad: int, verdicts: str, tmp_path: Path) -> None:
    """Bit flip -> weights, NaN local grad -> grad_local, corrupted reduced grad -> grad_reduced, compute -> replay,
    and on_suspect=raise stops every rank at the same step; decided before the update or read one step later."""
    hosts = [f"node-{r // 2}" for r in range(world)]
    scenarios = on_path(_faults(world, bad), verdicts)
    scenarios[0]["config"] = {**scenarios[0]["config"], "incident_dir": str(tmp_path)}
    results = spawn_ranks(run_scenarios, world, (scenarios,), timeout=180, rank_env=_hosts(hosts))
    by_scenario = list(zip(*results, strict=True))

    bitflip, nan, comm, compute, raised = by_scenario
    expected = [(bitflip, "weights", 3), (nan, "grad_local", 2), (comm, "grad_reduced", 4), (compute, "replay", 4)]
    for per_rank, check, step in expected:
        _assert_collective(list(per_rank))
        inc = _first(per_rank[0])
        assert (inc["check"], inc["step"], inc["suspect_ranks"]) == (check, step, [bad]), inc
        suspect = inc["suspects"][0]
        assert suspect["host_name"] == hosts[bad] and suspect["rank"] == bad
        assert suspect["hw_id"] == f"cpu:{hosts[bad]}:{bad % 2}"

    assert _first(bitflip[0])["evidence"]["differing_parameters"] == {str(bad): ["fc1.weight"]}
    assert _first(nan[0])["evidence"]["nonfinite_parameters"] == {str(bad): ["fc2.weight"]}
    assert _first(comm[0])["evidence"]["verdict"] == "communication"
    assert _first(compute[0])["evidence"]["fault"] == "persistent"
    assert all(i["step"] >= 4 for i in compute[0]["incidents"])  # nothing before the first audit after the fault

    assert [r["raised_at"] for r in raised] == [5] * world
    assert all(r["raised_after_s"] < 60 for r in raised)
    assert _first(raised[0])["suspect_ranks"] == [bad]

    lines = (tmp_path / "incidents.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert records and all(r["check"] == "weights" and r["suspect_ranks"] == [bad] for r in records)
    assert len(records) == len(bitflip[0]["incidents"])  # one writer: each incident once


@pytest.mark.parametrize("verdicts", VERDICTS)
def test_two_replicas_separate_transient_from_persistent_compute_faults(verdicts: str) -> None:
    """World 2: a fault the rank cannot reproduce names it; a reproducible one is ambiguous and names both. Memory
    that changes at rest (a weight bit, an Adam moment) is named on its rank alone: the at-rest check referees the
    two replicas' vote, which by itself cannot say which one is right."""
    scenarios = on_path([
        {"config": {"replay_every": 2}, "steps": 5,
         "fault": {"kind": "perturb_output", "rank": 1, "step": 2, "module": "act", "relative": 1e-3,
                   "transient": True}},
        {"config": {"replay_every": 2}, "steps": 3,
         "fault": {"kind": "perturb_output", "rank": 0, "step": 2, "module": "act", "relative": 1e-3}},
        {"config": {"replay_every": 2}, "bad_batch": True},
        {"config": {"replay_every": 0}, "steps": 5,
         "fault": {"kind": "flip_weight_bit", "rank": 1, "step": 3, "param": "fc1.weight", "index": 9, "bit": 17}},
        {"config": {"replay_every": 0}, "steps": 4,
         "fault": {"kind": "flip_state_bit", "rank": 0, "step": 2, "param": "fc2.weight", "key": "exp_avg_sq",
                   "index": 3, "bit": 27}},
        {"config": {"replay_every": 0, "update_every": 1}, "steps": 4,
         "fault": {"kind": "corrupt_update", "rank": 1, "step": 2, "index": 3, "relative": 1e-3}},
        {"config": {"replay_every": 0, "update_every": 1}, "steps": 5,
         "fault": {"kind": "corrupt_update", "rank": 0, "step": 2, "index": 3, "relative": 1e-3,
                   "transient": True}},
    ], verdicts)
    transient, persistent, bad_batch, weight, moment, update, once = zip(
        *spawn_ranks(run_scenarios, 2, (scenarios,), timeout=120), strict=True)
    _assert_collective(list(transient))
    _assert_collective(list(persistent))
    assert _verdicts(transient[0]) == [(2, "replay", (1,), False)]
    assert _first(transient[0])["evidence"]["fault"] == "transient"
    assert _first(transient[0])["evidence"]["reproduced_own_result"] == {"0": True, "1": False}
    assert _verdicts(persistent[0]) == [(2, "replay", (0, 1), True)]
    assert _first(persistent[0])["evidence"]["fault"] == "persistent"
    assert all("batch['meta'][1]" in r["error"] and "builtins.object" in r["error"] for r in bad_batch)
    _assert_collective(list(weight))
    # the flip persists, so the vote keeps disagreeing (the same episode); the at-rest check named rank 1 at once
    assert _verdicts(weight[0]) == [(3, "weights", (1,), False)]  # one episode: the split stays refereed
    ev = _first(weight[0])["evidence"]
    assert ev["verdict"] == "at_rest" and ev["differing_parameters"] == {"1": ["fc1.weight"]}
    assert ev["vote"]["ambiguous"] is True and ev["vote"]["suspect_ranks"] == [0, 1]
    # the moment is not replicated in the vote: only the at-rest check sees it; the next update spreads nothing
    # to the other replica (the state is this rank's own), so the weights diverge later: that is the vote's to see
    _assert_collective(list(moment))
    assert _verdicts(moment[0])[0] == (2, "weights", (0,), False)
    assert _first(moment[0])["evidence"]["differing_parameters"] == {"0": ["fc2.weight [exp_avg_sq]"]}
    # a faulty optimizer unit on one of two ranks: its partner and it disagree on each other's updates, and with no
    # third rank to referee the audit names both, ambiguous (a warning, never a page); the healthy audit before passed
    _assert_collective(list(update))
    assert _verdicts(update[0])[0] == (2, "update", (0, 1), True)
    assert all(r["counts"]["update"]["pass"] == 1 for r in update), [r["counts"] for r in update]
    # one wrong update on rank 0 (its rerun computes right: transient): the audit names rank 0 at step 3, and the
    # vote of that step, split between the two replicas, is refereed by it: rank 0 alone, one episode each
    _assert_collective(list(once))
    assert sorted(_verdicts(once[0])) == [(3, "update", (0,), False), (3, "weights", (0,), False)]
    by_check = {i["check"]: i["evidence"]["verdict"] for i in once[0]["incidents"]}
    assert by_check == {"update": "transient", "weights": "update"}


def test_common_training_loop_shapes_raise_no_false_alarm() -> None:
    """Healthy loops that trip naive replays stay silent: accumulation without no_sync (replay skipped, said in the
    log), zero_grad(set_to_none=False), parameters frozen after wrapping (still weight-checked), unused parameters,
    and bf16 autocast around the forward pass only."""
    scenarios = [
        {"config": {"replay_every": 1}, "steps": 3, "accumulate": 2, "no_sync": False},
        {"config": {"replay_every": 1}, "steps": 4, "set_to_none": False},
        {"config": {"replay_every": 1}, "steps": 4, "find_unused": True, "freeze_after_wrap": "fc2.bias",
         "fault": {"kind": "flip_weight_bit", "rank": 1, "step": 3, "param": "fc2.bias", "index": 0, "bit": 4}},
        {"config": {"replay_every": 1}, "steps": 4, "autocast": True},
    ]
    no_sync, zeros, frozen, autocast = zip(*spawn_ranks(run_scenarios, 3, (scenarios,), timeout=180), strict=True)
    for case in (no_sync, zeros, autocast):
        assert all(not r["incidents"] for r in case), case[0]["incidents"]
    # The frozen parameter's flip (before step 3's forward): the weight check names it; the replay of that step is
    # skipped (it compares healthy replicas only) instead of reporting the same fault twice.
    assert _verdicts(frozen[0]) == [(3, "weights", (1,), False)]
    assert frozen[0]["incidents"][0]["evidence"]["differing_parameters"] == {"1": ["fc2.bias"]}


def test_replay_holds_with_activation_checkpointing_and_experts_without_tokens() -> None:
    """Reentrant and non-reentrant activation checkpointing (dropout inside), and a trainable expert that gets no
    token (find_unused_parameters=True): every audit passes (counted, no error), and a compute fault is still
    named by the replay in each configuration."""
    fault = {"kind": "perturb_output", "rank": 1, "step": 3, "module": "fc2", "relative": 1e-3}
    shapes: list[dict[str, Any]] = [{"checkpoint": "reentrant"}, {"checkpoint": "nonreentrant"},
                                    {"experts": True, "find_unused": True}]
    scenarios = [{"config": {"replay_every": 1}, "steps": 5, **shape, **extra}
                 for shape in shapes for extra in ({}, {"fault": fault})]
    results = list(zip(*spawn_ranks(run_scenarios, 3, (scenarios,), timeout=240), strict=True))
    for shape, healthy, faulty in zip(shapes, results[0::2], results[1::2], strict=True):
        for r in healthy:
            assert not r["incidents"] and not r["errors"], (shape, r["incidents"])
            assert r["counts"]["replay"] == {"pass": 5}, (shape, r["counts"]["replay"])
        assert _verdicts(faulty[0])[0][:3] == (3, "replay", (1,)), (shape, faulty[0]["incidents"])


def test_tolerance_mode_under_gpu_noise_sees_single_element_flips_and_tolerates_a_deviating_rank() -> None:
    """Emulated GPU numerics (fresh 1e-6 relative noise per call on every rank, rank 2's kernels 1e-5 off):
    tolerance mode with calibrated per-quantity thresholds passes 120 audits with no false incident, and names the
    origin of a sign flip and of a mantissa bit-20 flip of one element of one parameter's local gradient at an audit
    step, of a 1e-3 compute fault present from the first (calibrating) audit, and of persistent 1e-4 compute faults
    after 8 calibrating audits, on a common rank and on the deviating one."""
    gpu = {"noise": 1e-6, "bias": 1e-5, "bias_rank": 2}
    config = {"replay_every": 1, "mode": "tolerance", "weights_every": 0}
    flip = {"kind": "flip_grad_bit", "rank": 1, "step": 5, "param": "fc1.weight", "index": 37}
    scenarios = [
        {"config": config, "steps": 120, "gpu_numerics": gpu, "loss_always": True},
        {"config": config, "steps": 8, "gpu_numerics": gpu, "fault": {**flip, "bit": 31}},
        {"config": config, "steps": 8, "gpu_numerics": gpu, "fault": {**flip, "bit": 20}},
        # A compute fault already there at the first (calibrating) audit must not raise the threshold over itself.
        {"config": config, "steps": 4, "gpu_numerics": gpu,
         "fault": {"kind": "perturb_output", "rank": 1, "step": 0, "module": "fc2", "relative": 1e-3}},
        # Persistent compute faults of 1e-4 relative after 8 calibrating audits, on a rank with the common kernels
        # and on the rank whose kernels deviate: per-parameter norm thresholds see both. (Not in fc1: the LayerNorm
        # after it undoes a scaling of its output, forward and backward, so such a fault changes nothing but rounding.)
        {"config": config, "steps": 12, "gpu_numerics": gpu,
         "fault": {"kind": "perturb_output", "rank": 1, "step": 8, "module": "norm", "relative": 1e-4}},
        {"config": config, "steps": 12, "gpu_numerics": gpu,
         "fault": {"kind": "perturb_output", "rank": 2, "step": 8, "module": "fc2", "relative": 1e-4}},
    ]
    healthy, sign, mantissa, early, small, small_deviating = zip(
        *spawn_ranks(run_scenarios, 3, (scenarios,), timeout=300), strict=True)
    # Within 3x of its threshold a persistent finding waits for a repeat at the next audit (named one step later
    # here: an audit every step), which the tail of the numerics' noise does not give.
    for case, step, rank in ((early, 0, 1), (small, 8, 1), (small_deviating, 8, 2)):
        first = case[0]["incidents"][0]
        assert (first["check"], first["suspect_ranks"]) == ("replay", [rank]), first
        assert step <= first["step"] <= step + 1 and not first["evidence"].get("ambiguous"), first
        assert first["evidence"]["confirmed"].startswith("repeated" if first["step"] > step else "above"), first
    for r in healthy:
        assert not r["incidents"] and not r["errors"], r["incidents"][:2]
        assert r["counts"]["replay"] == {"pass": 120} and r["mode"] == "tolerance"
        assert len(r["thresholds"]) == 1 + 2 * 7 and max(r["thresholds"]) < 1e-3  # calibrated, per quantity
    for case in (sign, mantissa):
        assert _verdicts(case[0])[0][:3] == (5, "replay", (1,)), case[0]["incidents"]


def test_tolerance_mode_in_bf16_holds_its_thresholds_at_one_unit_in_the_last_place() -> None:
    """bf16 autocast under emulated GPU numerics (1e-6 noise on every rank, rank 2's kernels 1e-5 off, outputs
    rounded stochastically as a float32 accumulation's difference would round): a difference that small grows through
    the layers' bf16 roundings into flips of single elements that move a gradient's norms by up to a unit in the last
    place, so no comparison of a 16-bit step uses a threshold below bf16's 2**-7. 60 healthy audits pass (counted,
    no incident) although the calibrated thresholds fall far below that unit, and a persistent 5e-2 compute fault
    is named on its rank."""
    gpu = {"noise": 1e-6, "bias": 1e-5, "bias_rank": 2, "dither": True}
    config = {"replay_every": 1, "mode": "tolerance", "weights_every": 0}
    scenarios = [
        {"config": config, "steps": 60, "gpu_numerics": gpu, "autocast": True},
        {"config": config, "steps": 12, "gpu_numerics": gpu, "autocast": True,
         "fault": {"kind": "perturb_output", "rank": 1, "step": 8, "module": "fc2", "relative": 5e-2,
                   "dither": True}},
    ]
    healthy, faulty = zip(*spawn_ranks(run_scenarios, 3, (scenarios,), timeout=300), strict=True)
    for r in healthy:
        assert not r["incidents"] and not r["errors"], r["incidents"][:2]
        assert r["counts"]["replay"] == {"pass": 60} and r["mode"] == "tolerance"
    assert min(healthy[0]["thresholds"]) < 2**-7  # calibrated below the unit: the floor, not the calibration, held
    first = faulty[0]["incidents"][0]
    assert (first["check"], first["suspect_ranks"], first["step"]) == ("replay", [1], 8), first


def test_healthy_long_run_replay_tolerance_accumulation_and_no_side_effects() -> None:
    """Healthy 200 steps (dropout, AdamW, replay every 10) -> no incident; tolerance mode flags only perturbations
    above the tolerance; gradient accumulation replays all micro-batches; replay leaves weights, .grad, buffers and
    RNG exactly as without it; at W=3 monitored training (every check on) is bitwise identical to unmonitored DDP."""
    scenarios = [
        {"config": {"replay_every": 10, "mode": "exact"}, "steps": 200},
        {"config": {"replay_every": 2, "mode": "tolerance", "tolerance": 1e-2}, "steps": 3,
         "fault": {"kind": "perturb_output", "rank": 2, "step": 1, "module": "act", "relative": 1e-5}},
        {"config": {"replay_every": 2, "mode": "tolerance", "tolerance": 1e-2}, "steps": 3,
         "fault": {"kind": "perturb_output", "rank": 2, "step": 1, "module": "act", "relative": 0.5}},
        {"config": {"replay_every": 1}, "steps": 4, "accumulate": 3},
        {"config": {"replay_every": 2}, "steps": 4, "accumulate": 3,
         "fault": {"kind": "perturb_output", "rank": 0, "step": 2, "module": "fc1", "relative": 1e-3}},
        {"config": {"replay_every": 1}, "steps": 6, "batchnorm": True, "watch_state": True, "seed": 7},
        {"config": {"replay_every": 0}, "steps": 6, "batchnorm": True, "seed": 7},
        # Bitwise identity with unmonitored training at W=3 (DDP's scaling by 1/W reproduced), every check on.
        {"unmonitored": True, "steps": 12, "seed": 3},
        {"config": {"replay_every": 2, "weights_every": 1}, "steps": 12, "seed": 3, "plain_hook": True},
        {"config": {"replay_every": 0, "weights_every": 1}, "steps": 12, "seed": 3, "plain_hook": True},
        {"config": {"replay_every": 0, "weights_every": 1, "verdicts": "deferred"}, "steps": 12, "seed": 3,
         "plain_hook": True, "loss_always": True},
        # gradient_as_bucket_view with gradients kept between steps: DDP divides in place from the second step on.
        {"unmonitored": True, "steps": 12, "seed": 3, "bucket_view": True, "set_to_none": False},
        {"config": {"replay_every": 2, "weights_every": 1}, "steps": 12, "seed": 3, "plain_hook": True,
         "bucket_view": True, "set_to_none": False},
    ]
    (healthy, small, large, accum, accum_fault, replay_on, replay_off, plain, monitored, monitored_no_replay,
     monitored_deferred, plain_view, monitored_view) = zip(*spawn_ranks(run_scenarios, 3, (scenarios,), timeout=300),
                                                           strict=True)
    assert all(not r["incidents"] for r in healthy)
    assert all(not r["incidents"] for r in small)
    assert _verdicts(large[0])[0] == (2, "replay", (2,), False)
    assert all(not r["incidents"] for r in accum)
    assert _verdicts(accum_fault[0])[0] == (2, "replay", (0,), False)
    for on, off in zip(replay_on, replay_off, strict=True):
        assert not on["incidents"] and not off["incidents"]
        assert on["undisturbed"] and all(on["undisturbed"])
        assert all(torch.equal(on["weights"][n], off["weights"][n]) for n in on["weights"])
    for ref, runs in ((plain, (monitored, monitored_no_replay, monitored_deferred)), (plain_view, (monitored_view,))):
        for rank, expected in enumerate(ref):
            for run in runs:
                got = run[rank]
                assert not got["incidents"] and got["counts"].get("replay", {}).get("error", 0) == 0
                assert got["counts"]["weights"]["pass"] == 12 and got["counts"]["grad_reduced"]["pass"] == 12
                assert all(torch.equal(expected["weights"][n], got["weights"][n]) for n in expected["weights"]), rank


def test_optimizer_state_is_voted_with_the_weights() -> None:
    """Three replicas: Adam's moments are fingerprinted with the weights. A bit flipped in one rank's moment is
    named by the vote (the majority's state differs from it) as well as by that rank's at-rest comparison; healthy
    runs count the votes as passes."""
    scenarios = [
        {"config": {"replay_every": 0}, "steps": 4,
         "fault": {"kind": "flip_state_bit", "rank": 2, "step": 2, "param": "fc1.bias", "key": "exp_avg",
                   "index": 1, "bit": 28}},
        {"config": {"replay_every": 0}, "steps": 4},
    ]
    moment, healthy = zip(*spawn_ranks(run_scenarios, 3, (scenarios,), timeout=120), strict=True)
    _assert_collective(list(moment))
    assert _verdicts(moment[0])[0] == (2, "weights", (2,), False)
    ev = _first(moment[0])["evidence"]
    assert ev["differing_parameters"] == {"2": ["fc1.bias [exp_avg]"]}
    assert ev["vote"]["differing_parameters"]["2"] == ["fc1.bias [exp_avg]"] and ev["vote"]["ambiguous"] is False
    for r in healthy:
        assert not r["incidents"] and r["counts"]["weights"] == {"pass": 4}, r["counts"]
