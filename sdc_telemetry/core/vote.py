"""Majority vote over per-rank fingerprint rows: who disagrees with the replicas' consensus."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["Vote", "vote"]


@dataclass(frozen=True)
class Vote:
    """Outcome of comparing one row per rank (row i belongs to position i of the group).

    - ``suspects``: positions that disagree with the strict majority; without a strict majority, the positions
      outside a unique largest group, or every position when there is no unique largest group.
    - ``ambiguous``: True when no strict majority exists (1-1 ties, 2-2 splits, all different).
    - ``reference``: the position whose row is the consensus (or the unique plurality), else None.
    - ``differing``: for each suspect, the column indices where its row differs from the reference row (or, with no
      reference, from the first other position's row).
    """

    suspects: tuple[int, ...]
    ambiguous: bool
    reference: int | None
    differing: dict[int, tuple[int, ...]]

    @property
    def agreed(self) -> bool:
        return not self.suspects


def vote(rows: Sequence[Sequence[Hashable]]) -> Vote:
    """Vote on rows of fingerprints.

    >>> vote([[1, 2], [1, 2], [1, 3]]).suspects
    (2,)
    >>> v = vote([[1], [2]]); (v.suspects, v.ambiguous)
    ((0, 1), True)
    """
    if not rows:
        raise ValueError("vote needs at least one row")
    keys = [tuple(r) for r in rows]
    groups: dict[tuple[Hashable, ...], list[int]] = {}
    for pos, key in enumerate(keys):
        groups.setdefault(key, []).append(pos)
    if len(groups) == 1:
        return Vote(suspects=(), ambiguous=False, reference=0, differing={})
    ranked = sorted(groups.values(), key=len, reverse=True)
    largest = ranked[0]
    unique_largest = len(ranked) == 1 or len(ranked[1]) < len(largest)
    majority = 2 * len(largest) > len(rows)
    if unique_largest and len(largest) > 1:
        reference: int | None = largest[0]
        suspects = tuple(p for p in range(len(rows)) if p not in largest)
    else:
        reference = None
        suspects = tuple(range(len(rows)))
    differing: dict[int, tuple[int, ...]] = {}
    for pos in suspects:
        other = reference if reference is not None else next(p for p in range(len(rows)) if keys[p] != keys[pos])
        differing[pos] = tuple(i for i, (a, b) in enumerate(zip(keys[pos], keys[other], strict=True)) if a != b)
    return Vote(suspects=suspects, ambiguous=not majority, reference=reference, differing=differing)
