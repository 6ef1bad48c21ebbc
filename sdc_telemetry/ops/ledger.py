"""The GPU ledger: which GPU was suspected when, and how its screens went.

Offline diagnostics miss many GPUs that corrupt data silently, and a GPU that passes every test after a reboot can
fail again weeks later, so a fleet keeps **strikes** per GPU (``hw_id``, the GPU UUID): every alert the responder acts
on is one strike, with the host, the job, the step, the check, the alert and the time. A second strike for the same
GPU within the strike window means "replace it", whatever a screen said in between: screens are recorded next to the
strikes and never clear them.

Two back ends, chosen by URL:

- ``sqlite:///PATH`` (``sqlite:////abs/path`` or ``sqlite:///relative/path``): one file, for one responder. The
  default, under :func:`default_state_dir`.
- ``postgresql://user@host:port/db`` (or ``postgres://``): for several responders that share one ledger. Needs the
  ``postgres`` extra (``pip install 'sdc_telemetry[postgres]'``, psycopg 3).

Python::

    from sdc_telemetry.ops.ledger import open_ledger

    with open_ledger("sqlite:///var/lib/sdc-telemetry/ledger.sqlite3") as ledger:
        ledger.add_strike("GPU-1f2e...", host_name="node-b", job="llm", step=1200, check="weights",
                          alertname="SDCWeightFingerprintMismatch")
        ledger.count_strikes("GPU-1f2e...", since=time.time() - 90 * 86400)   # -> 1
        for gpu in ledger.fleet(window_s=90 * 86400):
            print(gpu.hw_id, gpu.host_name, gpu.strikes_in_window, gpu.strikes)

One alert, one strike: a strike carries the alert's identity (``alert_key``: Alertmanager's fingerprint and the
alert's ``startsAt``), unique per GPU, so that the same alert delivered to several responders sharing one ledger
(Alertmanager in HA sends it to each) is one strike, and counting a GPU's earlier strikes leaves out the alert at hand.

Outages: with ``journal=PATH`` (what the responder gives a PostgreSQL ledger) every strike is first written to a
local SQLite journal (durable on this host) and then to the database; a strike the database cannot take now stays
in the journal and is replayed, idempotently (by its alert key), at the next use of the ledger once the database
answers. Deciding while the database is down uses this responder's own strikes (``count_local_strikes``), so a GPU's
second strike during an outage still runs the replace command. A journal rather than refusing to act: draining a
suspect node must not wait for a shared database.

``read_only=True`` (what ``fleet`` uses) opens an existing ledger without creating or changing anything.

Standard library only for SQLite; nothing here is imported by a training process.
"""

from __future__ import annotations

import logging
import os
import re
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_STRIKE_WINDOW_S", "GPURecord", "Ledger", "LedgerError", "ScreenResult", "Strike",
           "default_ledger_url", "default_state_dir", "open_ledger"]

log = logging.getLogger("sdc_telemetry")

DEFAULT_STRIKE_WINDOW_S = 90 * 86400.0
_MAX_TEXT = 512  # longest text kept per field: a label is data here, but an unbounded one is not
_PG_SCHEMES = ("postgresql://", "postgres://")


class LedgerError(RuntimeError):
    """The ledger cannot be opened or used (bad URL, driver missing, database unreachable)."""


