"""Trust, on real gloo ranks: the detector never goes blind silently, never cries wolf, never hangs."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from sdc_telemetry.testing import spawn_ranks

from ._scenarios import run_scenarios


def _verdicts(result: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [(i["step"], i["check"], tuple(i["suspect_ranks"])) for i in result["incidents"]]


def _same_everywhere(per_rank: tuple[dict[str, Any], ...]) -> None:
    assert all(_verdicts(r) == _verdicts(per_rank[0]) for r in per_rank)


@pytest.fixture(scope="module", params=["immediate", "deferred"])
def three_ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One spawn of 3 ranks (2 hosts) running every trust scenario in a row, once per verdict path: decided before
    the update (``verdicts="immediate"``), and read one step later (``"deferred"``, what GPUs chose before)."""
    verdicts = request.param
    deferred = verdicts == "deferred"
    incident_dir = tmp_path_factory.mktemp("incidents")
    flip = {"kind": "flip_weight_bit", "rank": 1, "step": 3, "param": "fc1.weight", "index": 5, "bit": 9}
    scenarios: dict[str, dict[str, Any]] = {
        "broken_replay": {"config": {"replay_every": 2}, "steps": 6, "loss": "broken"},
        "nan_everywhere": {"config": {"replay_every": 0, "on_suspect": "raise"}, "steps": 6, "nan_all_step": 2},
        "persistent": {"config": {"replay_every": 0, "incident_dir": str(incident_dir)}, "steps": 40,
                       "fault": flip},
        # Triggered audits (replay_every=0: no scheduled audit, only the trigger): data or hardware?
        # Deferred verdicts replay a step after its update: the loop follows the documented guard (`if step.finite:
        # optimizer.step()`), so that a non-finite update never poisons the weights the late replay runs on.
        "data_nan": {"config": {"replay_every": 0, "on_suspect": "raise"}, "steps": 5, "loss_always": True,
                     "nan_rank_at": {"rank": 1, "step": 2}, "guard": deferred},
        "data_nan_guarded": {"config": {"replay_every": 0, "on_suspect": "raise"}, "steps": 5, "loss_always": True,
                             "nan_rank_at": {"rank": 1, "step": 2}, "guard": True},
        # A step decided late (deferred) right before a scheduled audit of the next step, in the same end of step.
        "nan_then_audit": {"config": {"replay_every": 2}, "steps": 5, "loss_always": True, "guard": True,
                           "nan_rank_at": {"rank": 1, "step": 1}},
        "data_nan_unguarded": {"config": {"replay_every": 0}, "steps": 5, "loss_always": True,
                               "nan_rank_at": {"rank": 1, "step": 2}},
        "hw_nan_unguarded": {"config": {"replay_every": 0}, "steps": 5, "loss_always": True,
                             "fault": {"kind": "nonfinite_grad", "rank": 2, "step": 2, "param": "fc1.weight",
                                       "index": 4}},
        "data_nan_scaler": {"config": {"replay_every": 0, "on_suspect": "raise"}, "steps": 5, "loss_always": True,
                            "scaler": True, "nan_rank_at": {"rank": 1, "step": 2}},
        "hw_nan": {"config": {"replay_every": 0}, "steps": 5, "loss_always": True, "guard": deferred,
                   "fault": {"kind": "nonfinite_grad", "rank": 2, "step": 2, "param": "fc1.weight", "index": 4}},
        "hw_nan_scaler": {"config": {"replay_every": 0, "on_suspect": "raise"}, "steps": 5, "loss_always": True,
                          "scaler": True,
                          "fault": {"kind": "nonfinite_grad", "rank": 2, "step": 2, "param": "fc1.weight",
                                    "index": 4}},
        "outlier_fault": {"config": {"replay_every": 0}, "steps": 16, "loss_always": True,
                          "fault": {"kind": "perturb_output", "rank": 1, "step": 13, "module": "act", "relative": 7.0,
                                    "transient": True}},
        "outlier_data": {"config": {"replay_every": 0, "on_suspect": "raise"}, "steps": 16, "loss_always": True,
                         "loss": "weighted", "heavy_batch_at": {"rank": 1, "step": 13, "weight": 50.0}},
        "root_cause": {"config": {"replay_every": 0, "on_suspect": "raise"}, "steps": 6,
                       "fault": {**flip, "bit": 30}},
        "second_divergence": {"config": {"replay_every": 0}, "steps": 12, "fault": flip,
                              "fault2": {**flip, "rank": 2, "step": 8, "index": 11}},
        "scaler_comm": {"config": {"replay_every": 0}, "steps": 6, "scaler": True,
                        "fault": {"kind": "corrupt_reduced_grad", "rank": 2, "step": 3, "index": 1,
                                  "value": math.inf}},
        "scaler_persistent_nan": {"config": {"replay_every": 0, "on_suspect": "raise"}, "steps": 10, "scaler": True,
                                  "nan_rank_from": {"rank": 1, "step": 2}},
        "scaler_replay_fault": {"config": {"replay_every": 2}, "steps": 5, "scaler": True,
                                "fault": {"kind": "perturb_output", "rank": 0, "step": 2, "module": "act",
                                          "relative": 1e-3}},
        "scaler_replay_healthy": {"config": {"replay_every": 1}, "steps": 6, "scaler": True, "accumulate": 2},
        "verify_row_swap": {"config": {"replay_every": 0, "weights_every": 0}, "steps": 4,
                            "swap_after": {"step": 2, "rank": 2, "param": "fc1.weight", "rows": (3, 7)}},
        "mixed_cluster": {"config": {"replay_every": 2}, "steps": 6, "signature_by_rank": True},
        "autotune_one_rank": {"config": {"replay_every": 2}, "steps": 4, "cudnn_benchmark_rank": 0},
        "toggle_sync": {"config": {"replay_every": 2}, "steps": 4, "accumulate": 3, "toggle_sync": True,
                        "fault": {"kind": "perturb_output", "rank": 2, "step": 2, "module": "fc1", "relative": 1e-3}},
        "namedtuple": {"config": {"replay_every": 1}, "steps": 3, "batch_type": "namedtuple", "loss": "tuple"},
        "ordereddict": {"config": {"replay_every": 1}, "steps": 3, "batch_type": "ordereddict"},
        "resume": {"config": {"replay_every": 4}, "steps": 8, "start_step": 100,
                   "fault": {**flip, "step": 105}},
        "clipped_nan": {"config": {"replay_every": 0}, "steps": 3, "clip": True,
                        "fault": {"kind": "nonfinite_grad", "rank": 0, "step": 1, "param": "fc2.weight", "index": 3}},
        "flip_raise": {"config": {"replay_every": 4, "on_suspect": "raise"}, "steps": 8, "fault": flip},
        "flip_last_step": {"config": {"replay_every": 4}, "steps": 4, "fault": {**flip, "step": 3}},
        "certify": {"config": {"replay_every": 2}, "steps": 5, "loss_always": True, "certify_at_end": True},
        "certify_episode": {"config": {"replay_every": 0}, "steps": 6, "fault": {**flip, "step": 2},
                            "certify_at_end": True},
        "nested": {"nested": True},
        "bad_dir": {"config": {"incident_dir": "/proc/no-such-dir/x"}},
    }
    for sc in scenarios.values():
        sc["config"] = {**sc.get("config", {}), "verdicts": verdicts}
    hosts = ["node-a", "node-a", "node-b"]
    results = spawn_ranks(run_scenarios, 3, (list(scenarios.values()),), timeout=600,
                          rank_env=lambda r: {"SDC_HOST_NAME": hosts[r], "LOCAL_RANK": str(r % 2)})
    by_name = dict(zip(scenarios, zip(*results, strict=True), strict=True))
    by_name["incident_dir"] = incident_dir
    by_name["verdicts"] = verdicts
    return by_name


