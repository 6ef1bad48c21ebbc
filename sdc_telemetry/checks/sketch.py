"""Gradient sketches for tolerance-mode replay: what changes under a sign flip or a mantissa change of one element.

A per-parameter norm cannot see a sign flip (the norm is unchanged) and barely sees a mantissa change (1e-7 of the
norm for one element of a million). A sketch keeps locality and sign: each parameter's flat gradient is cut into at
most ``BLOCKS`` contiguous blocks, and each block contributes a seeded random projection (a sum with +-1 signs, as a
count sketch does) and its own norm. Recomputing with run-to-run noise of relative size e moves a block's projection
by about e times the block's norm; one element g_j flipped in sign moves it by 2|g_j|, a mantissa bit b of float32
by 2**(b - 23) |g_j|: for blocks of a few thousand elements, 1e-3 to 1e-2 of the block's norm, far above noise.

``delta(a, b)`` is the largest block's change relative to the block's share of its parameter's norm (and at least
a small share of the whole gradient's). Computed on audit steps only, one parameter at a time and a few blocks at a
time (float64 temporaries of a quarter of that parameter's fp32 size), on the gradients' device; the rows are small
(2 x BLOCKS + 1 per parameter) and travel with the replay record.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["BLOCKS", "WIDTH", "sketch", "delta", "deltas", "floor"]

BLOCKS = 64        # at most this many blocks per parameter
MIN_BLOCK = 256    # elements per block at least (small blocks make cancelling gradients look noisy)
FLOOR = 1e-2       # a block's scale is at least this share of the whole gradient's
WIDTH = 2 * BLOCKS + 1
_GROUP = 8         # blocks sketched at a time (bounds the temporaries on an audit)
_SEED = 0x5DC5EED
_signs: dict[tuple[int, torch.device], torch.Tensor] = {}


def _rademacher(n: int, device: torch.device) -> torch.Tensor:
    """Seeded +-1 signs for the first n positions, the same on every rank whatever its device: drawn by the CPU
    generator and copied to ``device`` (a CUDA generator's stream of numbers depends on the launch grid, which
    depends on the GPU's SM count, so two GPU models would draw different signs and every sketch would differ).
    Cached by the largest size seen per device so that a model's parameters share one sign vector."""
    for (size, dev), signs in _signs.items():
        if dev == device and size >= n:
            return signs[:n]
    size = max(n, 1 << 16)
    gen = torch.Generator().manual_seed(_SEED)
    signs = torch.randint(0, 2, (size,), generator=gen, dtype=torch.int8).mul_(2).sub_(1).to(device)
    for key in [k for k in _signs if k[1] == device]:
        del _signs[key]
    _signs[(size, device)] = signs
    return signs[:n]


def _blocks(n: int) -> int:
    return max(1, min(BLOCKS, math.ceil(n / MIN_BLOCK)))


def sketch(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """(len(grads), WIDTH) float64 rows on the gradients' device: block projections, block norms (zeros pad
    parameters with fewer blocks), then the element count."""
    if not grads:
        return torch.zeros((0, WIDTH), dtype=torch.float64)
    device = grads[0].device
    out = torch.zeros((len(grads), WIDTH), dtype=torch.float64, device=device)
    for i, g in enumerate(grads):
        flat = g.detach().reshape(-1)  # a view of a contiguous gradient: no copy
        n = flat.numel()
        out[i, -1] = n
        if n == 0:
            continue
        blocks = _blocks(n)
        size = math.ceil(n / blocks)
        signs = _rademacher(blocks * size, device)
        # _GROUP blocks at a time: the float64 temporaries are 2 x _GROUP / BLOCKS of the gradient, not 3 copies
        for start in range(0, blocks, _GROUP):
            stop = min(blocks, start + _GROUP)
            lo, hi = start * size, min(stop * size, n)
            part = torch.zeros((stop - start) * size, dtype=torch.float64, device=device)
            part[:hi - lo] = flat[lo:hi]
            view = part.view(stop - start, size)
            out[i, start:stop] = (view * signs[lo:lo + (stop - start) * size].view(stop - start, size)).sum(dim=1)
            out[i, BLOCKS + start:BLOCKS + stop] = torch.linalg.vector_norm(view, dim=1)
    return out


def floor(norms: torch.Tensor, sizes: torch.Tensor, share: float = FLOOR) -> torch.Tensor:
    """Per parameter, the scale its changes are measured against: its own norm, and at least ``share`` of its share
    of the whole gradient's norm (by element count), so that a gradient which is zero up to rounding does not turn
    noise into a large relative change."""
    norms = norms.double()
    total = float(torch.linalg.vector_norm(norms))
    count = max(float(sizes.sum()), 1.0)
    return torch.maximum(norms, share * total * (sizes.double() / count).sqrt()).clamp_min(1e-30)


def delta(recomputed: torch.Tensor, recorded: torch.Tensor) -> float:
    """The largest of ``deltas``: 0 when nothing changed, inf when the tables are not comparable."""
    return max(deltas(recomputed, recorded), default=0.0)


def deltas(recomputed: torch.Tensor, recorded: torch.Tensor) -> list[float]:
    """Per parameter, the largest change of a block's projection, relative to the block's share of its parameter's
    norm, and at least ``FLOOR`` of its share of the whole gradient's norm: a gradient that is zero up to rounding (a
    bias whose terms cancel) must not turn noise into a mismatch. 0 where nothing changed; inf where the values are
    not comparable (non-finite on one side only; every parameter when the shapes differ)."""
    if recomputed.shape != recorded.shape or recorded.ndim != 2 or recorded.shape[1] != WIDTH:
        return [math.inf] * max(1, recorded.shape[0] if recorded.ndim == 2 else 1)
    a, b = recomputed.double().cpu(), recorded.double().cpu()
    proj_a, proj_b, norms, n = a[:, :BLOCKS], b[:, :BLOCKS], b[:, BLOCKS:2 * BLOCKS], b[:, -1]
    scale = floor(torch.linalg.vector_norm(norms, dim=1), n).tolist()  # each parameter's, at least FLOOR of its share
    finite_a, finite_b = torch.isfinite(proj_a), torch.isfinite(proj_b)
    out = []
    for i in range(b.shape[0]):
        count = int(n[i])
        if count == 0:
            out.append(0.0)
            continue
        blocks = _blocks(count)
        if not torch.equal(finite_a[i, :blocks], finite_b[i, :blocks]):
            out.append(math.inf)
            continue
        size = math.ceil(count / blocks)
        diff = (proj_a[i, :blocks] - proj_b[i, :blocks]).abs()
        if not bool(torch.isfinite(diff).all()):
            diff = torch.where(torch.isfinite(diff), diff, torch.zeros_like(diff))  # same non-finite both sides
        share = max(scale[i] * math.sqrt(size / count), 1e-30)  # the block's part of it
        out.append(float(diff.max()) / share)
    return out
