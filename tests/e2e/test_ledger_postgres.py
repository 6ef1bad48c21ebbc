"""The GPU ledger on a real PostgreSQL server that the test starts (initdb/pg_ctl in a temp dir, as a non-root
user), used by the ``Ledger`` API, by ``sdc-telemetry respond`` (a second strike runs the replace command) and by
``sdc-telemetry fleet``."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sdc_telemetry.ops.ledger import Ledger
from sdc_telemetry.ops.respond import Responder
from tests._responder import TOKEN, alert, metric, notification, post, recorder_template, request, runs
from tests.e2e.test_respond import responder_process

pytestmark = pytest.mark.e2e


def _missing(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: a missing binary is a failure)")
    pytest.skip(reason)


def _pg_bin(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)),
                                       None)
    if found is None:
        _missing(f"no PostgreSQL {name} on PATH or in /usr/lib/postgresql/*/bin (Debian package postgresql)")
    assert found is not None
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_as() -> tuple[str | None, int | None, int | None]:
    """PostgreSQL refuses to run as root: run it as ``nobody`` (created if absent) when the tests are root."""
    if os.geteuid() != 0:
        return None, None, None
    try:
        pw = pwd.getpwnam("nobody")
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "nobody"],
                       check=True)
        pw = pwd.getpwnam("nobody")
    return pw.pw_name, pw.pw_uid, pw.pw_gid


_SERVER: dict[str, Any] = {}  # stop() and start() of the module's server, for the outage test


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    """A PostgreSQL server on a free 127.0.0.1 port, data in a temp dir, stopped afterwards: yields its URL."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        _missing("psycopg is not installed (pip install -e '.[postgres]')")
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    user, uid, gid = _run_as()
    root = Path(tempfile.mkdtemp(prefix="sdc-pg-"))
    data, log = root / "data", root / "pg.log"
    if uid is not None and gid is not None:
        os.chown(root, uid, gid)
    kw: dict[str, object] = {"user": uid, "group": gid} if uid is not None else {}
    port = _free_port()
    env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
    try:
        subprocess.run([initdb, "-D", str(data), "-U", "sdc", "--auth=trust", "-E", "UTF8", "--no-sync"],
                       check=True, capture_output=True, cwd=root, env=env, timeout=120, **kw)  # type: ignore[arg-type]
        opts = f"-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={root} -c fsync=off"
        subprocess.run([pg_ctl, "-D", str(data), "-l", str(log), "-o", opts, "-w", "-t", "60", "start"],
                       check=True, capture_output=True, cwd=root, env=env, timeout=90, **kw)  # type: ignore[arg-type]
    except subprocess.CalledProcessError as e:
        text = log.read_text() if log.exists() else ""
        shutil.rmtree(root, ignore_errors=True)
        raise AssertionError(f"PostgreSQL did not start (as {user}): {e.stderr.decode()} {text}") from None
    def ctl(*cmd: str) -> None:
        subprocess.run([pg_ctl, "-D", str(data), "-l", str(log), *cmd], check=True, capture_output=True, cwd=root,
                       env=env, timeout=90, **kw)  # type: ignore[arg-type]

    _SERVER.update(stop=lambda: ctl("-m", "fast", "-w", "stop"),
                   start=lambda: ctl("-o", opts, "-w", "-t", "60", "start"))
    try:
        yield f"postgresql://sdc@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([pg_ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True, cwd=root,
                       env=env, timeout=60, **kw)  # type: ignore[arg-type]
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def pg_ledger(postgres_url: str) -> Iterator[Ledger]:
    with Ledger(postgres_url) as ledger:
        ledger._execute("DELETE FROM sdc_strikes")
        ledger._execute("DELETE FROM sdc_screens")
        yield ledger


