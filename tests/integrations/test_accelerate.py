"""SDCAccelerate in loops written as Accelerate's users write them (``accelerator.accumulate``,
``accelerator.backward``, the prepared optimizer), on 3 gloo ranks: DDP with gradient accumulation, bf16 mixed
precision, fp16's GradScaler, and Accelerate's FSDP2 plugin; a weight bit flip, a compute fault and a bad sample.
One spawn runs every scenario; the single-process tests cover the set-up's refusals and its undoing."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import sdc_telemetry as sdc
from sdc_telemetry.testing import spawn_ranks

if not os.environ.get("CI"):
    pytest.importorskip("accelerate")

from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import DistributedType

from sdc_telemetry.accelerate import SDCAccelerate

from . import _accelerate_ranks
from ._ranks import assert_healthy_and_replayed, launcher_env

WORLD = 3
QUIET = {"metrics_port": None, "nvml": False}
HEALTHY = sdc.SDCConfig(weights_every=1, replay_every=2, on_suspect="raise", **QUIET)
RAISE = sdc.SDCConfig(weights_every=1, replay_every=0, on_suspect="raise", **QUIET)
PLAN: list[dict[str, Any]] = [
    {"config": None},                                                      # 0: the loop without the monitor
    {"config": HEALTHY},                                                   # 1: DDP, 2 micro-batches per step
    {"config": RAISE, "flip": (1, 2)},                                     # 2
    {"config": sdc.SDCConfig(weights_every=1, replay_every=1, on_suspect="raise", **QUIET), "perturb": (2, 1)},
    {"config": sdc.SDCConfig(weights_every=1, replay_every=0, **QUIET), "nan_at": (1, 4),  # 4: micro-batch 4 is
     "skip_nonfinite": True},                                              # step 2's first
    {"config": HEALTHY, "mixed_precision": "bf16"},                        # 5
    {"config": HEALTHY, "scaler": True},                                   # 6
    {"config": HEALTHY, "fsdp2": True},                                    # 7
    {"config": RAISE, "fsdp2": True, "flip": (1, 2)},                      # 8
]


@pytest.fixture(scope="module")
def runs() -> list[list[dict[str, Any]]]:
    out: list[list[dict[str, Any]]] = spawn_ranks(_accelerate_ranks.run, WORLD, (PLAN,), timeout=300,
                                                  rank_env=launcher_env(WORLD))
    return out


def _each(runs: list[list[dict[str, Any]]], index: int) -> list[dict[str, Any]]:
    return [per_rank[index] for per_rank in runs]


@pytest.mark.parametrize("index", [1, 5, 6, 7], ids=["ddp-accumulate", "bf16", "fp16-scaler", "fsdp2"])
def test_healthy_loops_run_every_check_and_raise_nothing(runs: list[list[dict[str, Any]]], index: int) -> None:
    """Four optimizer steps of two micro-batches each: the replay of steps 0 and 2 matches bit for bit (so the
    recorded loss carries Accelerate's 1/2 and its scaler's factor, and bf16's autocast is replayed), the gradient
    checks pass every step, and no check fails, errs or is skipped, but FSDP2's first at-rest comparison (no update
    before it); the prepared model is DDP, or FSDP2's module; accelerator.backward is given back at close."""
    results = _each(runs, index)
    if PLAN[index].get("fsdp2"):
        for rank, r in enumerate(results):
            assert r["model_type"] == "FSDPSequential", r["model_type"]
            assert r["incidents"] == [] and r["raised"] is None, f"rank {rank}: {r}"
            assert r["results"][("replay", "pass")] == 2 and r["results"][("grad_local", "pass")] == 4
            assert r["results"][("weights", "pass")] == 3 and r["results"][("weights", "skipped")] == 1
            assert r["results"][("update", "pass")] == 2  # no replica: the update audit runs with the replay
            assert not any(res in ("fail", "error") for _, res in r["results"]), r["results"]
    else:
        for r in results:
            assert r["model_type"] == "DistributedDataParallel"
        assert_healthy_and_replayed(results)
    assert all(r["backward_restored"] and r["closed"] for r in results)


def test_the_monitor_leaves_training_bit_for_bit_unchanged(runs: list[list[dict[str, Any]]]) -> None:
    """The monitored healthy loop ends with the same weights, bit for bit, as the same loop without it."""
    for baseline, monitored in zip(_each(runs, 0), _each(runs, 1), strict=True):
        assert monitored["weights"] == baseline["weights"]
        assert monitored["updates"] == baseline["updates"] == 4


@pytest.mark.parametrize("index", [2, 8], ids=["ddp", "fsdp2"])
def test_a_weight_bit_flip_stops_every_rank_before_the_update(runs: list[list[dict[str, Any]]], index: int) -> None:
    """A bit flipped in rank 1's first-layer weights (its shard under FSDP2, where no replica holds it) before step
    2: the weight check of step 2 names rank 1 alone (memory changed at rest), and SDCDetected leaves the loop on
    every rank inside the synchronising accelerator.backward, before step 2's update."""
    for rank, r in enumerate(_each(runs, index)):
        assert r["raised"] == (2, "weights", [1]) and r["incidents"] == [(2, "weights", [1])], f"rank {rank}: {r}"
        assert r["verdicts"] == ["at_rest"]
        assert r["updates"] == 2 and r["backward_restored"]


