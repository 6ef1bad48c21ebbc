"""Exact, position-sensitive tensor fingerprints: one read of the data, on the tensor's device, no host sync.

Definition. A tensor's bytes, in row-major (logical) element order, are read as little-endian 64-bit words
``w[0..n)`` (a trailing partial word is zero-padded). The words are laid out as rows of ``K = 4093`` words, and
every ``B = 128`` rows form a block (the last block may have fewer rows). Each block is summed over its rows into
``K`` column sums; the words after the last whole row are kept on their own. Call the result, in order, the
partial sums ``p[0..m)``. Then

    fingerprint = sum_j h[j] * mix(p[j])   (mod 2**64, as int64)

where ``mix`` is a fixed bijection of 64-bit words (add a constant, xor-shift, odd multiply, xor-shift) and
``h[j]`` are fixed pseudo-random odd constants (splitmix64 of ``j + 1``, lowest bit set).

Why this shape:
- Integer arithmetic mod 2**64 does not depend on the order of the additions, so the result is exact and identical
  whatever the thread count or device: two replicas compare rows with ``==``.
- Speed: a weight per word would cost a multiply pass over all of the data. The block sum is one read of the data
  and leaves 1/128 of it, small enough to mix and weight. It is a strided reduction: on CPU one core runs it at
  about 2/3 of ``torch.sum``'s speed (summing 32 rows, then 4 of those sums, is the fastest schedule found), so it
  needs more cores than ``torch.sum`` to keep up with memory; GPUs reduce a strided dimension at full bandwidth.
- Changing ``B``, ``K``, ``mix`` or ``h`` changes every fingerprint, including those saved in weight
  certificates: the reference test pins the definition.
- ``K`` is an odd prime, so row lengths of power-of-two layer widths never line up with it.
- ``mix`` is not linear on purpose: with linear weights, exchanging two words that differ only in their top bit
  (``1.5`` and ``-1.5`` in float64, ``0.0`` and ``-0.0`` as the last element of a word) changes the sum by
  ``2**63`` times an even number, which is 0 mod 2**64. The xor-shifts carry high bits down, so that is seen.

What is guaranteed, exactly:
- Equal dtype, shape and bits give equal rows, whatever the strides, contiguity, memory format (channels_last) or
  storage offset (a tensor that is not a contiguous, 8-byte aligned run of whole words costs one copy).
- Every change confined to one 8-byte word (so every single-bit flip, of any dtype) changes the row: it changes
  one partial sum, ``mix`` is a bijection so ``mix(p[j])`` changes by some ``d != 0``, and ``h[j] * d != 0``
  mod 2**64 because ``h[j]`` is odd.
- Any other change (swapped elements or rows, a transpose, a reversal, a roll, several changed words) changes the
  row unless the weighted sum cancels by chance (about 1 in 2**60 for data not built for it), with one structural
  blind spot: words in the same block and column (word indices ``i``, ``j`` with ``i // (B*K) == j // (B*K)`` and
  ``i % K == j % K``, or both in the last block's rows with ``i % K == j % K``) share a partial sum. A change
  is invisible when it only exchanges words among such positions (or its deltas cancel within one such group).
  For a matrix whose rows are ``L`` words long, that takes swapping rows ``d`` apart with ``d * L`` a multiple of
  4093 inside one 4 MiB block: rows of at most 127 words (1016 bytes) that are 4093 rows apart, or rows whose
  length is a multiple of 4093 words. Tensors under 4093 words (32 KiB) have no structural blind spot at all.
- ``digest`` folds a table of rows into one word the same way (mix, then weight by position).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence

import torch

from sdc_telemetry.core import fingerprint_kernel

__all__ = ["digest", "fingerprint", "format_fingerprint", "FINGERPRINT_ALGORITHM"]

# The id weight certificates record: a certificate is only verified by the algorithm that made it (the first,
# position-blind word sum was "sdc-fp1").
FINGERPRINT_ALGORITHM = "sdc-fp2"

_WORD = 8
_B = 128  # rows summed per block: the partial sums are 1/_B of the data
_K = 4093  # columns per block: an odd prime, never a divisor of power-of-two row lengths
_STAGE = 32  # rows summed by the first of two reduction passes (a schedule, not part of the definition)

# Constants of splitmix64 (Steele et al.), as signed int64: odd multipliers with good bit diffusion.
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_M1 = 0xBF58476D1CE4E5B9 - 2**64
_M2 = 0x94D049BB133111EB - 2**64
_LOW = {s: (1 << (64 - s)) - 1 for s in (27, 30, 31, 32)}  # masks that turn an arithmetic shift into a logical one


def _xorshift_(x: torch.Tensor, s: int, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``x ^= x >>> s`` (logical shift) in place: a bijection of 64-bit words that moves high bits down."""
    shifted = torch.bitwise_right_shift(x, s, out=scratch) if scratch is not None else x >> s
    return x.bitwise_xor_(shifted.bitwise_and_(_LOW[s]))


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """A fixed bijection of int64 words, in place: xor-shift, odd multiply, xor-shift (each step is invertible).

    One scratch buffer for the shifts: a fresh temporary per step would cost more than the arithmetic.
    """
    scratch = torch.empty_like(x)
    _xorshift_(x.add_(_GOLDEN), 32, scratch)  # the offset makes mix(0) != 0: appended zero words count
    x.mul_(_M1)
    return _xorshift_(x, 31, scratch)


