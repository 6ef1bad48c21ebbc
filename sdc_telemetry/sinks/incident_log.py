"""The incident log: ``<incident_dir>/incidents.jsonl``, one JSON line per episode opened and per repeat milestone."""

from __future__ import annotations

import errno
import fcntl
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

    Safe with concurrent writers (several jobs, or a restarted job next to a stale one, sharing the directory): every
    append, and the repair of a torn tail, runs under an exclusive advisory lock on the file (``fcntl.flock``), so a
    line is written whole (a single ``write`` to a file opened ``O_APPEND``, then fsynced) before another process
    looks at the end of the file. The file only ever holds whole lines: a torn trailing fragment (a writer that
    crashed or hit a full disk mid-record) is moved to a side file ``incidents.jsonl.torn-<time_ns>-<pid>`` (unique,
    kept for forensics) before the next append, and only under the lock, so a record another process is still
    writing is never taken for one. A failed write (``OSError``: a full disk, a short write, a failed fsync) is cut
    back off and retried ``attempts`` times in all with a short backoff (``backoff_s``, doubling, the lock released
    meanwhile); when every attempt failed the error is raised (the monitor logs it and counts it in
    ``sdc_internal_errors_total{component="incident_log"}``) and the record is kept, in order, for later: the next
    write, ``retry()`` (which the monitor calls at each step while records are held, at most every ``retry_s``
    seconds) and ``close()`` write the held records first, once the disk takes them again. At most ``MAX_HELD``
    records are held (the oldest is dropped beyond, with an error line): a record is never lost silently.
    """

    MAX_HELD = 1000

    def __init__(self, directory: str | os.PathLike[str], *, attempts: int = 4, backoff_s: float = 0.02,
                 retry_s: float = 5.0) -> None:
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ValueError(f"attempts must be an int >= 1, got {attempts!r}")
        if not isinstance(backoff_s, (int, float)) or not 0 <= backoff_s <= 1:
            raise ValueError(f"backoff_s must be a number of seconds in [0, 1], got {backoff_s!r}")
        self.path = Path(directory) / INCIDENT_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.attempts = attempts
        self.backoff_s = float(backoff_s)
        self.retry_s = float(retry_s)
        self.held: list[bytes] = []  # records not written yet (every attempt failed), oldest first
        self._next_retry = 0.0
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        self._finalizer = weakref.finalize(self, os.close, self._fd)  # no leaked descriptor without close()
        self.torn: Path | None = None  # the side file of the last repair, if any
        try:
            with self._locked():
                self._repair()
        except BaseException:
            self.close()
            raise

    def append(self, incident: Incident) -> None:
        self._write({"record": "incident", **incident.to_dict()})

    def update(self, incident: Incident) -> None:
        """A repeat milestone of an open episode (identified by its check and opening step)."""
        self._write({"record": "update", "step": incident.step, "check": incident.check,
                     "suspect_ranks": list(incident.suspect_ranks), "count": incident.count,
                     "last_step": incident.last_step, "time_unix": time.time()})

    def retry(self) -> None:
        """Write the held records if the disk takes them now (one attempt, at most every ``retry_s``). Cheap when
        nothing is held; raises nothing (a failure waits for the next retry)."""
        if not self.held or self._fd is None or time.monotonic() < self._next_retry:
            return
        self._next_retry = time.monotonic() + self.retry_s
        try:
            self._drain()
        except OSError as e:
            log.debug("sdc_telemetry: %d record(s) for %s still held: %s", len(self.held), self.path, e)
            return
        log.warning("sdc_telemetry: wrote the record(s) held after a failed write to %s", self.path)

    def close(self) -> None:
        if self._fd is not None and self.held:
            try:
                self._drain()
            except OSError as e:
                log.error("sdc_telemetry: %d incident record(s) could not be written to %s before closing: %s",
                          len(self.held), self.path, e.strerror or e)
        if self._fd is not None:
            self._finalizer()
            self._fd = None

    # -- writing -------------------------------------------------------------------------------------------------

    def _write(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            raise RuntimeError(f"incident log {self.path} is closed")
        line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
        self.held.append(line)  # written after the records held before it: the file keeps their order
        if len(self.held) > self.MAX_HELD:
            del self.held[0]
            log.error("sdc_telemetry: more than %d incident records held for %s: the oldest is dropped",
                      self.MAX_HELD, self.path)
        for attempt in range(1, self.attempts + 1):
            try:
                self._drain()
                return
            except OSError as e:
                if attempt == self.attempts:
                    self._next_retry = time.monotonic() + self.retry_s
                    raise OSError(e.errno, f"writing a record to {self.path} failed {self.attempts} times, the last: "
                                           f"{e.strerror or e}; {len(self.held)} record(s) held and written once "
                                           "the disk takes them") from e
                log.warning("sdc_telemetry: writing a record to %s failed (%s); retrying (%d of %d)", self.path,
                            e.strerror or e, attempt + 1, self.attempts)
                time.sleep(self.backoff_s * 2 ** (attempt - 1))

    def _drain(self) -> None:
        """Write the held records in order (lock held for the whole batch); each is removed once written."""
        with self._locked():
            self._repair()  # a writer that crashed mid-record since: our line starts on a line of its own
            while self.held:
                self._write_line(self.held[0])
                del self.held[0]

    def _write_line(self, line: bytes) -> None:
        """Append ``line`` whole (lock held): on any error the file is cut back to where it was."""
        assert self._fd is not None
        before = os.fstat(self._fd).st_size
        try:
            written = os.write(self._fd, line)
            if written != len(line):  # a short write on a full disk: cut it off so that the file keeps whole lines
                raise OSError(errno.ENOSPC, f"short write: {written} of {len(line)} bytes (removed again)")
            os.fsync(self._fd)
        except OSError:
            self._truncate(before)
            raise

    def _truncate(self, size: int) -> None:
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, size)
        except OSError:
            log.exception("sdc_telemetry: could not cut a partial record off %s", self.path)

    def _locked(self) -> _Lock:
        assert self._fd is not None
        return _Lock(self._fd)

    # -- repair --------------------------------------------------------------------------------------------------

    def _repair(self) -> None:
        """Move a torn trailing fragment aside (lock held: no live writer is in the middle of a record)."""
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        if size == 0 or os.pread(self._fd, 1, size - 1) == b"\n":
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
        torn = self._side_file(fragment)
        os.ftruncate(self._fd, end)
        os.fsync(self._fd)
        self.torn = torn
        log.warning("sdc_telemetry: %s ended in a torn record (%d bytes, an interrupted write): moved to %s",
                    self.path, len(fragment), torn)

    def _side_file(self, fragment: bytes) -> Path:
        """Write ``fragment`` durably to a new side file whose name no other repair uses."""
        for n in range(100):
            suffix = f"-{n}" if n else ""
            path = self.path.with_name(f"{INCIDENT_FILE}.torn-{time.time_ns()}-{os.getpid()}{suffix}")
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue
            try:
                view = memoryview(fragment)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            return path
        raise OSError(errno.EEXIST, f"no unused side file name for a torn record of {self.path}")


class _Lock:
    """An exclusive ``flock`` on the incident file for the duration of a ``with`` block."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
