"""The generated Grafana dashboards: checked in, built from the metric table, wired to each other."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from sdc_telemetry.ops import alerts, dashboards
from sdc_telemetry.sinks.metrics import FAMILIES, GPU, IDENTITY_LABELS, family

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"


def _load(uid: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((DASHBOARDS / dashboards.FILES[uid]).read_text())
    return doc


def _panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in doc["panels"] if p["type"] != "row"]


def _exprs(doc: dict[str, Any]) -> str:
    return "\n".join(t["expr"] for p in _panels(doc) for t in p["targets"])


def test_regenerating_gives_the_checked_in_files(tmp_path: Path) -> None:
    """dashboards/ holds exactly what generate() writes, byte for byte."""
    paths = dashboards.generate(tmp_path)
    assert sorted(p.name for p in paths) == sorted(p.name for p in DASHBOARDS.iterdir())
    for p in paths:
        assert p.read_bytes() == (DASHBOARDS / p.name).read_bytes(), \
            f"dashboards/{p.name} is stale: run sdc-telemetry dashboards"


def test_generation_is_deterministic() -> None:
    """Two generations give identical JSON (fixed uids and panel ids)."""
    first = [dashboards.dashboard_json(d) for d in dashboards.dashboards().values()]
    assert first == [dashboards.dashboard_json(d) for d in dashboards.dashboards().values()]


def test_titles_uids_and_variables() -> None:
    """SDC overview has datasource, job, host and rank variables; GPU health has datasource, job, host and gpu."""
    overview, gpu = _load(dashboards.OVERVIEW_UID), _load(dashboards.GPU_UID)
    assert (overview["title"], overview["uid"]) == ("SDC overview", "sdc-overview")
    assert (gpu["title"], gpu["uid"]) == ("GPU health", "sdc-gpu-health")
    variables = {v["name"]: v for v in overview["templating"]["list"]}
    assert list(variables)[:4] == ["datasource", "job", "host", "rank"]
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert "service_name" in variables["job"]["query"]
    assert [v["name"] for v in gpu["templating"]["list"]] == ["datasource", "job", "host", "gpu"]


def test_every_query_uses_the_datasource_variable() -> None:
    """Panels and targets read from ${datasource}, so the dashboards work with any Prometheus."""
    for uid in dashboards.FILES:
        for p in _panels(_load(uid)):
            assert p["datasource"] == dashboards.DS, p["title"]
            assert p["targets"] and all(t["datasource"] == dashboards.DS for t in p["targets"]), p["title"]


def test_layout_fits_the_grid_without_overlaps() -> None:
    """Every panel lies inside 24 columns and no two panels overlap."""
    for uid in dashboards.FILES:
        cells: dict[tuple[int, int], str] = {}
        for p in _load(uid)["panels"]:
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24, p["title"]
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    assert (x, y) not in cells, (p["title"], cells.get((x, y)))
                    cells[(x, y)] = p["title"]


def _recording_rules() -> dict[str, str]:
    return {r.record: r.expr for r in alerts.RECORDING_RULES}


def test_metric_names_come_from_the_table_and_every_family_is_shown() -> None:
    """Each metric a query reads is a table family (histograms with their suffixes) or a recording rule; every family
    is shown, directly or through a rollup the dashboards read."""
    names = {f.name for f in FAMILIES}
    histograms = {f.name for f in FAMILIES if f.kind == "histogram"}
    labels = set(IDENTITY_LABELS) | {label for f in FAMILIES for label in f.labels}
    records = _recording_rules()
    used: set[str] = set()
    for uid in dashboards.FILES:
        exprs = _exprs(_load(uid))
        for record in re.findall(r"\b(sdc:[a-z_:0-9]+)", exprs):
            assert record in records, record
            exprs += "\n" + records[record]
        for word in set(re.findall(r"\b((?:sdc|hw|gpu)_[a-z_]+)\b", exprs)) - labels:
            base = re.sub(r"_(bucket|sum|count)$", "", word) if word not in names else word
            assert word in names or base in histograms, word
            used.add(base)
    assert used == names


def test_overview_reads_rollups_and_per_rank_series_only_for_suspects_and_top_k() -> None:
    """Every overview query reads an sdc:* rollup, except the suspects table and panels limited to the top k."""
    for p in _panels(_load(dashboards.OVERVIEW_UID)):
        for t in p["targets"]:
            if "$tolerance" in t["expr"]:
                continue
            per_rank = re.search(r"\bsdc_[a-z_]+\{", t["expr"])
            assert not per_rank or p["title"].startswith("Suspects") or \
                t["expr"].startswith(("topk(", "bottomk(")), (p["title"], t["expr"])


def test_coverage_panel_shows_ran_over_due_per_check() -> None:
    """The coverage panel plots, per check, the rollup of (pass + fail) over all results."""
    panel = next(p for p in _panels(_load(dashboards.OVERVIEW_UID)) if p["title"].startswith("Check coverage"))
    assert "by (check)" in panel["targets"][0]["expr"] and "sdc:checks:coverage5m" in panel["targets"][0]["expr"]
    coverage = _recording_rules()["sdc:checks:coverage5m"]
    assert 'result=~"pass|fail"' in coverage and panel["fieldConfig"]["defaults"]["unit"] == "percentunit"


def test_top_row_reads_in_two_seconds() -> None:
    """The overview opens with stat panels: open incidents, current suspects, checks stalled, ranks reporting."""
    top = [p for p in _load(dashboards.OVERVIEW_UID)["panels"] if p["gridPos"]["y"] == 1]
    titles = [p["title"] for p in top]
    assert titles[:4] == ["Open incidents", "Current suspects", "Checks stalled", "Ranks reporting"]
    assert all(p["type"] == "stat" for p in top)


def test_suspects_table_links_to_the_gpu_view() -> None:
    """The suspects table shows host, rank, GPU UUID, check and since when, and links to GPU health for the row."""
    table = next(p for p in _panels(_load(dashboards.OVERVIEW_UID)) if p["title"].startswith("Suspects"))
    assert table["type"] == "table"
    shown = {o["matcher"]["options"]: o["properties"][0]["value"] for o in table["fieldConfig"]["overrides"]}
    assert {shown[k] for k in ("host_name", "rank", "hw_id", "check", "Value")} == \
        {"Host", "Rank", "GPU UUID", "Check", "Suspect since"}
    url = table["fieldConfig"]["defaults"]["links"][0]["url"]
    assert url.startswith(f"/d/{dashboards.GPU_UID}/")
    assert "var-host=${__data.fields.host_name}" in url and "var-gpu=${__data.fields.hw_id}" in url


def test_replay_panels_use_a_log_scale_and_draw_the_tolerance() -> None:
    """Replay delta panels show the top ranks on a log axis, with the tolerance series."""
    panels = [p for p in _panels(_load(dashboards.OVERVIEW_UID)) if p["title"].startswith("Replay") and "delta"
              in p["title"]]
    assert len(panels) == 2
    for p in panels:
        assert p["fieldConfig"]["defaults"]["custom"]["scaleDistribution"] == {"type": "log", "log": 10}
        assert p["targets"][0]["expr"].startswith(f"topk({dashboards.TOP_K}, clamp_min(max by (host_name, rank)")
        assert any(t["legendFormat"] == "tolerance" and "$tolerance" in t["expr"] for t in p["targets"])


def test_gpu_dashboard_shows_every_nvml_family_and_joins_on_host_and_gpu() -> None:
    """GPU health has a panel per GPU family and joins SDC series on (host_name, hw_id)."""
    gpu = _load(dashboards.GPU_UID)
    exprs = _exprs(gpu)
    for f in GPU:
        assert f.name in exprs, f.name
    assert "on (host_name, hw_id)" in exprs
    assert any(p["title"].startswith("Suspect GPUs") for p in _panels(gpu))


def test_gpu_dashboard_has_a_fleet_panel_of_strikes_per_gpu() -> None:
    """GPU health lists the ledger's strikes per GPU (sdc_fleet_gpu_strikes by hw_id and host_name, most first; the
    job's GPUs without a strike at 0), a family of the responder that carries no rank identity; a second strike is
    red."""
    panel = next(p for p in _panels(_load(dashboards.GPU_UID)) if p["title"].startswith("Fleet"))
    assert panel["type"] == "table"
    (target,) = panel["targets"]
    assert target["expr"].startswith("sort_desc(\n  max by (hw_id, host_name) (sdc_fleet_gpu_strikes{")
    assert "or\n  0 * max by (hw_id, host_name) (sdc_steps_total{" in target["expr"]
    assert target["instant"] is True and target["format"] == "table"
    strikes = family("sdc_fleet_gpu_strikes")
    assert (strikes.kind, strikes.labels, strikes.source) == ("gauge", ("hw_id", "host_name"), "fleet")
    value = next(o for o in panel["fieldConfig"]["overrides"] if o["matcher"]["options"] == "Value"
                 and o["properties"][0]["id"] == "custom.cellOptions")
    steps = value["properties"][1]["value"]["steps"]
    assert steps[-1] == {"color": "red", "value": 2}


def test_overview_shows_ambiguous_suspects_and_pager_failures_apart() -> None:
    """The Current suspects stat counts ambiguous suspects as a second value, and Monitor errors the failed direct
    pages, from their rollups; GPU health plots sdc_suspect_ambiguous next to sdc_suspect."""
    stats = {p["title"]: p for p in _panels(_load(dashboards.OVERVIEW_UID)) if p["type"] == "stat"}
    suspects = [t["expr"] for t in stats["Current suspects"]["targets"]]
    assert len(suspects) == 2 and "sdc:ambiguous_suspect_ranks:count" in suspects[1]
    errors = [t["expr"] for t in stats["Monitor errors"]["targets"]]
    assert len(errors) == 2 and "sdc:pager_failures:sum" in errors[1]
    verdicts = next(p for p in _panels(_load(dashboards.GPU_UID)) if p["title"] == "SDC verdicts next to GPU errors")
    assert any("sdc_suspect_ambiguous{" in t["expr"] for t in verdicts["targets"])


def test_gradient_panel_is_top_k_ranks_and_weights_are_per_host() -> None:
    """Gradient norms: the top k ranks per phase; weight agreement: the k lowest hosts over time."""
    panels = {p["title"]: p for p in _panels(_load(dashboards.OVERVIEW_UID))}
    k = dashboards.TOP_K
    assert panels[f"Gradient norm, top {k} ranks"]["targets"][0]["expr"].startswith(
        f"topk({k}, max by (host_name, rank, phase)")
    agreement = panels[f"Weight-fingerprint agreement, {k} lowest hosts"]
    assert agreement["type"] == "state-timeline"
    assert agreement["targets"][0]["expr"].startswith(f"bottomk({k}, min by (host_name) (sdc:")


def test_panel_queries_substitute_every_variable() -> None:
    """panel_queries() returns every target with $job, $host, $rank, $gpu and Grafana's intervals filled in."""
    queries = dashboards.panel_queries(job="llm", host="node-b", rank="2", gpu="GPU-1")
    total = sum(len(p["targets"]) for uid in dashboards.FILES for p in _panels(_load(uid)))
    assert len(queries) == total
    assert all("$" not in q.expr for q in queries)
    assert any('rank=~"2"' in q.expr for q in queries) and any('hw_id=~"GPU-1"' in q.expr for q in queries)


