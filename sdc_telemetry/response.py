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


@dataclass(frozen=True)
class Incident:
    """One verdict of one check at one step, identical on every rank.

    ``evidence`` is JSON-serialisable: the fingerprints or values that disagreed, and the check's reasoning
    (``ambiguous``, ``verdict``...).
    """

    step: int
    check: str
    suspect_ranks: tuple[int, ...]
    suspects: tuple[RankIdentity, ...]
    evidence: dict[str, Any] = field(default_factory=dict)
    time_unix: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "check": self.check,
            "suspect_ranks": list(self.suspect_ranks),
            "suspects": [s.to_dict() for s in self.suspects],
            "evidence": self.evidence,
            "time_unix": self.time_unix,
        }

    def describe(self) -> str:
        """One log line naming check, step, host, rank and GPU of every suspect."""
        who = "; ".join(f"host={s.host_name} rank={s.rank} local_rank={s.local_rank} gpu={s.hw_id}"
                        for s in self.suspects)
        extra = " (ambiguous)" if self.evidence.get("ambiguous") else ""
        verdict = self.evidence.get("verdict")
        what = f" verdict={verdict}" if verdict else ""
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
