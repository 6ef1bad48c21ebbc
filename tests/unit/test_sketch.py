"""Tolerance-mode gradient sketches: block projections and norms, sensitive to one element's sign or mantissa."""

from __future__ import annotations

import math

import pytest
import torch

from sdc_telemetry.checks.sketch import BLOCKS, WIDTH, _rademacher, delta, sketch


def _whole(g: torch.Tensor) -> torch.Tensor:
    """The definition, on the whole padded gradient at once (what the grouped computation must equal)."""
    flat = g.reshape(-1).double()
    n = flat.numel()
    blocks = max(1, min(BLOCKS, math.ceil(n / 256)))
    size = math.ceil(n / blocks)
    padded = torch.zeros(blocks * size, dtype=torch.float64)
    padded[:n] = flat
    view = padded.view(blocks, size)
    row = torch.zeros(WIDTH, dtype=torch.float64)
    row[:blocks] = (view * _rademacher(blocks * size, g.device).view(blocks, size)).sum(dim=1)
    row[BLOCKS:BLOCKS + blocks] = torch.linalg.vector_norm(view, dim=1)
    row[-1] = n
    return row


def test_grouped_sketch_equals_the_whole_definition() -> None:
    """Sketching a few blocks at a time gives the rows of the whole-tensor definition (sizes with a ragged last
    block, fewer blocks than a group, and a non-contiguous gradient)."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) for n in (1, 300, 70_001, 1 << 16)] + [torch.randn(64, 90).t()]
    rows = sketch(grads)
    for g, row in zip(grads, rows, strict=True):
        torch.testing.assert_close(row, _whole(g), rtol=1e-12, atol=1e-12)


def test_one_sign_flip_or_mantissa_change_stands_out_of_noise() -> None:
    """Under 1e-6 relative noise the delta stays near 1e-6; a sign flip or mantissa bit 20 of one element of a
    100k-element gradient moves it well above 1e-4."""
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(100_000, generator=gen)
    noisy = g * (1 + 1e-6 * torch.randn(g.shape, generator=gen))
    flipped = g.clone()
    flipped[777] = -flipped[777]
    mantissa = g.clone()
    mantissa.view(torch.int32)[777] ^= 1 << 20
    base = sketch([g])
    assert delta(sketch([noisy]), base) < 1e-5
    assert delta(sketch([flipped]), base) > 1e-3
    assert delta(sketch([mantissa]), base) > 1e-4


def test_signs_are_the_cpu_generators_draw_and_a_prefix_survives_growth() -> None:
    """The +-1 signs are one fixed draw of the CPU generator (the definition every device shares), and growing the
    cached vector for a larger parameter keeps every earlier sign."""
    from sdc_telemetry.checks import sketch as module

    module._signs.clear()
    small = _rademacher(1000, torch.device("cpu")).clone()
    big = _rademacher(3 << 17, torch.device("cpu"))
    reference = torch.randint(0, 2, (3 << 17,), generator=torch.Generator().manual_seed(module._SEED),
                              dtype=torch.int8).mul_(2).sub_(1)
    assert torch.equal(big, reference) and torch.equal(small, reference[:1000])
    assert set(big.unique().tolist()) == {-1, 1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_signs_equal_the_cpu_signs_past_any_launch_grid() -> None:
    """On a GPU the signs are the CPU's, bit for bit, beyond 2048 x SMs elements (where a CUDA generator's draw
    depends on the GPU model's launch grid): two GPU models sketch alike."""
    n = 1 << 22
    assert torch.equal(_rademacher(n, torch.device("cuda", 0)).cpu(), _rademacher(n, torch.device("cpu")))
    g = torch.randn(n, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(sketch([g.cuda()]).cpu(), sketch([g]), rtol=1e-9, atol=1e-9)
