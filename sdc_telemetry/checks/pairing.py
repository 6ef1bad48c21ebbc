"""Who audits whom, and who is to blame: partner choice and attribution from gathered replay outcomes (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Outcome", "Pairing", "ClassPairing", "ReplicaPairing", "attribute", "plan_pairs", "plan_replica_pairs"]

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

    alone: tuple[int, ...] = ()  # every position has partners (see ClassPairing)

    def origin(self, pos: int, shift: int) -> int:
        """The position whose micro-batches ``pos`` replays."""
        return self.order[(self.index[pos] + shift) % len(self.order)]

    def replayer(self, pos: int, shift: int) -> int:
        """The position that replays ``pos``'s micro-batches."""
        return self.order[(self.index[pos] - shift) % len(self.order)]


def plan_pairs(hosts: Sequence[str], classes: Sequence[int] | None = None) -> Pairing | ClassPairing:
    """Pair every rank with a rank on another host where possible, in O(W log W); with ``classes`` (a numerics class
    per position: device model, software stack, kernel settings) only within a class (``ClassPairing``).

    Ranks are interleaved round-robin across hosts (the first rank of every host, then the second ...), so a shift
    along that order crosses hosts for every rank unless it is a multiple of the host count (equal host sizes).
    At most ``_MAX_CANDIDATES`` shifts are examined; those crossing hosts for the most ranks are kept, in order.

    >>> p = plan_pairs(["a", "a", "b", "b"])
    >>> [p.origin(pos, p.shifts[0]) for pos in range(4)]
    [2, 3, 1, 0]
    """
    if classes is not None and len(set(classes)) > 1:
        return ClassPairing.plan(hosts, classes)
    return _plan(hosts)


def _plan(hosts: Sequence[str]) -> Pairing:
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
class ClassPairing:
    """Partners within numerics classes (ranks whose GPUs, software stacks or kernel settings differ compute
    different bits, and draw different dropout masks: a CUDA generator's stream depends on the SM count). Each class
    of two or more positions rotates through its own host-interleaved ``Pairing``; a position alone in its class
    replays itself (a rerun: it can show a transient fault, not a persistent one) and is listed in ``alone``.

    The rotation is by index: ``shifts`` are ``1..R`` and index ``s`` selects the ``s``-th shift of every class
    (cyclically), so that a referee round with another index meets another partner wherever the class has one.

    >>> p = plan_pairs(["a", "b", "a", "b", "c"], classes=[7, 7, 9, 9, 9])
    >>> [p.origin(pos, 1) for pos in range(5)], p.alone
    ([1, 0, 3, 4, 2], ())
    >>> plan_pairs(["a", "b", "c"], classes=[7, 7, 9]).alone
    (2,)
    """

    members: tuple[tuple[int, ...], ...]   # class -> its positions
    pairings: tuple[Pairing, ...]          # class -> pairing over its members (by index into ``members``)
    class_of: tuple[int, ...]              # position -> class
    local: tuple[int, ...]                 # position -> index among its class's members
    shifts: tuple[int, ...]

    @classmethod
    def plan(cls, hosts: Sequence[str], classes: Sequence[int]) -> ClassPairing:
        grouped: dict[int, list[int]] = {}  # in order of first appearance
        for p, c in enumerate(classes):
            grouped.setdefault(c, []).append(p)
        members = tuple(tuple(m) for m in grouped.values())
        pairings = tuple(_plan([hosts[p] for p in m]) for m in members)
        class_of, local = [0] * len(hosts), [0] * len(hosts)
        for c, m in enumerate(members):
            for i, p in enumerate(m):
                class_of[p], local[p] = c, i
        rotation = max(1, max(len(pr.shifts) for pr in pairings))
        return cls(members, pairings, tuple(class_of), tuple(local), tuple(range(1, rotation + 1)))

    @property
    def alone(self) -> tuple[int, ...]:
        """Positions alone in their numerics class: no partner computes the same bits, so replay cannot audit them."""
        return tuple(m[0] for m in self.members if len(m) == 1)

    def _move(self, pos: int, index: int, forward: bool) -> int:
        c = self.class_of[pos]
        pairing = self.pairings[c]
        if not pairing.shifts:
            return pos
        shift = pairing.shifts[(index - 1) % len(pairing.shifts)]
        i = pairing.origin(self.local[pos], shift) if forward else pairing.replayer(self.local[pos], shift)
        return self.members[c][i]

    def origin(self, pos: int, shift: int) -> int:
        return self._move(pos, shift, True)

    def replayer(self, pos: int, shift: int) -> int:
        return self._move(pos, shift, False)


@dataclass(frozen=True)
class ReplicaPairing:
    """Pairs of replicas lifted to positions: where several ranks compute one micro-batch together (tensor, context
    or pipeline parallelism), the replica at order index ``i`` replays the replica at ``i + s``, and each position
    replays the position of the same slot (coordinate) in that replica."""

    replicas: Pairing | ClassPairing       # over replica indices
    replica_of: tuple[int, ...]            # position -> replica index
    slot_of: tuple[int, ...]               # position -> slot within its replica
    at: dict[tuple[int, int], int]         # (replica, slot) -> position

    @property
    def shifts(self) -> tuple[int, ...]:
        return self.replicas.shifts

    @property
    def alone(self) -> tuple[int, ...]:
        """Positions of replicas alone in their numerics class."""
        return tuple(p for p, r in enumerate(self.replica_of) if r in self.replicas.alone)

    def origin(self, pos: int, shift: int) -> int:
        return self.at[(self.replicas.origin(self.replica_of[pos], shift), self.slot_of[pos])]

    def replayer(self, pos: int, shift: int) -> int:
        return self.at[(self.replicas.replayer(self.replica_of[pos], shift), self.slot_of[pos])]


def plan_replica_pairs(hosts: Sequence[str], replica_of: Sequence[int], slot_of: Sequence[int],
                       classes: Sequence[int] | None = None) -> ReplicaPairing:
    """``plan_pairs`` over replicas, a replica standing for the set of hosts its ranks run on: a replica is paired
    with one on other hosts where possible, so that no coordinate is checked by a rank of the same host. With
    ``classes`` (per position), a replica's numerics class is the set of its ranks' classes, and replicas pair within
    a class.

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
    kinds: list[set[int]] = [set() for _ in range(count)]
    for pos, r in enumerate(replica_of):
        per[r].add(hosts[pos])
        kinds[r].add(classes[pos] if classes is not None else 0)
    keys: dict[tuple[int, ...], int] = {}
    replica_classes = [keys.setdefault(tuple(sorted(k)), len(keys)) for k in kinds]
    return ReplicaPairing(plan_pairs(["+".join(sorted(h)) for h in per], replica_classes), tuple(replica_of),
                          tuple(slot_of), at)


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
