"""Deciding, without processes: votes, gradient verdicts, replay attribution, partner choice, shippable batches."""

from __future__ import annotations

import json
import math
from collections import OrderedDict, namedtuple

import pytest
import torch

from sdc_telemetry import RankIdentity as sdc_identity
from sdc_telemetry import check_shippable
from sdc_telemetry.checks import grad, weights
from sdc_telemetry.checks.pairing import Outcome, attribute, plan_pairs
from sdc_telemetry.checks.replay import noise_median
from sdc_telemetry.core.vote import vote


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
    f = weights.decide([[(1,), (2,)], [(1,), (2,)], [(1,), (3,)]], [10, 11, 12], ["a", "b"])
    assert f is not None and f.suspect_ranks == (12,)
    assert f.evidence["differing_parameters"] == {"12": ["b"]}
    assert f.evidence["fingerprints"] == {"12": {"b": f"{3:016x}"}}
    assert f.evidence["majority_fingerprints"] == {"b": f"{2:016x}"}
    assert weights.decide([[(1,), (2,)]] * 3, [0, 1, 2], ["a", "b"]) is None


def _st(rank: int, local_bad: bool = False, reduced_bad: bool = False, measured: bool = True) -> grad.GradStatus:
    return grad.GradStatus(rank, measured, local_bad, True, reduced_bad,
                           math.nan if local_bad else 1.0, math.nan if reduced_bad else 1.0)


def test_grad_decide_local_nonfinite_names_that_rank() -> None:
    """A non-finite local gradient on one rank names it, even though every reduced gradient is NaN too."""
    f = grad.decide([_st(0, reduced_bad=True), _st(1, True, True), _st(2, reduced_bad=True)])
    assert f is not None and (f.check, f.suspect_ranks) == ("grad_local", (1,))
    assert f.evidence["verdict"] == "nonfinite_local_gradients"


def test_grad_decide_nonfinite_everywhere_is_numerics() -> None:
    """Every rank non-finite at once (a bad batch, overflow): a numerics event with no suspect."""
    f = grad.decide([_st(r, True, True) for r in range(4)])
    assert f is not None and f.suspect_ranks == () and f.evidence["verdict"] == "numerics"
    f = grad.decide([_st(r, reduced_bad=True) for r in range(4)])
    assert f is not None and (f.check, f.suspect_ranks) == ("grad_reduced", ())


def test_grad_decide_scaler_overflow_on_one_rank_is_numerics() -> None:
    """With a GradScaler, an fp16 overflow on some ranks is routine (the step is skipped everywhere)."""
    f = grad.decide([_st(0, True, True), _st(1, reduced_bad=True)], overflow_expected=True)
    assert f is not None and f.suspect_ranks == () and f.evidence["verdict"] == "numerics"


def test_grad_decide_scaler_names_a_minority_that_stays_nonfinite() -> None:
    """With a GradScaler, the same rank non-finite alone at SCALER_PATIENCE steps in a row is not an overflow."""
    rows = [_st(0), _st(1, True, True), _st(2, reduced_bad=True)]
    assert grad.nonfinite_minority(rows) == (1,)
    early = grad.decide(rows, overflow_expected=True, repeats=grad.SCALER_PATIENCE - 2)
    assert early is not None and early.suspect_ranks == ()
    late = grad.decide(rows, overflow_expected=True, repeats=grad.SCALER_PATIENCE - 1)
    assert late is not None and late.suspect_ranks == (1,) and late.evidence["verdict"] == "persistent_nonfinite"
    assert grad.nonfinite_minority([_st(r, True, True) for r in range(3)]) == ()


def test_grad_decide_single_process_names_itself() -> None:
    """One process cannot tell numerics from hardware: it records a grad_local incident naming itself."""
    f = grad.decide([grad.GradStatus(0, True, True, False, False)])
    assert f is not None and f.suspect_ranks == (0,) and f.evidence["ambiguous"]


