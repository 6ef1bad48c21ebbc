"""The incident log: ``<incident_dir>/incidents.jsonl``, one JSON line per episode opened and per repeat milestone."""

from __future__ import annotations

import json
import logging
import os
import time
import weakref
from pathlib import Path
from typing import Any

from sdc_telemetry.core.incident import Incident

__all__ = ["IncidentLog", "INCIDENT_FILE"]

log = logging.getLogger("sdc_telemetry")

INCIDENT_FILE = "incidents.jsonl"


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
