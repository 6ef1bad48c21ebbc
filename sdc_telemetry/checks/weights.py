"""``weights``: replicas must hold bit-identical parameters; a majority vote names the odd one out.

Healthy path: one fingerprint pass over every parameter, folded into one position-sensitive digest that travels in
the step's status vector (replicas agree when the group's MIN and MAX digests are equal). Only when they differ is
the per-parameter fingerprint table gathered and voted on (``decide``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from sdc_telemetry.core.collective import agree, collective_device, gather_objects, gather_ragged
from sdc_telemetry.core.evidence import MAX_ITEMS, top
from sdc_telemetry.core.findings import Finding
from sdc_telemetry.core.fingerprint import digest, fingerprint, format_fingerprint
from sdc_telemetry.core.vote import vote

__all__ = ["WeightsCheck", "decide", "state_rows"]

log = logging.getLogger("sdc_telemetry")


def state_rows(name: str, state: dict[Any, Any]) -> list[tuple[str, Any]]:
    """The optimizer state of parameter ``name`` that is fingerprinted, as (label ``name [key]``, key), in a fixed
    order: its tensors (Adam's moments, SGD's momentum), not the scalar step counts."""
    return [(f"{name} [{k}]", k) for k in sorted(state, key=str)
            if isinstance(state[k], torch.Tensor) and state[k].numel() > 1]


class WeightsCheck:
    """Measures this rank's parameter fingerprints; gathers everyone's on disagreement."""

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]], group: dist.ProcessGroup | None,
                 ranks: Sequence[int], classes: Sequence[Hashable] | None = None,
                 local: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        self.names = [n for n, _ in named_params]
        self.labels = list(self.names)  # the last table's rows: the parameters, then their optimizer state
        self._params = [p for _, p in named_params]
        # Optimizer state (Adam's moments, SGD's momentum) is voted with the weights where every replica holds it
        # whole for its parameters: the elementwise optimizers the update audit knows (not a sharded optimizer).
        self._optimizer = optimizer
        self._local = local
        self._group = group
        self._ranks = list(ranks)
        self._classes = list(classes) if classes is not None else None
        self.table: torch.Tensor | None = None  # (P, C) of the last measure()
        self.majority: list[tuple[int, ...]] | None = None  # the majority's rows after a disagreement
        self._pos = self._ranks.index(dist.get_rank()) if dist.is_initialized() else 0
        # The last vote: each class's reference position, the positions off their reference, and the finding.
        self._split: tuple[dict[str, int], set[int], Finding | None] | None = None

    def measure(self) -> torch.Tensor:
        """This rank's fingerprint table (every parameter, then the optimizer state of each, labelled
        ``name [key]``), kept for a later ``gather``; returns its digest (0-d, on device)."""
        local = self._local or (lambda t: t)
        tensors = [local(p) for p in self._params]
        labels = list(self.names)
        if self._optimizer is not None:
            for name, p in zip(self.names, self._params, strict=True):
                state = self._optimizer.state.get(p, {})
                for label, key in state_rows(name, state):
                    tensors.append(local(state[key]))
                    labels.append(label)
        self.labels = labels
        self.table = fingerprint(tensors)
        return digest(self.table)

    def verdict(self, step: int, error_any: bool, error_mine: bool, agree: bool, table: torch.Tensor | None,
                writer: bool) -> tuple[Finding | None, str]:
        """The step's weight verdict and this rank's result, from the agreement (every rank alike).

        While a divergence persists (record mode), every rank's table is gathered again only when the pattern of
        the disagreement changes (``_same_split``: two fixed-size all-reduces), not at every step."""
        if error_any:
            if writer:
                log.warning("sdc_telemetry: step %d: weight check could not run: a rank failed to fingerprint its "
                            "parameters", step)
            return None, "error" if error_mine else "skipped"
        if agree:
            self._split = None
            return None, "pass"
        assert table is not None
        if self._split is not None and self._same_split(table):
            finding = self._split[2]
        else:
            finding = self.gather(table)
        return finding, "fail" if finding is not None else "pass"

    def refereed(self, finding: Finding) -> None:
        """The last vote's finding as the at-rest check settled it (``checks/at_rest.merge``): while the replicas
        keep the same split, later steps repeat this finding (one episode) instead of the vote's own."""
        if self._split is not None:
            self._split = (self._split[0], self._split[1], finding)

    def _names_by_position(self) -> list[list[str]]:
        """Every position's row labels, gathered at each vote (the rare path): pipeline stages hold different
        parameters, optimizer state appears with the first update, and the evidence must name each suspect's own
        tensors, identically on every rank."""
        gathered = gather_objects(list(self.labels), self._group)
        return [[str(n) for n in names] if isinstance(names, list) else [] for names in gathered]

    def _same_split(self, table: torch.Tensor) -> bool:
        """Collective: do the same ranks still disagree with their class's consensus as at the last vote? Each
        class's reference rank (a member of its consensus) contributes its digest, every rank compares its own."""
        assert self._split is not None
        refs, off_before, _ = self._split
        keys = sorted({repr(k) for k in (self._classes or [0] * len(self._ranks))})
        mine = repr(self._classes[self._pos] if self._classes is not None else 0)
        d = int(digest(table).item())
        wire = collective_device(self._group, table.device)
        vec = torch.full((len(keys),), torch.iinfo(torch.int64).min, dtype=torch.int64)
        if refs.get(mine) == self._pos:
            vec[keys.index(mine)] = d
        high, _ = agree(vec.to(wire), self._group)
        off = mine in refs and d != high[keys.index(mine)]
        changed, _ = agree(torch.tensor([int(off != (self._pos in off_before))], dtype=torch.int64, device=wire),
                           self._group)
        return not changed[0]

    def current_majority(self) -> list[tuple[int, ...]] | None:
        """Collective (every rank, when the replicas disagree: agreed): the majority's rows of the last measured
        table, gathered now. The vote's own ``majority`` is that of the step the split began, and the replicas have
        trained on since. The memoised split is left alone (the episode goes on as it was)."""
        assert self.table is not None
        cols = self.table.shape[1]
        rows = gather_ragged(self.table.reshape(-1), self._group)
        tables = [[tuple(r[i * cols:(i + 1) * cols]) for i in range(len(r) // cols)] for r in rows]
        finding = decide(tables, self._ranks, self._names_by_position(), self._classes)
        ref = finding.evidence.get("majority_rank") if finding is not None else None
        self.majority = tables[self._ranks.index(ref)] if isinstance(ref, int) else None
        return self.majority

    def gather(self, table: torch.Tensor) -> Finding | None:
        """Rare path (digests differ): gather every rank's ``table`` (of the step being decided) and vote, within
        numerics classes."""
        cols = table.shape[1]
        rows = gather_ragged(table.reshape(-1), self._group)
        names = self._names_by_position()
        tables = [[tuple(r[i * cols:(i + 1) * cols]) for i in range(len(r) // cols)] for r in rows]
        finding = decide(tables, self._ranks, names, self._classes)
        ref = finding.evidence.get("majority_rank") if finding is not None else None
        self.majority = tables[self._ranks.index(ref)] if isinstance(ref, int) else None
        refs, off = _split_of(tables, self._classes)
        self._split = (refs, off, finding)
        return finding


def _split_of(tables: Sequence[Sequence[Sequence[int]]], classes: Sequence[Hashable] | None
              ) -> tuple[dict[str, int], set[int]]:
    """How the ranks split at a vote: a reference position per class of two or more members (the first of its
    largest group of identical tables) and the positions whose table differs from their class's reference."""
    groups: dict[str, list[int]] = {}
    for pos in range(len(tables)):
        groups.setdefault(repr(classes[pos] if classes is not None else 0), []).append(pos)
    refs: dict[str, int] = {}
    off: set[int] = set()
    for key, members in groups.items():
        if len(members) < 2:
            continue
        same: dict[tuple[tuple[int, ...], ...], list[int]] = {}
        for p in members:
            same.setdefault(tuple(tuple(row) for row in tables[p]), []).append(p)
        ref = max(same.values(), key=len)[0]
        refs[key] = ref
        off |= {p for p in members if tables[p] != tables[ref]}
    return refs, off


def decide(tables: Sequence[Sequence[Sequence[int]]], ranks: Sequence[int],
           names: Sequence[str] | Sequence[Sequence[str]], classes: Sequence[Hashable] | None = None
           ) -> Finding | None:
    """Vote on per-rank parameter fingerprints (``tables[i][p]``: the fingerprint row of rank position i's parameter p).

    ``classes`` (numerics signatures by position): replicas on different hardware or software may legitimately
    round differently, so only ranks of the same class are compared; a rank alone in its class is not voted on.
    Evidence names the differing parameters and fingerprints, bounded in size at any world size. ``names``: the
    parameter names (the same on every rank), or each position's own (pipeline stages).
    """
    by_pos: Sequence[Sequence[str]] = ([names] * len(tables)  # type: ignore[list-item]
                                       if not names or isinstance(names[0], str) else names)  # type: ignore[assignment]
    groups: dict[Hashable, list[int]] = {}
    for pos in range(len(tables)):
        groups.setdefault(classes[pos] if classes is not None else 0, []).append(pos)
    suspects: list[int] = []
    ambiguous = False
    differing: dict[int, tuple[int, ...]] = {}
    reference: int | None = None
    for members in groups.values():
        if len(members) < 2:
            continue
        v = vote([tables[p] for p in members])
        if v.agreed:
            continue
        suspects += [members[s] for s in v.suspects]
        ambiguous = ambiguous or v.ambiguous
        differing.update({members[s]: cols for s, cols in v.differing.items()})
        if v.reference is not None and reference is None:
            reference = members[v.reference]
    if not suspects:
        return None
    suspects.sort()
    shown = suspects[:MAX_ITEMS]
    evidence: dict[str, object] = {
        "ambiguous": ambiguous,
        "suspect_count": len(suspects),
        "differing_parameters": {str(ranks[p]): [by_pos[p][c] for c in differing[p][:MAX_ITEMS]] for p in shown},
        "differing_parameter_count": {str(ranks[p]): len(differing[p]) for p in shown},
        "fingerprints": {str(ranks[p]): top({by_pos[p][c]: format_fingerprint(tables[p][c]) for c in differing[p]})
                         for p in shown},
    }
    if reference is not None:
        cols = sorted({c for p in shown for c in differing[p][:MAX_ITEMS]})[:MAX_ITEMS]
        evidence["majority_rank"] = ranks[reference]
        evidence["majority_fingerprints"] = {by_pos[reference][c]: format_fingerprint(tables[reference][c])
                                             for c in cols}
    return Finding("weights", tuple(ranks[p] for p in suspects), evidence)