def test_grad_decide_reduced_only_is_communication() -> None:
    """All local gradients finite, one rank's reduced gradients not: grad_reduced, verdict communication."""
    f = grad.decide([_st(0), _st(1), _st(2, reduced_bad=True)])
    assert f is not None and (f.check, f.suspect_ranks) == ("grad_reduced", (2,))
    assert f.evidence["verdict"] == "communication"
    assert grad.decide([_st(r) for r in range(3)]) is None


def test_grad_decide_evidence_is_bounded_at_any_world_size() -> None:
    """Half of 16,384 ranks non-finite: the evidence lists a bounded sample and the count."""
    rows = [_st(r, local_bad=r % 2 == 0, reduced_bad=True) for r in range(16384)]
    f = grad.decide(rows)
    assert f is not None and len(f.suspect_ranks) == 8192
    assert f.evidence["nonfinite_ranks"] == 8192 and len(f.evidence["local_grad_norm"]) <= 16
    assert len(json.dumps(f.evidence)) < 2000


def test_weights_vote_within_numerics_classes() -> None:
    """Mixed stacks round differently: ranks are compared only within their class; a lone rank is not voted on."""
    tables = [[(1,)], [(1,)], [(2,)], [(3,)], [(3,)]]
    assert weights.decide(tables, [0, 1, 2, 3, 4], ["w"], classes=[7, 7, 8, 9, 9]) is None
    f = weights.decide(tables, [0, 1, 2, 3, 4], ["w"], classes=[7, 7, 7, 9, 9])
    assert f is not None and f.suspect_ranks == (2,)


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


def test_pairs_cross_hosts() -> None:
    """Partners sit on another host whenever one exists; with one host any other rank will do."""
    for hosts in (["a", "a", "b", "b"], ["a", "b", "a", "b"], ["a"] * 4 + ["b"] * 4 + ["c"] * 4):
        p = plan_pairs(hosts)
        assert p.shifts
        for s in p.shifts:
            assert all(hosts[p.origin(i, s)] != hosts[i] for i in range(len(hosts)))
            assert sorted(p.origin(i, s) for i in range(len(hosts))) == list(range(len(hosts)))
            assert all(p.replayer(p.origin(i, s), s) == i for i in range(len(hosts)))
    single = plan_pairs(["a", "a", "a"])
    assert single.shifts == (1, 2)


def test_pairs_plan_16k_ranks_quickly_enough_to_be_linearithmic() -> None:
    """16,384 ranks on 2,048 hosts: every rank audits another host (timed in benchmarks/scale.py, not here)."""
    hosts = [f"h{r // 8}" for r in range(16384)]
    p = plan_pairs(hosts)
    s = p.shifts[0]
    assert all(hosts[p.origin(i, s)] != hosts[i] for i in range(0, 16384, 97))


def test_check_shippable_names_the_offending_leaf() -> None:
    """Plain nests pass; an arbitrary object is named with its path and type."""
    check_shippable({"x": torch.ones(2), "meta": [1, "a", None, (2.0, True)]})
    with pytest.raises(TypeError, match=r"batch\['meta'\]\[1\].*object"):
        check_shippable({"meta": [1, object()]})
    Pair = namedtuple("Pair", "a b")
    check_shippable(Pair(torch.ones(1), {"k": OrderedDict(v=2)}))  # namedtuples and OrderedDicts travel too
    with pytest.raises(TypeError, match="set"):
        check_shippable(Pair(1, {3}))


def test_attribute_most_ranks_unreproducible_means_replay_is_unfaithful() -> None:
    """When most ranks cannot reproduce themselves, no rank is blamed: the replay itself is wrong."""
    suspects, why = attribute(Outcome(3, edges=[(0, 1), (1, 2)], reproduced={0: False, 1: False, 2: True}))
    assert suspects == () and why["fault"] == "unfaithful"


def test_noise_median_from_summed_histograms() -> None:
    """The calibrated noise floor is the median rank's rerun delta, read from a fixed-size summed histogram."""
    from sdc_telemetry.checks.calibration import histogram as _histogram

    counts = [sum(c) for c in zip(_histogram(0.0), _histogram(1e-7), _histogram(1e-3), strict=True)]
    median = noise_median(counts)
    assert median is not None and 1e-7 <= median <= 1e-6
    assert noise_median([0] * 42) is None


