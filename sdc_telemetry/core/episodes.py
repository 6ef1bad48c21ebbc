"""One fault, one incident: repeated findings of a check naming the same suspects update an open episode.

An episode of a check stays open while each run of that check finds the same suspects (or, for a numerics event,
non-finite values again); a run that passes closes it, and a later finding opens a new incident. Runs that could not
reach a verdict (error, skipped) leave it as it is. Pure bookkeeping, identical on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence

from sdc_telemetry.core.findings import CHECKS, Finding
from sdc_telemetry.core.identity import RankIdentity
from sdc_telemetry.core.incident import Incident

__all__ = ["Episodes", "milestone"]

log = logging.getLogger("sdc_telemetry")

MAX_INCIDENTS = 1000


def milestone(count: int) -> bool:
    """Repeat counts worth telling again (log line, JSONL update, re-page): 10, 100, 1000, ..."""
    return count >= 10 and str(count).rstrip("0") == "1"


class Episodes:
    """The open episode of each check, and the incident list they are appended to (bounded)."""

    def __init__(self, incidents: list[Incident], max_incidents: int = MAX_INCIDENTS) -> None:
        self.incidents = incidents
        self._max = max_incidents
        self._open: dict[str, tuple[tuple[tuple[int, ...], bool], Incident]] = {}
        self.dropped = 0
        self.closed: list[Incident] = []  # the episodes the last observe() ended (a pass, or another finding)

    def current(self, check: str) -> Incident | None:
        """The open episode of ``check``, if any."""
        entry = self._open.get(check)
        return entry[1] if entry else None

    def open_hardware(self) -> list[Incident]:
        """Open episodes that name a hardware suspect (numerics events excluded)."""
        return [inc for _, inc in self._open.values() if inc.suspect_ranks and not inc.numerics]

    def observe(self, step: int, findings: Sequence[Finding], passed: Collection[str],
                identify: Callable[[tuple[int, ...]], tuple[RankIdentity, ...]]
                ) -> tuple[list[Incident], list[Incident]]:
        """Fold one hook point's findings in. Returns (incidents opened, episodes that reached a milestone).

        ``passed``: the checks that passed on every rank (decided from data every rank shares). A rank-local pass
        must not close an episode: the ranks' episodes, and the collectives that follow a new incident, would
        diverge."""
        opened: list[Incident] = []
        repeated: list[Incident] = []
        self.closed = []
        by_check = {f.check: f for f in findings}
        for check in CHECKS:
            finding = by_check.get(check)
            if finding is None:
                if check in passed and (ended := self._open.pop(check, None)) is not None:
                    self.closed.append(ended[1])
                continue
            key = (finding.suspect_ranks, finding.evidence.get("verdict") in ("numerics", "data"))
            entry = self._open.get(check)
            if entry is not None and entry[0] == key:
                incident = entry[1]
                incident.count += 1
                incident.last_step = step
                if milestone(incident.count):
                    repeated.append(incident)
                continue
            if entry is not None:
                self.closed.append(entry[1])  # another finding of this check ends the episode it replaces
            incident = Incident(step=step, check=check, suspect_ranks=finding.suspect_ranks,
                                suspects=identify(finding.suspect_ranks), evidence=dict(finding.evidence))
            self._open[check] = (key, incident)
            opened.append(incident)
            self._append(incident)
        return opened, repeated

    def _append(self, incident: Incident) -> None:
        if len(self.incidents) >= self._max:
            del self.incidents[0]
            if not self.dropped:
                log.warning("sdc_telemetry: more than %d incidents: the oldest are dropped from monitor.incidents "
                            "(the incident log keeps them)", self._max)
            self.dropped += 1
        self.incidents.append(incident)
