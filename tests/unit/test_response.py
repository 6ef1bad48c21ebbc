"""Incidents: one log line, JSON lines that stay valid, SDCDetected carrying the incident."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import sdc_telemetry.sinks.incident_log as incident_log
from sdc_telemetry import Incident, RankIdentity, SDCDetected
from sdc_telemetry.sinks.incident_log import IncidentLog


def _incident(step: int = 4) -> Incident:
    who = RankIdentity(rank=2, local_rank=0, host_name="node-b", hw_id="GPU-1234")
    return Incident(step=step, check="weights", suspect_ranks=(2,), suspects=(who,),
                    evidence={"differing_parameters": {"2": ["fc.weight"]}, "ambiguous": False})


def test_describe_names_check_step_host_rank_gpu() -> None:
    """The log line names everything on-call needs."""
    line = _incident().describe()
    for part in ("check=weights", "step=4", "host=node-b", "rank=2", "gpu=GPU-1234"):
        assert part in line


def test_incident_log_appends_complete_json_lines(tmp_path: Path) -> None:
    """Each append is one full JSON line; reopening appends after the existing lines."""
    log = IncidentLog(tmp_path / "inc")
    log.append(_incident(1))
    log.close()
    log = IncidentLog(tmp_path / "inc")
    log.append(_incident(2))
    log.close()
    lines = (tmp_path / "inc" / "incidents.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["suspects"][0] == {"rank": 2, "local_rank": 0, "host_name": "node-b", "hw_id": "GPU-1234"}


def test_sdc_detected_carries_the_incident() -> None:
    """The exception's message is the log line and .incident the verdict."""
    inc = _incident()
    err = SDCDetected(inc)
    assert err.incident is inc and "rank=2" in str(err)


def test_local_identity_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU the hardware id is cpu:<host>:<local_rank>; SDC_HOST_NAME overrides the host name."""
    monkeypatch.setenv("SDC_HOST_NAME", "pod-7")
    monkeypatch.setenv("LOCAL_RANK", "3")
    me = RankIdentity.local()
    assert (me.host_name, me.local_rank, me.hw_id) == ("pod-7", 3, "cpu:pod-7:3")


def test_torn_trailing_record_is_moved_aside_before_the_first_append(tmp_path: Path) -> None:
    """A record cut short by a crash is kept in a side file, and the next record starts on a line of its own."""
    path = tmp_path / "incidents.jsonl"
    whole = json.dumps(_incident(1).to_dict()) + "\n"
    torn = json.dumps(_incident(2).to_dict())[:37]
    path.write_text(whole + torn)
    log = IncidentLog(tmp_path)
    log.append(_incident(3))
    log.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 3]
    assert log.torn is not None and log.torn.read_text() == torn
    assert log.torn.name.startswith("incidents.jsonl.torn-")


def test_a_file_of_one_torn_fragment_is_emptied_into_the_side_file(tmp_path: Path) -> None:
    """No complete line at all: the whole fragment moves aside and the file starts clean."""
    (tmp_path / "incidents.jsonl").write_text('{"step": 1, "che')
    log = IncidentLog(tmp_path)
    log.append(_incident(5))
    log.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "incidents.jsonl").read_text().splitlines()] == [5]


def _fault_writes(monkeypatch: pytest.MonkeyPatch, log: IncidentLog,
                  fault: Callable[[int, bytes], int]) -> list[int]:
    """Route os.write on the log's descriptor (only) through ``fault``; returns the list of calls seen."""
    real_write = os.write
    calls: list[int] = []

    def write(fd: int, data: Any) -> int:
        if fd != log._fd:
            return real_write(fd, data)
        calls.append(len(data))
        return fault(fd, bytes(data))

    monkeypatch.setattr(incident_log.os, "write", write)
    return calls


def _records(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (directory / "incidents.jsonl").read_text().splitlines()]


