"""Who audits whom, and who is to blame: partner choice and attribution from gathered replay outcomes (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Outcome", "attribute", "pick_shifts"]


@dataclass
class Outcome:
    """Gathered outcomes of one audit, by group position: the plain input of ``attribute``."""

    world: int
    edges: list[tuple[int, int]] = field(default_factory=list)  # (replayer, origin) pairs that mismatched
    reproduced: dict[int, bool] = field(default_factory=dict)   # origin position -> reran its own batch identically


def pick_shifts(hosts: Sequence[str]) -> list[int]:
    """Shifts s (replayer p audits p + s) in rotation order: those pairing every rank with another host first."""
    world = len(hosts)

    def crossing(s: int) -> int:
        return sum(hosts[p] != hosts[(p + s) % world] for p in range(world))

    shifts = list(range(1, world))
    best = max((crossing(s) for s in shifts), default=0)
    preferred = [s for s in shifts if crossing(s) == best]
    return preferred if best > 0 else shifts


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
