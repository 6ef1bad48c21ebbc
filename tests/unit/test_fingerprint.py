"""Fingerprints: exact, position-sensitive, every single-bit flip visible, independent of memory layout."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import sdc_telemetry as sdc
from sdc_telemetry.core.fingerprint import digest
from sdc_telemetry.faults import flip_bit

fp_module = importlib.import_module("sdc_telemetry.core.fingerprint")  # the package re-exports the function
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8]
B, K = fp_module._B, fp_module._K
U64 = 2**64

# -- a plain-Python reading of the documented definition ------------------------------------------------------------


def _splitmix(i: int) -> int:
    z = i * 0x9E3779B97F4A7C15 % U64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % U64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % U64
    return z ^ (z >> 31)


def _mix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) % U64
    x = (x ^ (x >> 32)) * 0xBF58476D1CE4E5B9 % U64
    return x ^ (x >> 31)


def _reference(t: torch.Tensor, b: int, k: int) -> int:
    raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    raw += b"\x00" * (-len(raw) % 8)
    w = [int.from_bytes(raw[i:i + 8], "little") for i in range(0, len(raw), 8)]
    whole, rows = len(w) // (b * k) * (b * k), len(w) // k * k
    partials = [sum(w[(a * b + r) * k + c] for r in range(b)) for a in range(whole // (b * k)) for c in range(k)]
    if rows > whole:  # the last block, with fewer rows
        partials += [sum(w[whole + r * k + c] for r in range((rows - whole) // k)) for c in range(k)]
    partials += w[rows:]
    total = sum((_splitmix(j + 1) | 1) * _mix(p % U64) for j, p in enumerate(partials)) % U64
    return total - U64 if total >= 2**63 else total


def _fp(t: torch.Tensor, b: int = B, k: int = K) -> int:
    return int(fp_module._fingerprint([t], b, k)[0, 0])


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-128, 128, shape, generator=g).to(dtype)


# -- the definition -------------------------------------------------------------------------------------------------


def test_matches_the_documented_definition_across_a_block_the_last_block_and_the_tail() -> None:
    """A tensor of 1 block + 40 rows + 5 words equals the plain-Python reading of the module's definition."""
    words = B * K + 40 * K + 5  # 40 rows: the last block is summed 32 rows at a time, then the 8 others
    t = _random((2 * words - 1,), torch.float32, 0)  # odd element count: the last word is zero-padded
    assert _fp(t) == _reference(t, B, K)


@settings(max_examples=60, deadline=None)
@given(numel=st.integers(0, 400), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_matches_the_reference_on_a_small_block_geometry(numel: int, dtype: torch.dtype, seed: int) -> None:
    """With 4 x 7 blocks (many whole blocks, partial blocks and tails), the computation follows the definition."""
    t = _random((numel,), dtype, seed)
    assert _fp(t, 4, 7) == _reference(t, 4, 7)


# -- single-bit flips -----------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(dtype=st.sampled_from(DTYPES), numel=st.integers(1, 257), seed=st.integers(0, 2**31 - 1),
       geometry=st.sampled_from([(B, K), (4, 7), (2, 3)]), data=st.data())
def test_any_single_bit_flip_changes_the_fingerprint(dtype: torch.dtype, numel: int, seed: int,
                                                     geometry: tuple[int, int], data: st.DataObject) -> None:
    """Flipping any bit of any element changes the fingerprint, on the block path too; flipping it back restores it."""
    t = _random((numel,), dtype, seed)
    index = data.draw(st.integers(0, numel - 1))
    bit = data.draw(st.integers(0, t.element_size() * 8 - 1))
    before = _fp(t, *geometry)
    flipped = t.clone()
    flip_bit(flipped, index, bit)
    assert _fp(flipped, *geometry) != before
    flip_bit(flipped, index, bit)
    assert _fp(flipped, *geometry) == before


def test_a_bit_flip_in_a_large_tensor_is_seen_in_every_part() -> None:
    """In a multi-block tensor, a top-bit flip in a whole block, in the partial block and in the tail is caught."""
    t = _random((2 * (2 * B * K + 2 * K + 3),), torch.float32, 1)
    before = _fp(t)
    for index in (0, 2 * B * K - 1, 2 * (2 * B * K + K), t.numel() - 1):
        flipped = t.clone()
        flip_bit(flipped, index, 31)
        assert _fp(flipped) != before, index


# -- moves: swaps, row swaps, transposes, reversals, rolls ---------------------------------------------------------


def _word(element: int, dtype: torch.dtype) -> int:
    return element * torch.empty(0, dtype=dtype).element_size() // 8


