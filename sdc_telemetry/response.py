"""Incidents and what happens to them: kept, logged once, appended to a JSONL file, raised when configured."""

from __future__ import annotations

import json
import logging
import os
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .identity import RankIdentity

__all__ = ["Incident", "SDCDetected", "IncidentLog", "INCIDENT_FILE"]

log = logging.getLogger("sdc_telemetry")

INCIDENT_FILE = "incidents.jsonl"


@dataclass
class Incident:
    """One episode of one check: opened at ``step``, identical on every rank.

    ``evidence`` is JSON-serialisable and bounded in size: the fingerprints or values that disagreed, and the check's
    reasoning (``ambiguous``, ``verdict``...). ``evidence["verdict"] == "numerics"`` with no suspects is a numerics
    event (every rank non-finite at once: overflow, a bad batch, divergence), never a hardware suspect.

    One fault is one incident: while later steps find the same check naming the same suspects, the episode is
    updated (``count`` findings so far, ``last_step``) instead of a new incident being opened.
    """

    step: int
    check: str
    suspect_ranks: tuple[int, ...]
    suspects: tuple[RankIdentity, ...]
    evidence: dict[str, Any] = field(default_factory=dict)
    time_unix: float = field(default_factory=time.time)
    count: int = 1
    last_step: int = -1

    def __post_init__(self) -> None:
        if self.last_step < 0:
            self.last_step = self.step

    @property
    def numerics(self) -> bool:
        """Every rank non-finite at once: recorded and counted, never raised or paged as a node."""
        return not self.suspect_ranks and self.evidence.get("verdict") == "numerics"

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "check": self.check,
            "suspect_ranks": list(self.suspect_ranks),
            "suspects": [s.to_dict() for s in self.suspects],
            "evidence": self.evidence,
            "time_unix": self.time_unix,
            "count": self.count,
            "last_step": self.last_step,
        }

    def describe(self) -> str:
        """One log line naming check, step, host, rank and GPU of every suspect."""
        who = "; ".join(f"host={s.host_name} rank={s.rank} local_rank={s.local_rank} gpu={s.hw_id}"
                        for s in self.suspects)
        extra = " (ambiguous)" if self.evidence.get("ambiguous") else ""
        verdict = self.evidence.get("verdict")
        what = f" verdict={verdict}" if verdict else ""
        if self.numerics:
            return (f"SDC numerics event: check={self.check} step={self.step}: non-finite gradients on every rank "
                    "(overflow, a bad batch or divergence; not a hardware suspect)")
        return f"SDC incident: check={self.check} step={self.step}{what} suspects{extra}: {who}"


class SDCDetected(RuntimeError):
    """Raised on every rank at the same step when ``on_suspect="raise"``; ``.incident`` says what and who."""

    def __init__(self, incident: Incident) -> None:
        super().__init__(incident.describe())
        self.incident = incident


class IncidentLog:
    """Appends one JSON line per incident to ``<directory>/incidents.jsonl``.

    Only the writer rank holds a log (one writer per file). Each line is written with a single ``write`` to a file
    opened ``O_APPEND`` and fsynced, so a process that dies leaves complete lines only.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory) / INCIDENT_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._finalizer = weakref.finalize(self, os.close, self._fd)  # no leaked descriptor without close()

    def append(self, incident: Incident) -> None:
        if self._fd is None:
            raise RuntimeError(f"incident log {self.path} is closed")
        line = (json.dumps(incident.to_dict(), sort_keys=True, default=str) + "\n").encode()
        written = os.write(self._fd, line)
        if written != len(line):  # a short write on a full disk: say so rather than leave half a line unnoticed
            raise OSError(f"short write to {self.path}: {written} of {len(line)} bytes")
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            self._finalizer()
            self._fd = None
