"""N-D layouts, pure parts: mesh coordinates, replica pairing coordinate by coordinate, attribution on replicas."""

from __future__ import annotations

from typing import Any

import pytest

from sdc_telemetry.checks.pairing import Outcome, attribute, plan_replica_pairs
from sdc_telemetry.parallel.base import LayoutError
from sdc_telemetry.parallel.coordinates import canonical, check_dims

# 8 ranks of a (dp_replicate 2, dp_shard 2, tp 2) mesh: replica = 2 * dp_replicate + dp_shard, slot = tp
REPLICA = [0, 0, 1, 1, 2, 2, 3, 3]
SLOT = [0, 1, 0, 1, 0, 1, 0, 1]


def test_replica_pairs_replay_the_same_coordinate_of_a_replica_on_another_host() -> None:
    """Every position replays the position with its own tp coordinate in the partner replica, which runs on the other
    host (replicas 0 and 1 on host a, 2 and 3 on host b), and every replica is replayed exactly once per shift."""
    hosts = ["a"] * 4 + ["b"] * 4
    pairs = plan_replica_pairs(hosts, REPLICA, SLOT)
    for shift in pairs.shifts:
        origins = [pairs.origin(p, shift) for p in range(8)]
        assert sorted(origins) == list(range(8))
        for p, o in enumerate(origins):
            assert SLOT[o] == SLOT[p] and REPLICA[o] != REPLICA[p] and hosts[o] != hosts[p]
            assert pairs.replayer(o, shift) == p
    # the ranks of one replica all replay the same partner replica (their collectives line up inside it)
    assert len({REPLICA[pairs.origin(p, pairs.shifts[0])] for p in (0, 1)}) == 1


def test_replica_pairs_refuse_replicas_with_different_coordinates() -> None:
    """A replica missing a coordinate (or holding one twice) is a mesh that does not describe the job."""
    with pytest.raises(ValueError, match="same coordinates"):
        plan_replica_pairs(["a"] * 4, [0, 0, 1, 1], [0, 1, 0, 0])


def test_attribution_on_replicas_names_the_faulty_replicas_mismatching_coordinates() -> None:
    """A compute fault on rank 6 spreads to rank 7 (its tp partner): the pairs (4, 6), (5, 7) [cross round] and
    (6, 0), (7, 1) [6 and 7 replaying replica 0] mismatch; replica 3 is common to every pair: ranks 6 and 7."""
    edges = [(4, 6), (5, 7), (6, 0), (7, 1)]
    outcome = Outcome(8, edges, {p: True for p in range(8)})
    names, why = attribute(outcome, REPLICA)
    assert names == (6, 7) and why["fault"] == "persistent" and not why["ambiguous"]
    # position-level attribution would find no common rank and call it ambiguous
    assert attribute(outcome)[1]["ambiguous"]


def test_attribution_on_replicas_transient_names_the_ranks_that_cannot_reproduce() -> None:
    """Replica 1's coordinate 1 (rank 3) cannot reproduce its own step; everyone else can: rank 3 alone."""
    outcome = Outcome(8, [(0, 2), (1, 3)], {p: p != 3 for p in range(8)})
    names, why = attribute(outcome, REPLICA)
    assert names == (3,) and why["fault"] == "transient"


def test_attribution_on_two_replicas_is_ambiguous() -> None:
    """Two replicas that disagree and each reproduce themselves: no referee, both replicas' ranks named."""
    outcome = Outcome(4, [(0, 2), (1, 3), (2, 0), (3, 1)], {p: True for p in range(4)})
    names, why = attribute(outcome, [0, 0, 1, 1])
    assert names == (0, 1, 2, 3) and why["ambiguous"]


def test_mesh_dims_are_refused_by_name() -> None:
    """Unknown, unnamed and repeated dims are refused naming the dim; torchtitan's fsdp dim reads as dp_shard."""
    for names, text in ((("ep", "tp"), "expert parallelism"), (("world",), "flat 'world' mesh"),
                        ((), "no dimension names"), (("tp", "tp"), "repeat")):
        with pytest.raises(LayoutError, match=text):
            check_dims(names)
    check_dims(("pp", "dp_replicate", "fsdp", "tp"))
    assert canonical(("fsdp", "tp")) == ("dp_shard", "tp")


