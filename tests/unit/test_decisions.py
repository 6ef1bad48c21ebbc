"""Deciding, without processes: votes, gradient verdicts, replay attribution, partner choice, shippable batches."""

from __future__ import annotations

import math
from collections import namedtuple

import pytest
import torch

from sdc_telemetry import check_shippable
from sdc_telemetry.checks import grad, weights
from sdc_telemetry.checks.replay import Outcome, attribute, pick_shifts
from sdc_telemetry.checks.vote import vote


def test_vote_one_outlier() -> None:
    """Three agree, one differs: the outlier is the only suspect, not ambiguous."""
    v = vote([[1, 2], [1, 2], [1, 9], [1, 2]])
    assert (v.suspects, v.ambiguous, v.differing) == ((2,), False, {2: (1,)})


def test_vote_two_outliers_out_of_five() -> None:
    """Three agree, two differ (each its own way): both named."""
    v = vote([[1], [1], [5], [1], [7]])
    assert (v.suspects, v.ambiguous) == ((2, 4), False)


def test_vote_tie_of_two_is_ambiguous_and_names_both() -> None:
    """Two replicas disagree: no majority, both named."""
    v = vote([[1, 1], [1, 2]])
    assert (v.suspects, v.ambiguous, v.reference) == ((0, 1), True, None)
    assert v.differing == {0: (1,), 1: (1,)}


def test_vote_all_different_names_everyone() -> None:
    """No two agree: ambiguous, every rank named."""
    v = vote([[1], [2], [3]])
    assert (v.suspects, v.ambiguous) == ((0, 1, 2), True)


def test_vote_agreement_and_plurality() -> None:
    """All equal -> nothing; a 2-1-1 split names the two singletons, flagged ambiguous."""
    assert vote([[4, 4]] * 3).agreed
    v = vote([[1], [1], [2], [3]])
    assert (v.suspects, v.ambiguous) == ((2, 3), True)


def test_weights_decide_names_parameters_and_fingerprints() -> None:
    """Evidence lists the differing parameter names and both fingerprints."""
    f = weights.decide([[1, 2], [1, 2], [1, 3]], [10, 11, 12], ["a", "b"])
    assert f is not None and f.suspect_ranks == (12,)
    assert f.evidence["differing_parameters"] == {"12": ["b"]}
    assert f.evidence["fingerprints"] == {"12": {"b": f"{3:016x}"}}
    assert f.evidence["majority_fingerprints"] == {"b": f"{2:016x}"}
    assert weights.decide([[1, 2]] * 3, [0, 1, 2], ["a", "b"]) is None


def _row(norm_local: float = 1.0, norm_reduced: float = 1.0, measured: bool = True) -> grad.StatusRow:
    return grad.StatusRow(step=3, local_measured=measured, local_norm=norm_local, reduced_norm=norm_reduced,
                          local_fp=0, error=False)


def test_grad_decide_local_nonfinite_names_that_rank() -> None:
    """A non-finite local gradient names its rank even though every reduced gradient is NaN too."""
    rows = [_row(norm_reduced=math.nan), _row(math.nan, math.nan), _row(norm_reduced=math.nan)]
    f = grad.decide(rows, [0, 1, 2], check_local=True)
    assert f is not None and (f.check, f.suspect_ranks) == ("grad_local", (1,))


def test_grad_decide_reduced_only_is_communication() -> None:
    """All local gradients finite, one rank's reduced gradients not: grad_reduced, verdict communication."""
    f = grad.decide([_row(), _row(), _row(norm_reduced=math.inf)], [0, 1, 2], check_local=True)
    assert f is not None and (f.check, f.suspect_ranks) == ("grad_reduced", (2,))
    assert f.evidence["verdict"] == "communication"
    assert grad.decide([_row()] * 3, [0, 1, 2], check_local=True) is None


def test_status_row_round_trips_through_gathered_ints() -> None:
    """The int64 row carries norms bit-exactly, NaN included."""
    params = [torch.nn.Parameter(torch.ones(3))]
    record = grad.GradRecord(params, torch.device("cpu"))
    row = grad.StatusRow.build(7, record, torch.tensor([2.0]), error=False)
    parsed = grad.StatusRow.parse(row.tolist())
    assert parsed.step == 7 and not parsed.local_measured and parsed.reduced_norm == 2.0
    assert math.isnan(parsed.local_norm)


def test_attribute_persistent_common_rank() -> None:
    """With 3+ ranks the rank common to every mismatching pair is the suspect."""
    suspects, why = attribute(Outcome(3, edges=[(1, 2), (2, 0)], reproduced={0: True, 1: True, 2: True}))
    assert suspects == (2,) and why["fault"] == "persistent" and not why["ambiguous"]


def test_attribute_transient_is_the_rank_that_cannot_reproduce_itself() -> None:
    """A rank whose rerun differs from its own record is the suspect (transient)."""
    suspects, why = attribute(Outcome(2, edges=[(0, 1)], reproduced={0: True, 1: False}))
    assert suspects == (1,) and why["fault"] == "transient"


def test_attribute_two_replicas_persistent_is_ambiguous() -> None:
    """Two replicas that each reproduce themselves: no referee, both named."""
    suspects, why = attribute(Outcome(2, edges=[(0, 1), (1, 0)], reproduced={0: True, 1: True}))
    assert suspects == (0, 1) and why["ambiguous"]


def test_pick_shifts_prefers_partners_on_other_hosts() -> None:
    """Ranks 0,1 on host a and 2,3 on host b: only shift 2 pairs every rank across hosts."""
    assert pick_shifts(["a", "a", "b", "b"]) == [2]
    assert pick_shifts(["a", "a", "a"]) == [1, 2]
    assert pick_shifts(["a", "b", "a", "b"]) == [1, 3]


def test_check_shippable_names_the_offending_leaf() -> None:
    """Plain nests pass; an arbitrary object is named with its path and type."""
    check_shippable({"x": torch.ones(2), "meta": [1, "a", None, (2.0, True)]})
    with pytest.raises(TypeError, match=r"batch\['meta'\]\[1\].*object"):
        check_shippable({"meta": [1, object()]})
    Pair = namedtuple("Pair", "a b")
    with pytest.raises(TypeError, match="Pair"):
        check_shippable(Pair(1, 2))


def test_attribute_most_ranks_unreproducible_means_replay_is_unfaithful() -> None:
    """When most ranks cannot reproduce themselves, no rank is blamed: the replay itself is wrong."""
    suspects, why = attribute(Outcome(3, edges=[(0, 1), (1, 2)], reproduced={0: False, 1: False, 2: True}))
    assert suspects == () and why["fault"] == "unfaithful"


def test_status_row_carries_accumulation_and_capture_flags() -> None:
    """repeated / replayable survive the gather, and comparable needs a measured, single-reduce step."""
    params = [torch.nn.Parameter(torch.ones(3))]
    record = grad.GradRecord(params, torch.device("cpu"))
    record.repeated = True
    parsed = grad.StatusRow.parse(grad.StatusRow.build(1, record, None, error=False, replayable=True).tolist())
    assert parsed.repeated and parsed.replayable and not parsed.comparable
