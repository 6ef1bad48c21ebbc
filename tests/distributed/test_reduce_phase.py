"""Reduce-phase corruption on real gloo ranks: a fault inside the all-reduce reaches every rank identically, so the
replicas agree and the replay sees nothing; the checksum that travels with the reduction names it at its step."""

from __future__ import annotations

import math
from typing import Any

import pytest

from sdc_telemetry.testing import spawn_ranks

from ._reduce_phase import run_counted


def _verdicts(result: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [(i["step"], i["check"], tuple(i["suspect_ranks"]), i["evidence"].get("ambiguous"))
            for i in result["incidents"]]


HEALTHY: dict[str, dict[str, Any]] = {
    "fp32": {"config": {"replay_every": 2}, "steps": 6},
    "no_sync_accumulation": {"config": {"replay_every": 2}, "steps": 4, "accumulate": 3},
    "accumulation_without_no_sync": {"config": {"replay_every": 0}, "steps": 4, "accumulate": 2, "no_sync": False},
    "grad_scaler": {"config": {"replay_every": 2}, "steps": 6, "scaler": True},
    "unused_parameter": {"config": {"replay_every": 2}, "steps": 4, "find_unused": True,
                         "freeze_after_wrap": "fc2.bias"},
    "bucket_view_kept_grads": {"config": {"replay_every": 2}, "steps": 4, "bucket_view": True, "set_to_none": False},
    "plain_hook": {"config": {"replay_every": 2}, "steps": 4, "plain_hook": True},
}
# Reductions per healthy run: one per step, two with accumulation that all-reduces every micro-batch.
ROUNDS = {name: sc["steps"] * (sc["accumulate"] if sc.get("no_sync") is False else 1) for name, sc in HEALTHY.items()}

FAULTY: dict[str, dict[str, Any]] = {
    "x8": {"config": {"replay_every": 2}, "steps": 6,
           "fault": {"kind": "corrupt_reduction", "step": 3, "index": 5, "factor": 8.0}},
    "plus_one_raise": {"config": {"replay_every": 2, "on_suspect": "raise"}, "steps": 6,
                       "fault": {"kind": "corrupt_reduction", "step": 2, "index": 40, "delta": 1.0}},
    "nan": {"config": {"replay_every": 0}, "steps": 4,
            "fault": {"kind": "corrupt_reduction", "step": 2, "index": 5, "value": math.nan}},
    "one_receiver_finite": {"config": {"replay_every": 0}, "steps": 5,
                            "fault": {"kind": "corrupt_reduced_grad", "rank": 1, "step": 2, "index": 5,
                                      "value": 5.0}},
}


@pytest.fixture(scope="module")
def three_ranks() -> dict[str, tuple[dict[str, Any], ...]]:
    """One spawn of 3 ranks running the healthy and the faulty scenarios in a row."""
    scenarios = {**HEALTHY, **FAULTY}
    results = spawn_ranks(run_counted, 3, (list(scenarios.values()),), timeout=600)
    return dict(zip(scenarios, zip(*results, strict=True), strict=True))


def test_healthy_runs_raise_no_false_alarm_and_the_checksum_runs_at_every_reduction(
        three_ranks: dict[str, tuple[dict[str, Any], ...]]) -> None:
    """fp32 on CPU (no noise to hide behind), accumulation with and without no_sync, a GradScaler, an unused
    parameter with find_unused_parameters, kept bucket views and DDP's own reduction: no incident, grad_reduced
    passes at every step and the checksum compared every reduction."""
    for name, rounds in ROUNDS.items():
        for r in three_ranks[name]:
            assert not r["incidents"] and not r["errors"], (name, r["incidents"])
            assert r["counts"]["grad_reduced"] == {"pass": HEALTHY[name]["steps"]}, (name, r["counts"])
            assert r["reduction_checks"] == rounds, (name, r["reduction_checks"])


def test_finite_corruption_inside_the_reduction_is_communication_at_its_step(
        three_ranks: dict[str, tuple[dict[str, Any], ...]]) -> None:
    """One reduced element x8 on every rank: the weights still agree and the replay passes, but grad_reduced names
    every rank at that step (ambiguous: it cannot say which link), verdict communication, reduce phase."""
    per_rank = three_ranks["x8"]
    for r in per_rank:
        assert r["fired"] == ["reduction of bucket 0 corrupted (factor 8.0 at 5) at step 3"]
        assert _verdicts(r) == [(3, "grad_reduced", (0, 1, 2), True)]
        evidence = r["incidents"][0]["evidence"]
        assert evidence["verdict"] == "communication" and evidence["reduce_phase"] is True
        assert r["counts"]["weights"] == {"pass": 6} and r["counts"]["replay"] == {"pass": 3}


def test_plus_one_inside_the_reduction_stops_every_rank_at_that_step(
        three_ranks: dict[str, tuple[dict[str, Any], ...]]) -> None:
    """+1.0 on one reduced element with on_suspect=raise: SDCDetected on every rank at the corrupted step."""
    for r in three_ranks["plus_one_raise"]:
        assert r["raised_at"] == 2 and r["raised_checks"] == ["grad_reduced"]
        assert r["incidents"][0]["evidence"]["verdict"] == "communication"


def test_nan_made_inside_the_reduction_is_communication_not_numerics(
        three_ranks: dict[str, tuple[dict[str, Any], ...]]) -> None:
    """A NaN from the reduction while every local gradient was finite: communication, every rank named."""
    for r in three_ranks["nan"]:
        first = r["incidents"][0]
        assert (first["step"], first["check"], first["suspect_ranks"]) == (2, "grad_reduced", [0, 1, 2])
        assert first["evidence"]["verdict"] == "communication" and first["evidence"]["reduce_phase"] is True


def test_a_finite_corruption_on_one_receiver_names_it_at_its_step(
        three_ranks: dict[str, tuple[dict[str, Any], ...]]) -> None:
    """A finite value written into one rank's reduced bucket: that rank, unambiguous, at that step (before the
    weight check sees the diverged replica at the next)."""
    for r in three_ranks["one_receiver_finite"]:
        assert _verdicts(r)[:2] == [(2, "grad_reduced", (1,), False), (3, "weights", (1,), False)]
        assert r["incidents"][0]["evidence"]["verdict"] == "communication"