def test_nd_layouts_refuse_a_torch_whose_dtensor_rng_the_replay_cannot_reproduce(monkeypatch) -> None:
    """Before torch 2.9 DTensor's RNG tracker kept its own generator state: the N-D layout refuses by name (this
    torch, and any newer one, is accepted)."""
    import torch

    from sdc_telemetry.parallel import mesh

    mesh.check_torch()  # the torch under test
    mesh.check_torch("2.9.0")
    mesh.check_torch("2.13.0+cu128")
    for old in ("2.8.1", "2.4.0+cu121"):
        with pytest.raises(LayoutError, match=r"torch >= 2\.9, this is " + old.replace("+", r"\+")):
            mesh.check_torch(old)
    monkeypatch.setattr(torch, "__version__", "2.6.0")
    with pytest.raises(LayoutError, match="RNG tracker"):
        mesh.MeshLayout(torch.nn.Linear(2, 2))  # refused before anything else is looked at


def test_one_rank_shard_group_reads_the_input_at_the_second_allocation() -> None:
    """A shard group of one rank: FSDP allocates the reduce-scatter input, copies the local gradients in, then
    allocates the output, and never calls the collective; the wrapper hands over the input at that second
    allocation. An allocation left without its second by a step that raised (an out-of-memory error a trainer
    skipped) does not shift the alternation: the next step's first allocation is an input again."""
    from types import SimpleNamespace

    import torch

    from sdc_telemetry.parallel.fsdp import _OneRankShards

    class Inner:
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.zeros(size, dtype=dtype, device=device)

    generation = [1]
    seen: list[torch.Tensor] = []

    class Wrapper(_OneRankShards):
        def _input(self, input_tensor: torch.Tensor, shards: int) -> None:
            seen.append(input_tensor)

    pg = SimpleNamespace(mesh_info=SimpleNamespace(shard_mesh_size=1))
    w = Wrapper(Inner(), pg, lambda: generation[0])
    cpu = torch.device("cpu")
    first = w.allocate((4,), dtype=torch.float32, device=cpu)
    first.fill_(3.0)  # FSDP's copy-in
    w.allocate((4,), dtype=torch.float32, device=cpu)
    assert len(seen) == 1 and seen[0] is first
    w.allocate((4,), dtype=torch.float32, device=cpu)  # a step that raised before its second allocation
    generation[0] += 1
    fresh = w.allocate((4,), dtype=torch.float32, device=cpu)
    assert len(seen) == 1  # the new step's first allocation is an input, not the stale one's second
    w.allocate((4,), dtype=torch.float32, device=cpu)
    assert len(seen) == 2 and seen[1] is fresh


def test_expert_records_name_the_first_that_differs() -> None:
    """Expert parallelism's rule: four records per MoE layer in forward order (tokens about to be sent, tokens
    received, the experts' output, the results come back), a mark per position the first that differed (+ 1); the
    first that differs on some but not all suspects names those, unless it is a received one (tokens or results:
    the sender is not known); every suspect differing there, none, or tolerance mode narrows nothing. Marks fit an
    int64 at any number of layers."""
    from sdc_telemetry.parallel.experts import ExpertOutputs

    rule = ExpertOutputs.__new__(ExpertOutputs)  # the rule reads ``parts`` and ``names`` only
    rule.parts, rule.names = 8, ["m1.experts", "m2.experts"]
    first = rule.encode
    assert first([False, False, True, True]) == 3 and first([False] * 8) == 0 and first([False] * 99 + [True]) == 100
    assert rule.merge(0, 5) == 5 and rule.merge(7, 3) == 3
    # rank 3's experts in layer 0 (channel 2), then everything downstream: rank 3
    assert rule.narrow((2, 3), {2: 4, 3: 3}, "exact") == ((3,), ("m1.experts", "expert_output"))
    # rank 2's tokens about to be sent to layer 1 (channel 4): rank 2, not the rank whose experts received them
    assert rule.narrow((2, 3), {2: 5, 3: 6}, "exact") == ((2,), ("m2.experts", "tokens_sent"))
    # tokens received or results come back differ first: who sent them is not known
    assert rule.narrow((2, 3), {2: 2, 3: 3}, "exact") == ((2, 3), None)
    assert rule.narrow((2, 3), {2: 4, 3: 5}, "exact") == ((2, 3), None)
    # both differ at their first record, none differs, or tolerance mode: the suspects as they were
    assert rule.narrow((2, 3), {2: 1, 3: 1}, "exact") == ((2, 3), None)
    assert rule.narrow((2, 3), {2: 0, 3: 0}, "exact") == ((2, 3), None)
    assert rule.narrow((2, 3), {2: 4, 3: 3}, "tolerance") == ((2, 3), None)