def test_replay_broken_on_every_audit_counts_errors_never_passes(three_ranks: dict[str, Any]) -> None:
    """A loss_fn that fails outside the wrapper: every audit is an error on every rank, no pass, no incident."""
    for r in three_ranks["broken_replay"]:
        assert r["counts"]["replay"] == {"error": 3}
        assert r["report_errors"].count("replay") == 3
        assert not r["incidents"]
        assert r["counts"]["weights"] == {"pass": 6}


def test_nan_on_every_rank_is_numerics_not_hardware(three_ranks: dict[str, Any]) -> None:
    """A bad batch on every rank with on_suspect=raise: training goes on, one numerics episode, no suspect."""
    per_rank = three_ranks["nan_everywhere"]
    _same_everywhere(per_rank)
    for r in per_rank:
        assert r["raised_at"] is None
        numerics = [i for i in r["incidents"] if i["evidence"].get("verdict") == "numerics"]
        assert numerics and all(not i["suspect_ranks"] for i in r["incidents"])
        assert numerics[0]["step"] == 2 and numerics[0]["check"] == "grad_local"
        assert len(r["incidents"]) <= 2 and r["steps_reported"] == list(range(6))
        assert r["counts"]["grad_local"].get("fail", 0) >= 1 and not r["errors"]


