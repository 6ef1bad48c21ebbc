"""The stop path: sdc.exit_on_sdc (exit 75, SIGTERM held back while stopping), the pager's flush before the raise,
and a telemetry close that waits for nothing it was not asked to."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import sdc_telemetry as sdc
from sdc_telemetry.core.config import SDCConfig
from sdc_telemetry.core.identity import RankIdentity
from sdc_telemetry.core.incident import Incident
from sdc_telemetry.sinks import Sinks
from sdc_telemetry.sinks.observer import Observer
from sdc_telemetry.sinks.pager import AlertmanagerPusher
from sdc_telemetry.sinks.telemetry import Telemetry

SUSPECT = RankIdentity(rank=1, local_rank=1, host_name="node-b", hw_id="GPU-1")
INCIDENT = Incident(step=4, check="weights", suspect_ranks=(1,), suspects=(SUSPECT,))


# -- an Alertmanager stand-in ---------------------------------------------------------------------------------------

class _AM(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _AMHandler)
        self.statuses: list[int] = []  # the next answers, then 200
        self.delay_s = 0.0
        self.accepted: list[Any] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _AMHandler(BaseHTTPRequestHandler):
    server: _AM

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(self.server.delay_s)
        status = self.server.statuses.pop(0) if self.server.statuses else 200
        if status == 200:
            self.server.accepted.append(body)
        self.send_response(status)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def am() -> Iterator[_AM]:
    server = _AM()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


# -- the pager's flush ----------------------------------------------------------------------------------------------

def test_flush_returns_once_alertmanager_accepted_the_page(am: _AM) -> None:
    """flush() waits for the post in flight (0.3 s) and returns True once it is accepted; close() is then instant."""
    am.delay_s = 0.3
    pusher = AlertmanagerPusher(am.url, "llm")
    pusher.page(INCIDENT)
    start = time.monotonic()
    assert pusher.flush(timeout_s=5) is True
    assert 0.25 < time.monotonic() - start < 3 and len(am.accepted) == 1
    start = time.monotonic()
    pusher.close()
    assert time.monotonic() - start < 0.1 and pusher.delivered == 1


def test_flush_retries_a_failed_post_without_waiting_out_the_backoff(am: _AM) -> None:
    """Two HTTP 500s and a 30 s backoff: flush() retries every retry_initial_s and returns True on the third post."""
    am.statuses = [500, 500]
    pusher = AlertmanagerPusher(am.url, "llm", retry_initial_s=0.05, retry_max_s=30)
    pusher.page(INCIDENT)
    start = time.monotonic()
    assert pusher.flush(timeout_s=5) is True
    assert time.monotonic() - start < 2 and pusher.failures == 2 and len(am.accepted) == 1
    pusher.close()


def test_flush_is_bounded_and_the_page_stays_queued(am: _AM) -> None:
    """Alertmanager failing: flush(0.3) returns False after about 0.3 s, the page is still pending and retried, and
    it is delivered once Alertmanager recovers."""
    am.statuses = [503] * 1000
    pusher = AlertmanagerPusher(am.url, "llm", retry_initial_s=0.05, retry_max_s=0.1)
    pusher.page(INCIDENT)
    start = time.monotonic()
    assert pusher.flush(timeout_s=0.3) is False
    assert 0.25 < time.monotonic() - start < 1.5 and pusher.pending == 1
    am.statuses = []
    assert pusher.flush(timeout_s=5) is True and len(am.accepted) == 1
    pusher.close()


def test_flush_with_nothing_pending_returns_at_once() -> None:
    """No page queued: flush() is True without a thread or a connection."""
    pusher = AlertmanagerPusher("http://127.0.0.1:9", "llm")
    start = time.monotonic()
    assert pusher.flush() is True and time.monotonic() - start < 0.05 and pusher._thread is None
    pusher.close()


def test_sinks_flush_never_raises_and_counts_the_failure() -> None:
    """A pager whose flush raises: Sinks.flush() logs it, counts an alertmanager internal error, raises nothing."""
    counted: list[str] = []

    class Counting(Observer):
        def internal_error(self, component: str) -> None:
            counted.append(component)

    class Broken:
        def flush(self, timeout_s: float) -> bool:
            raise OSError("disk on fire")

    Sinks(Counting(), pager=Broken()).flush()
    Sinks(Counting()).flush()  # no pager: nothing to do
    assert counted == ["alertmanager"]


# -- telemetry's close ----------------------------------------------------------------------------------------------

def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def _free_port() -> int:
    """A base port whose endpoint port (base + the suspect's local rank, where Telemetry listens) was just free."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1]) - SUSPECT.local_rank


def test_telemetry_close_waits_for_no_scrape_by_default_and_stops_the_endpoint_at_once() -> None:
    """Scraped twice (Prometheus watches), then close() with the default close_scrape_wait_s: it waits for no final
    scrape and stops the endpoint in well under the 0.5 s poll interval of serve_forever."""
    t = Telemetry(SDCConfig(metrics_port=_free_port(), metrics_host="127.0.0.1", nvml=False), SUSPECT)
    assert t.port is not None
    _scrape(t.port)
    _scrape(t.port)
    time.sleep(0.6)  # serve_forever's shutdown() would now wait for its next 0.5 s poll
    start = time.perf_counter()
    t.close()
    took = time.perf_counter() - start
    assert took < 0.1, took
    with pytest.raises(OSError):
        _scrape(t.port)


def test_telemetry_close_still_waits_for_the_final_scrape_when_asked() -> None:
    """close_scrape_wait_s=5 and a scraper every 0.2 s: close() returns once a scrape read sdc_monitor_closed 1."""
    t = Telemetry(SDCConfig(metrics_port=_free_port(), metrics_host="127.0.0.1", nvml=False), SUSPECT,
                  close_scrape_wait_s=5)
    assert t.port is not None
    port = t.port
    seen: list[str] = []
    stop = threading.Event()

    def scraper() -> None:
        while not stop.is_set():
            try:
                seen.append(_scrape(port))
            except OSError:
                return
            time.sleep(0.2)

    thread = threading.Thread(target=scraper, daemon=True)
    thread.start()
    time.sleep(0.5)
    start = time.perf_counter()
    t.close()
    took = time.perf_counter() - start
    stop.set()
    thread.join(5)
    assert 0.0 < took < 1.5, took
    assert any("sdc_monitor_closed{" in s and "} 1.0" in s.split("sdc_monitor_closed{", 1)[1].split("\n", 1)[0]
               for s in seen)


# -- exit_on_sdc ----------------------------------------------------------------------------------------------------

PRELUDE = """
import os, signal, sys, time
import torch
import sdc_telemetry as sdc
from sdc_telemetry.core.identity import RankIdentity

model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
monitor = sdc.SDCMonitor(model, opt, config=sdc.SDCConfig(metrics_port=None, nvml=False, on_suspect="raise",
                                                          replay_every=0))
ME = RankIdentity(0, 0, "node-a", "cpu:node-a:0")
def incident():
    return sdc.Incident(step=3, check="weights", suspect_ranks=(0,), suspects=(ME,))
def train_one():
    batch = torch.randn(2, 4)
    with monitor.step(batch) as s:
        s.backward(model(batch).square().mean())
    opt.step()
    opt.zero_grad()
"""


def _run(body: str, *, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    code = PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def test_sdc_detected_in_a_plain_loop_exits_75_after_closing_the_monitor() -> None:
    """SDCDetected inside the block: exit code 75, one stop line with the close time, nothing after the block runs,
    and the monitor is closed."""
    proc = _run("""
        import atexit
        atexit.register(lambda: print("atexit ran", flush=True))
        with sdc.exit_on_sdc(monitor):
            train_one()
            print("trained", flush=True)
            raise sdc.SDCDetected(incident())
        print("after the block", flush=True)
    """)
    assert proc.returncode == sdc.EXIT_SDC, proc.stderr[-2000:]
    assert "trained" in proc.stdout and "after the block" not in proc.stdout and "atexit ran" not in proc.stdout
    assert "sdc_telemetry: rank 0 stops with exit code 75 (monitor closed in" in proc.stderr
    assert "check=weights step=3" in proc.stderr


def test_normal_end_closes_the_monitor_and_goes_on() -> None:
    """No incident: the block ends normally, the monitor is closed, the code after the block runs, exit 0."""
    proc = _run("""
        with sdc.exit_on_sdc(monitor):
            train_one()
        print("closed", monitor.closed, flush=True)
        print("handler restored", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "closed True" in proc.stdout and "handler restored True" in proc.stdout


def test_another_exception_propagates_and_closes_the_monitor_on_its_exception_path() -> None:
    """A KeyError in the block is raised as is (exit 1, traceback), with the monitor closed and no stop line."""
    proc = _run("""
        try:
            with sdc.exit_on_sdc(monitor):
                train_one()
                raise KeyError("boom")
        except KeyError:
            print("closed", monitor.closed, flush=True)
            raise
    """)
    assert proc.returncode == 1 and "KeyError: 'boom'" in proc.stderr
    assert "closed True" in proc.stdout and "stops with exit code" not in proc.stderr


def test_an_exception_raised_while_sdc_detected_unwound_still_exits_75() -> None:
    """A cleanup that fails while SDCDetected propagates (its __context__ is the SDCDetected): exit 75."""
    proc = _run("""
        with sdc.exit_on_sdc(monitor):
            try:
                raise sdc.SDCDetected(incident())
            finally:
                raise RuntimeError("cleanup failed")
    """)
    assert proc.returncode == sdc.EXIT_SDC, proc.stderr[-2000:]


def test_decorator_form_and_no_monitor() -> None:
    """@sdc.exit_on_sdc() on a function, without a monitor: SDCDetected from it exits 75."""
    proc = _run("""
        @sdc.exit_on_sdc()
        def main():
            raise sdc.SDCDetected(incident())
        main()
        print("after main", flush=True)
    """)
    assert proc.returncode == sdc.EXIT_SDC and "after main" not in proc.stdout, proc.stderr[-2000:]


def test_sigterm_while_stopping_is_held_back_and_the_rank_exits_75() -> None:
    """The monitor has decided to raise (an incident with suspects is open) and is still flushing when the launcher's
    SIGTERM arrives: the rank finishes its stop (the code after the signal runs) and exits 75."""
    proc = _run("""
        with sdc.exit_on_sdc(monitor):
            train_one()
            monitor.incidents.append(incident())      # the episode opened; the page is being flushed
            os.kill(os.getpid(), signal.SIGTERM)      # the first rank exited: torchrun stops the others
            time.sleep(0.2)
            print("flush finished", flush=True)
            raise sdc.SDCDetected(incident())
    """)
    assert proc.returncode == sdc.EXIT_SDC, proc.stderr[-2000:]
    assert "flush finished" in proc.stdout
    assert "signal 15 while stopping on an SDC incident" in proc.stderr


def test_sigterm_while_stopping_exits_75_within_the_grace_even_if_the_stop_hangs() -> None:
    """Held back, but the stop hangs: the rank still exits 75 once STOP_GRACE_S (0.5 s here) has passed."""
    proc = _run("""
        import sdc_telemetry.stop as stop
        stop.STOP_GRACE_S = 0.5
        start = time.monotonic()
        with sdc.exit_on_sdc(monitor):
            monitor.incidents.append(incident())
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
    """)
    assert proc.returncode == sdc.EXIT_SDC, proc.stderr[-2000:]
    assert "did not finish within 0.5s" in proc.stderr


def test_sigterm_when_not_stopping_ends_the_process_as_before() -> None:
    """No SDC stop under way: SIGTERM keeps its default action (killed by signal 15), and a handler installed
    before the block is called instead of it."""
    default = _run("""
        with sdc.exit_on_sdc(monitor):
            train_one()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            print("survived", flush=True)
    """)
    assert default.returncode == -signal.SIGTERM and "survived" not in default.stdout
    chained = _run("""
        signal.signal(signal.SIGTERM, lambda s, f: print("previous handler", s, flush=True))
        with sdc.exit_on_sdc(monitor):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
        print("done", flush=True)
    """)
    assert chained.returncode == 0 and "previous handler 15" in chained.stdout and "done" in chained.stdout


def test_record_mode_incident_does_not_hold_sigterm_back() -> None:
    """on_suspect="record": an open suspect never makes a SIGTERM look like the SDC stop (exit by signal 15)."""
    proc = _run("""
        monitor.config = sdc.SDCConfig(metrics_port=None, nvml=False, on_suspect="record", replay_every=0)
        with sdc.exit_on_sdc(monitor):
            monitor.incidents.append(incident())
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    """)
    assert proc.returncode == -signal.SIGTERM


def test_exit_on_sdc_rejects_what_is_not_a_monitor() -> None:
    """A wrong argument is a TypeError naming what it expects."""
    with pytest.raises(TypeError, match="expected an SDCMonitor"):
        sdc.exit_on_sdc("monitor")