def _make_weights(n: int, device: torch.device) -> torch.Tensor:
    """``h[0..n)``: odd pseudo-random int64 constants (splitmix64 of the index), identical on every device."""
    x = torch.arange(1, n + 1, dtype=torch.int64, device=device).mul_(_GOLDEN)
    _xorshift_(x, 30)
    x.mul_(_M1)
    _xorshift_(x, 27)
    x.mul_(_M2)
    _xorshift_(x, 31)
    return x.bitwise_or_(1)


_weights_lock = threading.Lock()
_weights_cache: dict[torch.device, torch.Tensor] = {}


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """The first ``n`` weights on ``device``; cached per device, grown by doubling (made there: no copy)."""
    with _weights_lock:
        h = _weights_cache.get(device)
        if h is None or h.numel() < n:
            h = _make_weights(max(n, 2 * (h.numel() if h is not None else 0), 4096), device)
            _weights_cache[device] = h
    return h[:n]


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in logical order as a 1-D int64 tensor (zero-padded): a view whenever possible."""
    if t.is_sparse or t.is_quantized or t.layout != torch.strided:
        raise TypeError(f"fingerprint supports dense strided tensors only, got layout={t.layout} dtype={t.dtype}")
    t = t.detach()
    nbytes = t.numel() * t.element_size()
    # Fast path, nearly every parameter and gradient: contiguous, whole 8-byte words, 8-byte aligned.
    if (t.is_contiguous() and t.dtype != torch.bool and not t.is_conj() and not t.is_neg()
            and nbytes % _WORD == 0 and t.data_ptr() % _WORD == 0):
        return t.reshape(-1).view(torch.int64)
    flat = t.resolve_conj().resolve_neg().reshape(-1)
    if flat.numel() > 1 and flat.stride(0) != 1:  # expanded (stride-0) views stay views after reshape
        flat = flat.contiguous()
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    raw = flat.view(torch.uint8)
    pad = -nbytes % _WORD
    if pad or raw.data_ptr() % _WORD:  # realign / pad with one copy
        raw = torch.cat([raw, raw.new_zeros(pad)])
    return raw.view(torch.int64)


def _column_sums(rows: torch.Tensor) -> torch.Tensor:
    """``rows.sum(0)`` for a ``(q, k)`` int64 view, summing 32 rows at a time first (the same integers, faster)."""
    q, k = rows.shape
    staged = q // _STAGE * _STAGE
    if staged == 0:
        return rows.sum(0)
    total = rows[:staged].view(-1, _STAGE, k).sum(1).sum(0)
    return total if staged == q else total + rows[staged:].sum(0)


def _partials(words: torch.Tensor, b: int, k: int) -> list[torch.Tensor]:
    """The partial sums, in order: column sums of each block of ``b`` rows of ``k`` words, of the last block (fewer
    rows), then the words after the last whole row, each on its own."""
    n = words.numel()
    whole = n // (b * k) * (b * k)
    rows = n // k * k
    parts = []
    if whole:
        # Summing 32 rows, then the 4 sums, gives the same integers as summing 128 rows at once, and is faster
        # on CPU: the strided reduction keeps up with memory only with few rows in flight.
        stage = math.gcd(b, _STAGE)
        parts.append(words[:whole].view(-1, b // stage, stage, k).sum(2).sum(1).view(-1))
    if rows > whole:
        parts.append(_column_sums(words[whole:rows].view(-1, k)))
    if rows < n:
        parts.append(words[rows:])
    return parts


def _fingerprint(tensors: Sequence[torch.Tensor], b: int, k: int) -> torch.Tensor:
    device = tensors[0].device
    if fingerprint_kernel.available(device):  # GPUs: every tensor in one launch (core/fingerprint_kernel.py)
        read = [t.detach() if fingerprint_kernel.direct(t) else _words(t) for t in tensors]
        return fingerprint_kernel.fingerprint_many(read, lambda n: _weights(n, device), k, b, _GOLDEN, _M1)
    pieces = [_partials(_words(t), b, k) for t in tensors]
    sizes = [sum(p.numel() for p in ps) for ps in pieces]
    # One copy of every partial sum (1/b of large tensors, all of small ones), mixed in place.
    flat = [p for ps in pieces for p in ps]
    mixed = _mix_(torch.cat(flat) if flat else torch.zeros(0, dtype=torch.int64, device=device))
    h = _weights(max(sizes), device)
    sums = []
    for seg in torch.split(mixed, sizes):
        # torch.dot is one fused pass on CPU; CUDA has no integer dot.
        sums.append(torch.dot(seg, h[:seg.numel()]) if device.type == "cpu" else (seg * h[:seg.numel()]).sum())
    return torch.stack(sums).unsqueeze(1)


def fingerprint(tensors: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """Fingerprint each tensor: returns an ``int64`` tensor of shape ``(len(tensors), 1)`` on the tensors' device.

    Equal fingerprints are the replica-agreement test: two tensors with the same dtype, shape and bits have the
    same row; any single-bit difference gives a different row, and so does moving values around (swapped
    elements or rows, a transpose, a reversal), except in the narrow case the module documentation spells out.

    >>> import torch, sdc_telemetry as sdc
    >>> a = torch.arange(6.0).view(2, 3)
    >>> bool((sdc.fingerprint([a]) == sdc.fingerprint([a.clone()])).all())
    True
    >>> bool((sdc.fingerprint([a]) == sdc.fingerprint([a.flip(0)])).all())
    False
    """
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    if len(tensors) == 0:
        return torch.zeros((0, 1), dtype=torch.int64)
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"fingerprint needs all tensors on one device, got {sorted(str(d) for d in devices)}")
    return _fingerprint(tensors, _B, _K)


def digest(rows: torch.Tensor) -> torch.Tensor:
    """Combine a fingerprint table ``(N, C)`` into one position-sensitive int64 word (0-d, same device, no sync).

    Any change of one row, and swapping two different rows, changes the digest, so replicas agree on a whole
    table with an all-reduce MIN and MAX of one number each.

    >>> import torch, sdc_telemetry as sdc
    >>> rows = sdc.fingerprint([torch.zeros(3), torch.ones(3)])
    >>> bool(digest(rows) == digest(rows.flip(0)))
    False
    """
    if rows.dtype != torch.int64 or rows.dim() != 2:
        raise ValueError(f"digest needs an int64 table of shape (N, C), got dtype={rows.dtype} "
                         f"shape={tuple(rows.shape)}")
    flat = _mix_(rows.reshape(-1).clone())
    h = _weights(flat.numel() + 1, rows.device)
    # h[0] weights the table's size so that tables of different shapes do not collide on an empty sum.
    return (flat * h[1:]).sum() + h[0] * rows.numel() + rows.shape[1]


def format_fingerprint(row: Iterable[int]) -> str:
    """One fingerprint row as text: each int64 column as 16 lower-case hex digits of its value mod 2**64, joined
    with ``-`` (how incidents and weight certificates show fingerprints).

    >>> format_fingerprint([1, -1])
    '0000000000000001-ffffffffffffffff'
    """
    return "-".join(f"{int(v) % (1 << 64):016x}" for v in row)