def test_short_write_is_cut_back_retried_and_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk that keeps writing half a record: each half is removed again, the write is retried `attempts`
    times, then the error says so, and the file keeps whole lines; the record is held and written (in order) with
    the next one once the disk takes it."""
    log = IncidentLog(tmp_path, attempts=3, backoff_s=0.001)
    log.append(_incident(1))
    real_write = os.write
    calls = _fault_writes(monkeypatch, log, lambda fd, data: real_write(fd, data[: len(data) // 2]))
    with pytest.raises(OSError, match="short write") as err:
        log.append(_incident(2))
    assert err.value.errno == errno.ENOSPC and "failed 3 times" in str(err.value) and len(calls) == 3
    monkeypatch.setattr(incident_log.os, "write", real_write)
    log.update(_incident(1))
    log.close()
    assert [(r["record"], r["step"]) for r in _records(tmp_path)] == [("incident", 1), ("incident", 2),
                                                                       ("update", 1)]


def test_a_write_that_fails_on_a_full_disk_is_retried_until_it_succeeds(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """ENOSPC twice, then space again: the record is written exactly once, with a warning per retry."""
    log = IncidentLog(tmp_path, backoff_s=0.001)
    real_write = os.write
    failures = [OSError(errno.ENOSPC, "No space left on device")] * 2

    def full_then_free(fd: int, data: bytes) -> int:
        if failures:
            raise failures.pop()
        return real_write(fd, data)

    calls = _fault_writes(monkeypatch, log, full_then_free)
    log.append(_incident(1))
    log.close()
    assert len(calls) == 3 and [r["step"] for r in _records(tmp_path)] == [1]
    assert caplog.text.count("No space left on device") == 2


def test_a_failed_fsync_is_retried_without_duplicating_the_record(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A write whose fsync fails is cut back and written again: one line, not two."""
    log = IncidentLog(tmp_path, backoff_s=0.001)
    real_fsync = os.fsync
    failed: list[int] = []

    def fsync(fd: int) -> None:
        if fd == log._fd and not failed:
            failed.append(fd)
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(incident_log.os, "fsync", fsync)
    log.append(_incident(1))
    log.close()
    assert failed and [r["step"] for r in _records(tmp_path)] == [1]