def test_a_compute_fault_is_named_by_the_replay(runs: list[list[dict[str, Any]]]) -> None:
    """Rank 2's first layer computes 1e-3 off from step 1 on: the replay of step 1 (a partner recomputing rank 2's
    two micro-batches) names rank 2 on every rank."""
    for rank, r in enumerate(_each(runs, 3)):
        assert r["raised"] == (1, "replay", [2]), f"rank {rank}: {r}"
        assert r["verdicts"] == ["persistent"]


def test_a_bad_sample_names_nobody_and_its_update_is_skipped(runs: list[list[dict[str, Any]]]) -> None:
    """A NaN in one sample of rank 1's batch at step 2: the triggered audit finds that a partner recomputing it gets
    the same NaN (verdict data, nobody named), the update of step 2 is skipped on every rank
    (skip_nonfinite=True), and training goes on to the end with finite weights."""
    for rank, r in enumerate(_each(runs, 4)):
        assert r["incidents"] == [(2, "grad_local", [])] and r["verdicts"] == ["data"], f"rank {rank}: {r}"
        assert r["raised"] is None and r["updates"] == 4 and r["weights_finite"]


@pytest.fixture()
def accelerator() -> Any:
    """A single-process Accelerator (no process group), its singletons reset after the test."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True)
    yield acc
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _prepared(acc: Any) -> tuple[torch.nn.Module, Any]:
    net = torch.nn.Linear(4, 2)
    model, optimizer = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    return model, optimizer


def _loss(module: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return module(batch).square().mean()


def test_the_prepared_optimizer_is_accepted_and_backward_is_given_back(accelerator: Any) -> None:
    """SDCMonitor and SDCAccelerate take AcceleratedOptimizer as it is (the torch optimizer inside is hooked: the
    step's gradient check passes); a second SDCAccelerate on the same accelerator is refused; close() gives
    accelerator.backward back, after which it runs without the monitor."""
    model, optimizer = _prepared(accelerator)
    assert type(optimizer).__name__ == "AcceleratedOptimizer"
    counts: dict[tuple[str, str], int] = {}

    class Count(sdc.Observer):
        def report(self, report: sdc.StepReport) -> None:
            for key in report.results.items():
                counts[key] = counts.get(key, 0) + 1

    run = SDCAccelerate(accelerator, model, optimizer, loss_fn=_loss, config=sdc.SDCConfig(**QUIET),
                        observer=Count())
    assert run.monitor.optimizer is optimizer.optimizer
    with pytest.raises(ValueError, match="already has an SDCAccelerate"):
        SDCAccelerate(accelerator, model, optimizer, loss_fn=_loss, config=sdc.SDCConfig(**QUIET))
    batch = torch.randn(3, 4)
    run.micro_batch(batch)
    accelerator.backward(_loss(model, batch))
    assert run.finite and counts.get(("grad_local", "pass")) == 1
    optimizer.step()
    run.close()
    assert "backward" not in vars(accelerator)
    accelerator.backward(_loss(model, batch))  # plain Accelerate again
    assert counts.get(("grad_local", "pass")) == 1


def test_backward_without_a_registered_micro_batch_says_what_is_missing(accelerator: Any) -> None:
    model, optimizer = _prepared(accelerator)
    with SDCAccelerate(accelerator, model, optimizer, loss_fn=_loss, config=sdc.SDCConfig(**QUIET)):
        with pytest.raises(RuntimeError, match=r"run.micro_batch\(batch\)"):
            accelerator.backward(_loss(model, torch.randn(3, 4)))
    assert "backward" not in vars(accelerator)


@pytest.mark.parametrize("kind", [DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM])
def test_modes_that_run_their_own_backward_are_refused_by_name(accelerator: Any, kind: DistributedType) -> None:
    model, optimizer = _prepared(accelerator)
    accelerator.state.distributed_type = kind
    PartialState._shared_state["distributed_type"] = kind
    with pytest.raises(ValueError, match=kind.name):
        SDCAccelerate(accelerator, model, optimizer, loss_fn=_loss, config=sdc.SDCConfig(**QUIET))
    assert "backward" not in vars(accelerator)


def test_a_loop_that_ends_inside_an_accumulation_window_still_settles_the_last_step(accelerator: Any) -> None:
    """gradient_accumulation_steps=2 and three micro-batches, verdicts read one step later: close() discards the
    half window (its gradients were never reduced) and still settles step 0's verdict, which an abandoned step would
    have dropped (no report, and no SDCDetected from it)."""
    accelerator.gradient_accumulation_steps = 2
    model, optimizer = _prepared(accelerator)
    reports: list[int] = []

    class Steps(sdc.Observer):
        def report(self, report: sdc.StepReport) -> None:
            reports.append(report.step)

    run = SDCAccelerate(accelerator, model, optimizer, loss_fn=_loss, observer=Steps(),
                        config=sdc.SDCConfig(verdicts="deferred", **QUIET))
    for _ in range(3):
        batch = torch.randn(3, 4)
        with accelerator.accumulate(model):
            run.micro_batch(batch)
            accelerator.backward(_loss(model, batch))
            optimizer.step()
            optimizer.zero_grad()
    assert reports == []  # step 0 ended; its verdict waits for the next step
    run.close()
    assert reports == [0] and run.monitor.closed
