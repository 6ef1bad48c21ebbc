"""Scale: a healthy step's monitor collectives move the same bytes per rank at any world size."""

from __future__ import annotations

from sdc_telemetry.testing import spawn_ranks

from ._scale import healthy_step_bytes


def test_healthy_step_bytes_do_not_grow_with_world_size() -> None:
    """W=2 and W=8 gloo ranks: one fixed-size agreement per healthy step, plus the reduce-phase checksum's sums
    (fixed by the model's bucket sizes: 3 float64 for this one-chunk model), the same bytes per rank."""
    small = spawn_ranks(healthy_step_bytes, 2, (5,), timeout=180)
    large = spawn_ranks(healthy_step_bytes, 8, (5,), timeout=300)
    assert small[0] == large[0] == large[7], (small[0], large[0])
    assert small[0]["calls"] == 2 and set(small[0]) == {"all_reduce", "checksum_all_reduce", "calls"}
    # the status vector [v, ~v]: 17 int64 fields, twice (core/status.py)
    assert small[0]["all_reduce"] <= 2 * 8 * 17 and small[0]["checksum_all_reduce"] == 3 * 8
