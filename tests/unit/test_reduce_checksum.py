"""The reduce-phase checksum without processes: its arithmetic against simulated reductions, and the verdict."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from sdc_telemetry.checks import grad
from sdc_telemetry.core import status as S
from sdc_telemetry.parallel.ddp import (
    BLOCK,
    CHUNK,
    _signs,
    chunk_constants,
    chunk_sums,
    compare,
    tolerance,
    weighted_sums,
)


def _reduce(xs: torch.Tensor, order: str) -> torch.Tensor:
    """Sum the ranks' rows in the rows' dtype, one rounding per addition, in a backend-like order."""
    world = xs.shape[0]
    if order == "tree":
        rows = list(xs)
        while len(rows) > 1:
            rows = [rows[i] + rows[i + 1] if i + 1 < len(rows) else rows[i] for i in range(0, len(rows), 2)]
        out: torch.Tensor = rows[0]
        return out
    if order == "ring":  # each of W segments starts its sum at a different rank, as a ring reduce-scatter does
        out = torch.empty_like(xs[0])
        for seg, idx in enumerate(torch.arange(xs.shape[1]).tensor_split(world)):
            ranks = [(seg + 1 + k) % world for k in range(world)]
            acc = xs[ranks[0], idx].clone()
            for r in ranks[1:]:
                acc = acc + xs[r, idx]
            out[idx] = acc
        return out
    ranks = list(range(world)) if order == "ascending" else list(range(world))[::-1]
    acc = xs[ranks[0]].clone()
    for r in ranks[1:]:
        acc = acc + xs[r]
    return acc


def _flag(xs: torch.Tensor, reduced: torch.Tensor) -> int:
    """The checksum's verdict on ``reduced`` as the reduction of the ranks' rows ``xs`` (1: mismatch)."""
    world, n = xs.shape
    sums = torch.stack([chunk_sums(x) for x in xs]).sum(0)  # (2, k): the all-reduce of the ranks' S and A
    vec = torch.cat([sums[0], sums[1], torch.tensor([float(world)], dtype=torch.float64)])
    coef, limit = chunk_constants([(n, xs.dtype)], world, xs.device)
    return int(compare(vec, weighted_sums(reduced), coef, limit, world))


def _grads(world: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gradient-like rows already scaled by 1/W as DDP does: heavy-tailed magnitudes, mixed signs, some zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world, n, generator=g, dtype=torch.float64) * torch.exp(2 * torch.randn(world, n, generator=g))
    x[:, ::7] = 0.0
    return (x * 1e-3).to(dtype) * (1.0 / world)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world", [1, 2, 3, 8, 16])
def test_healthy_reductions_in_any_order_never_mismatch(world: int, dtype: torch.dtype) -> None:
    """Every summation order a backend may use stays within the tolerance: no false alarm, at any size."""
    for seed, n in enumerate((1, 3, 1000, 2 * CHUNK + 17)):
        xs = _grads(world, n, dtype, seed)
        for order in ("ascending", "descending", "tree", "ring"):
            assert _flag(xs, _reduce(xs, order)) == 0, (world, dtype, n, order)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_corruption_inside_the_reduction_is_seen(world: int) -> None:
    """One element x8, +1.0, NaN or Inf in the reduced result (finite inputs), in a full chunk or the tail: seen."""
    xs = _grads(world, 2 * CHUNK + 100, torch.float32, 1)
    good = _reduce(xs, "ring")
    typical = good.abs().mean().item()
    # Elements of typical size or more, in the first chunk, the second, and the tail.
    picks = [next(i for i in range(start, start + 100) if good[i].abs() > typical)
             for start in (0, CHUNK, 2 * CHUNK)]
    corruptions: list[Callable[[torch.Tensor], torch.Tensor]] = [
        lambda v: v * 8, lambda v: v + 1.0, lambda v: v * math.nan, lambda v: v + math.inf]
    for i in picks:
        for corrupt in corruptions:
            bad = good.clone()
            bad[i] = corrupt(bad[i])
            assert _flag(xs, bad) == 1, (i, bad[i].item())


def test_blocks_that_trade_places_are_seen_where_their_weights_differ() -> None:
    """Two blocks of 16 elements swapped (a wrong address inside the reduction) change S when their signs differ."""
    xs = _grads(3, 5000, torch.float32, 2)
    good = _reduce(xs, "tree")
    w = _signs(torch.device("cpu"))
    p, q = next((p, q) for p in range(2, 60) for q in range(p + 1, 100) if w[p] != w[q])
    bad = good.clone()
    bad[p * BLOCK:(p + 1) * BLOCK], bad[q * BLOCK:(q + 1) * BLOCK] = (good[q * BLOCK:(q + 1) * BLOCK].clone(),
                                                                      good[p * BLOCK:(p + 1) * BLOCK].clone())
    assert _flag(xs, bad) == 1


def test_a_true_overflow_is_numerics_not_a_mismatch() -> None:
    """fp16 values whose correct sum overflows: the Inf is the dtype's, not a fault (left to the numerics verdict)."""
    xs = torch.full((2, 10), 40000.0, dtype=torch.float16)
    reduced = _reduce(xs, "ascending")
    assert torch.isinf(reduced).all() and _flag(xs, reduced) == 0
    xs = torch.full((2, 10), 1.0, dtype=torch.float16)
    reduced = _reduce(xs, "ascending")
    reduced[3] = math.inf  # not an overflow: 1 + 1 cannot reach Inf
    assert _flag(xs, reduced) == 1


