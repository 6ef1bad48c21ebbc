"""Incidents: one log line, JSON lines that stay valid, SDCDetected carrying the incident."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_local_identity_on_cpu(monkeypatch) -> None:  # type: ignore[no-untyped-def]
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


def test_short_write_is_cut_back_and_reported(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A full disk writes half a record: it is removed again, the error says so, and the file keeps whole lines."""
    import os

    import pytest

    import sdc_telemetry.sinks.incident_log as response

    log = IncidentLog(tmp_path)
    log.append(_incident(1))
    real_write = os.write
    monkeypatch.setattr(response.os, "write", lambda fd, data: real_write(fd, data[: len(data) // 2]))
    with pytest.raises(OSError, match="short write"):
        log.append(_incident(2))
    monkeypatch.setattr(response.os, "write", real_write)
    log.update(_incident(1))
    log.close()
    records = [json.loads(x) for x in (tmp_path / "incidents.jsonl").read_text().splitlines()]
    assert [(r["record"], r["step"]) for r in records] == [("incident", 1), ("update", 1)]