def test_calibration_sets_one_threshold_per_compared_quantity() -> None:
    """Thresholds per quantity (loss and norms, then each parameter's sketch): until 3 cross-rank audits 1e-3 (room
    for a rank whose kernels are 1e-5 off, about 1e-4 in the sketches); then CROSS_FACTOR above each quantity's
    largest healthy delta over a window of audits, so a parameter whose gradient cancels (noisy sketches) does not
    set the bar for the others; a quantity without data keeps its own; the rerun floor and the cap bound them all."""
    from sdc_telemetry.checks.calibration import _SETTLED, AUTO_FLOOR, CROSS_FACTOR, Calibration
    from sdc_telemetry.checks.calibration import histogram as _histogram

    cal = Calibration(3)
    assert cal.thresholds == [1e-3] * 3 and cal.tolerance == 1e-3
    assert cal.rerun(_histogram(0.0)) and cal.thresholds == [1e-3] * 3  # exact reruns say nothing about other ranks
    assert not cal.across(None) and not cal.across(math.nan) and not cal.across([math.nan, -1.0, None])
    assert cal.across([2.9e-5, 1.8e-4, None])
    assert cal.thresholds == [1e-3] * 3  # one audit is too few to know how far a deviating rank moves a quantity
    for _ in range(_SETTLED - 2):
        assert cal.across([1e-7, 2e-5, 1e-6]) and cal.thresholds == [1e-3] * 3
    assert cal.across([1e-7, 2e-5, 1e-6])  # settled: the window's maximum per quantity, each on its own
    assert cal.thresholds == pytest.approx([CROSS_FACTOR * 2.9e-5, CROSS_FACTOR * 1.8e-4, 1e-3])
    assert cal.across([1e-7, 2e-5, 1e-6])
    assert cal.thresholds == pytest.approx([CROSS_FACTOR * 2.9e-5, CROSS_FACTOR * 1.8e-4, AUTO_FLOOR])
    for _ in range(10):
        cal.across([2e-5, 2e-5, 2e-5])
    assert cal.thresholds == pytest.approx([CROSS_FACTOR * 2e-5] * 3)  # the window moved on
    assert cal.tolerance == max(cal.thresholds)
    with pytest.raises(ValueError, match="3 quantities got 2"):
        cal.across([1e-5, 1e-5])
    exact = Calibration(2)
    for _ in range(_SETTLED):
        exact.across(0.0)
    assert exact.thresholds == [AUTO_FLOOR, AUTO_FLOOR]  # bitwise-equal ranks: the floor
    noisy = Calibration(2)
    noisy.rerun(_histogram(0.5))
    for _ in range(_SETTLED):
        noisy.across([1e-5, 1e-5])
    assert noisy.thresholds == [0.05, 0.05]  # the cap


def test_each_kind_of_quantity_has_its_own_rerun_noise_floor() -> None:
    """The sketches' rerun deltas are heavy-tailed (a block whose terms cancel): their noise floor bounds the
    sketches' thresholds only. Floored by it, the norms' thresholds sat at 3x a sketch's rerun noise (9.5e-5 under
    the campaign's emulated GPU numerics) and a persistent fault of 1e-4 went unseen in 4 of 40 trials."""
    from sdc_telemetry.checks.calibration import _AUTO_FACTOR, _SETTLED, CROSS_FACTOR, Calibration, noise_median
    from sdc_telemetry.checks.calibration import histogram as _histogram

    cal = Calibration(3, kinds=[0, 0, 1])
    assert cal.rerun(_histogram(1e-7), kind=0) and cal.rerun(_histogram(1.4e-5), kind=1)
    for _ in range(_SETTLED):
        cal.across([2e-6, 5e-6, 1e-6])
    sketch_floor = _AUTO_FACTOR * noise_median(_histogram(1.4e-5))  # type: ignore[operator]
    assert cal.thresholds == pytest.approx([1e-5, CROSS_FACTOR * 5e-6, sketch_floor])
    assert cal.noise_floor >= 1.4e-5
    with pytest.raises(ValueError, match="3 quantities need as many kinds"):
        Calibration(3, kinds=[0, 1])


