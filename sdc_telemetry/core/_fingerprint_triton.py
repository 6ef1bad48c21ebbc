# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""The Triton kernel of ``core/fingerprint_kernel.py`` (imported only where Triton is; Triton resolves a kernel's
helpers among its module's globals, and its arguments carry Triton's annotations, not Python types)."""

import triton
import triton.language as tl

__all__ = ["fingerprint_tiles"]


@triton.jit
def _word(base, bytes_at, idx, full, nbytes, mask):
    """Words ``idx`` of a tensor of ``nbytes`` bytes (0 where not ``mask``): whole words read as int64, the last
    partial word (odd byte counts) assembled from its bytes, the missing ones zero, as the definition pads."""
    x = tl.load(base + idx, mask=mask & (idx < full), other=0)
    lane = tl.arange(0, 8)
    tail = tl.load(bytes_at + full * 8 + lane, mask=full * 8 + lane < nbytes, other=0).to(tl.int64)
    partial = tl.sum(tail << (lane.to(tl.int64) * 8), axis=0)
    return tl.where(mask & (idx == full), partial, x)


@triton.jit
def fingerprint_tiles(info, work, h, out, K: tl.constexpr, B: tl.constexpr, BC: tl.constexpr,
                       RB: tl.constexpr, NCOL: tl.constexpr, GOLDEN: tl.constexpr, M1: tl.constexpr,
                       LOW32: tl.constexpr, LOW31: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(work + 2 * pid)
    q = tl.load(work + 2 * pid + 1)
    address = tl.load(info + 4 * t)
    base = address.to(tl.pointer_type(tl.int64))
    bytes_at = address.to(tl.pointer_type(tl.uint8))
    nbytes = tl.load(info + 4 * t + 1)
    rows = tl.load(info + 4 * t + 2)
    blocks = tl.load(info + 4 * t + 3)
    n = (nbytes + 7) // 8
    full = nbytes // 8
    lanes = tl.arange(0, BC)
    if q < blocks * NCOL:
        # a tile of one block: column sums over its (up to B) rows
        b = q // NCOL
        cols = (q % NCOL) * BC + lanes
        valid = cols < K
        acc = tl.zeros([BC], dtype=tl.int64)
        for r in range(0, B, RB):
            rr = b * B + r + tl.arange(0, RB)
            idx = rr[:, None] * K + cols[None, :]
            mask = (rr < rows)[:, None] & valid[None, :]
            acc += tl.sum(_word(base, bytes_at, idx, full, nbytes, mask), axis=0)
        j = b * K + cols
    else:
        # words after the last whole row: each is its own partial sum
        s = (q - blocks * NCOL) * BC + lanes
        pos = rows * K + s
        valid = pos < n
        acc = _word(base, bytes_at, pos, full, nbytes, valid)
        j = blocks * K + s
    x = acc + GOLDEN
    x = x ^ ((x >> 32) & LOW32)
    x = x * M1
    x = x ^ ((x >> 31) & LOW31)
    weight = tl.load(h + j, mask=valid, other=0)
    tl.atomic_add(out + t, tl.sum(tl.where(valid, x * weight, 0), axis=0))

