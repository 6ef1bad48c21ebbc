"""Who audits whom, and who is to blame: partner choice and attribution from gathered replay outcomes (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Outcome", "Pairing", "attribute", "plan_pairs"]

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


def attribute(outcome: Outcome) -> tuple[tuple[int, ...], dict[str, Any]]:
    """Suspect positions and the reasoning, from mismatching pairs and same-rank reruns.

    - A rank that cannot reproduce its own recorded result is the suspect (a transient fault).
    - Otherwise (persistent): the rank common to every mismatching pair; with 2 replicas, or when no single rank
      explains every pair, the incident is ambiguous and names the candidates.
    """
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
