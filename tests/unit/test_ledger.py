"""The GPU strike ledger on SQLite, and `sdc-telemetry fleet` reading it."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from sdc_telemetry.ops.cli import main
from sdc_telemetry.ops.ledger import Ledger, LedgerError, open_ledger, sqlite_path


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'sub' / 'ledger.sqlite3'}"


def test_strikes_persist_and_count_within_a_window(url: str) -> None:
    """Strikes survive reopening the file; count_strikes counts all or those since a time."""
    with open_ledger(url) as ledger:
        ledger.add_strike("GPU-a", host_name="n1", job="llm", step=7, check="replay", alertname="SDCReplayMismatch",
                          at=100.0)
        ledger.add_strike("GPU-a", host_name="n1", at=200.0)
        ledger.add_strike("GPU-b", host_name="n2", at=150.0)
    with Ledger(url) as ledger:
        assert ledger.count_strikes("GPU-a") == 2
        assert ledger.count_strikes("GPU-a", since=150.0) == 1
        assert ledger.count_strikes("GPU-c") == 0
        first = ledger.strikes("GPU-a")[0]
        assert (first.host_name, first.job, first.step, first.check, first.alertname, first.at) == \
            ("n1", "llm", 7, "replay", "SDCReplayMismatch", 100.0)
        assert [s.hw_id for s in ledger.strikes(since=120)] == ["GPU-b", "GPU-a"]


def test_fleet_sorts_by_strikes_and_a_pass_never_clears_them(url: str) -> None:
    """fleet() lists GPUs with most strikes in the window first; a passing screen is recorded beside the strikes
    and clears none."""
    with Ledger(url) as ledger:
        ledger.add_strike("GPU-b", host_name="n2", at=1000.0)
        for t in (900.0, 950.0):
            ledger.add_strike("GPU-a", host_name="n1", at=t)
        ledger.add_strike("GPU-old", host_name="n3", at=1.0)
        ledger.add_strike("GPU-old", host_name="n3", at=2.0)
        ledger.add_strike("GPU-old", host_name="n3", at=3.0)
        ledger.record_screen(host_name="n1", device="cuda:0", hw_id="GPU-a", passed=True, at=960.0)
        gpus = ledger.fleet(window_s=500, now=1000.0)
        assert [(g.hw_id, g.strikes_in_window, g.strikes) for g in gpus] == \
            [("GPU-a", 2, 2), ("GPU-b", 1, 1), ("GPU-old", 0, 3)]
        assert (gpus[0].screens_passed, gpus[0].last_screen) == (1, "pass")
        assert ledger.count_strikes("GPU-a") == 2
        assert [r.passed for r in ledger.screens("n1")] == [True]


def test_bad_urls_are_refused_naming_the_forms(tmp_path: Path) -> None:
    """Unknown schemes, two-slash SQLite URLs and unreachable PostgreSQL servers raise LedgerError."""
    for bad in ("mysql://x/y", "sqlite://relative.db", "ledger.db", ""):
        with pytest.raises(LedgerError):
            Ledger(bad)
    with pytest.raises(LedgerError, match=r"PostgreSQL|psycopg"):
        Ledger("postgresql://nobody:secret@127.0.0.1:1/none")
    assert sqlite_path("sqlite:////abs/x.db") == Path("/abs/x.db")
    assert sqlite_path("sqlite://") is None


def test_password_is_redacted() -> None:
    """A ledger URL's password never appears in its repr or messages."""
    with pytest.raises(LedgerError) as e:
        Ledger("postgresql://sdc:hunter2@127.0.0.1:1/db")
    assert "hunter2" not in str(e.value)


def test_odd_text_is_stored_without_error(url: str) -> None:
    """Lone surrogates and very long values in a strike are stored (escaped, clipped), never an exception."""
    with Ledger(url) as ledger:
        ledger.add_strike("GPU-\ud800", host_name="n" * 10_000, job="\udcff")
        s = ledger.strikes()[0]
        assert s.hw_id == "GPU-\\ud800" and len(s.host_name) == 512