@dataclass(frozen=True)
class Strike:
    """One acted alert against one GPU."""

    hw_id: str
    host_name: str
    at: float                   # Unix time
    job: str | None = None      # service_name of the training job
    step: int | None = None
    check: str | None = None    # the check that named the GPU (weights, replay, grad_local, grad_reduced)
    alertname: str | None = None
    alert_key: str | None = None  # the alert's identity (fingerprint@startsAt): one alert, one strike

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ScreenResult:
    """One device's result in one ``sdc-telemetry screen`` run."""

    host_name: str
    device: str                 # cuda:0, cpu-worker:1 ...
    passed: bool
    at: float
    hw_id: str | None = None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GPURecord:
    """One GPU as ``fleet`` lists it: its strikes (all time and within the window) and its screens."""

    hw_id: str
    host_name: str              # the host of its latest strike (or screen, when it has none)
    strikes: int                # all time
    strikes_in_window: int      # within the strike window: 2 or more means "replace"
    first_strike_at: float | None
    last_strike_at: float | None
    last_alertname: str | None
    screens_passed: int
    screens_failed: int
    last_screen: str | None     # "pass", "fail", or None when never screened
    last_screen_at: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_state_dir() -> Path:
    """Where the responder keeps its ledger and state by default: ``$SDC_STATE_DIR``, else
    ``/var/lib/sdc-telemetry`` when running as root, else ``$XDG_STATE_HOME/sdc-telemetry`` (``~/.local/state``)."""
    env = os.environ.get("SDC_STATE_DIR")
    if env:
        return Path(env)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return Path("/var/lib/sdc-telemetry")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "sdc-telemetry"


def default_ledger_url() -> str:
    """``sqlite:///<default_state_dir()>/ledger.sqlite3``."""
    return f"sqlite:///{default_state_dir() / 'ledger.sqlite3'}"


def sqlite_path(url: str) -> Path | None:
    """The file of a ``sqlite:///PATH`` URL (None for ``sqlite://`` in memory and for other schemes)."""
    if not url.startswith("sqlite://"):
        return None
    rest = url[len("sqlite://"):]
    if rest in ("", "/:memory:", ":memory:"):
        return None
    if not rest.startswith("/"):
        raise LedgerError(f"ledger URL {url!r}: write sqlite:///PATH (three slashes; four for an absolute path)")
    path = rest[1:]
    if not path:
        raise LedgerError(f"ledger URL {url!r} names no file")
    return Path(path)


def _clip(value: object) -> str | None:
    if value is None:
        return None
    text = str(value)
    # Lone surrogates cannot be stored as UTF-8: keep the rest of the value readable.
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text[:_MAX_TEXT]


_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS sdc_strikes (id {serial}, hw_id TEXT NOT NULL, host_name TEXT NOT NULL, "
    "job TEXT, step BIGINT, check_name TEXT, alertname TEXT, at DOUBLE PRECISION NOT NULL, alert_key TEXT)",
    "CREATE INDEX IF NOT EXISTS sdc_strikes_hw_at ON sdc_strikes (hw_id, at)",
    "CREATE TABLE IF NOT EXISTS sdc_screens (id {serial}, host_name TEXT NOT NULL, device TEXT NOT NULL, "
    "hw_id TEXT, passed INTEGER NOT NULL, at DOUBLE PRECISION NOT NULL, detail TEXT)",
    "CREATE INDEX IF NOT EXISTS sdc_screens_hw_at ON sdc_screens (hw_id, at)",
)


