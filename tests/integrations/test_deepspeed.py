"""SDCDeepSpeed in loops written as DeepSpeed's users write them (``deepspeed.initialize``, ``engine.backward``,
``engine.step`` after every micro-batch) on 3 gloo CPU ranks (DeepSpeed's CPU accelerator): ZeRO stages 0 to 3,
two parameter groups, gradient accumulation and bf16, healthy; a weight bit flip, a compute fault, a bad sample, a
faulty optimizer kernel on one rank, and bits flipped at rest in one rank's fp32 master partition and in its Adam
moment (which no other rank holds under ZeRO). One spawn runs every scenario."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

import sdc_telemetry as sdc
from sdc_telemetry.testing import spawn_ranks

if not os.environ.get("CI"):
    pytest.importorskip("deepspeed")

from . import _deepspeed_ranks
from ._ranks import launcher_env

WORLD = 3
QUIET = {"metrics_port": None, "nvml": False}
HEALTHY = sdc.SDCConfig(weights_every=1, replay_every=2, on_suspect="raise", **QUIET)
DEFERRED = sdc.SDCConfig(weights_every=1, replay_every=2, on_suspect="raise", verdicts="deferred", **QUIET)
RAISE = sdc.SDCConfig(weights_every=1, replay_every=0, on_suspect="raise", **QUIET)
PLAN: list[dict[str, Any]] = [
    {"config": None},                                                            # 0: ZeRO-2 without the monitor
    {"config": HEALTHY},                                                         # 1: ZeRO-2
    {"config": HEALTHY, "stage": 1, "groups": 2},                                # 2: ZeRO-1, two parameter groups
    {"config": HEALTHY, "stage": 0},                                             # 3
    {"config": HEALTHY, "accumulate": 2},                                        # 4
    {"config": HEALTHY, "bf16": True},                                           # 5
    {"config": RAISE, "flip": (1, 2)},                                           # 6
    {"config": sdc.SDCConfig(weights_every=1, replay_every=1, on_suspect="raise", **QUIET), "perturb": (2, 1)},
    {"config": sdc.SDCConfig(weights_every=1, replay_every=0, **QUIET), "nan_at": (1, 2)},        # 8
    {"config": HEALTHY, "wrong_update": (1, 1)},                                 # 9
    {"config": RAISE, "at_rest": (2, 2, "param")},                               # 10
    {"config": RAISE, "at_rest": (0, 2, "exp_avg"), "stage": 1, "groups": 2},    # 11
    {"config": None, "refuse": 0},                                               # 12: bf16 at stage 0 refused
    {"config": DEFERRED},                                                        # 13: verdicts read a step later
    {"config": DEFERRED, "wrong_update": (1, 1)},                                # 14
    # ZeRO-3: parameters partitioned and gathered by DeepSpeed's hooks (no replica of any weight)
    {"config": None, "stage": 3},                                                # 15
    {"config": HEALTHY, "stage": 3},                                             # 16
    {"config": DEFERRED, "stage": 3, "groups": 2},                               # 17
    {"config": sdc.SDCConfig(weights_every=1, replay_every=1, on_suspect="raise", **QUIET), "perturb": (2, 1),
     "stage": 3},                                                                # 18
    {"config": HEALTHY, "wrong_update": (1, 1), "stage": 3},                     # 19
    {"config": RAISE, "at_rest": (2, 2, "param"), "stage": 3, "groups": 2},      # 20
    {"config": sdc.SDCConfig(weights_every=1, replay_every=0, **QUIET), "nan_at": (1, 2), "stage": 3},  # 21
    {"config": HEALTHY, "certify": True},                                        # 22: a directory per run
    {"config": HEALTHY, "certify": True, "stage": 3},                            # 23
    {"config": None, "reentrant": True},                                         # 24: reentrant checkpointing
    {"config": HEALTHY, "reentrant": True},                                      # 25
]
DS_ENV = {"DS_ACCELERATOR": "cpu"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    # DeepSpeed's CPU shared-memory op, built once by `make setup` into the venv
    env = {**DS_ENV, "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                             os.path.join(sys.prefix, "torch_extensions"))}
    plan = [{**p, "certify": str(tmp_path_factory.mktemp(f"ds-checkpoint-{i}"))} if p.get("certify") else p
            for i, p in enumerate(PLAN)]
    out: list[list[dict[str, Any]]] = spawn_ranks(_deepspeed_ranks.run, WORLD, (plan,), timeout=600, env=env,
                                                  rank_env=launcher_env(WORLD))
    return out


def _each(runs: list[list[dict[str, Any]]], index: int) -> list[dict[str, Any]]:
    return [per_rank[index] for per_rank in runs]


@pytest.mark.parametrize("index", [1, 2, 3, 4, 5, 13, 16, 17],
                         ids=["zero2", "zero1-two-groups", "zero0", "zero2-accumulate", "zero2-bf16", "zero2-deferred",
                              "zero3", "zero3-two-groups-deferred"])
def test_healthy_loops_run_every_check_and_raise_nothing(runs: list[list[dict[str, Any]]], index: int) -> None:
    """Four optimizer steps: the gradient checks (local and the reduced partition), the weights, and (ZeRO 1 to 3)
    the update audit of each rank's fp32 partition run and pass on every rank; the replay of steps 0 and 2 matches
    bit for bit (at ZeRO-3 every rank recomputes at once, through DeepSpeed's gathers), except with accumulation,
    where it is skipped by design (said once); nothing fails or errs; engine.backward is given back at close. The
    weights are voted at stages 0-2; at stage 3 no rank holds another's partition and the at-rest check compares
    each rank's own from the first update on (the first step has nothing to compare: skipped)."""
    plan = PLAN[index]
    for rank, r in enumerate(_each(runs, index)):
        assert r["raised"] is None and r["incidents"] == [] and r["updates"] == 4, f"rank {rank}: {r}"
        res = r["results"]
        assert res[("grad_local", "pass")] == 4 and res[("grad_reduced", "pass")] == 4, res
        if plan.get("stage", 2) == 3:
            assert res[("weights", "pass")] == 3 and res[("weights", "skipped")] == 1, res
        else:
            assert res[("weights", "pass")] == 4, res
        assert res[("replay", "skipped" if plan.get("accumulate", 1) > 1 else "pass")] == 2, res
        # ZeRO 1/2: no other rank holds this rank's fp32 partition, so the update audit runs with the replay
        assert res.get(("update", "pass"), 0) == (2 if plan.get("stage", 2) else 0), res
        assert not any(result in ("fail", "error") for _, result in res), res
        assert r["backward_restored"] and r["closed"]


@pytest.mark.parametrize(("baseline", "monitored"), [(0, 1), (15, 16)], ids=["zero2", "zero3"])
def test_the_monitor_leaves_training_bit_for_bit_unchanged(runs: list[list[dict[str, Any]]], baseline: int,
                                                           monitored: int) -> None:
    """The monitored healthy loop (replays, update audits and at ZeRO-3 the recomputations' gathers included) ends
    with the same weights, bit for bit, as the same loop without it."""
    for baseline_run, monitored_run in zip(_each(runs, baseline), _each(runs, monitored), strict=True):
        assert monitored_run["weights"] == baseline_run["weights"]
        assert monitored_run["updates"] == baseline_run["updates"] == 4


def test_a_weight_bit_flip_is_named_by_the_vote_before_the_update(runs: list[list[dict[str, Any]]]) -> None:
    """A bit flipped in rank 1's copy of the first-layer weights before step 2: every rank holds the whole module
    under ZeRO-2, so the vote of step 2 names rank 1 and SDCDetected leaves the loop inside engine.backward, before
    step 2's update, on every rank."""
    for rank, r in enumerate(_each(runs, 6)):
        assert r["raised"] == (2, "weights", [1]) and r["incidents"] == [(2, "weights", [1])], f"rank {rank}: {r}"
        assert r["updates"] == 2 and r["backward_restored"]


@pytest.mark.parametrize("index", [7, 18], ids=["zero2", "zero3"])
def test_a_compute_fault_is_named_by_the_replay(runs: list[list[dict[str, Any]]], index: int) -> None:
    """Rank 2's first layer computes 1e-3 off from step 1 on: the replay of step 1 (a partner recomputing rank 2's
    micro-batch on engine.module; at ZeRO-3 every rank at once, through DeepSpeed's gathers) names rank 2 on every
    rank."""
    for rank, r in enumerate(_each(runs, index)):
        assert r["raised"] == (1, "replay", [2]), f"rank {rank}: {r}"
        assert r["verdicts"] == ["persistent"]


@pytest.mark.parametrize("index", [8, 21], ids=["zero2", "zero3"])
def test_a_bad_sample_names_nobody(runs: list[list[dict[str, Any]]], index: int) -> None:
    """A NaN in one sample of rank 1's batch at step 2: the triggered audit finds that a partner recomputing it gets
    the same NaN (verdict data, nobody named); training goes on to the end, and the weights stay finite (ZeRO-2
    skips an update whose gradient norm is not finite)."""
    for rank, r in enumerate(_each(runs, index)):
        assert r["incidents"] == [(2, "grad_local", [])] and r["verdicts"] == ["data"], f"rank {rank}: {r}"
        assert r["raised"] is None and r["updates"] == 4 and r["weights_finite"]


@pytest.mark.parametrize("index", [9, 14, 19], ids=["zero2", "zero2-deferred", "zero3"])
def test_a_wrong_update_of_one_ranks_partition_is_named_by_the_update_audit(
        runs: list[list[dict[str, Any]]], index: int) -> None:
    """Rank 1's optimizer kernel writes one element of its fp32 partition 1e-3 off from step 1 on. ZeRO all-gathers
    that partition into every rank's module, so the vote cannot see it; the update audit of step 1 (a partner
    recomputing rank 1's AdamW step on its partition, gradient and moments) names rank 1, persistent (its own rerun
    repeats the error), at the end of step 1 on every rank, with verdicts decided before the update or read one
    step later alike."""
    for rank, r in enumerate(_each(runs, index)):
        assert r["raised"] == (1, "update", [1]) and r["verdicts"] == ["persistent"], f"rank {rank}: {r}"
        # the weights checks saw nothing: every module holds the same (wrong) weights; at ZeRO-3 no vote
        assert r["results"][("weights", "pass")] == (1 if PLAN[index].get("stage") == 3 else 2)


@pytest.mark.parametrize(("index", "rank_hit", "label"), [(10, 2, "zero.fp32_partition.group0"),
                                                          (11, 0, "zero.fp32_partition.group0 [exp_avg]"),
                                                          (20, 2, "zero.fp32_partition.group0")],
                         ids=["zero2-master-weights", "zero1-adam-moment", "zero3-master-weights"])
def test_memory_changed_at_rest_on_one_rank_is_named_on_that_rank(runs: list[list[dict[str, Any]]], index: int,
                                                                   rank_hit: int, label: str) -> None:
    """A bit flipped before step 2's forward pass in one rank's fp32 master partition, or in its first Adam moment
    (ZeRO-1 with two parameter groups, stepped one at a time): no other rank holds either; the at-rest check of
    step 2 names that rank alone, with the tensor that changed."""
    for rank, r in enumerate(_each(runs, index)):
        assert r["raised"] == (2, "weights", [rank_hit]) and r["verdicts"] == ["at_rest"], f"rank {rank}: {r}"
        assert label in str(r["evidence"][0]), r["evidence"][0]


def test_bf16_at_stage_0_is_refused_by_name(runs: list[list[dict[str, Any]]]) -> None:
    """DeepSpeed steps its own BF16_Optimizer at stage 0 (fp32 master weights sharded its own way): refused, with
    what to use instead."""
    for r in _each(runs, 12):
        assert "use ZeRO stage 1 or 2" in r["refused"], r


@pytest.mark.parametrize("index", [22, 23], ids=["zero2", "zero3"])
def test_deepspeeds_own_checkpoint_is_certified_and_verified(runs: list[list[dict[str, Any]]], index: int) -> None:
    """After training, certificate() on every rank (ZeRO-3: each parameter gathered in turn, shapes from its
    ds_shape), then DeepSpeed's own checkpoint (engine.save_checkpoint; at ZeRO-3 its consolidated
    save_16bit_model): the saved weights verify against the certificate, and the same weights with one bit flipped
    do not, naming that parameter."""
    for rank, r in enumerate(_each(runs, index)):
        assert r["incidents"] == [] and r["raised"] is None, f"rank {rank}: {r}"
        assert r["verified"] == ["|", "3.weight"], r["verified"]


def test_reentrant_checkpointing_makes_the_replay_an_error_and_leaves_training_alone(
        runs: list[list[dict[str, Any]]]) -> None:
    """Reentrant activation checkpointing refuses autograd.grad(), and recomputing through .grad would fire ZeRO's
    reduction hooks: both replays are counted as errors (never passes, never a hang), every other check runs and
    passes, and training ends bit for bit as without the monitor."""
    for baseline, r in zip(_each(runs, 24), _each(runs, 25), strict=True):
        res = r["results"]
        assert res[("replay", "error")] == 2 and ("replay", "pass") not in res, res
        assert res[("grad_local", "pass")] == 4 and res[("weights", "pass")] == 4 and res[("update", "pass")] == 2
        assert r["incidents"] == [] and r["weights"] == baseline["weights"]