def test_large_finite_fp16_gradients_are_not_called_non_finite() -> None:
    """Norms are accumulated in float32: a finite fp16 gradient whose norm exceeds 65504 stays finite."""
    params = [torch.nn.Parameter(torch.zeros(100, dtype=torch.float16))]
    record = grad.GradRecord(params, torch.device("cpu"))
    record.store([0], [torch.full((100,), 60000.0, dtype=torch.float16)])
    assert math.isfinite(float(record.total_norm())) and float(record.total_norm()) > 65504
    held = [(0, torch.full((100,), 60000.0, dtype=torch.float16))]
    assert math.isfinite(float(grad.reduced_norms(1, held, torch.device("cpu"))[0]))


def test_an_episode_closes_only_on_a_pass_every_rank_shares() -> None:
    """A rank-local pass (other ranks errored) keeps the episode open, so every rank's episodes stay in step."""
    from sdc_telemetry.core.episodes import Episodes
    from sdc_telemetry.core.findings import Finding

    def ident(ranks: tuple[int, ...]) -> tuple[sdc_identity, ...]:
        return tuple(sdc_identity(r, r, "h", f"cpu:h:{r}") for r in ranks)

    incidents: list = []
    episodes = Episodes(incidents)
    finding = Finding("replay", (2,), {"verdict": "persistent"})
    opened, _ = episodes.observe(4, [finding], frozenset(), ident)
    assert len(opened) == 1
    episodes.observe(5, [], frozenset(), ident)  # passed here, errored elsewhere: not closed
    opened, _ = episodes.observe(6, [finding], frozenset(), ident)
    assert opened == [] and incidents[0].count == 2 and incidents[0].last_step == 6
    episodes.observe(7, [], frozenset({"replay"}), ident)  # passed on every rank: closed
    opened, _ = episodes.observe(8, [finding], frozenset(), ident)
    assert len(opened) == 1 and len(incidents) == 2


def test_sharded_reduced_gradients_are_compared_among_replicas_of_a_shard() -> None:
    """FSDP2: a reduced shard non-finite on every replica of that shard is an overflow (numerics); one replica of a
    shard non-finite while the others are finite is the communication suspect; a 1-D mesh names nobody."""
    rows = [_st(0, reduced_bad=True), _st(1), _st(2, reduced_bad=True), _st(3)]
    f = grad.decide(rows, shard_of=[0, 1, 0, 1])  # (2 replicas, 2 shards): shard 0 non-finite everywhere
    assert f is not None and f.suspect_ranks == () and f.evidence["verdict"] == "numerics"
    f = grad.decide(rows, shard_of=[0, 1, 1, 0])  # ranks 0 and 2 each disagree with their shard's replica
    assert f is not None and f.suspect_ranks == (0, 2) and f.evidence["verdict"] == "communication"
    f = grad.decide(rows, shard_of=[0, 1, 2, 3])  # 1-D mesh: no replica to compare
    assert f is not None and f.suspect_ranks == ()


