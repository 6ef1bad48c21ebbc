"""Fingerprints: exact, every single-bit flip visible, independent of memory layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sdc_telemetry as sdc
from sdc_telemetry.faults import flip_bit

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@settings(max_examples=300, deadline=None)
@given(dtype=st.sampled_from(DTYPES), numel=st.integers(1, 257), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_any_single_bit_flip_changes_the_fingerprint(dtype: torch.dtype, numel: int, seed: int,
                                                     data: st.DataObject) -> None:
    """Flipping any bit of any element of an fp32/bf16/fp16 tensor changes its fingerprint."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(numel, generator=g).to(dtype)
    index = data.draw(st.integers(0, numel - 1))
    bit = data.draw(st.integers(0, t.element_size() * 8 - 1))
    before = sdc.fingerprint([t])
    flipped = t.clone()
    flip_bit(flipped, index, bit)
    assert not torch.equal(before, sdc.fingerprint([flipped]))
    flip_bit(flipped, index, bit)
    assert torch.equal(before, sdc.fingerprint([flipped]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_equal_tensors_have_equal_fingerprints_whatever_their_layout(dtype: torch.dtype) -> None:
    """Strides, transposition, channels_last and storage offset do not change the fingerprint."""
    x = torch.randn(2, 3, 5, 7).to(dtype)
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


def test_one_row_per_tensor_on_the_tensors_device_without_mixing_dtypes() -> None:
    """Shape (n, 1) int64; different values or dtypes of the same bytes are told apart by value."""
    a = torch.arange(10, dtype=torch.float32)
    rows = sdc.fingerprint([a, a + 1, torch.zeros(0), torch.tensor(True), torch.tensor([3], dtype=torch.int8)])
    assert rows.shape == (5, 1) and rows.device == a.device
    assert rows[0, 0] != rows[1, 0]
    assert rows[2, 0] == 0
    assert torch.equal(sdc.fingerprint(a), sdc.fingerprint([a]))
    assert sdc.fingerprint([]).shape == (0, 1)


def test_fingerprint_is_the_wrapping_sum_of_8_byte_words() -> None:
    """Documented definition: little-endian 64-bit words summed mod 2**64 (tail zero-padded)."""
    t = torch.tensor([1.5, -2.25, 3.0], dtype=torch.float32)
    raw = t.numpy().tobytes() + b"\x00" * 4
    words = [int.from_bytes(raw[i:i + 8], "little", signed=False) for i in range(0, len(raw), 8)]
    expected = sum(words) % 2**64
    got = int(sdc.fingerprint([t])[0, 0]) % 2**64
    assert got == expected


def test_rejects_sparse_tensors() -> None:
    """Sparse tensors get a TypeError naming the layout."""
    with pytest.raises(TypeError, match=r"sparse|layout"):
        sdc.fingerprint([torch.eye(3).to_sparse()])


def test_expanded_views_are_fingerprinted_like_their_materialised_copy() -> None:
    """A stride-0 (expanded) tensor, as autograd returns for x.sum(), fingerprints like its contiguous copy."""
    e = torch.ones(1).expand(5)
    assert torch.equal(sdc.fingerprint([e]), sdc.fingerprint([e.contiguous()]))
