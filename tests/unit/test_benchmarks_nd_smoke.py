"""benchmarks/nd.py runs end to end in its ``--quick`` configurations and writes results of the documented shape.

Shape only: step-time figures are printed, never asserted (the machine may be shared). The runs are subprocesses,
as a user runs them: ``python benchmarks/nd.py --quick`` and ``--campaign --quick``.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "nd.py"


@pytest.fixture
def nd(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The benchmark imported as a module (for its planning and scoring functions)."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    return importlib.import_module("nd")


def _run(tmp_path: Path, *args: str, name: str) -> tuple[dict[str, Any], str]:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args, "--out-dir", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = tmp_path / f"{name}.json"
    assert path.is_file(), f"{name}.json was not written"
    data = json.loads(path.read_text())
    assert data["benchmark"] == name and {"torch", "cpus", "time"} <= set(data["environment"])
    return data, proc.stdout


LAYOUTS = {"hsdp_tp": ("HSDP x TP", "dp_replicate x dp_shard x tp"), "pp_dp": ("PP x DP", "pipeline stage"),
           "pp_interleaved": ("PP x DP interleaved", "ScheduleInterleaved1F1B")}


def test_nd_quick_reports_ratios_audit_cost_and_counted_checks(tmp_path: Path) -> None:
    """nd.py --quick: HSDP x TP on 8 ranks, PP x DP on 4 (one stage a rank, and two interleaved), each
    configuration's step-time ratio against the same model unmonitored (positive, the baseline exactly 1), an audit
    cost for the replaying one, every monitored check passed on every step."""
    data, out = _run(tmp_path, "--quick", name="nd")
    assert set(data["layouts"]) == set(LAYOUTS)
    for layout, (title, described) in LAYOUTS.items():
        assert title in out
        run = data["layouts"][layout]
        assert described in run["monitor_layout"], run["monitor_layout"]
        assert run["errors"] == [] and run["incidents"] == [], layout
        summary = run["summary"]
        assert summary["no monitor"]["ratio"] == 1.0 and summary["no monitor"]["results"] == {}
        replay_label = next(k for k in summary if "replay/" in k)
        steps = run["rounds"] * run["segment"]
        for label, row in summary.items():
            assert row["ratio"] > 0 and row["step_ms"] > 0 and row["iqr"][0] <= row["iqr"][1], (layout, label)
            if label == "no monitor":
                continue
            res = row["results"]
            assert res["grad_local:pass"] == res["grad_reduced:pass"] == res["weights:pass"] == steps, (layout, res)
            assert all(k.endswith(":pass") for k in res), (layout, res)
        audited = summary[replay_label]
        assert audited["results"]["replay:pass"] == audited["audits"] == run["rounds"], (layout, audited)
        assert audited["audit_cost_steps"] is not None and audited["audit_cost_steps"] > -1


def test_nd_campaign_quick_detects_and_names_with_coordinates(tmp_path: Path) -> None:
    """nd.py --campaign --quick: every fault fired, no trial failed, no false incident; the weight flip and the
    compute fault are detected with the faulty rank among the suspects and a coordinate that is right."""
    data, out = _run(tmp_path, "--campaign", "--quick", name="nd_campaign")
    assert "Fault campaign on HSDP x TP" in out
    assert data["errors"] == [] and data["false_incidents"] == 0 and data["healthy_rank_steps"] > 0
    rows = {r["kind"]: r for r in data["rows"]}
    assert set(rows) == {"weight_mantissa", "compute_1e-3", "grad_sign"}
    for kind, row in rows.items():
        assert row["fired"] == row["injected"] == 1, kind
    for kind in ("weight_mantissa", "compute_1e-3"):
        row = rows[kind]
        assert row["detected"] == row["rank_named"] == row["coordinate_right"] == 1, row
    assert rows["compute_1e-3"]["replica_right"] == 1 and rows["compute_1e-3"]["first_check"] == {"replay": 1}
    assert rows["weight_mantissa"]["first_check"] == {"weights": 1}


def test_campaign_plan_is_seeded_and_stratified(nd: ModuleType) -> None:
    """The same seed gives the same plan, each kind is drawn equally often, faults fall before the last audit,
    and an unknown kind or a trial too short is refused by name."""
    a = nd.plan(3, seed=1, steps=6, world=8)
    assert a == nd.plan(3, seed=1, steps=6, world=8) and a != nd.plan(3, seed=2, steps=6, world=8)
    kinds = [t["kind"] for t in a]
    assert all(kinds.count(k) == 3 for k in nd.KINDS)
    for t in a:
        if t["kind"] == "healthy":
            assert t["rank"] is None and t["step"] is None
            continue
        assert 0 <= t["rank"] < 8 and 1 <= t["step"] <= 4
        if t["kind"].startswith(("weight_", "grad_")):
            assert t["bit"] in nd.BITS[t["kind"].split("_", 1)[1]]
    with pytest.raises(ValueError, match="unknown fault kinds"):
        nd.plan(1, seed=0, steps=6, world=8, kinds=("weight_sgn",))
    with pytest.raises(ValueError, match="steps"):
        nd.plan(1, seed=0, steps=3, world=8)


def test_coordinate_scoring(nd: ModuleType) -> None:
    """Ranks map to (dp_replicate, dp_shard, tp) row-major; a coordinate is right when it is a suspect's and
    matches the faulty rank on the dims where the suspects agree."""
    assert nd.coordinate_of(5) == {"dp_replicate": 1, "dp_shard": 0, "tp": 1}
    weights = {"suspects": [1, 5], "coordinate": nd.coordinate_of(1)}  # two replicas of one shard: ambiguous
    assert nd._coordinate_right(weights, nd.coordinate_of(5))
    assert not nd._coordinate_right(weights, nd.coordinate_of(7))  # another shard
    replay = {"suspects": [6, 7], "coordinate": nd.coordinate_of(6)}
    assert nd._coordinate_right(replay, nd.coordinate_of(7))
    assert not nd._coordinate_right({"suspects": [6, 7], "coordinate": nd.coordinate_of(2)}, nd.coordinate_of(7))
    assert not nd._coordinate_right({"suspects": [6], "coordinate": None}, nd.coordinate_of(6))


def test_campaign_plan_on_the_pipeline_layout_draws_the_faulty_ranks_own_stage(nd: ModuleType) -> None:
    """On pp 2 x dp_replicate 2 x dp_shard 1 x tp 2 (pp outermost: ranks 0-3 run stage 0), every fault targets a
    tensor or module of the faulty rank's own stage: the embeddings only on stage 0, the head only on stage 1."""
    trials = nd.plan(4, seed=3, steps=6, world=8, layout="pp_rep_tp")
    assert nd.coordinate_of(5, "pp_rep_tp") == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "tp": 1}
    seen = set()
    for t in trials:
        if t["kind"] == "healthy":
            continue
        stage = nd.coordinate_of(t["rank"], "pp_rep_tp")["pp"]
        params, modules = nd._campaign_targets(stage, 2)
        target = t.get("param") or t["module"]
        assert target in params or target in modules, (t, stage)
        seen.add((stage, target.split(".")[0]))
    assert ("tok" not in {name for stage, name in seen if stage == 1})
    assert ("head" not in {name for stage, name in seen if stage == 0})
    with pytest.raises(ValueError, match="campaign runs on"):
        nd.run_campaign(1, layout="pp_tp")
