"""spawn_ranks: results by rank, and failures reported as soon as they are known, with nothing left running."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

from sdc_telemetry.testing import RankFailed, spawn_ranks

TIMEOUT = 120.0  # far longer than any of these runs: a failure reported "within 120s" means it waited for it


def _echo(rank: int, world: int, tag: str) -> tuple[int, int, str, str]:
    return rank, world, tag, os.environ.get("SDC_TEST_TAG", "")


def _rank1_raises(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank 1")
    time.sleep(600)


def _rank1_exits(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()
    time.sleep(600)


def _rank1_skips_the_collective(rank: int, world: int) -> None:
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    time.sleep(600)


def _sleeps(rank: int, world: int) -> None:
    time.sleep(600)


def _failure(fn: object, world: int = 2, **kw: object) -> str:
    kw.setdefault("timeout", TIMEOUT)
    with pytest.raises(RankFailed) as info:
        spawn_ranks(fn, world, **kw)  # type: ignore[arg-type]
    assert multiprocessing.active_children() == []
    return str(info.value)


def test_results_come_back_ordered_by_rank_with_the_environment_applied() -> None:
    """Each rank's return value comes back at its rank's index; env and rank_env reach the rank's process."""
    out = spawn_ranks(_echo, 2, ("x",), timeout=TIMEOUT, rank_env=lambda r: {"SDC_TEST_TAG": f"t{r}"})
    assert out == [(0, 2, "x", "t0"), (1, 2, "x", "t1")]
    assert multiprocessing.active_children() == []


def test_a_rank_that_raises_is_reported_with_its_error_and_the_hung_rank_is_killed() -> None:
    """The raising rank's error and traceback are reported, not a timeout; the rank still running is killed."""
    msg = _failure(_rank1_raises)
    assert "rank 1: ValueError: boom from rank 1" in msg and "Traceback" in msg
    assert "rank 0: no result" in msg and "killed" in msg
    assert "did not finish within" not in msg


def test_a_rank_that_dies_is_reported_with_its_exit_code() -> None:
    """A rank that exits without a result (os._exit(3)) is reported with exit code 3, not as a timeout."""
    msg = _failure(_rank1_exits)
    assert "rank 1: died without a result, exit code 3" in msg
    assert "rank 0:" in msg
    assert "did not finish within" not in msg


def test_a_collective_that_a_rank_never_joins_fails_within_pg_timeout() -> None:
    """pg_timeout reaches the process group: the waiting rank's collective raises a timeout of its own."""
    msg = _failure(_rank1_skips_the_collective, pg_timeout=2.0)
    rank0 = next(line for line in msg.splitlines() if line.startswith("rank 0:"))
    assert "timed out" in msg.lower() and "Error" in rank0
    assert "did not finish within" not in msg


def test_a_hung_run_ends_at_the_timeout_and_is_killed() -> None:
    """A rank still running at ``timeout`` is reported as such and killed."""
    msg = _failure(_sleeps, world=1, timeout=3.0)
    assert "ranks [0] did not finish within 3s" in msg and "rank 0: still running at the timeout: killed" in msg


def test_bad_arguments_are_refused_before_spawning() -> None:
    """world < 1 and non-positive timeouts raise ValueError naming the argument."""
    with pytest.raises(ValueError, match="world"):
        spawn_ranks(_echo, 0)
    with pytest.raises(ValueError, match="pg_timeout"):
        spawn_ranks(_echo, 1, pg_timeout=0)
