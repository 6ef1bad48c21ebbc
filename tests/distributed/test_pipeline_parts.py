"""Pipeline-parallel building blocks (parallel/pipeline.py) on a (dp=2, pp=2) mesh of 4 gloo ranks: DDP-wrapped and
fully_shard-ed stage modules, the gradient taps on a stage, the schedule rerun, the coordinate and the refusals."""

from __future__ import annotations

from typing import Any

import pytest

from sdc_telemetry.testing import spawn_ranks

from ._pipeline import run_pipeline


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    """One spawn of 4 ranks running every case."""
    return spawn_ranks(run_pipeline, 4, (), timeout=300)


def test_ddp_stage_under_gpipe_asserts_at_the_second_step_without_find_unused(ranks: list[dict[str, Any]]) -> None:
    """torch 2.13: a DDP-wrapped module in ScheduleGPipe fails in DDP's bucket rebuild at step 2, and runs with
    find_unused_parameters=True; the layout refuses the first by name."""
    for r in ranks:
        assert r["single_gpipe"].startswith("step 1: ") and "rebuilt_param_indices_" in r["single_gpipe"]
        assert r["single_gpipe_find_unused"] == "ok"
        assert "find_unused_parameters=True" in r["refusals"]["gpipe_without_find_unused"]


def test_ddp_stage_gradients_are_a_plain_all_reduce_and_tapped_once_per_step(ranks: list[dict[str, Any]]) -> None:
    """With find_unused_parameters=True each reduced .grad is bitwise the dp all-reduce of the tapped local
    gradients / replicas / micro-batches; the comm hook tap runs in every step and the reduce checksum passes."""
    for r in ranks:
        for case in ("rerun", "plain", "fault"):
            c = r["ddp"][case]
            assert c["reduced_plain"] == [True, True, True]
            assert c["mismatch"] == [0, 0, 0]
            assert all(n >= 1 for n in c["taps"])


def test_fsdp_stage_reduce_scatter_is_tapped_once_per_step(ranks: list[dict[str, Any]]) -> None:
    """A fully_shard-ed stage module reduce-scatters once per schedule step (after the last backward): one tap."""
    for r in ranks:
        assert r["fsdp"]["plain"]["taps"] == [1, 1, 1]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_partner_rerun_reproduces_the_origin_bit_for_bit(ranks: list[dict[str, Any]], kind: str) -> None:
    """The partner replica's rerun of the origin's step gives the origin's tapped gradient fingerprints on every
    stage and its losses on the last stage, bit for bit (DDP: replica 1 reruns alone; FSDP2: the replicas swap)."""
    rerunning = [0, 1, 2, 3] if kind == "fsdp" else [2, 3]
    for rank in rerunning:
        res = ranks[rank][kind]["rerun"]["rerun"]
        assert res["rows_equal"] and not res["rows_own_equal"]
        assert res["losses_equal"] is (True if rank % 2 == 1 else None)
    if kind == "ddp":
        assert ranks[0]["ddp"]["rerun"]["rerun"] is None and ranks[1]["ddp"]["rerun"]["rerun"] is None


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_rerun_leaves_grad_rng_and_schedule_state(ranks: list[dict[str, Any]], kind: str) -> None:
    """The rerun leaves .grad (the same tensors, the same bits), the RNG, the last stage's outputs and the schedule's
    losses as they were, and no gradient tap fires (nothing is reduced across replicas)."""
    for r in ranks:
        for case in ("rerun", "fault"):
            res = r[kind][case]["rerun"]
            if res is None:
                continue
            assert res["grad_untouched"] and res["rng_restored"] and res["outputs_kept"]
            assert res["taps_during_rerun"] == 0 and res["internal_losses"] == 0


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_training_after_a_rerun_is_bitwise_that_of_no_rerun(ranks: list[dict[str, Any]], kind: str) -> None:
    """The steps after the rerun give the same losses and final weights, bit for bit, as a run without it."""
    for r in ranks:
        assert r[kind]["rerun"]["final"] == r[kind]["plain"]["final"]
        assert r[kind]["rerun"]["losses"] == r[kind]["plain"]["losses"]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_compute_fault_on_the_origin_makes_the_rerun_differ(ranks: list[dict[str, Any]], kind: str) -> None:
    """Rank 1 (replica 0, last stage) scales its first layer's output by 1+1e-3 at step 1: the partner's rerun of
    replica 0's step differs from what rank 1 recorded, in gradient fingerprints and losses, and rank 0's stage
    gradients differ too (the wrong gradient flows back)."""
    assert ranks[3][kind]["fault"]["rerun"]["rows_equal"] is False
    assert ranks[3][kind]["fault"]["rerun"]["losses_equal"] is False
    assert ranks[2][kind]["fault"]["rerun"]["rows_equal"] is False


def test_stage_coordinates_and_weight_slots(ranks: list[dict[str, Any]]) -> None:
    """Rank r sits at (pp = r % 2, dp = r // 2); DDP stages get one weight slot per stage, FSDP2 stages one per
    (stage, shard), and only DDP stages have weight replicas."""
    for rank, r in enumerate(ranks):
        ddp, fsdp = r["ddp"]["plain"], r["fsdp"]["plain"]
        assert ddp["coordinate"] == {"pp": rank % 2, "dp_replicate": rank // 2}
        assert fsdp["coordinate"] == {"pp": rank % 2, "dp_shard": rank // 2}
        assert ddp["shard_of"] == [0, 1, 0, 1] and ddp["slots"] == (2, rank % 2)
        assert fsdp["shard_of"] == [0, 2, 1, 3] and fsdp["slots"] == (4, 2 * (rank % 2) + rank // 2)
        assert ddp["weight_replicas"] and not fsdp["weight_replicas"] and ddp["replicas"] and fsdp["replicas"]


def test_uncovered_pipelines_are_refused_by_name(ranks: list[dict[str, Any]]) -> None:
    """A rank's stages out of the schedule's order, stage modules wrapped differently, DDP stages under a looped
    schedule without find_unused_parameters or under a zero-bubble schedule, model parts that are not the
    schedule's, one comm hook for several stage modules, a plain stage module with two replicas, a schedule without
    loss_fn and a last stage stepped without a target are refused with a message naming the problem."""
    for r in ranks:
        f = r["refusals"]
        assert "ascending order" in f["interleaved_reversed"], f["interleaved_reversed"]
        assert "wrapped differently" in f["interleaved_mixed"]
        assert "ScheduleLoopedBFS needs" in f["looped_without_find_unused"]
        assert "find_unused_parameters=True" in f["looped_without_find_unused"]
        assert "ScheduleInterleavedZeroBubble with DDP-wrapped stage modules" in f["zero_bubble_ddp"]
        assert "torch.autograd.grad" in f["zero_bubble_ddp"]
        assert "the 2 stage modules this rank runs, in local stage order" in f["parts_reversed"]
        assert "got other modules" in f["parts_reversed"] and "got 1 module(s)" in f["parts_missing"]
        assert "one hook with one state" in f["parts_one_comm_hook"]
        assert "neither DistributedDataParallel" in f["plain_module"]
        assert "without loss_fn" in f["no_loss_fn"]
        assert "needs target=" in f["no_target"]