def test_replay_partners_share_a_numerics_class() -> None:
    """Two device models (and one odd rank): every rank replays a rank of its own class, on another host where the
    class spans hosts, the rotation meets every partner of the class, and the rank alone in its class replays itself
    and is listed as not auditable; one class everywhere keeps the plain host-interleaved plan."""
    from sdc_telemetry.checks.pairing import ClassPairing, plan_pairs

    hosts = ["a", "a", "b", "b", "c", "c", "d"]
    classes = [10, 20, 10, 20, 10, 20, 30]  # H100s on 0, 2, 4; A100s on 1, 3, 5; one L40S on 6
    p = plan_pairs(hosts, classes)
    assert isinstance(p, ClassPairing) and p.alone == (6,)
    met: dict[int, set[int]] = {pos: set() for pos in range(7)}
    for s in p.shifts:
        origins = [p.origin(pos, s) for pos in range(7)]
        assert sorted(origins) == list(range(7))  # a permutation: every rank is audited once per round
        for pos, o in enumerate(origins):
            assert classes[o] == classes[pos] and p.replayer(o, s) == pos
            assert (hosts[o] != hosts[pos]) == (pos != 6)
            met[pos].add(o)
    assert met[0] == {2, 4} and met[1] == {3, 5} and met[6] == {6}
    assert plan_pairs(hosts, [1] * 7).alone == () and not isinstance(plan_pairs(hosts, [1] * 7), ClassPairing)
    # N-D: replicas pair within the class of their ranks; replica 2 (ranks 4, 5) has a class of its own.
    from sdc_telemetry.checks.pairing import plan_replica_pairs

    rp = plan_replica_pairs(["a", "a", "b", "b", "c", "c"], [0, 0, 1, 1, 2, 2], [0, 1, 0, 1, 0, 1],
                            classes=[1, 1, 1, 1, 2, 2])
    assert rp.alone == (4, 5)
    assert [rp.origin(pos, rp.shifts[0]) for pos in range(6)] == [2, 3, 0, 1, 4, 5]


class _Stages:
    """The part of parallel.outputs.StageOutputs the replay's stage rule reads."""

    def __init__(self, stage_of: list[int] | list[list[int]]) -> None:
        self.stages_of = [s if isinstance(s, list) else [s] for s in stage_of]
        self.parts = len(self.stages_of[0])

    from sdc_telemetry.parallel.outputs import StageOutputs as _Real

    encode, merge, sent_differs = _Real.encode, staticmethod(_Real.merge), _Real.sent_differs  # how marks are made


def _stage_rule(stage_of: list[int] | list[list[int]], marks: dict[tuple[int, int], int], suspects: tuple[int, ...],
                why: dict[str, object] | None = None, rerun: dict[int, int] | None = None, mode: str = "exact"
                ) -> tuple[tuple[int, ...], object]:
    from sdc_telemetry.checks.replay import ReplayCheck

    check = ReplayCheck.__new__(ReplayCheck)  # the rule reads four fields; no process group needed
    check._outputs, check._output_marks, check._rerun_output_marks = _Stages(stage_of), marks, rerun or {}
    check.mode = mode
    return check._first_wrong_stage(suspects, why or {"fault": "persistent", "ambiguous": False})


# Four stages, three replicas; position = replica * 4 + stage. Replica 1 (positions 4..7) is the suspect.
FOUR = [0, 1, 2, 3] * 3


def test_stage_rule_names_the_first_stage_of_a_forward_fault() -> None:
    """Stage 2 of replica 1 computes wrongly: the outputs of stages 2 and 3 differ in both of its comparisons, the
    earlier stages' match; every stage's gradients differ (all four positions suspects): position 6 alone."""
    marks = {(p, q): int(FOUR[p] >= 2) for p, q in [(0, 4), (1, 5), (2, 6), (3, 7), (4, 8), (5, 9), (6, 10), (7, 11)]}
    assert _stage_rule(FOUR, marks, (4, 5, 6, 7)) == ((6,), (2, "output"))


def test_stage_rule_narrows_nothing_it_cannot_explain() -> None:
    """Patterns a forward fault cannot make leave the suspects as they are: a differing stage before a matching one
    (noise over the threshold in tolerance mode), every output alike (a backward fault), an output not compared, and
    an ambiguous finding. A transient fault uses the positions' own reruns."""
    pairs = [(0, 4), (1, 5), (2, 6), (3, 7)]
    gap = {pq: int(FOUR[pq[0]] in (0, 3)) for pq in pairs}
    assert _stage_rule(FOUR, gap, (4, 5, 6, 7)) == ((4, 5, 6, 7), None)
    assert _stage_rule(FOUR, dict.fromkeys(pairs, 0), (4, 5, 6, 7)) == ((4, 5, 6, 7), None)
    unknown = {**{pq: 1 for pq in pairs}, (3, 7): -1}
    assert _stage_rule(FOUR, unknown, (4, 5, 6, 7)) == ((4, 5, 6, 7), None)
    assert _stage_rule(FOUR, dict.fromkeys(pairs, 1), (4, 5, 6, 7), {"ambiguous": True}) == ((4, 5, 6, 7), None)
    rerun = {4: 0, 5: 1, 6: 1, 7: 1}
    assert _stage_rule(FOUR, {}, (4, 5, 6, 7), {"fault": "transient"}, rerun) == ((5,), (1, "output"))


