"""Late audits (deferred verdicts): the pure rules that tell a reproduced anomaly (data) from a vanished one
(hardware) on weights one update later, and what stays undecided."""

from __future__ import annotations

import math

import pytest

from sdc_telemetry.checks import late

HOSTS = ["a", "a", "b", "b"]
RANKS = [10, 11, 12, 13]


def test_summary_is_the_recorded_loss_and_the_gradient_norm() -> None:
    """The step's loss is the sum of micro-batch losses times their scales; the norm is over per-parameter norms."""
    assert late.summary([2.0, 4.0], [0.5, 0.5], [3.0, 4.0]) == (3.0, 5.0)
    loss, norm = late.summary([1.0], [1.0], [1.0, math.nan])
    assert loss == 1.0 and math.isnan(norm)


def test_distance_is_in_doublings_and_non_finite_values_compare_as_such() -> None:
    """Finite pairs: |log2| of their ratio, the larger of loss and norm; NaN on both sides counts as alike (0), NaN
    on one side only as infinitely far."""
    assert late.distance((1.0, 8.0), (1.0, 2.0)) == pytest.approx(2.0)
    assert late.distance((math.nan, math.nan), (math.nan, math.nan)) == 0.0
    assert late.distance((1.0, math.nan), (1.5, math.inf)) == pytest.approx(math.log2(1.5))
    assert late.distance((1.0, math.nan), (1.0, 3.0)) == math.inf
    assert late.distance((-1.0, 1.0), (1.0, 1.0)) == math.inf


@pytest.mark.parametrize("dist,band,expected", [
    (0.0, 0.0, late.REPRODUCED), (0.3, 0.1, late.REPRODUCED), (0.45, 0.1, late.UNCLEAR), (0.7, 0.1, late.GONE),
    (math.inf, 0.0, late.GONE), (1.0, 0.4, late.UNCLEAR), (0.6, 0.4, late.REPRODUCED),
])
def test_classify_leaves_a_gap_between_reproduced_and_gone(dist: float, band: float, expected: int) -> None:
    """Within the band plus a margin: reproduced; beyond twice that: gone; in between: unclear."""
    assert late.classify(dist, band) == expected


def test_an_anomaly_every_replayer_reproduces_is_data() -> None:
    """Both anomalous origins' replayers reproduce the anomaly: data, nobody named."""
    r = late.decide([1, 2], {1: (late.REPRODUCED, True, 0.01), 2: (late.REPRODUCED, True, 0.0)}, {}, 0.02, HOSTS,
                    RANKS)
    assert (r.verdict, r.suspects, r.anomalous) == ("data", (), (11, 12))


def test_a_vanished_anomaly_that_the_origin_no_longer_makes_is_a_transient_fault() -> None:
    """Gone on the replayer, and the origin's own rerun today agrees with it: transient, unambiguous."""
    r = late.decide([2], {2: (late.GONE, True, 1.8)}, {}, 0.01, HOSTS, RANKS)
    assert (r.verdict, r.suspects) == ("hardware", (12,))
    assert r.evidence["verdict"] == "transient" and r.evidence["ambiguous"] is False
    assert r.evidence["reproduced_own_result"] == {"12": True}


def test_a_persistent_fault_is_unambiguous_only_with_a_referee() -> None:
    """Gone, and the origin still disagrees with its replayer today: persistent, ambiguous unless a second
    replayer also disagrees with the origin (then it is the origin)."""
    alone = late.decide([1], {1: (late.GONE, False, math.inf)}, {}, 0.0, HOSTS, RANKS)
    refereed = late.decide([1], {1: (late.GONE, False, math.inf)}, {1: True}, 0.0, HOSTS, RANKS)
    assert alone.evidence["verdict"] == refereed.evidence["verdict"] == "persistent"
    assert alone.evidence["ambiguous"] is True and refereed.evidence["ambiguous"] is False
    assert alone.suspects == refereed.suspects == (11,)


def test_unclear_or_missing_outcomes_are_undecided_never_hardware() -> None:
    """An anomaly that neither reproduced nor clearly vanished, or one that no replayer measured, names nobody as
    hardware: undecided (the caller makes it an ambiguous warning)."""
    unclear = late.decide([1, 2], {1: (late.GONE, True, 2.0), 2: (late.UNCLEAR, True, 0.4)}, {}, 0.05, HOSTS, RANKS)
    missing = late.decide([1, 3], {1: (late.GONE, True, 2.0)}, {}, 0.05, HOSTS, RANKS)
    for r in (unclear, missing):
        assert r.verdict == "undecided" and r.suspects == () and "reason" in r.evidence


def test_several_vanished_origins_on_several_hosts_are_ambiguous() -> None:
    """Two ranks on two hosts, both gone: hardware, but which host is not known."""
    r = late.decide([1, 2], {1: (late.GONE, True, 2.0), 2: (late.GONE, True, 2.0)}, {}, 0.0, HOSTS, RANKS)
    assert r.suspects == (11, 12) and r.evidence["ambiguous"] is True
