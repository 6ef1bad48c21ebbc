"""Memory of the replay and the certificate (2 gloo CPU ranks): what an audit and certificate() add at their peak.

The model: 8 blocks of two 512 x 512 linear layers, each block fully_shard-ed (one FSDP parameter group of 2 MiB of
fp32 gradients), so the whole model's unsharded gradients are 8 times one group's. Live tensor bytes are counted by
``_memory.LiveBytes``. An audit's recomputation is compared with a bare one (the same forward and backward with no
parameter gradient): the difference is what measuring the gradients holds.
"""

from __future__ import annotations

from typing import Any

import pytest

from sdc_telemetry.testing import spawn_ranks

from ._memory import run_memory, run_update_memory

# The rows, and the fingerprint's working memory for one tensor (its partial sums: 4093 words per block row): small
# next to a parameter's gradient (about 9 % of one 1 MiB gradient here, under 2 % of a 64 MiB one).
SLACK = 128 * 1024


@pytest.fixture(scope="module")
def measured() -> list[dict[str, Any]]:
    """One spawn of 2 ranks: FSDP2 audits (exact, tolerance), certificates, DDP audits."""
    return spawn_ranks(run_memory, 2, (), timeout=600)


def _extra(results: list[dict[str, Any]], case: str) -> list[int]:
    return [a["audit"] - a["bare"] for r in results for a in r[case]["audits"]]


def test_fsdp_audit_adds_at_most_one_group_gradient(measured: list[dict[str, Any]]) -> None:
    """An FSDP2 audit (exact mode) holds at most one unsharded parameter group's gradient beyond a bare
    recomputation, on a model whose unsharded gradients are 8 groups; both audits pass."""
    for r in measured:
        groups = r["fsdp_exact"]["groups"]
        assert sum(groups) >= 8 * max(groups)
        assert r["fsdp_exact"]["replay"] == {"pass": 2} and not r["fsdp_exact"]["incidents"]
    extra = _extra(measured, "fsdp_exact")
    assert len(extra) == 4
    assert max(extra) <= max(measured[0]["fsdp_exact"]["groups"]) + SLACK, extra


def test_fsdp_tolerance_audit_adds_one_gradient_and_its_sketch(measured: list[dict[str, Any]]) -> None:
    """In tolerance mode the audit adds at most one group's gradient and the float64 working copies of one
    parameter's sketch (three times its fp32 bytes, twice each): far below the whole model's gradients."""
    groups = measured[0]["fsdp_tolerance"]["groups"]
    largest = max(measured[0]["ddp"]["params"])
    for r in measured:
        assert r["fsdp_tolerance"]["replay"] == {"pass": 2} and not r["fsdp_tolerance"]["incidents"]
    extra = _extra(measured, "fsdp_tolerance")
    assert max(extra) <= max(groups) + 6 * largest + SLACK < sum(groups) + 1, extra


def test_certificate_holds_at_most_one_group(measured: list[dict[str, Any]]) -> None:
    """certificate() on the sharded model grows by at most one group's unsharded size (it gathers one tensor at a
    time), while keeping every gathered tensor would grow by the whole model (the tracker sees gathers)."""
    for case in ("fsdp_exact", "fsdp_nobias"):
        for r in measured:
            cert, groups = r[case]["certificate"], r[case]["groups"]
            # Net growth: a free of older garbage inside the window (the collector runs when it likes) can take a
            # few bytes off it (seen once: the 16-byte head bias), so the whole model is asserted within the slack.
            assert cert["all_held"] >= sum(groups) - SLACK > 4 * (max(groups) + SLACK)
            assert cert["growth"] <= max(groups) + SLACK, (case, cert)


def test_ddp_audit_adds_at_most_one_parameter_gradient(measured: list[dict[str, Any]]) -> None:
    """A DDP audit holds at most one parameter's gradient beyond a bare recomputation; both audits pass."""
    for r in measured:
        assert r["ddp"]["replay"] == {"pass": 2} and not r["ddp"]["incidents"]
    extra = _extra(measured, "ddp")
    assert len(extra) == 4
    assert max(extra) <= max(measured[0]["ddp"]["params"]) + SLACK, extra


def test_update_audit_holds_at_most_one_group() -> None:
    """4 ranks, FSDP2 on a 1-D mesh, AdamW, an update audit every step: each audit (the exchange, the partner's
    recomputation and the rank's own rerun) grows by at most one parameter group's unsharded size, while the whole
    local shard's audit inputs (parameters, gradients, two Adam moments) weigh several groups; every audit passes."""
    results = spawn_ranks(run_update_memory, 4, (), timeout=300)
    for r in results:
        assert r["update"] == {"pass": 3} and not r["errors"] and not r["incidents"], r
        assert r["local_inputs"] >= 4 * max(r["groups"])
        assert len(r["growth"]) == 3 and max(r["growth"]) <= max(r["groups"]) + SLACK, (r["growth"], r["groups"])