def test_a_disk_that_stays_full_raises_after_the_retries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC on every attempt: OSError(ENOSPC) after `attempts` tries (the monitor counts it), earlier lines intact,
    and once there is space the held record is written before the next one."""
    log = IncidentLog(tmp_path, attempts=4, backoff_s=0.001)
    log.append(_incident(1))

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    calls = _fault_writes(monkeypatch, log, full)
    t0 = time.monotonic()
    with pytest.raises(OSError) as err:
        log.append(_incident(2))
    assert err.value.errno == errno.ENOSPC and len(calls) == 4 and time.monotonic() - t0 < 1
    monkeypatch.undo()
    log.append(_incident(3))
    log.close()
    assert [r["step"] for r in _records(tmp_path)] == [1, 2, 3] and not log.held


def test_repairs_in_the_same_second_keep_separate_side_files(tmp_path: Path) -> None:
    """Two torn tails repaired back to back get two side files (time_ns and pid in the name), each with its
    fragment."""
    path = tmp_path / "incidents.jsonl"
    torn = []
    for fragment in ('{"step": 1, "che', '{"step": 2, "suspe'):
        path.write_text(json.dumps({"step": 0}) + "\n" + fragment)
        log = IncidentLog(tmp_path)
        log.close()
        assert log.torn is not None
        torn.append(log.torn)
    assert torn[0] != torn[1]
    assert [p.read_text() for p in torn] == ['{"step": 1, "che', '{"step": 2, "suspe']
    for p in torn:
        assert p.name.startswith("incidents.jsonl.torn-") and p.name.endswith(f"-{os.getpid()}")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["incidents.jsonl", *(p.name for p in torn)])


def _append_many(directory: str, writer: int, count: int, start: Any) -> None:
    """A writer process: appends ``count`` records, reopening the log (and so repairing it) every 10 records."""
    start.wait(30)
    log = IncidentLog(directory)
    for i in range(count):
        if i and i % 10 == 0:
            log.close()
            log = IncidentLog(directory)
        who = RankIdentity(rank=writer, local_rank=0, host_name=f"node-{writer}", hw_id=f"GPU-{writer}")
        log.append(Incident(step=i, check="weights", suspect_ranks=(writer,), suspects=(who,),
                            evidence={"writer": writer, "padding": "x" * (500 + 37 * (i % 50))}))
    log.close()


def test_two_processes_appending_concurrently_lose_no_record(tmp_path: Path) -> None:
    """Two real processes append 150 records each to one incidents.jsonl, reopening it every 10 records: all 300
    lines are whole JSON, each writer's records are all there in order, and no repair ever moved a record aside."""
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    procs = [ctx.Process(target=_append_many, args=(str(tmp_path), w, 150, start)) for w in (1, 2)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    records = _records(tmp_path)
    assert len(records) == 300
    for w in (1, 2):
        assert [r["step"] for r in records if r["evidence"]["writer"] == w] == list(range(150))
    assert [p.name for p in tmp_path.iterdir()] == ["incidents.jsonl"]


def _slow_writer(directory: str, half_written: Any, go: Any) -> None:
    """A writer process whose record reaches the disk in two halves, waiting for ``go`` in between (a large record
    on a slow disk, seen by another process opening the log mid-write)."""
    log = IncidentLog(directory)
    real_write = os.write

    def write(fd: int, data: Any) -> int:
        if fd != log._fd:
            return real_write(fd, data)
        half = len(data) // 2
        real_write(fd, data[:half])
        half_written.set()
        go.wait(30)
        real_write(fd, data[half:])
        return len(data)

    incident_log.os.write = write  # type: ignore[assignment]  # this child process only
    log.append(_incident(7))
    log.close()


def test_opening_the_log_never_cuts_a_record_another_process_is_writing(tmp_path: Path) -> None:
    """While another process has written half of a record, opening the log (its torn-tail repair) waits for the
    lock instead of moving the half aside; the record ends up whole, and no side file is made."""
    IncidentLog(tmp_path).close()
    ctx = multiprocessing.get_context("spawn")
    half_written, go = ctx.Event(), ctx.Event()
    writer = ctx.Process(target=_slow_writer, args=(str(tmp_path), half_written, go))
    writer.start()
    try:
        assert half_written.wait(60), "the writer process did not start writing"
        opened: list[IncidentLog] = []
        opener = threading.Thread(target=lambda: opened.append(IncidentLog(tmp_path)))
        opener.start()
        opener.join(0.5)
        assert opener.is_alive() and not opened, "opening the log did not wait for the writer's lock"
        go.set()
        opener.join(30)
        writer.join(30)
        assert writer.exitcode == 0
    finally:
        go.set()
        writer.join(30)
    (second,) = opened
    assert second.torn is None
    second.append(_incident(8))
    second.close()
    assert [r["step"] for r in _records(tmp_path)] == [7, 8]
    assert [p.name for p in tmp_path.iterdir()] == ["incidents.jsonl"]


def test_a_held_record_is_written_by_retry_or_close_when_space_returns(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """No later incident: the record held after a full disk is written by retry() (at most every retry_s; the
    monitor calls it at each step while records are held) or at close(), once the disk takes it."""
    for finish in ("retry", "close"):
        directory = tmp_path / finish
        log = IncidentLog(directory, attempts=2, backoff_s=0.001, retry_s=0.05)

        def full(fd: int, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        _fault_writes(monkeypatch, log, full)
        with pytest.raises(OSError, match="1 record\\(s\\) held"):
            log.append(_incident(5))
        log.retry()  # still full (and too early): nothing written, nothing raised
        assert len(log.held) == 1 and _records(directory) == []
        monkeypatch.undo()
        if finish == "retry":
            time.sleep(0.06)
            log.retry()
            assert not log.held and [r["step"] for r in _records(directory)] == [5]
        log.close()
        assert [r["step"] for r in _records(directory)] == [5]
