"""Context parallelism without the monitor, on 4 gloo CPU ranks (dp_shard=2, cp=2): the parts the CP tests build on.

FSDP2 over the flattened dp_shard_cp mesh, the sequence split across the cp ranks with torch's CP module wrapper
(math SDPA, explicit causal mask: torch 2.13's ring attention has no CPU path).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sdc_telemetry.testing import spawn_ranks

from ._cp import reference_train, run_train

STEPS = 3


@pytest.fixture(scope="module")
def cp_run() -> list[dict[str, Any]]:
    """One spawn of 4 ranks training STEPS steps, each rank also recomputing another dp index's chunk each step."""
    return spawn_ranks(run_train, 4, ({"steps": STEPS, "rerun": True},), timeout=240)


def test_layout_is_dp_shard_by_cp(cp_run: list[dict[str, Any]]) -> None:
    """Ranks are laid out dp_shard-major; every parameter's DTensor mesh is the flattened dp_shard_cp mesh, whose
    root is the (dp_shard, cp) world mesh."""
    assert [r["coordinate"] for r in cp_run] == [{"dp_shard": d, "cp": c} for d in (0, 1) for c in (0, 1)]
    for r in cp_run:
        assert set(r["param_mesh"]) == {("dp_shard_cp",)} and r["root_mesh"] == ("dp_shard", "cp")


def test_cp_loss_equals_full_sequence_loss(cp_run: list[dict[str, Any]]) -> None:
    """At every step the mean of a dp index's cp-chunk losses equals the loss of the unsharded model on the full
    sequence (trained on the same batches) to fp32 rounding (a local-only attention would not), and the trained
    weights follow the same trajectory (AdamW turns rounding-level gradient differences into up to lr per step)."""
    ref = reference_train(STEPS, 2)
    for step in range(STEPS):
        for d in (0, 1):
            chunks = [r["losses"][step] for r in cp_run if r["dp_index"] == d]
            assert len(chunks) == 2 and chunks[0] != chunks[1]  # two different chunks, not one loss twice
            assert sum(chunks) / 2 == pytest.approx(ref["losses"][step][d], rel=1e-6, abs=0)
    assert ref["losses"][0][0] != ref["losses"][0][1]  # the dp indices train on different batches
    for r in cp_run:
        for name, w in ref["weights"].items():
            assert torch.allclose(r["full_weights"][name], w, rtol=0, atol=5e-3), name


def test_rerun_on_other_dp_index_is_bitwise(cp_run: list[dict[str, Any]]) -> None:
    """Each rank's no_grad recomputation (both cp ranks of a dp index at once) of the other dp index's same-cp chunk
    reproduces that rank's training loss bit for bit, at every step."""
    by_coord = {(r["dp_index"], r["coordinate"]["cp"]): r for r in cp_run}
    for (d, c), r in by_coord.items():
        origin = by_coord[((d + 1) % 2, c)]
        assert r["reruns"] == origin["losses"], (d, c)
        assert r["reruns"] != r["losses"]
