"""``weights``: replicas must hold bit-identical parameters; a majority vote names the odd one out.

One fingerprint pass over every parameter, one all-gather of a row of int64 per rank, one host sync.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .._collective import gather_rows
from ..fingerprint import fingerprint
from . import Finding
from .vote import vote

__all__ = ["WeightsCheck", "decide"]

log = logging.getLogger("sdc_telemetry")

_MAX_NAMES = 32  # evidence stays small enough for one log line and one JSONL record


class WeightsCheck:
    """Measures this rank's parameter fingerprints and gathers everyone's."""

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]], group: dist.ProcessGroup | None,
                 ranks: Sequence[int]) -> None:
        self.names = [n for n, _ in named_params]
        self._params = [p for _, p in named_params]
        self._group = group
        self._ranks = list(ranks)

    def measure(self) -> torch.Tensor:
        return fingerprint(self._params).squeeze(1) if self._params else torch.zeros(0, dtype=torch.int64)

    def run(self) -> tuple[Finding | None, list[int]]:
        """Measure, gather every rank's fingerprints and vote. Returns the finding and the ranks that could not
        measure (a software failure is reported as such, never voted on as if it were corruption)."""
        try:
            fps = self.measure()
            row = torch.cat([torch.zeros(1, dtype=torch.int64, device=fps.device), fps])
        except Exception:  # contained and logged; the collective must still run on this rank
            log.exception("sdc_telemetry: fingerprinting parameters failed (rank %d)", dist.get_rank())
            row = torch.zeros(len(self._params) + 1, dtype=torch.int64)
            row[0] = 1
        rows = gather_rows(row, self._group)
        failed = [self._ranks[i] for i, r in enumerate(rows) if r[0]]
        if failed:
            return None, failed
        return decide([r[1:] for r in rows], self._ranks, self.names), []


def decide(rows: Sequence[Sequence[int]], ranks: Sequence[int], names: Sequence[str]) -> Finding | None:
    """Vote on per-rank parameter fingerprints; evidence names the parameters and fingerprints that differ."""
    v = vote(rows)
    if v.agreed:
        return None
    differing: dict[str, list[str]] = {}
    fingerprints: dict[str, dict[str, str]] = {}
    for pos, all_cols in v.differing.items():
        shown = all_cols[:_MAX_NAMES]
        differing[str(ranks[pos])] = [names[c] for c in shown]
        fingerprints[str(ranks[pos])] = {names[c]: f"{rows[pos][c] & (2**64 - 1):016x}" for c in shown}
    evidence: dict[str, object] = {
        "ambiguous": v.ambiguous,
        "differing_parameters": differing,
        "differing_parameter_count": {str(ranks[p]): len(c) for p, c in v.differing.items()},
        "fingerprints": fingerprints,
    }
    if v.reference is not None:
        cols = sorted({c for cs in v.differing.values() for c in cs[:_MAX_NAMES]})
        evidence["majority_rank"] = ranks[v.reference]
        evidence["majority_fingerprints"] = {names[c]: f"{rows[v.reference][c] & (2**64 - 1):016x}" for c in cols}
    return Finding("weights", tuple(ranks[p] for p in v.suspects), evidence)
