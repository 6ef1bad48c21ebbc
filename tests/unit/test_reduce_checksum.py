"""The reduce-phase checksum without processes: its arithmetic against simulated reductions, and the verdict."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from sdc_telemetry.checks import grad
from sdc_telemetry.core import status as S
from sdc_telemetry.parallel import ddp
from sdc_telemetry.parallel.ddp import (
    CHUNK,
    COLS,
    ReduceChecksum,
    _Pending,
    _scale_and_measure,
    _signs,
    _View,
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


def test_runs_that_trade_places_are_seen() -> None:
    """Two runs of 16 or 64 elements a power-of-two distance apart, swapped (a wrong address inside the reduction),
    change S: a column is 4093 elements apart, never a power of two."""
    xs = _grads(3, 3 * CHUNK, torch.float32, 2)
    good = _reduce(xs, "tree")
    for length in (16, 64):
        for distance in (256, 4096, 32768):
            for p in (5 * 64, CHUNK - 2 * 64):
                q = p + distance
                bad = good.clone()
                bad[p:p + length], bad[q:q + length] = good[q:q + length].clone(), good[p:p + length].clone()
                assert _flag(xs, bad) == 1, (length, distance, p)


def test_chunk_layout_is_rows_of_columns_with_signs_per_column() -> None:
    """S is sum_c w_c * (column c's float32 sum): chunk i's element j sits in column j % COLS; the last chunk's
    partial row counts as zeros (no padded copy), and A is the sum of |x|."""
    x = _grads(1, 2 * CHUNK + 3 * COLS + 17, torch.float32, 5)[0]
    w = _signs(torch.device("cpu"))
    sums = chunk_sums(x)
    for c in range(3):
        part = x[c * CHUNK:(c + 1) * CHUNK].double()
        cols = torch.zeros(COLS, dtype=torch.float64)
        cols.index_add_(0, torch.arange(part.numel()) % COLS, part)
        assert float(sums[0, c]) == pytest.approx(float(cols @ w), rel=1e-5, abs=1e-9)
        assert float(sums[1, c]) == pytest.approx(float(part.abs().sum()), rel=1e-6)
    assert torch.equal(weighted_sums(x), sums[0])


def _bucket(sizes: list[int], seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor], tuple[_View, ...]]:
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(sum(sizes), generator=g) * torch.exp(torch.randn(sum(sizes), generator=g))
    views, places, off = [], [], 0
    for i, n in enumerate(sizes):
        views.append(flat[off:off + n])
        places.append(_View(off, n, i if i % 3 != 2 else -1))  # every third one not monitored (frozen)
        off += n
    return flat, views, tuple(places)


@pytest.mark.parametrize("aliased", ["none", "all", "mixed"])
def test_piecewise_scaling_and_measuring_equal_the_whole_bucket_passes(aliased: str, monkeypatch: pytest.MonkeyPatch
                                                                       ) -> None:
    """Pieces smaller than some gradients: the scaled bucket is bitwise DDP's one-pass scaling, every monitored
    local norm bitwise one _foreach_norm of its whole gradient, the sums those of the whole bucket."""
    monkeypatch.setattr(ddp, "PIECE", CHUNK)
    sizes = [5, 3 * CHUNK + 11, 0, 700, CHUNK, 2 * CHUNK - 3, 1, 40000, 9]
    flat, views, places = _bucket(sizes)
    alias = {"none": [False] * len(sizes), "all": [True] * len(sizes),
             "mixed": [i % 2 == 0 for i in range(len(sizes))]}[aliased]
    expect = flat.clone()
    for j, v in enumerate(torch.split(expect, sizes)):
        v.copy_(v / 3) if alias[j] else v.copy_(v * (1.0 / 3))
    norms_ref = torch.stack(torch._foreach_norm([v for v, p in zip(views, places, strict=True) if p.index >= 0],
                                                2, dtype=torch.float32))
    got: dict[str, object] = {}
    checksum = ReduceChecksum()
    pending = _Pending(lambda i, n: got.update(index=i, norms=n), lambda: got.update(failed=True), places)
    _scale_and_measure(flat, views, alias, 3, places, pending, checksum, 0)
    assert torch.equal(flat, expect) and "failed" not in got and pending.taken
    assert got["index"] == [p.index for p in places if p.index >= 0]
    assert torch.equal(torch.stack(got["norms"]), norms_ref)  # type: ignore[arg-type]
    local = checksum._round.local[0]
    assert torch.allclose(local, chunk_sums(expect), rtol=1e-6, atol=1e-9)


def test_reduced_pass_reads_norms_with_the_checksum_and_hands_them_over_once(monkeypatch: pytest.MonkeyPatch
                                                                              ) -> None:
    """S' and the reduced norms in one pass; after mismatch() folds the round, reduced_norms() gives every
    monitored parameter's norm once (None where a bucket's were not read)."""
    monkeypatch.setattr(ddp, "PIECE", CHUNK)
    flat, views, places = _bucket([CHUNK + 5, 12, 2 * CHUNK])
    checksum = ReduceChecksum()
    checksum.local(0, flat)
    r = checksum._round
    r.work, r.sums, r.world = _Done(), torch.cat([r.local[0][0], r.local[0][1], torch.ones(1, dtype=torch.float64)]), 1
    checksum.reduced(0, flat, places)
    assert torch.allclose(r.reduced[0], weighted_sums(flat), rtol=1e-6, atol=1e-9)
    flag = checksum.mismatch()
    assert flag is not None and int(flag) == 0
    found = checksum.reduced_norms()
    assert found is not None and found[0] == [0, 1]
    assert torch.equal(found[1], torch.stack(torch._foreach_norm(views[:2], 2, dtype=torch.float32)))
    assert checksum.reduced_norms() is None


class _Done:
    def wait(self) -> None:
        """Already complete."""


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_weighted_sums_match_the_cpu_ones_without_cublas() -> None:
    """On CUDA, S per chunk is a float64 multiply and sum (no cuBLAS gemv on the callback's pool streams): the
    same values as the CPU's mv, to float64 rounding."""
    x = torch.randn(3 * CHUNK + 1234, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(weighted_sums(x.cuda()).cpu(), weighted_sums(x), rtol=1e-12, atol=1e-9)