def test_concurrent_writers_lose_nothing(url: str) -> None:
    """Threads sharing a ledger, and a second connection to the same file, record every strike."""
    with Ledger(url) as a, Ledger(url) as b:
        def write(ledger: Ledger, k: int) -> None:
            for i in range(25):
                ledger.add_strike(f"GPU-{k}", host_name="n", at=float(i))
        threads = [threading.Thread(target=write, args=(a if k % 2 else b, k)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(a.strikes()) == 100


def test_fleet_cli_prints_gpus_by_strikes(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`sdc-telemetry fleet` prints one row per GPU, most strikes first, REPLACE at two in the window; --json too."""
    with Ledger(url) as ledger:
        ledger.add_strike("GPU-b", host_name="n2", alertname="SDCReplayMismatch")
        ledger.add_strike("GPU-a", host_name="n1", alertname="SDCWeightFingerprintMismatch")
        ledger.add_strike("GPU-a", host_name="n1", alertname="SDCWeightFingerprintMismatch")
    assert main(["fleet", "--ledger", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["hw_id", "host_name"]
    assert lines[1].split()[:4] == ["GPU-a", "n1", "2", "2"] and "REPLACE" in lines[1]
    assert lines[2].split()[:4] == ["GPU-b", "n2", "1", "1"] and "watch" in lines[2]
    assert main(["fleet", "--ledger", url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(g["hw_id"], g["strikes_in_window"]) for g in doc] == [("GPU-a", 2), ("GPU-b", 1)]


def test_fleet_cli_empty_and_bad_ledger(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An empty ledger says so (exit 0); a path with no ledger exits 2 and is not created (fleet only reads); a bad
    URL exits 2."""
    Ledger(f"sqlite:///{tmp_path / 'e.db'}").close()
    assert main(["fleet", "--ledger", f"sqlite:///{tmp_path / 'e.db'}"]) == 0
    assert "no GPU recorded" in capsys.readouterr().out
    missing = tmp_path / "sub" / "none.db"
    assert main(["fleet", "--ledger", f"sqlite:///{missing}"]) == 2
    assert "no SQLite ledger at" in capsys.readouterr().err and not missing.parent.exists()
    assert main(["fleet", "--ledger", "nosuch://x"]) == 2
    assert "sqlite:///PATH" in capsys.readouterr().err


def test_fleet_reads_only_escapes_what_it_prints_and_lists_screened_gpus(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """fleet changes nothing in the ledger file (same bytes after), prints control characters from the ledger
    escaped, and lists a GPU whose screen failed although it has no strike yet, with its last screen."""
    path = tmp_path / "l.db"
    with Ledger(f"sqlite:///{path}") as ledger:
        ledger.add_strike("GPU-a", host_name="n1\x1b[31mred", alertname="SDCReplayMismatch")
        ledger.record_screen(host_name="n2", device="cuda:0", hw_id="GPU-s", passed=False, detail="odd")
        ledger.record_screen(host_name="n3", device="cuda:0", hw_id="GPU-ok", passed=True)
    before = path.read_bytes()
    assert main(["fleet", "--ledger", f"sqlite:///{path}"]) == 0
    out = capsys.readouterr().out
    assert path.read_bytes() == before
    assert "\x1b" not in out and "n1\\x1b[31mred" in out
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert set(rows) == {"GPU-a", "GPU-s", "GPU-ok"}
    assert "fail" in rows["GPU-s"] and rows["GPU-s"].rstrip().endswith("watch")
    assert rows["GPU-ok"].rstrip().endswith("ok") and rows["GPU-a"].split()[2:4] == ["1", "1"]


def test_one_alert_is_one_strike_and_counting_leaves_it_out(tmp_path: Path) -> None:
    """The same alert (same alert key) recorded by two responders sharing one ledger is one strike; counting a GPU's
    earlier strikes leaves out the alert at hand; a later alert of the same GPU is a second strike."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    with Ledger(url) as a, Ledger(url) as b:
        assert a.add_strike("GPU-x", host_name="n1", alert_key="fp1@t0") is not None
        assert b.count_strikes("GPU-x", excluding="fp1@t0") == 0  # the peer's strike of this same alert
        assert b.add_strike("GPU-x", host_name="n1", alert_key="fp1@t0") is None
        assert a.count_strikes("GPU-x") == 1
        assert b.add_strike("GPU-x", host_name="n1", alert_key="fp1@t9") is not None
        assert a.count_strikes("GPU-x", excluding="fp1@t9") == 1


def test_a_ledger_from_before_alert_keys_is_migrated(tmp_path: Path) -> None:
    """A ledger file written without the alert_key column gets it (and its unique index) when opened."""
    import sqlite3

    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE sdc_strikes (id INTEGER PRIMARY KEY AUTOINCREMENT, hw_id TEXT NOT NULL, host_name "
                 "TEXT NOT NULL, job TEXT, step BIGINT, check_name TEXT, alertname TEXT, at DOUBLE PRECISION NOT "
                 "NULL)")
    conn.execute("INSERT INTO sdc_strikes (hw_id, host_name, at) VALUES ('GPU-o', 'n', 1.0)")
    conn.commit()
    conn.close()
    with Ledger(f"sqlite:///{path}") as ledger:
        assert ledger.count_strikes("GPU-o") == 1
        assert ledger.add_strike("GPU-o", host_name="n", alert_key="k@1") is not None
        assert ledger.add_strike("GPU-o", host_name="n", alert_key="k@1") is None
        assert [s.alert_key for s in ledger.strikes("GPU-o")] == [None, "k@1"]
