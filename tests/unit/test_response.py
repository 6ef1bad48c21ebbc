"""Incidents: one log line, JSON lines that stay valid, SDCDetected carrying the incident."""

from __future__ import annotations

import json
from pathlib import Path

from sdc_telemetry import Incident, RankIdentity, SDCDetected
from sdc_telemetry.response import IncidentLog


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