def test_postgres_ledger_records_counts_and_lists(pg_ledger: Ledger, postgres_url: str) -> None:
    """On PostgreSQL strikes and screens are recorded, counted within a window and listed by strikes, and a second
    connection (another responder) sees them."""
    pg_ledger.add_strike("GPU-a", host_name="n1", job="llm", step=12, check="weights",
                         alertname="SDCWeightFingerprintMismatch", at=100.0)
    pg_ledger.add_strike("GPU-a", host_name="n1", at=200.0)
    pg_ledger.add_strike("GPU-b", host_name="n2", at=190.0)
    pg_ledger.record_screen(host_name="n1", device="cuda:0", hw_id="GPU-a", passed=True, at=210.0)
    with Ledger(postgres_url) as other:
        assert other.count_strikes("GPU-a") == 2
        assert other.count_strikes("GPU-a", since=150.0) == 1
        first = other.strikes("GPU-a")[0]
        assert (first.job, first.step, first.check, first.at) == ("llm", 12, "weights", 100.0)
        gpus = other.fleet(window_s=1000, now=250.0)
    assert [(g.hw_id, g.strikes_in_window, g.screens_passed) for g in gpus] == [("GPU-a", 2, 1), ("GPU-b", 1, 0)]


def test_postgres_ledger_reconnects_after_the_connection_drops(pg_ledger: Ledger) -> None:
    """A connection the server terminated is replaced on the next call."""
    pg_ledger.add_strike("GPU-r", host_name="n", at=1.0)
    with Ledger(pg_ledger.url) as admin:
        admin._execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
                       "AND datname = current_database()")
    time.sleep(0.2)
    assert pg_ledger.count_strikes("GPU-r") == 1


def test_responder_on_postgres_runs_replace_on_second_strike(pg_ledger: Ledger, postgres_url: str,
                                                            tmp_path: Path) -> None:
    """Two responders sharing a PostgreSQL ledger: the GPU's first strike (on one) drains, its second (on the other,
    another host after a move) runs --replace-command; `fleet --ledger postgresql://...` lists it."""
    replace, replaced = recorder_template(tmp_path, "replaced", " replace {host_name} {hw_id}")
    args = ("--ledger", postgres_url, "--replace-command", replace)
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    with responder_process(one, *args) as (url, out1):
        assert post(url, notification(alert("node-b", hw_id="GPU-pg")))[1]["acted"] == ["node-b"]
    with responder_process(two, *args) as (url, out2):
        outcome = post(url, notification(alert("node-c", hw_id="GPU-pg")))[1]
        assert outcome["replaced"] == ["node-c"]
        text = request(url, "GET", "/metrics")[1]
    assert [r[0] for r in runs(out1)] == ["node-b"] and runs(out2) == []
    assert runs(replaced) == [["replace", "node-c", "GPU-pg"]]
    assert metric(text, "sdc_fleet_gpu_strikes", hw_id="GPU-pg", host_name="node-c") == 2
    assert pg_ledger.count_strikes("GPU-pg") == 2
    fleet = subprocess.run([sys.executable, "-m", "sdc_telemetry.ops.cli", "fleet", "--ledger", postgres_url],
                           capture_output=True, text=True, check=True, timeout=60)
    assert fleet.stdout.splitlines()[1].split()[:4] == ["GPU-pg", "node-c", "2", "2"]


def test_no_strike_is_lost_while_postgres_is_down(pg_ledger: Ledger, postgres_url: str, tmp_path: Path) -> None:
    """The server stops mid-run: a GPU's second alert during the outage still runs the replace command (decided from
    the responder's journal) and its strike, kept in the journal, reaches the database once it is back."""
    replace, replaced = recorder_template(tmp_path, "replaced", " replace {host_name} {hw_id}")
    drain, drained = recorder_template(tmp_path, "drained", " drain {host_name} {hw_id}")
    journal = tmp_path / "state.journal.sqlite3"
    with Ledger(postgres_url, journal=journal) as ledger, \
            Responder(drain, ledger=ledger, replace_command=replace, bearer_token=TOKEN) as r:
        assert post(r.url, notification(alert("node-o", hw_id="GPU-o")))[1]["acted"] == ["node-o"]
        _SERVER["stop"]()
        try:
            during = alert("node-p", hw_id="GPU-o", starts_at="2024-01-05T00:00:00Z")
            assert post(r.url, notification(during))[1]["replaced"] == ["node-p"]
            assert ledger.pending == 1
        finally:
            _SERVER["start"]()
        assert ledger.count_strikes("GPU-o") == 2 and ledger.pending == 0  # replayed on the first use
    assert runs(drained) == [["drain", "node-o", "GPU-o"]] and runs(replaced) == [["replace", "node-p", "GPU-o"]]
    assert [s.host_name for s in pg_ledger.strikes("GPU-o")] == ["node-o", "node-p"]