def test_panel_queries_refuse_an_unknown_variable() -> None:
    """A variable panel_queries() does not know is an error, not a silently broken query."""
    doc = {"title": "x", "panels": [{"title": "p", "targets": [{"refId": "A", "expr": "up{a=~\"$nope\"}"}]}]}
    with pytest.raises(ValueError, match="unsubstituted"):
        dashboards.panel_queries(docs=[doc])


def test_every_panel_query_returns_data_from_a_real_prometheus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/prometheus_scale.py --quick backfills a 16-rank job into a real Prometheus with the rollups: every
    alert, rollup and panel query runs and every panel query returns data."""
    for tool in ("promtool", "prometheus"):
        if shutil.which(tool) is None:
            if os.environ.get("CI") == "true":
                pytest.fail(f"{tool} is not on PATH (CI=true: a missing binary is a failure)")
            pytest.skip(f"{tool} is not on PATH")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    result = importlib.import_module("prometheus_scale").main(["--quick", "--out-dir", str(tmp_path)])
    panels = [q for q in result["queries"] if q["kind"] == "panel"]
    assert len(panels) == len(dashboards.panel_queries())
    assert [q["name"] for q in panels if q["series"] == 0] == []
    assert len([q for q in result["queries"] if q["kind"] == "alert"]) == len(alerts.RULES)
    suspects = next(q for q in panels if q["name"].startswith("SDC overview / Suspects"))
    assert suspects["series"] == 1  # rank 7, the one latched suspect
    assert (tmp_path / "prometheus_scale.json").is_file()
