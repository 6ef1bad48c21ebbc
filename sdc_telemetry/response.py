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

__all__ = ["Incident", "SDCDetected", "IncidentLog", "INCIDENT_FILE", "EXIT_SDC"]

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


# The process exit code of a rank that stopped on an SDC incident (sysexits' EX_TEMPFAIL: "try again later"), so
# that torchrun, Slurm and Kubernetes can tell a stop on purpose from a crash and restart without the node.
EXIT_SDC = 75


class SDCDetected(RuntimeError):
    """Raised on every rank at the same step when ``on_suspect="raise"`` (at the end of the step's
    ``with monitor.step()`` block, before ``optimizer.step()``); ``.incident`` says what and who.

    Stop recipe::

        try:
            train()
        except sdc.SDCDetected as e:
            monitor.close()                 # returns within seconds; the page was already pushed
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(e.exit_code)           # sdc.EXIT_SDC (75) on every rank

    ``os._exit`` rather than ``sys.exit``: gloo's threads can abort a process during interpreter teardown after
    ``destroy_process_group()``, and the launcher would then report a crash instead of the SDC stop.
    """

    exit_code = EXIT_SDC

    def __init__(self, incident: Incident) -> None:
        super().__init__(incident.describe())
        self.incident = incident


class IncidentLog:
    """Appends the incidents to ``<directory>/incidents.jsonl``: one JSON line when an episode opens
    (``"record": "incident"``) and one at each repeat milestone (``"record": "update"``: count, last step).

    Only the writer rank holds a log (one writer per file). Each line is written with a single ``write`` to a file
    opened ``O_APPEND`` and fsynced. The file only ever holds whole lines: a torn trailing fragment (a crash or a
    full disk during an earlier write) is moved to ``incidents.jsonl.torn-<unix time>`` (kept for forensics) before
    the first append, and a short write is cut back off before the error is raised.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory) / INCIDENT_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        self._finalizer = weakref.finalize(self, os.close, self._fd)  # no leaked descriptor without close()
        self.torn: Path | None = None
        self._repair()

    def append(self, incident: Incident) -> None:
        self._write({"record": "incident", **incident.to_dict()})

    def update(self, incident: Incident) -> None:
        """A repeat milestone of an open episode (identified by its check and opening step)."""
        self._write({"record": "update", "step": incident.step, "check": incident.check,
                     "suspect_ranks": list(incident.suspect_ranks), "count": incident.count,
                     "last_step": incident.last_step, "time_unix": time.time()})

    def close(self) -> None:
        if self._fd is not None:
            self._finalizer()
            self._fd = None

    def _write(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            raise RuntimeError(f"incident log {self.path} is closed")
        line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
        before = os.fstat(self._fd).st_size
        try:
            written = os.write(self._fd, line)
        except OSError:
            self._truncate(before)
            raise
        if written != len(line):  # a short write on a full disk: cut it off so that the file keeps whole lines
            self._truncate(before)
            raise OSError(f"short write to {self.path}: {written} of {len(line)} bytes (removed again)")
        os.fsync(self._fd)

    def _truncate(self, size: int) -> None:
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, size)
        except OSError:
            log.exception("sdc_telemetry: could not cut a partial record off %s", self.path)

    def _repair(self) -> None:
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        if size == 0:
            return
        tail_from = max(0, size - 1)
        if os.pread(self._fd, 1, tail_from) == b"\n":
            return
        # Find the end of the last whole line: everything after it is a torn fragment.
        end, pos, chunk = 0, size, 1 << 16
        while pos > 0:
            start = max(0, pos - chunk)
            data = os.pread(self._fd, pos - start, start)
            cut = data.rfind(b"\n")
            if cut >= 0:
                end = start + cut + 1
                break
            pos = start
        fragment = os.pread(self._fd, size - end, end)
        self.torn = self.path.with_name(f"{INCIDENT_FILE}.torn-{int(time.time())}")
        self.torn.write_bytes(fragment)
        os.ftruncate(self._fd, end)
        os.fsync(self._fd)
        log.warning("sdc_telemetry: %s ended in a torn record (%d bytes, an interrupted write): moved to %s",
                    self.path, len(fragment), self.torn)