def _collide(i: int, j: int, n_words: int, b: int, k: int) -> bool:
    """Word positions that share a partial sum (the documented blind spot)."""
    whole = n_words // (b * k) * (b * k)
    rows = n_words // k * k
    def group(w: int) -> tuple[int, int] | None:
        if w < whole:
            return w // (b * k), w % k
        return (-1, w % k) if w < rows else None
    return group(i) is not None and group(i) == group(j)


@settings(max_examples=200, deadline=None)
@given(dtype=st.sampled_from(DTYPES), numel=st.integers(2, 300), seed=st.integers(0, 2**31 - 1),
       geometry=st.sampled_from([(B, K), (4, 7)]), data=st.data())
def test_swapping_two_different_elements_changes_the_fingerprint(dtype: torch.dtype, numel: int, seed: int,
                                                                 geometry: tuple[int, int],
                                                                 data: st.DataObject) -> None:
    """Exchanging two unequal elements changes the fingerprint unless their words share a partial sum."""
    t = _random((numel,), dtype, seed)
    i = data.draw(st.integers(0, numel - 1))
    j = data.draw(st.integers(0, numel - 1))
    assume(not torch.equal(t[i], t[j]))
    swapped = t.clone()
    swapped[[i, j]] = t[[j, i]]
    n_words = -(-numel * t.element_size() // 8)
    wi, wj = _word(i, dtype), _word(j, dtype)
    assume(wi == wj or not _collide(wi, wj, n_words, *geometry))
    assert _fp(swapped, *geometry) != _fp(t, *geometry)


@settings(max_examples=100, deadline=None)
@given(dtype=st.sampled_from(DTYPES), rows=st.integers(2, 40), cols=st.integers(2, 40),
       seed=st.integers(0, 2**31 - 1), move=st.sampled_from(["rows", "transpose", "flip", "roll", "roll_rows"]),
       data=st.data())
def test_structured_moves_change_the_fingerprint(dtype: torch.dtype, rows: int, cols: int, seed: int, move: str,
                                                 data: st.DataObject) -> None:
    """Row swaps, transposes (odd and even sizes), reversals and rolls of a random matrix change its fingerprint."""
    m = _random((rows, cols), dtype, seed)
    if move == "rows":
        r1, r2 = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, rows - 1))
        assume(r1 != r2)
        moved = m.clone()
        moved[[r1, r2]] = m[[r2, r1]]
    elif move == "transpose":
        m = _random((rows, rows), dtype, seed)  # same shape, so only the element order differs
        moved = m.t().contiguous()
    elif move == "flip":
        moved = m.flip(0, 1)
    elif move == "roll":
        moved = m.roll(data.draw(st.integers(1, rows * cols - 1)))
    else:
        moved = m.roll(data.draw(st.integers(1, rows - 1)), 0)
    assume(not torch.equal(moved, m))
    assert sdc.fingerprint(moved)[0, 0] != sdc.fingerprint(m)[0, 0]


@pytest.mark.parametrize("n", [2047, 2048])
def test_moves_in_multi_block_matrices_change_the_fingerprint(n: int) -> None:
    """On 16 MiB matrices (four blocks): row swaps near and far, transpose, reversal and roll are all seen."""
    m = _random((n, n), torch.float32, n)
    base = _fp(m)
    near, far = m.clone(), m.clone()
    near[[10, 11]] = m[[11, 10]]
    far[[0, n - 1]] = m[[n - 1, 0]]
    for moved in (near, far, m.t().contiguous(), m.flip(0), m.roll(1), m.roll(1, 0)):
        assert _fp(moved) != base


def test_sign_only_word_swaps_are_seen() -> None:
    """Swapping words that differ only in their top bit (0.0 / -0.0, x / -x in float64) changes the fingerprint."""
    assert _fp(torch.tensor([0.0, 0.0, 0.0, -0.0])) != _fp(torch.tensor([0.0, -0.0, 0.0, 0.0]))
    x = torch.tensor([1.5, -1.5], dtype=torch.float64)
    assert _fp(x) != _fp(x.flip(0))


def test_the_documented_blind_spot_is_exactly_a_shared_partial_sum() -> None:
    """Swapping two words of the same block and column is invisible; moving one column over is seen."""
    t = _random((2 * B * K,), torch.float32, 2)  # one whole block of 8-byte words
    words = t.view(torch.int64)
    same_group, next_column = words.clone(), words.clone()
    same_group[[5, 5 + 3 * K]] = words[[5 + 3 * K, 5]]
    next_column[[5, 6 + 3 * K]] = words[[6 + 3 * K, 5]]
    assert _fp(same_group.view(torch.float32)) == _fp(t)
    assert _fp(next_column.view(torch.float32)) != _fp(t)


