"""``weights``, verdict ``at_rest``: a rank's own parameters and optimizer state did not change between the update
and the next weight check.

Where no other rank holds a tensor (FSDP2 on a 1-D mesh, ``dp_replicate=1``, sharded optimizers) the weight vote has
nothing to compare; with two replicas it cannot say which is wrong. Memory that changes at rest is seen by the rank
itself: right after the optimizer's update that precedes a weight check (its step post-hook), the rank fingerprints
its local shards of the parameters the optimizer updates and their optimizer state (Adam's moments, ...); at the
weight check it fingerprints them again (the parameters' rows come from the vote's table where there is one) and a
difference names that rank, unambiguously. Nothing but the optimizer's step may change them in between: code that
does (an EMA written into the weights, a manual clamp, a reload) calls ``SDCMonitor.weights_changed()``.

Healthy path: one more fingerprint read of the local parameters and optimizer state (after the update) per weight
check, and one field in the step's status vector; at the check it reuses the vote's table (which holds the
optimizer state too where replicas hold it), or reads them once where there is no vote. Only when the flag is up
anywhere does every rank gather what changed (``decide``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sdc_telemetry.checks.weights import state_rows
from sdc_telemetry.core.evidence import MAX_ITEMS, top
from sdc_telemetry.core.findings import Finding
from sdc_telemetry.core.fingerprint import fingerprint, format_fingerprint

__all__ = ["AtRestCheck", "Compared", "decide", "merge", "refereed_by_update"]


@dataclass(frozen=True)
class Compared:
    """One weight check's comparison on this rank, kept until the verdict is read (one step later with deferred
    verdicts, when the reference has moved on)."""

    labels: tuple[str, ...]
    reference: torch.Tensor   # (T, C) fingerprints right after the update
    now: torch.Tensor         # (T, C) fingerprints at the weight check
    since_step: int           # the step whose update the reference follows

    def changed(self) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
        """(label, fingerprint after the update, fingerprint now) of every tensor that changed (host sync: the rare
        path only)."""
        diff = (self.reference != self.now).any(dim=1).nonzero().flatten().tolist()
        ref, now = self.reference.tolist(), self.now.tolist()
        return [(self.labels[i], tuple(ref[i]), tuple(now[i])) for i in diff]


class AtRestCheck:
    """This rank's reference fingerprints after an update, and the comparison at the next weight check.

    ``names``/``params``: the module's parameters in the weight check's order (its table's rows); ``optimizer``: the
    optimizer whose step is the only thing that may change them; ``local``: this rank's share of a tensor."""

    def __init__(self, names: Sequence[str], params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer,
                 local: Callable[[torch.Tensor], torch.Tensor], *, table_rows: bool = True) -> None:
        self._names = list(names)
        self._params = list(params)
        self._row = {id(p): i for i, p in enumerate(self._params)}
        self._optimizer = optimizer
        self._local = local
        self._device = self._params[0].device
        self._reference: tuple[tuple[str, ...], torch.Tensor, torch.Tensor | None, int] | None = None
        self._rows: torch.Tensor | None = None  # the tracked parameters' rows in the weight check's table
        # ``params`` are the weight check's table rows (the module's parameters); False: the optimizer's own copies
        # (a ZeRO optimizer's fp32 partitions), read here and never taken from the table.
        self._table_rows = table_rows
        self._stepped: list[int] = []  # the rows of the reference

    def _tracked(self) -> tuple[list[int], list[tuple[str, torch.Tensor]]]:
        """The table rows of the parameters the optimizer updates, and their optimizer state tensors (labelled
        ``name [key]``), in a fixed order."""
        rows = sorted({self._row[id(p)] for g in self._optimizer.param_groups for p in g["params"]
                       if id(p) in self._row})
        return rows, self._state(rows)

    def _state(self, rows: Sequence[int]) -> list[tuple[str, torch.Tensor]]:
        state = []
        for r in rows:
            values = self._optimizer.state.get(self._params[r], {})
            state += [(label, self._local(values[key])) for label, key in state_rows(self._names[r], values)]
        return state

    def after_update(self, step: int) -> None:
        """The reference: fingerprints of the tracked parameters and their state, right after the update. Called
        again in the same step while the optimizer shows only some of its parameter groups (a ZeRO optimizer steps
        them one at a time), the reference covers every group stepped so far."""
        earlier = self._stepped if self._reference is not None and self._reference[3] == step else []
        self._reference = None
        rows, state = self._tracked()
        if earlier:
            rows = sorted(set(rows) | set(earlier))
            state = self._state(rows)
        self._stepped = rows
        if not rows:
            return
        params = fingerprint([self._local(self._params[r]) for r in rows])
        states = fingerprint([t for _, t in state]) if state else None
        labels = tuple([self._names[r] for r in rows] + [label for label, _ in state])
        self._reference = (labels, params, states, step)
        self._rows = torch.tensor(rows, dtype=torch.long, device=params.device)

    def forget(self) -> None:
        """The weights changed on purpose (or the update was not seen): no comparison until the next update."""
        self._reference = None

    def measure(self, table: torch.Tensor | None, table_labels: Sequence[str] | None = None
                ) -> tuple[torch.Tensor, Compared | None]:
        """The 0-d status (0: nothing compared, 1: unchanged, 2: something changed at rest on this rank; no host
        synchronisation) and the comparison.
        ``table``: the weight check's fingerprint table, when it made one, and ``table_labels`` its rows (the parameters
        first, then the optimizer state it votes on): the rows it holds are reused, not read again."""
        if self._reference is None:
            return torch.zeros((), dtype=torch.int64, device=self._device), None
        labels, ref_params, ref_states, since = self._reference
        # The reference's parameters (a ZeRO-3 optimizer shows none of them between its steps), their state now
        rows = self._stepped
        state = self._state(rows)
        if tuple([self._names[r] for r in rows] + [label for label, _ in state]) != labels:
            self._reference = None  # the optimizer's parameters or state changed shape: nothing comparable
            return torch.zeros((), dtype=torch.int64, device=self._device), None
        assert self._rows is not None
        if not self._table_rows:
            table = None
        now_params = table.index_select(0, self._rows.to(table.device)) if table is not None \
            else fingerprint([self._local(self._params[r]) for r in rows])
        parts_ref, parts_now = [ref_params], [now_params]
        if ref_states is not None:
            parts_ref.append(ref_states)
            where = {label: i for i, label in enumerate(table_labels)} \
                if table is not None and table_labels is not None else {}
            rows_now = [where.get(label) for label, _ in state]
            if table is not None and rows_now and all(r is not None for r in rows_now):
                parts_now.append(table.index_select(0, torch.tensor(rows_now, dtype=torch.long, device=table.device)))
            else:
                parts_now.append(fingerprint([t for _, t in state]))
        reference, now = torch.cat(parts_ref), torch.cat(parts_now)
        flag = (reference != now).any().to(torch.int64) + 1
        return flag, Compared(labels, reference, now, since)


def decide(mine: Compared | None, gather: Callable[[object], list[object]], ranks: Sequence[int]) -> Finding | None:
    """Collective (every rank, when any rank's flag is up): what changed at rest, on which ranks."""
    changed = mine.changed() if mine is not None else []
    report = None
    if changed:
        assert mine is not None
        report = {"count": len(changed), "since_step": mine.since_step,
                  "changed": [(label, format_fingerprint(ref), format_fingerprint(now))
                              for label, ref, now in changed[:MAX_ITEMS]]}
    reports = gather(report)
    suspects = [(ranks[pos], r) for pos, r in enumerate(reports) if isinstance(r, dict)]
    if not suspects:
        return None
    shown = suspects[:MAX_ITEMS]
    evidence: dict[str, object] = {
        "verdict": "at_rest",
        "ambiguous": False,
        "suspect_count": len(suspects),
        "since_step": min(int(r["since_step"]) for _, r in suspects),
        "differing_parameters": {str(rank): [c[0] for c in r["changed"]] for rank, r in shown},
        "differing_parameter_count": {str(rank): int(r["count"]) for rank, r in shown},
        "fingerprints": {str(rank): top({c[0]: c[2] for c in r["changed"]}) for rank, r in shown},
        "fingerprints_after_update": {str(rank): top({c[0]: c[1] for c in r["changed"]}) for rank, r in shown},
    }
    return Finding("weights", tuple(rank for rank, _ in suspects), evidence)


def merge(at_rest: Finding, vote: Finding | None) -> Finding:
    """One weights finding from both: the ranks whose memory changed at rest are named; the vote's unambiguous
    suspects are added (a wrong update that at-rest cannot see); an ambiguous vote (two replicas) is refereed."""
    if vote is None:
        return at_rest
    suspects = set(at_rest.suspect_ranks)
    if not vote.evidence.get("ambiguous"):
        suspects |= set(vote.suspect_ranks)
    evidence = dict(at_rest.evidence)
    evidence["suspect_count"] = len(suspects)
    evidence["vote"] = {k: vote.evidence[k] for k in ("ambiguous", "suspect_count", "differing_parameters",
                                                      "majority_rank") if k in vote.evidence}
    evidence["vote"]["suspect_ranks"] = list(vote.suspect_ranks[:MAX_ITEMS])
    return Finding("weights", tuple(sorted(suspects)), evidence)


def refereed_by_update(vote: Finding, update: Finding) -> Finding:
    """A vote that cannot name a rank (two replicas), settled by the update audit of the same step: the replicas'
    weights split because one rank applied a wrong update, which the audit named unambiguously."""
    evidence = {k: v for k, v in vote.evidence.items() if k not in ("ambiguous", "suspect_count")}
    evidence.update({"verdict": "update", "ambiguous": False, "suspect_count": len(update.suspect_ranks),
                     "vote": {"ambiguous": True, "suspect_ranks": list(vote.suspect_ranks[:MAX_ITEMS])},
                     "update_step": update.evidence.get("update_step")})
    return Finding("weights", tuple(update.suspect_ranks), evidence)