# Interleaved: 2 pp ranks x 2 replicas, 4 stages, stages {0, 2} on pp rank 0 and {1, 3} on pp rank 1; position =
# replica * 2 + pp rank. A position's mark holds a bit per local stage (bit 0: its first stage, bit 1: its second).
LOOPED = [[0, 2], [1, 3]] * 2


def test_stage_rule_names_a_stage_of_an_interleaved_rank() -> None:
    """Stage 1 (pp rank 1's first) of replica 1 computes wrongly: stages 1, 2 and 3 differ, stage 0 does not. Both
    ranks of the replica see a differing output (pp rank 0 in its stage 2), so only the bits tell: position 3 (pp rank
    1) alone, at stage 1. A fault in stage 2 (pp rank 0's second stage) leaves stage 1's outputs alike: position 2."""
    marks = {(0, 2): 0b10, (1, 3): 0b11}
    assert _stage_rule(LOOPED, marks, (2, 3)) == ((3,), (1, "output"))
    assert _stage_rule(LOOPED, {(0, 2): 0b10, (1, 3): 0b10}, (2, 3)) == ((2,), (2, "output"))
    # stage 3 differs alone: pp rank 1's second stage
    assert _stage_rule(LOOPED, {(0, 2): 0b00, (1, 3): 0b10}, (2, 3)) == ((3,), (3, "output"))
    # stage 0 differs but stage 1 does not: no forward fault makes that
    assert _stage_rule(LOOPED, {(0, 2): 0b11, (1, 3): 0b10}, (2, 3)) == ((2, 3), None)


def test_outputs_are_compared_per_local_stage() -> None:
    """``_outputs_differ`` compares each local stage's last forwards (a first step's extra shape-inference forward
    aside), giving a bit per stage; a stage missing on either side makes the comparison unknown (-1)."""
    from sdc_telemetry.checks.replay import ReplayCheck

    check = ReplayCheck.__new__(ReplayCheck)
    check._outputs, check.mode = _Stages([[0, 2]]), "exact"
    recorded = ([5, 1, 2, 3, 4], [1.0] * 5, [0, 0, 1, 0, 1])  # stage 0's first forward: the shape inference
    same = ([1, 2, 3, 4], [1.0] * 4, [0, 1, 0, 1])
    assert check._outputs_differ(recorded, same, 0.0) == 0
    assert check._outputs_differ(recorded, ([1, 9, 3, 4], [1.0] * 4, [0, 1, 0, 1]), 0.0) == 0b10
    assert check._outputs_differ(recorded, ([7, 2, 3, 4], [1.0] * 4, [0, 1, 0, 1]), 0.0) == 0b01
    assert check._outputs_differ(recorded, ([1, 3], [1.0] * 2, [0, 0]), 0.0) == -1
    assert check._outputs_differ(None, same, 0.0) == -1