# -- layout, shape of the result, errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_equal_tensors_have_equal_fingerprints_whatever_their_layout(dtype: torch.dtype) -> None:
    """Strides, transposition, channels_last and storage offset do not change the fingerprint."""
    x = _random((2, 3, 5, 7), dtype, 3)
    big = torch.zeros(x.numel() + 3, dtype=dtype)
    big[3:] = x.reshape(-1)
    layouts = [
        x.clone(),
        x.contiguous(memory_format=torch.channels_last),
        x.transpose(1, 3).contiguous().transpose(1, 3),
        big[3:].view_as(x),  # storage offset not a multiple of 8 bytes
    ]
    rows = sdc.fingerprint(layouts)
    assert rows.shape == (4, 1) and rows.dtype == torch.int64
    assert all(torch.equal(rows[0], r) for r in rows)


def test_views_needing_the_slow_path_fingerprint_like_their_contiguous_copy() -> None:
    """Strided slices, odd byte counts, bool, conjugate views and expanded views equal their materialised copy."""
    z = torch.randn(5, 3, dtype=torch.complex64)
    views = [torch.randn(6, 10)[:, ::3], torch.arange(7, dtype=torch.int8), torch.tensor([True, False, True]),
             z.conj(), torch.ones(1).expand(5), torch.randn(300, 301)[1:, 1:]]
    for v in views:
        assert _fp(v) == _fp(v.resolve_conj().clone(memory_format=torch.contiguous_format)), v.dtype


def test_one_row_per_tensor_on_the_tensors_device() -> None:
    """Shape (n, 1) int64 on the tensors' device; different values give different rows; an empty list is (0, 1)."""
    a = torch.arange(10, dtype=torch.float32)
    rows = sdc.fingerprint([a, a + 1, torch.zeros(0), torch.tensor(True), torch.tensor([3], dtype=torch.int8)])
    assert rows.shape == (5, 1) and rows.device == a.device and rows.dtype == torch.int64
    assert rows[0, 0] != rows[1, 0]
    assert rows[2, 0] == 0
    assert torch.equal(sdc.fingerprint(a), sdc.fingerprint([a]))
    assert sdc.fingerprint([]).shape == (0, 1)


def test_appended_zero_words_change_the_fingerprint() -> None:
    """A tensor and the same tensor with a zero word appended have different fingerprints."""
    a = torch.randn(8)
    assert _fp(a) != _fp(torch.cat([a, torch.zeros(2)]))


def test_the_result_does_not_depend_on_the_thread_count() -> None:
    """Integer arithmetic: one thread and several give the same rows."""
    tensors = [_random((3 * B * K,), torch.float32, 4), _random((777,), torch.bfloat16, 5)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = sdc.fingerprint(tensors)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, sdc.fingerprint(tensors))


def test_rejects_sparse_tensors_and_mixed_devices() -> None:
    """Sparse tensors get a TypeError naming the layout; tensors on two devices a ValueError naming both."""
    with pytest.raises(TypeError, match=r"sparse|layout"):
        sdc.fingerprint([torch.eye(3).to_sparse()])
    with pytest.raises(ValueError, match=r"one device.*meta"):
        sdc.fingerprint([torch.ones(2), torch.ones(2, device="meta")])


# -- digest ---------------------------------------------------------------------------------------------------------


def test_digest_changes_with_any_row_and_with_row_order() -> None:
    """One changed row, a swap of two rows or a different row count changes the digest; equal tables agree."""
    rows = sdc.fingerprint([_random((64,), torch.float32, s) for s in range(6)])
    d = digest(rows)
    assert d.dim() == 0 and d.dtype == torch.int64 and d.device == rows.device
    assert torch.equal(d, digest(rows.clone()))
    changed = rows.clone()
    changed[3, 0] ^= 1 << 63
    swapped = rows[[1, 0, 2, 3, 4, 5]]
    for other in (changed, swapped, rows[:5], torch.cat([rows, torch.zeros(1, 1, dtype=torch.int64)])):
        assert digest(other) != d


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 50), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_digest_sees_every_single_bit_of_the_table(n: int, seed: int, data: st.DataObject) -> None:
    """Flipping any bit of any row's word changes the digest."""
    rows = torch.randint(-2**63, 2**63 - 1, (n, 1), generator=torch.Generator().manual_seed(seed))
    i, bit = data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, 63))
    flipped = rows.clone()
    flip_bit(flipped, i, bit)
    assert digest(flipped) != digest(rows)


def test_digest_rejects_a_table_of_the_wrong_shape_or_dtype() -> None:
    """digest wants an int64 (N, C) table and says what it got."""
    with pytest.raises(ValueError, match="int64"):
        digest(torch.zeros(3, 1))
    with pytest.raises(ValueError, match=r"shape=\(3,\)"):
        digest(torch.zeros(3, dtype=torch.int64))