def test_a_rank_that_could_not_measure_makes_the_round_unmeasured() -> None:
    """The ranks-that-measured count below W: never a mismatch, whatever the sums say."""
    xs = _grads(3, 100, torch.float32, 3)
    bad = _reduce(xs, "ascending") * 8
    sums = torch.stack([chunk_sums(x) for x in xs]).sum(0)
    coef, limit = chunk_constants([(100, torch.float32)], 3, torch.device("cpu"))
    vec = torch.cat([sums[0], sums[1], torch.tensor([2.0], dtype=torch.float64)])
    assert int(compare(vec, weighted_sums(bad), coef, limit, 3)) == 0
    vec[-1] = 3.0
    assert int(compare(vec, weighted_sums(bad), coef, limit, 3)) == 1


def test_tolerance_is_the_any_order_bound_and_bad_input_is_refused() -> None:
    """(W-1) * eps of the dtype plus the block sums' float32 term (30 * eps32), a little more for long chunks."""
    eps = torch.finfo(torch.float32).eps
    assert tolerance(3, torch.float32, 10) == pytest.approx(32 * eps, rel=1e-5)
    assert tolerance(3, torch.float32, CHUNK) == pytest.approx(32 * eps, rel=1e-2)
    bf16 = torch.finfo(torch.bfloat16).eps
    assert tolerance(9, torch.bfloat16, 10) == pytest.approx(8 * bf16, rel=1e-3)
    assert tolerance(2, torch.float64, 10) < 1e-12
    with pytest.raises(TypeError):
        tolerance(2, torch.int32, 10)


def _st(rank: int, mismatch: bool = False, reduced_bad: bool = False, local_bad: bool = False) -> grad.GradStatus:
    return grad.GradStatus(rank, True, local_bad, True, reduced_bad, 1.0, math.nan if reduced_bad else 1.0,
                           mismatch)


def test_checksum_off_on_every_rank_is_communication_inside_the_reduction() -> None:
    """The same mismatch everywhere: grad_reduced, communication, reduce phase, every rank named, ambiguous."""
    f = grad.decide([_st(r, mismatch=True) for r in range(3)])
    assert f is not None and (f.check, f.suspect_ranks) == ("grad_reduced", (0, 1, 2))
    assert f.evidence["verdict"] == "communication" and f.evidence["reduce_phase"] is True
    assert f.evidence["ambiguous"] is True


def test_nan_made_inside_the_reduction_is_communication_and_overflow_stays_numerics() -> None:
    """Reduced NaN on every rank with finite local gradients: communication when the checksum is off, numerics
    (an overflow in the reduction) when it is not."""
    f = grad.decide([_st(r, mismatch=True, reduced_bad=True) for r in range(4)])
    assert f is not None and f.evidence["verdict"] == "communication" and f.evidence["reduce_phase"] is True
    f = grad.decide([_st(r, reduced_bad=True) for r in range(4)])
    assert f is not None and f.suspect_ranks == () and f.evidence["verdict"] == "numerics"


def test_checksum_off_on_some_ranks_names_them_unambiguously() -> None:
    """Off on one receiver only: that rank, not ambiguous; a non-finite local gradient still comes first."""
    f = grad.decide([_st(0), _st(1, mismatch=True), _st(2)])
    assert f is not None and (f.check, f.suspect_ranks) == ("grad_reduced", (1,))
    assert f.evidence["ambiguous"] is False and f.evidence["verdict"] == "communication"
    f = grad.decide([_st(0, local_bad=True), _st(1, mismatch=True), _st(2)])
    assert f is not None and (f.check, f.suspect_ranks) == ("grad_local", (0,))


def test_grad_check_reads_the_checksum_field_on_the_fast_and_the_rare_path() -> None:
    """Agreed on every rank: decided from the agreement alone; disagreeing: the flag travels in the gathered row."""
    gathered: list[torch.Tensor] = []

    def gather(row: torch.Tensor) -> list[list[int]]:
        gathered.append(row)
        return [[1, int(row[1]), int(row[2]), int(r == 2)] for r in range(3)]

    check = grad.GradCheck([0, 1, 2], 0, ["w"], True, None, gather, lambda o: [o] * 3)
    high = [0] * S.FIELDS
    high[S.LOCAL_MEASURED] = high[S.REDUCED_MEASURED] = high[S.REDUCED_CHECKSUM] = 1
    f = check.verdict(high, list(high), high, (1.0, 1.0, 1.0), torch.ones(1), S.GRAD_FIELDS, False)
    assert f is not None and f.suspect_ranks == (0, 1, 2) and not gathered
    low = list(high)
    low[S.REDUCED_CHECKSUM] = 0
    f = check.verdict(high, low, low, (1.0, 1.0, 0.0), torch.ones(1), S.GRAD_FIELDS, False)
    assert f is not None and f.suspect_ranks == (2,) and f.evidence["ambiguous"] is False and gathered
    healthy = list(low)
    assert check.verdict(healthy, healthy, healthy, (1.0, 1.0, 0.0), torch.ones(1), S.GRAD_FIELDS, False) is None