def test_stage_rule_names_the_last_stage_that_sent_a_wrong_gradient() -> None:
    """A fault in the backward of stage 2 of replica 1 (the gradient it sends back): every output matches, stage 2
    sends a different gradient and so does stage 1 (it back-propagates what it received); stage 3 is untouched and
    stage 0 sends nothing. With one stage per rank a position's sent-gradient bit is bit 1: position 6 at stage 2,
    whether or not stage 3's rank is a suspect (exact mode; tolerance mode does not narrow by sent gradients).
    Under an interleaved schedule (bits 2 and 3 for the two local stages' sent gradients) a fault in stage 2's
    backward (pp rank 0's second stage): position 2. A pattern a backward fault cannot make (stage 2 differs, stage
    1 does not) narrows nothing."""
    pairs = [(0, 4), (1, 5), (2, 6), (3, 7)]
    sent = {pq: 0b10 * int(FOUR[pq[0]] in (1, 2)) for pq in pairs}
    assert _stage_rule(FOUR, {pq: m for pq, m in sent.items() if pq != (3, 7)}, (4, 5, 6)) == \
        ((6,), (2, "gradient_sent"))
    assert _stage_rule(FOUR, sent, (4, 5, 6, 7)) == ((6,), (2, "gradient_sent"))
    gap = {pq: 0b10 * int(FOUR[pq[0]] == 2) for pq in pairs[:3]}
    assert _stage_rule(FOUR, gap, (4, 5, 6)) == ((4, 5, 6), None)
    assert _stage_rule(LOOPED, {(0, 2): 0b1000, (1, 3): 0b0100}, (2, 3)) == ((2,), (2, "gradient_sent"))
    # tolerance mode: a differing sent gradient is no mismatch (stage 2's rank may not be a suspect): nothing narrowed
    assert _stage_rule(FOUR, sent, (4, 5, 6, 7), mode="tolerance") == ((4, 5, 6, 7), None)
    # a forward fault wins: stage 1's output differs (and so do the gradients sent back): position 3, by its output
    assert _stage_rule(LOOPED, {(0, 2): 0b1010, (1, 3): 0b1111}, (2, 3)) == ((3,), (1, "output"))


def test_sent_gradients_are_compared_per_local_stage() -> None:
    """The gradients a stage sends back are a channel of their own (``parts + k``): compared like outputs; none on
    either side (a first stage) is a match, records on one side only make the comparison unknown."""
    from sdc_telemetry.checks.replay import ReplayCheck

    check = ReplayCheck.__new__(ReplayCheck)
    check._outputs, check.mode = _Stages([[1, 3]]), "exact"
    recorded = ([1, 2, 3, 4, 5, 6], [1.0] * 6, [0, 1, 0, 1, 3, 2])
    assert check._outputs_differ(recorded, recorded, 0.0) == 0
    assert check._outputs_differ(recorded, ([1, 2, 3, 4, 5, 9], [1.0] * 6, [0, 1, 0, 1, 3, 2]), 0.0) == 0b0100
    assert check._outputs_differ(recorded, ([1, 2, 3, 4, 8, 6], [1.0] * 6, [0, 1, 0, 1, 3, 2]), 0.0) == 0b1000
    forward_only = ([1, 2, 3, 4], [1.0] * 4, [0, 1, 0, 1])
    assert check._outputs_differ(forward_only, forward_only, 0.0) == 0
    assert check._outputs_differ(recorded, forward_only, 0.0) == -1


def test_a_16_bit_step_is_never_compared_below_one_unit_in_the_last_place() -> None:
    """The least tolerance of a replay comparison: bf16's 2**-7 under a bf16 autocast or with bf16 parameters, fp16's
    2**-10, the coarser of the two when both were used, and none for a float32 step (autocast off counts as off)."""
    from sdc_telemetry.checks.replay import rounding_floor
    from sdc_telemetry.checks.shipping import MicroBatch

    def micro(autocast: tuple[bool, torch.dtype] | None) -> MicroBatch:
        return MicroBatch(batch=None, cpu_rng=torch.zeros(1), dev_rng=None, autocast=autocast)

    fp32 = [torch.zeros(2)]
    assert rounding_floor([micro(None), micro((False, torch.bfloat16))], fp32) == 0.0
    assert rounding_floor([micro((True, torch.bfloat16))], fp32) == 2**-7
    assert rounding_floor([micro((True, torch.float16))], fp32) == 2**-10
    assert rounding_floor([micro((True, torch.float16))], [torch.zeros(2, dtype=torch.bfloat16)]) == 2**-7
    assert rounding_floor([micro(None)], [torch.zeros(2, dtype=torch.float16)]) == 2**-10