class Ledger:
    """Strikes and screens in SQLite or PostgreSQL (see the module docstring). Thread-safe; a context manager.

    ``Ledger(url)`` opens (and creates, for SQLite, with its directory) the database and its tables; a bad URL, a
    missing driver or an unreachable server raise :class:`LedgerError` naming the problem.
    """

    def __init__(self, url: str, *, journal: str | os.PathLike[str] | None = None, read_only: bool = False) -> None:
        if not isinstance(url, str) or not url:
            raise LedgerError(f"ledger URL must be a non-empty string, got {url!r}")
        self.url = url
        self.read_only = read_only
        self._lock = threading.Lock()
        self._pg = url.startswith(_PG_SCHEMES)
        if self._pg:
            self._conn: Any = self._connect_pg()
        elif url.startswith("sqlite://"):
            path = sqlite_path(url)
            try:
                if read_only:
                    if path is None or not path.is_file():
                        raise LedgerError(f"no SQLite ledger at {url!r} (nothing recorded yet, or another path)")
                    self._conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=30.0,
                                                 check_same_thread=False, isolation_level=None)
                else:
                    if path is not None:
                        path.parent.mkdir(parents=True, exist_ok=True)
                    self._conn = sqlite3.connect(str(path) if path is not None else ":memory:", timeout=30.0,
                                                 check_same_thread=False, isolation_level=None)
                    if path is not None:
                        self._conn.execute("PRAGMA journal_mode=WAL")
                self._conn.execute("PRAGMA busy_timeout=30000")
            except (OSError, sqlite3.Error) as e:
                raise LedgerError(f"cannot open the SQLite ledger {url!r}: {e}") from None
        else:
            raise LedgerError(f"ledger URL {url!r}: use sqlite:///PATH or postgresql://USER@HOST:PORT/DB")
        if not read_only:
            serial = "BIGSERIAL PRIMARY KEY" if self._pg else "INTEGER PRIMARY KEY AUTOINCREMENT"
            for stmt in _SCHEMA:
                self._execute(stmt.format(serial=serial))
            self._migrate()
        self._journal = _Journal(Path(journal)) if journal is not None and not read_only else None

    def _migrate(self) -> None:
        """Ledgers written before strikes carried their alert's identity get the column and its unique index."""
        if self._pg:
            self._execute("ALTER TABLE sdc_strikes ADD COLUMN IF NOT EXISTS alert_key TEXT")
        elif "alert_key" not in {r[1] for r in self._execute("PRAGMA table_info(sdc_strikes)")}:
            self._execute("ALTER TABLE sdc_strikes ADD COLUMN alert_key TEXT")
        self._execute("CREATE UNIQUE INDEX IF NOT EXISTS sdc_strikes_alert ON sdc_strikes (hw_id, alert_key)")

    def _connect_pg(self) -> Any:
        try:
            import psycopg
        except ImportError:
            raise LedgerError("a postgresql:// ledger needs psycopg 3: pip install 'sdc_telemetry[postgres]'") \
                from None
        try:
            return psycopg.connect(self.url, autocommit=True, connect_timeout=10)
        except psycopg.Error as e:
            raise LedgerError(f"cannot connect to the PostgreSQL ledger {self.redacted_url}: {e}") from None

    @property
    def redacted_url(self) -> str:
        """The URL with any password replaced by ``***`` (for logs and messages)."""
        return re.sub(r"(://[^/:@]*:)[^@/]*@", r"\1***@", self.url)

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            try:
                self._conn.close()
            except Exception:  # noqa: BLE001, S110 - closing a broken connection has nothing left to do
                pass
            if self._journal is not None:
                self._journal.close()

    def __repr__(self) -> str:
        return f"Ledger({self.redacted_url!r})"

    # -- SQL -------------------------------------------------------------------------------------------------------

    def _execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run one statement (``?`` placeholders) and return its rows; one reconnect for a dropped PostgreSQL
        connection; LedgerError otherwise."""
        if self._pg:
            sql = sql.replace("?", "%s")
        with self._lock:
            for attempt in (0, 1):
                try:
                    cur = self._conn.execute(sql, tuple(params))
                    rows = cur.fetchall() if cur.description is not None else []
                    return [tuple(r) for r in rows]
                except sqlite3.Error as e:
                    raise LedgerError(f"ledger {self.redacted_url}: {e}") from None
                except Exception as e:
                    if not self._pg:
                        raise
                    import psycopg

                    if not isinstance(e, psycopg.Error):
                        raise
                    if attempt == 0 and (isinstance(e, psycopg.OperationalError) or self._conn.closed):
                        try:
                            self._conn.close()
                        except Exception:  # noqa: BLE001, S110 - replaced just below
                            pass
                        try:
                            self._conn = self._connect_pg()
                        except LedgerError:
                            raise LedgerError(f"ledger {self.redacted_url}: {e}") from None
                        continue
                    raise LedgerError(f"ledger {self.redacted_url}: {e}") from None
        raise AssertionError("unreachable")

    # -- strikes ---------------------------------------------------------------------------------------------------

    def add_strike(self, hw_id: str, *, host_name: str, job: str | None = None, step: int | None = None,
                   check: str | None = None, alertname: str | None = None, at: float | None = None,
                   alert_key: str | None = None) -> Strike | None:
        """Record one strike against ``hw_id``; returns it, or None when the ledger already holds this alert's
        strike (``alert_key``: another responder recorded it). With a journal, a strike the database cannot take
        now is kept in the journal (returned, logged by the caller's LedgerError-free path) and replayed later."""
        if not hw_id or not host_name:
            raise ValueError(f"a strike needs a hw_id and a host_name, got {hw_id!r}, {host_name!r}")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise ValueError(f"step must be an int or None, got {step!r}")
        strike = Strike(hw_id=_clip(hw_id) or "", host_name=_clip(host_name) or "",
                        at=float(time.time() if at is None else at), job=_clip(job), step=step, check=_clip(check),
                        alertname=_clip(alertname), alert_key=_clip(alert_key))
        if self._journal is not None:
            if not self._journal.add(strike):
                return None  # this responder already recorded this alert's strike
            try:
                self.replay()
            except LedgerError:
                return strike  # durable in the journal; replayed once the database answers
            return strike if self._journal.inserted(strike) else None
        return strike if self._insert(strike) else None

    def _insert(self, strike: Strike) -> bool:
        """INSERT the strike; False when the ledger already holds the same alert's strike for this GPU."""
        rows = self._execute("INSERT INTO sdc_strikes (hw_id, host_name, job, step, check_name, alertname, at, "
                             "alert_key) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING RETURNING id",
                             (strike.hw_id, strike.host_name, strike.job, strike.step, strike.check,
                              strike.alertname, strike.at, strike.alert_key))
        return bool(rows)

    @property
    def pending(self) -> int:
        """Strikes in the journal that the database has not taken yet."""
        return self._journal.pending() if self._journal is not None else 0

    def replay(self) -> int:
        """Write the journal's pending strikes to the database (idempotent by alert key); how many were replayed.
        LedgerError when the database still cannot take them (they stay pending)."""
        if self._journal is None:
            return 0
        done = 0
        for row_id, strike in self._journal.unsynced():
            self._journal.mark(row_id, inserted=self._insert(strike))
            done += 1
        return done

    def _replayed(self) -> None:
        """Before reading: pending journal strikes go to the database first when it answers (else read anyway)."""
        if self._journal is not None and self._journal.pending():
            try:
                n = self.replay()
            except LedgerError:
                return
            if n:
                log.warning("sdc ledger: replayed %d strike(s) from the journal into %s", n, self.redacted_url)

    def count_local_strikes(self, hw_id: str, *, since: float | None = None,
                            excluding: str | None = None) -> int:
        """This responder's own strikes of ``hw_id`` in its journal (0 without one): what decides while the database
        cannot be read."""
        return self._journal.count(hw_id, since, excluding) if self._journal is not None else 0

    def strikes(self, hw_id: str | None = None, *, since: float | None = None) -> list[Strike]:
        """Strikes, oldest first: all, or of one GPU, or since a Unix time."""
        where: list[str] = []
        params: list[Any] = []
        if hw_id is not None:
            where.append("hw_id = ?")
            params.append(hw_id)
        if since is not None:
            where.append("at >= ?")
            params.append(float(since))
        sql = "SELECT hw_id, host_name, at, job, step, check_name, alertname, alert_key FROM sdc_strikes"
        if where:
            sql += " WHERE " + " AND ".join(where)
        self._replayed()
        rows = self._execute(sql + " ORDER BY at, id", params)
        return [Strike(hw_id=r[0], host_name=r[1], at=float(r[2]), job=r[3], step=None if r[4] is None else int(r[4]),
                       check=r[5], alertname=r[6], alert_key=r[7]) for r in rows]

    def count_strikes(self, hw_id: str, *, since: float | None = None, excluding: str | None = None) -> int:
        """How many strikes ``hw_id`` has (since a Unix time, if given), leaving out the strike of the alert
        ``excluding`` (the alert being acted on: another responder may have recorded it already)."""
        sql, params = _count_sql("sdc_strikes", hw_id, since, excluding)
        self._replayed()
        return int(self._execute(sql, params)[0][0])

    # -- screens ---------------------------------------------------------------------------------------------------

    def record_screen(self, *, host_name: str, device: str, passed: bool, hw_id: str | None = None,
                      detail: str = "", at: float | None = None) -> ScreenResult:
        """Record one device's screen result. A pass never clears a strike."""
        result = ScreenResult(host_name=_clip(host_name) or "", device=_clip(device) or "", passed=bool(passed),
                              at=float(time.time() if at is None else at), hw_id=_clip(hw_id),
                              detail=(_clip(detail) or ""))
        self._execute("INSERT INTO sdc_screens (host_name, device, hw_id, passed, at, detail) "
                      "VALUES (?, ?, ?, ?, ?, ?)",
                      (result.host_name, result.device, result.hw_id, int(result.passed), result.at, result.detail))
        return result

    def screens(self, host_name: str | None = None, *, hw_id: str | None = None) -> list[ScreenResult]:
        """Screen results, oldest first: all, or of one host, or of one GPU."""
        where: list[str] = []
        params: list[Any] = []
        if host_name is not None:
            where.append("host_name = ?")
            params.append(host_name)
        if hw_id is not None:
            where.append("hw_id = ?")
            params.append(hw_id)
        sql = "SELECT host_name, device, passed, at, hw_id, detail FROM sdc_screens"
        if where:
            sql += " WHERE " + " AND ".join(where)
        rows = self._execute(sql + " ORDER BY at, id", params)
        return [ScreenResult(host_name=r[0], device=r[1], passed=bool(r[2]), at=float(r[3]), hw_id=r[4],
                             detail=r[5] or "") for r in rows]

    # -- the fleet -------------------------------------------------------------------------------------------------

    def fleet(self, *, window_s: float = DEFAULT_STRIKE_WINDOW_S, now: float | None = None) -> list[GPURecord]:
        """Every GPU the ledger knows, struck or screened: most strikes in the window first (then all-time, then
        latest strike), then the GPUs without strikes, a failed last screen first."""
        since = (time.time() if now is None else now) - window_s
        by_gpu: dict[str, list[Strike]] = {}
        for s in self.strikes():
            by_gpu.setdefault(s.hw_id, []).append(s)
        screens: dict[str, list[ScreenResult]] = {}
        for r in self.screens():
            if r.hw_id is not None:
                screens.setdefault(r.hw_id, []).append(r)
        out = []
        for hw_id in {*by_gpu, *screens}:
            strikes = by_gpu.get(hw_id, [])
            mine = screens.get(hw_id, [])
            last = mine[-1] if mine else None
            out.append(GPURecord(
                hw_id=hw_id, host_name=strikes[-1].host_name if strikes else mine[-1].host_name,
                strikes=len(strikes), strikes_in_window=sum(1 for s in strikes if s.at >= since),
                first_strike_at=strikes[0].at if strikes else None,
                last_strike_at=strikes[-1].at if strikes else None,
                last_alertname=strikes[-1].alertname if strikes else None,
                screens_passed=sum(1 for r in mine if r.passed), screens_failed=sum(1 for r in mine if not r.passed),
                last_screen=None if last is None else ("pass" if last.passed else "fail"),
                last_screen_at=None if last is None else last.at))
        out.sort(key=lambda g: (-g.strikes_in_window, -g.strikes, -(g.last_strike_at or 0.0),
                                g.last_screen != "fail", g.hw_id))
        return out


def open_ledger(url: str | None = None) -> Ledger:
    """Open the ledger at ``url`` (default: :func:`default_ledger_url`)."""
    return Ledger(url if url is not None else default_ledger_url())


def _count_sql(table: str, hw_id: str, since: float | None, excluding: str | None) -> tuple[str, list[Any]]:
    """A GPU's strikes in ``table`` since a time, leaving out the alert ``excluding``: (SQL, parameters)."""
    sql = f"SELECT COUNT(*) FROM {table} WHERE hw_id = ?"  # noqa: S608 - table is one of two literals here
    params: list[Any] = [hw_id]
    if since is not None:
        sql += " AND at >= ?"
        params.append(float(since))
    if excluding is not None:
        sql += " AND (alert_key IS NULL OR alert_key <> ?)"
        params.append(excluding)
    return sql, params


class _Journal:
    """This responder's strikes in a local SQLite file, each marked once the shared database took it (or already held
    it): durable on this host through a database outage, and what decides while the database is down."""

    def __init__(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(str(path), timeout=30.0, check_same_thread=False, isolation_level=None)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.execute(
                "CREATE TABLE IF NOT EXISTS journal (id INTEGER PRIMARY KEY AUTOINCREMENT, hw_id TEXT NOT NULL, "
                "host_name TEXT NOT NULL, job TEXT, step INTEGER, check_name TEXT, alertname TEXT, at REAL NOT NULL, "
                "alert_key TEXT, synced INTEGER NOT NULL DEFAULT 0, inserted INTEGER NOT NULL DEFAULT 0)")
            self._conn.execute("CREATE UNIQUE INDEX IF NOT EXISTS journal_alert ON journal (hw_id, alert_key)")
        except (OSError, sqlite3.Error) as e:
            raise LedgerError(f"cannot open the strike journal {path}: {e}") from None
        self.path = path
        self._lock = threading.Lock()

    def add(self, s: Strike) -> bool:
        """Keep the strike (durably); False when this alert's strike is already here."""
        with self._lock:
            cur = self._conn.execute(
                "INSERT INTO journal (hw_id, host_name, job, step, check_name, alertname, at, alert_key) VALUES "
                "(?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING RETURNING id",
                (s.hw_id, s.host_name, s.job, s.step, s.check, s.alertname, s.at, s.alert_key))
            return cur.fetchone() is not None

    def unsynced(self) -> list[tuple[int, Strike]]:
        with self._lock:
            rows = self._conn.execute("SELECT id, hw_id, host_name, at, job, step, check_name, alertname, alert_key "
                                      "FROM journal WHERE synced = 0 ORDER BY id").fetchall()
        return [(r[0], Strike(hw_id=r[1], host_name=r[2], at=float(r[3]), job=r[4], step=r[5], check=r[6],
                              alertname=r[7], alert_key=r[8])) for r in rows]

    def mark(self, row_id: int, *, inserted: bool) -> None:
        with self._lock:
            self._conn.execute("UPDATE journal SET synced = 1, inserted = ? WHERE id = ?", (int(inserted), row_id))

    def inserted(self, s: Strike) -> bool:
        """The database took this strike as new (not another responder's record of the same alert)."""
        with self._lock:
            row = self._conn.execute("SELECT inserted FROM journal WHERE hw_id = ? AND alert_key IS ? AND at = ?",
                                     (s.hw_id, s.alert_key, s.at)).fetchone()
        return bool(row and row[0])

    def pending(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM journal WHERE synced = 0").fetchone()[0])

    def count(self, hw_id: str, since: float | None, excluding: str | None) -> int:
        sql, params = _count_sql("journal", hw_id, since, excluding)
        with self._lock:
            return int(self._conn.execute(sql, params).fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()
