"""SDCMegatron in loops written as Megatron-core's users write them (a ``GPTModel`` in its
``DistributedDataParallel``, ``get_megatron_optimizer``, the schedule of ``get_forward_backward_func()`` with
``finalize_model_grads``, ``optimizer.step()``) on 4 gloo CPU ranks: data parallelism over 4 ranks, and tensor
parallelism 2 x data parallelism 2; the distributed optimizer and the replicated one, bf16, gradient accumulation,
Megatron's full activation recomputation, dropout through its RNG tracker. Healthy; a weight bit flip, a compute fault,
a bad sample, a faulty optimizer kernel on one rank, bits flipped at rest in one rank's optimizer slice and Adam
moment. One spawn runs every scenario."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest

import sdc_telemetry as sdc
from sdc_telemetry.testing import spawn_ranks

if not os.environ.get("CI"):
    pytest.importorskip("megatron.core")

from . import _megatron_ranks
from ._ranks import launcher_env

WORLD = 4
QUIET = {"metrics_port": None, "nvml": False}
HEALTHY = sdc.SDCConfig(weights_every=1, replay_every=2, on_suspect="raise", **QUIET)
DEFERRED = sdc.SDCConfig(weights_every=1, replay_every=2, on_suspect="raise", verdicts="deferred", **QUIET)
RAISE = sdc.SDCConfig(weights_every=1, replay_every=0, on_suspect="raise", **QUIET)
REPLAY_EACH = sdc.SDCConfig(weights_every=1, replay_every=1, on_suspect="raise", **QUIET)
RECORD = sdc.SDCConfig(weights_every=1, replay_every=0, **QUIET)
PLAN: list[dict[str, Any]] = [
    {"config": None},                                                            # 0: dp=4, distributed optimizer
    {"config": HEALTHY, "evaluate": "grad"},                                     # 1: an evaluation pass each step
    {"config": HEALTHY, "micro": 2, "three": True},                              # 2: accumulation, (sum, tokens)
    {"config": HEALTHY, "distopt": False},                                       # 3: replicated optimizer
    {"config": HEALTHY, "bf16": True, "micro": 2},                               # 4: fp32 main_grad and masters
    {"config": None, "recompute": "full"},                                       # 5
    {"config": HEALTHY, "recompute": "full"},                                    # 6: reentrant recomputation
    {"config": RAISE, "flip": (1, 2)},                                           # 7
    {"config": REPLAY_EACH, "perturb": (2, 1)},                                  # 8
    {"config": RECORD, "nan_at": (1, 2)},                                        # 9
    {"config": HEALTHY, "wrong_update": (1, 1)},                                 # 10
    {"config": DEFERRED, "wrong_update": (1, 1)},                                # 11
    {"config": RAISE, "at_rest": (2, 2, "param")},                               # 12
    {"config": RAISE, "at_rest": (0, 2, "exp_avg"), "bf16": True},               # 13
    {"config": None, "refuse": "overlap"},                                       # 14
    {"config": None, "refuse": "fusion"},                                        # 15
    # tensor parallelism 2 x data parallelism 2
    {"config": None, "tp": 2},                                                   # 16
    {"config": HEALTHY, "tp": 2, "evaluate": "no_grad"},                         # 17
    {"config": HEALTHY, "tp": 2, "micro": 2, "distopt": False, "bf16": True, "recompute": "full"},  # 18
    {"config": RAISE, "flip": (3, 2), "tp": 2},                                  # 19
    {"config": REPLAY_EACH, "perturb": (2, 1), "tp": 2},                         # 20
    {"config": HEALTHY, "wrong_update": (1, 1), "tp": 2},                        # 21
    {"config": RECORD, "nan_at": (1, 2), "tp": 2},                               # 22
]


@pytest.fixture(scope="module")
def runs() -> list[list[dict[str, Any]]]:
    out: list[list[dict[str, Any]]] = spawn_ranks(_megatron_ranks.run, WORLD, (PLAN,), timeout=600,
                                                  rank_env=launcher_env(WORLD))
    return out


def _each(runs: list[list[dict[str, Any]]], index: int) -> list[dict[str, Any]]:
    return [per_rank[index] for per_rank in runs]


@pytest.mark.parametrize("index", [1, 2, 3, 4, 6, 17, 18],
                         ids=["distopt", "accumulate-three-values", "replicated-optimizer", "bf16-accumulate",
                              "recompute-full", "tp2", "tp2-replicated-bf16-accumulate-recompute"])
def test_healthy_loops_run_every_check_and_raise_nothing(runs: list[list[dict[str, Any]]], index: int) -> None:
    """Four optimizer steps: the local gradients (measured where Megatron reduces each bucket group), the reduced
    gradients (this rank's reduce-scattered slice under the distributed optimizer), the weights and the replay of
    steps 0 and 2 (bit for bit, dropout through Megatron's RNG tracker; under tensor parallelism both ranks of a
    replica recompute together; under full recomputation through .grad with Megatron's hooks quieted) pass on every
    rank (an evaluation pass after each update through the same forward_step, with gradients on or off, leaves
    nothing behind: a step it opened is withdrawn at the next zero_grad_buffer); the update audit runs where no
    other rank holds a rank's optimizer slice (the distributed optimizer) or referees two replicas (dp=2); nothing
    fails or errs; finish_grad_sync and zero_grad_buffer are given back at close."""
    plan = PLAN[index]
    for rank, r in enumerate(_each(runs, index)):
        assert r["raised"] is None and r["incidents"] == [] and r["updates"] == 4, f"rank {rank}: {r}"
        res = r["results"]
        assert res[("grad_local", "pass")] == 4 and res[("grad_reduced", "pass")] == 4, res
        assert res[("weights", "pass")] == 4 and res[("replay", "pass")] == 2, res
        audited = plan.get("distopt", True) or plan.get("tp", 1) == 2
        assert res.get(("update", "pass"), 0) == (2 if audited else 0), res
        assert not any(result in ("fail", "error", "skipped") for _, result in res), res
        assert r["restored"] and r["closed"]
        assert r["layout"] == ("Megatron-core DDP over " + ("dp=2 x tp=2" if plan.get("tp") == 2 else "dp=4")
                               + (" (distributed optimizer)" if plan.get("distopt", True) else
                                  " (replicated optimizer)"))


@pytest.mark.parametrize(("baseline", "monitored"), [(0, 1), (5, 6), (16, 17)],
                         ids=["distopt", "recompute-full", "tp2"])
def test_the_monitor_leaves_training_bit_for_bit_unchanged(runs: list[list[dict[str, Any]]], baseline: int,
                                                           monitored: int) -> None:
    """The monitored healthy loop (replays and update audits included; under full recomputation the replay runs a
    real backward into .grad, which Megatron's hooks would add into main_grad were they not quieted) ends with the
    same weights, bit for bit, as the same loop without it."""
    for baseline_run, monitored_run in zip(_each(runs, baseline), _each(runs, monitored), strict=True):
        assert monitored_run["weights"] == baseline_run["weights"]
        assert monitored_run["updates"] == baseline_run["updates"] == 4


@pytest.mark.parametrize(("index", "hit", "verdict"), [(7, 1, None), (19, 3, "at_rest")], ids=["dp4", "tp2"])
def test_a_weight_bit_flip_is_named_before_the_update(runs: list[list[dict[str, Any]]], index: int, hit: int,
                                                      verdict: str | None) -> None:
    """A bit flipped in one rank's copy of the first MLP weight before step 2: every data-parallel rank holds the
    whole tensor-parallel shard after Megatron's all-gather, so the vote of step 2 names that rank (two replicas
    under tp=2: the at-rest check referees, naming the rank whose memory changed); SDCDetected leaves the schedule
    before step 2's update, on every rank."""
    for rank, r in enumerate(_each(runs, index)):
        assert r["raised"] == (2, "weights", [hit]) and r["incidents"] == [(2, "weights", [hit])], f"rank {rank}: {r}"
        assert r["verdicts"] == [verdict] and r["updates"] == 2 and r["restored"]


def test_a_compute_fault_is_named_by_the_replay(runs: list[list[dict[str, Any]]]) -> None:
    """Rank 2's first MLP computes 1e-3 off from step 1 on: the replay of step 1 (a partner recomputing rank 2's
    micro-batch on the DDP's module) names rank 2, persistent, on every rank."""
    for rank, r in enumerate(_each(runs, 8)):
        assert r["raised"] == (1, "replay", [2]) and r["verdicts"] == ["persistent"], f"rank {rank}: {r}"


def test_a_compute_fault_under_tensor_parallelism_with_two_replicas_names_both(
        runs: list[list[dict[str, Any]]]) -> None:
    """The same fault on rank 2 under tp=2 x dp=2: the replicas recompute each other's micro-batch, both tensor-
    parallel ranks at once; the fault reaches both ranks of its replica through the tensor-parallel all-reduce, and
    with two replicas no third decides which differs: the incident names all four ranks (ambiguous), never none."""
    for rank, r in enumerate(_each(runs, 20)):
        assert r["raised"] == (1, "replay", [0, 1, 2, 3]) and r["verdicts"] == ["persistent"], f"rank {rank}: {r}"


@pytest.mark.parametrize("index", [9, 22], ids=["dp4", "tp2"])
def test_a_bad_sample_names_nobody(runs: list[list[dict[str, Any]]], index: int) -> None:
    """A NaN in one loss-mask element of data-parallel rank 1's micro-batch at step 2: the triggered audit finds that
    a partner recomputing it gets the same NaN (verdict data, nobody named); the loop skips that update
    (run.finite is False on every rank) and goes on to the end with finite weights."""
    for rank, r in enumerate(_each(runs, index)):
        assert r["incidents"] == [(2, "grad_local", [])] and r["verdicts"] == ["data"], f"rank {rank}: {r}"
        assert r["raised"] is None and r["updates"] == 3 and r["weights_finite"]


@pytest.mark.parametrize("index", [10, 11, 21], ids=["distopt", "distopt-deferred", "tp2"])
def test_a_wrong_update_of_one_ranks_slice_is_named_by_the_update_audit(runs: list[list[dict[str, Any]]],
                                                                        index: int) -> None:
    """Rank 1's optimizer kernel writes one element of its slice 1e-3 off from step 1 on. Megatron all-gathers that
    slice into every data-parallel rank's parameters, so the vote cannot see it; the update audit of step 1 (a
    partner recomputing rank 1's AdamW step on its slice, gradient and moments) names rank 1, persistent, at the end
    of step 1 on every rank, with verdicts decided before the update or read one step later alike."""
    for rank, r in enumerate(_each(runs, index)):
        assert r["raised"] == (1, "update", [1]) and r["verdicts"] == ["persistent"], f"rank {rank}: {r}"
        assert r["results"][("weights", "pass")] == 2  # every replica holds the same wrong weights


@pytest.mark.parametrize(("index", "hit", "label"), [(12, 2, r"\]$"), (13, 0, r"\] \[exp_avg\]$")],
                         ids=["distopt-slice", "bf16-adam-moment"])
def test_memory_changed_at_rest_on_one_rank_is_named_on_that_rank(runs: list[list[dict[str, Any]]], index: int,
                                                                   hit: int, label: str) -> None:
    """A bit flipped before step 2's forward pass in one rank's optimizer slice (fp32: a view of its parameters;
    bf16: its fp32 master copy) or in its first Adam moment: no other rank holds either; the at-rest check of step 2
    names that rank alone, with the tensor as ``parameter[start:end]``."""
    for rank, r in enumerate(_each(runs, index)):
        assert r["raised"] == (2, "weights", [hit]) and r["verdicts"] == ["at_rest"], f"rank {rank}: {r}"
        names = [t for t in _changed(r["evidence"][0])]
        assert names and all(re.search(r"^[\w.]+\[\d+:\d+\]", n) and re.search(label, n) for n in names), names


def _changed(evidence: dict[str, Any]) -> list[str]:
    """The tensor names an at-rest incident's evidence lists."""
    found: list[str] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        elif isinstance(x, str) and re.search(r"\[\d+:\d+\]", x):
            found.append(x)

    walk(evidence)
    return found


@pytest.mark.parametrize(("index", "words"), [(14, "overlap_param_gather is not supported"),
                                              (15, "gradient_accumulation_fusion=False")], ids=["overlap", "fusion"])
def test_unsupported_settings_are_refused_by_name(runs: list[list[dict[str, Any]]], index: int, words: str) -> None:
    """overlap_param_gather (its forward hooks would gather during a replay) and gradient_accumulation_fusion (its
    kernel adds a replay's weight gradients into main_grad) are refused with what to set instead."""
    for r in _each(runs, index):
        assert words in r["refused"], r