def test_one_persistent_fault_is_one_episode(three_ranks: dict[str, Any]) -> None:
    """A weight flip that stays for 37 steps in record mode: one incident, updated, and a few JSONL lines."""
    per_rank = three_ranks["persistent"]
    _same_everywhere(per_rank)
    incidents = per_rank[0]["incidents"]
    assert len(incidents) <= 3
    assert (incidents[0]["step"], incidents[0]["check"], incidents[0]["suspect_ranks"]) == (3, "weights", [1])
    assert incidents[0]["count"] == 37 and incidents[0]["last_step"] == 39
    lines = (three_ranks["incident_dir"] / "incidents.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert 2 <= len(records) <= 5
    assert records[0]["record"] == "incident" and records[1] == {**records[1], "record": "update", "count": 10}
    # The divergence keeps its pattern: the fingerprint tables are gathered once, not at each of the 37 steps.
    assert all(r["gathers"] == 1 for r in per_rank)


def test_a_new_divergence_during_an_episode_is_seen_at_its_step(three_ranks: dict[str, Any]) -> None:
    """Record mode: a second rank's weights diverging while the first episode is open changes the pattern, so the
    tables are gathered again at that step and the new split is reported: the vote has no majority left, and the
    at-rest check names the rank whose memory changed (rank 2), which the later steps of that split repeat."""
    per_rank = three_ranks["second_divergence"]
    _same_everywhere(per_rank)
    incidents = per_rank[0]["incidents"]
    assert [(i["step"], i["check"]) for i in incidents] == [(3, "weights"), (8, "weights")]
    assert incidents[0]["suspect_ranks"] == [1] and incidents[0]["last_step"] == 7
    assert incidents[0]["evidence"]["verdict"] == "at_rest"
    second = incidents[1]
    assert second["suspect_ranks"] == [2] and second["evidence"]["verdict"] == "at_rest"
    assert second["evidence"]["vote"]["ambiguous"] is True and second["last_step"] == 11
    assert all(r["gathers"] == 2 for r in per_rank), [r["gathers"] for r in per_rank]


def test_grad_scaler_with_rank_local_inf_detected_without_hang(three_ranks: dict[str, Any]) -> None:
    """GradScaler skips the update on the rank whose reduced gradients hold Inf: every rank learns it at the
    same step, nothing waits on optimizer.step(), and the diverged replica is then named by the weight check."""
    per_rank = three_ranks["scaler_comm"]
    _same_everywhere(per_rank)
    assert _verdicts(per_rank[0])[:2] == [(3, "grad_reduced", (2,)), (4, "weights", (2,))]
    assert per_rank[0]["incidents"][0]["evidence"]["verdict"] == "communication"


def test_grad_scaler_overflow_is_numerics_until_it_persists_on_one_rank(three_ranks: dict[str, Any]) -> None:
    """With a GradScaler, rank 1 non-finite alone is an overflow at first (numerics, training goes on); still alone
    5 steps in a row while the scaler lowers its scale, it is named and every rank stops."""
    per_rank = three_ranks["scaler_persistent_nan"]
    _same_everywhere(per_rank)
    assert _verdicts(per_rank[0]) == [(2, "grad_local", ()), (6, "grad_local", (1,))]
    assert per_rank[0]["incidents"][0]["count"] == 4
    assert all(r["raised_at"] == 6 for r in per_rank)


def test_grad_scaler_replay_finds_a_compute_fault_and_passes_when_healthy(three_ranks: dict[str, Any]) -> None:
    """With step.backward(loss, scaler=...) the replay reproduces the scaled gradients: a compute fault is named,
    and a healthy run with accumulation passes every audit without errors."""
    faulty = three_ranks["scaler_replay_fault"]
    _same_everywhere(faulty)
    assert _verdicts(faulty[0])[0] == (2, "replay", (0,))
    for r in three_ranks["scaler_replay_healthy"]:
        assert not r["incidents"] and r["counts"]["replay"] == {"pass": 6} and not r["errors"]


def test_each_check_reports_its_own_duration(three_ranks: dict[str, Any]) -> None:
    """grad_local, grad_reduced, weights and replay are timed separately (not one figure for all)."""
    for d in three_ranks["scaler_replay_healthy"][0]["durations"]:
        assert set(d) == {"grad_local", "grad_reduced", "weights", "replay"} and all(v >= 0 for v in d.values())
        assert len(set(d.values())) == 4


def test_verify_weights_works_with_weights_every_zero_and_sees_a_row_swap(three_ranks: dict[str, Any]) -> None:
    """weights_every=0: verify_weights() still runs, and catches two swapped rows right after they happen."""
    for r in three_ranks["verify_row_swap"]:
        assert r["verified"] == [(2, "weights", [2])]
        assert r["counts"]["weights"] == {"fail": 1}  # the one on-demand run, no scheduled one


def test_mixed_cluster_pairs_within_a_numerics_class_and_stays_silent(three_ranks: dict[str, Any]) -> None:
    """Ranks on two stacks (ranks 0 and 2 on one, rank 1 on another): the replay uses a calibrated tolerance, every
    audit pairs ranks of the same stack (0 and 2 replay each other), rank 1 is said to be alone in its class and
    reruns its own micro-batches, and a healthy run has no incident."""
    per_rank = three_ranks["mixed_cluster"]
    for rank, r in enumerate(per_rank):
        assert r["mode"] == "tolerance" and r["alone"] == [1]
        assert not r["incidents"] and r["counts"]["replay"] == {"pass": 3} and not r["errors"]
        assert r["audited"] == [{0: 2, 1: 1, 2: 0}[rank]] * 3, (rank, r["audited"])


def test_namedtuple_and_ordereddict_batches_replay(three_ranks: dict[str, Any]) -> None:
    """Batches as namedtuples (read by field name in the loss) and OrderedDicts travel and replay exactly."""
    for name in ("namedtuple", "ordereddict"):
        for r in three_ranks[name]:
            assert not r["incidents"] and r["counts"]["replay"] == {"pass": 3}, (name, r["counts"])


def test_nanogpt_sync_toggle_accumulation_is_audited(three_ranks: dict[str, Any]) -> None:
    """Accumulation by toggling require_backward_grad_sync: audits replay all micro-batches and name a faulty rank."""
    per_rank = three_ranks["toggle_sync"]
    _same_everywhere(per_rank)
    assert _verdicts(per_rank[0]) == [(2, "replay", (2,))]
    assert per_rank[0]["counts"]["replay"] == {"pass": 1, "fail": 1}


def test_resume_counts_from_start_step(three_ranks: dict[str, Any]) -> None:
    """Resumed at 100: a flip before step 105's forward pass is reported at 105; audits follow the user's steps."""
    per_rank = three_ranks["resume"]
    _same_everywhere(per_rank)
    assert _verdicts(per_rank[0])[0] == (105, "weights", (1,))
    assert per_rank[0]["steps_reported"] == list(range(100, 108))
    assert per_rank[0]["counts"]["replay"] == {"pass": 2}  # steps 100 and 104 audited


def test_nonfinite_evidence_is_taken_before_clipping(three_ranks: dict[str, Any]) -> None:
    """Gradient clipping after the step does not smear the evidence: it names only the poisoned parameter."""
    inc = three_ranks["clipped_nan"][0]["incidents"][0]
    assert (inc["step"], inc["check"], inc["suspect_ranks"]) == (1, "grad_local", [0])
    assert inc["evidence"]["nonfinite_parameters"] == {"0": ["fc2.weight"]}


def test_misuse_gets_clear_errors_on_every_rank(three_ranks: dict[str, Any]) -> None:
    """Nested steps and an unusable incident_dir give a clear error on every rank (not a peer's dropped socket)."""
    assert all("steps do not nest" in r["error"] for r in three_ranks["nested"])
    assert all("incident_dir" in r["error"] and "every rank" in r["error"] for r in three_ranks["bad_dir"])


def test_a_verdict_names_the_measured_step_on_either_path(three_ranks: dict[str, Any]) -> None:
    """Immediate verdicts stop in the step that found the fault; deferred ones at the end of the next step (or at an
    audit, or at close), still naming the step it was measured in, on every rank."""
    late = three_ranks["verdicts"] == "deferred"
    for r in three_ranks["flip_raise"]:
        assert (r["raised_at"], r["stopped_in_step"]) == (3, 4 if late else 3)
    record = three_ranks["flip_last_step"]
    _same_everywhere(record)
    assert _verdicts(record[0]) == [(3, "weights", (1,))]  # deferred: the last step's verdict was settled by close()
    assert record[0]["steps_reported"] == [0, 1, 2, 3]


def test_the_guard_keeps_a_data_nan_out_of_the_weights(three_ranks: dict[str, Any]) -> None:
    """`if step.finite: optimizer.step()`: every rank skips the update of the step with one rank's NaN batch (the same
    answer everywhere), so the weights stay finite and identical; without the guard the NaN reaches every replica."""
    guarded = three_ranks["data_nan_guarded"]
    for r in guarded:
        assert r["skipped_updates"] == [2] and r["weights_finite"] and r["raised_at"] is None
        assert all(torch.equal(r["weights"][n], guarded[0]["weights"][n]) for n in r["weights"])
        assert r["counts"]["grad_local"].get("pass", 0) >= 4 and not r["errors"]
    assert not any(r["weights_finite"] for r in three_ranks["data_nan_unguarded"])


def test_a_late_audit_before_the_next_steps_scheduled_audit_leaves_it_intact(three_ranks: dict[str, Any]) -> None:
    """A NaN batch at step 1, the scheduled audit at step 2: read one step late, step 1's replay runs at the end of
    step 2, just before step 2's own audit, which still passes (the recomputation touched nothing it reads)."""
    per_rank = three_ranks["nan_then_audit"]
    _same_everywhere(per_rank)
    for r in per_rank:
        assert [(i["step"], i["check"], i["suspect_ranks"], i["evidence"]["verdict"]) for i in r["incidents"]] == \
            [(1, "grad_local", [], "data")]
        assert r["counts"]["replay"] == {"pass": 3} and not r["errors"]


def test_without_the_guard_a_late_replay_never_pages_what_it_cannot_decide(three_ranks: dict[str, Any]) -> None:
    """No guard: the NaN update reaches every replica before a deferred verdict is read, so the late replay has no
    finite weights to run on. A NaN in one rank's batch, or one rank's NaN, is then at most an ambiguous warning
    naming that rank, never a page; decided before the update, the first is data and the second names the rank."""
    late = three_ranks["verdicts"] == "deferred"
    for name, bad in (("data_nan_unguarded", 1), ("hw_nan_unguarded", 2)):
        per_rank = three_ranks[name]
        _same_everywhere(per_rank)
        [incident] = [i for i in per_rank[0]["incidents"] if i["step"] == 2]
        assert incident["check"] == "grad_local", incident
        if late:
            assert incident["suspect_ranks"] == [bad] and incident["evidence"]["ambiguous"] is True, incident
            assert "step.finite" in incident["evidence"]["triggered_audit"]["reason"]
        elif name == "data_nan_unguarded":
            assert incident["suspect_ranks"] == [] and incident["evidence"]["verdict"] == "data"
        else:
            assert incident["suspect_ranks"] == [bad] and incident["evidence"]["ambiguous"] is False


def test_sdc_detected_names_the_root_cause_in_causal_order(three_ranks: dict[str, Any]) -> None:
    """A weight corrupted to a huge value also makes that rank's next gradients non-finite: both are found at the
    same step, and SDCDetected.incident is the weights incident, with every incident of the step after it."""
    per_rank = three_ranks["root_cause"]
    _same_everywhere(per_rank)
    for r in per_rank:
        assert r["raised_at"] == 3
        assert r["raised_checks"][0] == "weights" and "grad_local" in r["raised_checks"], r["raised_checks"]


def test_a_nan_in_one_ranks_batch_is_data_never_a_suspect(three_ranks: dict[str, Any]) -> None:
    """A NaN in one rank's batch, with and without a GradScaler: the triggered audit's partner gets the same NaN,
    so it is a numerics incident with verdict data, no suspect, and on_suspect="raise" does not stop training."""
    for name in ("data_nan", "data_nan_scaler"):
        per_rank = three_ranks[name]
        _same_everywhere(per_rank)
        for r in per_rank:
            assert r["raised_at"] is None and not r["errors"], name
            [incident] = [i for i in r["incidents"] if i["step"] == 2]
            assert incident["check"] == "grad_local" and incident["suspect_ranks"] == [], name
            assert incident["evidence"]["verdict"] == "data", incident["evidence"]
            assert incident["evidence"]["triggered_audit"]["replayed"] is True
            assert r["steps_reported"] == [0, 1, 2, 3, 4]


def test_a_nan_only_one_ranks_computation_makes_is_named(three_ranks: dict[str, Any]) -> None:
    """A NaN made in one rank's gradient (the same micro-batch gives finite gradients on a partner), with and
    without a GradScaler: the triggered audit names that rank at that step; with raise, every rank stops there."""
    for name in ("hw_nan", "hw_nan_scaler"):
        per_rank = three_ranks[name]
        _same_everywhere(per_rank)
        incident = per_rank[0]["incidents"][0]
        assert (incident["step"], incident["check"], incident["suspect_ranks"]) == (2, "grad_local", [2]), name
        assert incident["evidence"]["verdict"] in ("transient", "persistent")
        assert incident["evidence"]["ambiguous"] is False
        assert incident["evidence"]["triggered_audit"]["mismatching_pairs"]
    assert all(r["raised_at"] == 2 for r in three_ranks["hw_nan_scaler"])


def test_a_transient_fault_off_the_audit_schedule_is_named_by_a_triggered_audit(three_ranks: dict[str, Any]) -> None:
    """No scheduled audit (replay_every=0): a one-step x8 fault in one rank's activations makes its loss and gradient
    norm jump away from the others and its own history; the triggered replay names it (transient) at that step."""
    per_rank = three_ranks["outlier_fault"]
    _same_everywhere(per_rank)
    [incident] = per_rank[0]["incidents"]
    assert (incident["step"], incident["check"], incident["suspect_ranks"]) == (13, "replay", [1])
    assert incident["evidence"]["verdict"] == "transient"
    assert incident["evidence"]["triggered_audit"]["trigger"] == "outlier"
    assert all(r["counts"]["replay"] == {"fail": 1} for r in per_rank)  # one triggered audit, nothing else


def test_a_hard_batch_is_data_never_a_suspect(three_ranks: dict[str, Any]) -> None:
    """One rank's batch weighs its samples x50 at one step (per-sample loss weights): the same outlier trigger, but
    the partner reproduces it: verdict data, no suspect, nothing raised."""
    per_rank = three_ranks["outlier_data"]
    _same_everywhere(per_rank)
    for r in per_rank:
        assert r["raised_at"] is None
        [incident] = r["incidents"]
        assert (incident["step"], incident["check"], incident["suspect_ranks"]) == (13, "replay", [])
        assert incident["evidence"]["verdict"] == "data"
        assert r["counts"]["replay"] == {"pass": 1}


def test_kernel_settings_that_differ_between_ranks_give_tolerance_everywhere(three_ranks: dict[str, Any]) -> None:
    """One rank with cuDNN autotuning on: its numerics signature differs, so every rank agrees on tolerance mode at
    set-up (no rank left in exact mode issuing collectives the others never join) and the audits pass."""
    per_rank = three_ranks["autotune_one_rank"]
    for r in per_rank:
        assert r["mode"] == "tolerance" and not r["incidents"] and not r["errors"]
        assert r["counts"]["replay"] == {"pass": 2}


def test_a_certificate_taken_after_the_last_step_verifies_on_every_rank(three_ranks: dict[str, Any]) -> None:
    """certificate() on every rank after the loop (deferred: the last step's pending verdict decided first) labels
    the last step and verifies against each rank's own state dict."""
    for r in three_ranks["certify"]:
        assert r["certified"] == (4, []) and not r["incidents"] and not r["errors"]


def test_a_certificate_during_a_weights_episode_holds_the_majority_s_current_weights(three_ranks: dict[str, Any]
                                                                                     ) -> None:
    """Record mode, rank 1's weights diverged at step 2 and trained on apart for 4 more steps: certificate() certifies
    the majority's weights as they are now (gathered again, not those of the step the split began), so the healthy
    ranks' own state dicts verify and the diverged rank's does not."""
    per_rank = three_ranks["certify_episode"]
    assert [(i["step"], i["check"], i["suspect_ranks"]) for i in per_rank[0]["incidents"]] == [(2, "weights", [1])]
    for r in (per_rank[0], per_rank[2]):
        assert r["certified"] == (5, []), r["certified"]
    step, changed = per_rank[1]["certified"]
    assert step == 5 and "fc1.weight" in changed
