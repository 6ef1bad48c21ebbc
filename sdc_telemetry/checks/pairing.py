"""Who audits whom, and who is to blame: partner choice and attribution from gathered replay outcomes (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Outcome", "Pairing", "ReplicaPairing", "attribute", "plan_pairs", "plan_replica_pairs"]

_MAX_SHIFTS = 16       # shifts kept in the rotation
_MAX_CANDIDATES = 64   # shifts examined (each costs O(W)): set-up stays O(W log W) at any world size


@dataclass
class Outcome:
    """Gathered outcomes of one audit, by group position: the plain input of ``attribute``."""

    world: int
    edges: list[tuple[int, int]] = field(default_factory=list)  # (replayer, origin) pairs that mismatched
    reproduced: dict[int, bool] = field(default_factory=dict)   # origin position -> reran its own batch identically


@dataclass(frozen=True)
class Pairing:
    """Positions in a host-interleaved order, and the shifts along that order to rotate through.

    With shift ``s``, the rank at order index ``i`` replays the rank at index ``i + s`` (mod W)."""

    order: tuple[int, ...]   # order index -> group position
    index: tuple[int, ...]   # group position -> order index
    shifts: tuple[int, ...]

    def origin(self, pos: int, shift: int) -> int:
        """The position whose micro-batches ``pos`` replays."""
        return self.order[(self.index[pos] + shift) % len(self.order)]

    def replayer(self, pos: int, shift: int) -> int:
        """The position that replays ``pos``'s micro-batches."""
        return self.order[(self.index[pos] - shift) % len(self.order)]


def plan_pairs(hosts: Sequence[str]) -> Pairing:
    """Pair every rank with a rank on another host where possible, in O(W log W).

    Ranks are interleaved round-robin across hosts (the first rank of every host, then the second ...), so a shift
    along that order crosses hosts for every rank unless it is a multiple of the host count (equal host sizes).
    At most ``_MAX_CANDIDATES`` shifts are examined; those crossing hosts for the most ranks are kept, in order.

    >>> p = plan_pairs(["a", "a", "b", "b"])
    >>> [p.origin(pos, p.shifts[0]) for pos in range(4)]
    [2, 3, 1, 0]
    """
    world = len(hosts)
    by_host: dict[str, list[int]] = {}
    for pos, h in enumerate(hosts):
        by_host.setdefault(h, []).append(pos)
    groups = sorted(by_host.values(), key=lambda g: g[0])
    order: list[int] = []
    for i in range(max((len(g) for g in groups), default=0)):
        order += [g[i] for g in groups if i < len(g)]
    index = [0] * world
    for i, pos in enumerate(order):
        index[pos] = i
    if world < 2:
        return Pairing(tuple(order), tuple(index), ())

    def crossing(s: int) -> int:
        return sum(hosts[order[i]] != hosts[order[(i + s) % world]] for i in range(world))

    scored = [(crossing(s), s) for s in range(1, min(world, _MAX_CANDIDATES + 1))]
    best = max(c for c, _ in scored)
    shifts = [s for c, s in scored if c == best][:_MAX_SHIFTS]
    return Pairing(tuple(order), tuple(index), tuple(shifts))


@dataclass(frozen=True)
class ReplicaPairing:
    """Pairs of replicas lifted to positions: where several ranks compute one micro-batch together (tensor, context
    or pipeline parallelism), the replica at order index ``i`` replays the replica at ``i + s``, and each position
    replays the position of the same slot (coordinate) in that replica."""

    replicas: Pairing                      # over replica indices
    replica_of: tuple[int, ...]            # position -> replica index
    slot_of: tuple[int, ...]               # position -> slot within its replica
    at: dict[tuple[int, int], int]         # (replica, slot) -> position

    @property
    def shifts(self) -> tuple[int, ...]:
        return self.replicas.shifts

    def origin(self, pos: int, shift: int) -> int:
        return self.at[(self.replicas.origin(self.replica_of[pos], shift), self.slot_of[pos])]

    def replayer(self, pos: int, shift: int) -> int:
        return self.at[(self.replicas.replayer(self.replica_of[pos], shift), self.slot_of[pos])]


def plan_replica_pairs(hosts: Sequence[str], replica_of: Sequence[int], slot_of: Sequence[int]) -> ReplicaPairing:
    """``plan_pairs`` over replicas, a replica standing for the set of hosts its ranks run on: a replica is paired
    with one on other hosts where possible, so that no coordinate is checked by a rank of the same host.

    >>> p = plan_replica_pairs(["a", "a", "b", "b"], [0, 0, 1, 1], [0, 1, 0, 1])
    >>> [p.origin(pos, p.shifts[0]) for pos in range(4)]
    [2, 3, 0, 1]
    """
    at = {(r, s): p for p, (r, s) in enumerate(zip(replica_of, slot_of, strict=True))}
    count = max(replica_of, default=-1) + 1
    slots = [{s for r, s in at if r == i} for i in range(count)]
    if len(at) != len(replica_of) or any(sl != slots[0] for sl in slots):
        raise ValueError("every replica must hold the same coordinates, each on one rank")
    per: list[set[str]] = [set() for _ in range(count)]
    for pos, r in enumerate(replica_of):
        per[r].add(hosts[pos])
    return ReplicaPairing(plan_pairs(["+".join(sorted(h)) for h in per]), tuple(replica_of), tuple(slot_of), at)


def attribute(outcome: Outcome, replica_of: Sequence[int] | None = None) -> tuple[tuple[int, ...], dict[str, Any]]:
    """Suspect positions and the reasoning, from mismatching pairs and same-rank reruns.

    - A rank that cannot reproduce its own recorded result is the suspect (a transient fault).
    - Otherwise (persistent): the rank common to every mismatching pair; with 2 replicas, or when no single rank
      explains every pair, the incident is ambiguous and names the candidates.

    ``replica_of`` (N-D layouts): positions belong to replicas that compute a micro-batch together, and a fault on
    one coordinate spreads to the others through the replica's collectives, so the reasoning runs on replicas; the
    suspects are the positions of the suspect replica whose own comparisons mismatched (or did not reproduce).
    """
    if replica_of is not None:
        return _attribute_replicas(outcome, replica_of)
    not_reproduced = sorted(p for p, ok in outcome.reproduced.items() if not ok)
    if 2 * len(not_reproduced) > outcome.world:
        return (), {"fault": "unfaithful", "ambiguous": True,
                    "reason": "most ranks cannot reproduce their own step: the replay itself is not faithful"}
    if not_reproduced:
        return tuple(not_reproduced), {"fault": "transient", "ambiguous": False,
                                       "reason": "could not reproduce its own recorded result"}
    if not outcome.edges:
        return (), {}
    common = set(outcome.edges[0])
    for e in outcome.edges[1:]:
        common &= set(e)
    if len(common) == 1:
        return (common.pop(),), {"fault": "persistent", "ambiguous": False,
                                 "reason": "the only rank common to every mismatching pair"}
    counts: dict[int, int] = {}
    for e in outcome.edges:
        for p in e:
            counts[p] = counts.get(p, 0) + 1
    top = max(counts.values())
    names = tuple(sorted(p for p, c in counts.items() if c == top)) if not common else tuple(sorted(common))
    reason = ("two replicas disagree and each reproduces itself: no referee" if outcome.world == 2
              else "no single rank explains every mismatching pair")
    return names, {"fault": "persistent", "ambiguous": True, "reason": reason}


def _attribute_replicas(outcome: Outcome, replica_of: Sequence[int]) -> tuple[tuple[int, ...], dict[str, Any]]:
    count = max(replica_of, default=-1) + 1
    edges = sorted({(replica_of[a], replica_of[b]) for a, b in outcome.edges})
    reproduced: dict[int, bool] = {}
    for p, ok in outcome.reproduced.items():
        reproduced[replica_of[p]] = reproduced.get(replica_of[p], True) and ok
    names, why = attribute(Outcome(count, edges, reproduced))
    if not names or why.get("fault") == "unfaithful":
        return (), why
    suspects = set(names)
    if why.get("fault") == "transient":
        chosen = [p for p, ok in outcome.reproduced.items() if not ok and replica_of[p] in suspects]
    else:
        chosen = [p for e in outcome.edges for p in e if replica_of[p] in suspects]
    return tuple(sorted(set(chosen))), why
