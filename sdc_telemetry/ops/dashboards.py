"""Grafana dashboards generated with grafanalib from the metric table.

``generate(out_dir)`` writes ``sdc-overview.json`` ("SDC overview") and ``sdc-gpu-health.json`` ("GPU health"),
checked in under ``dashboards/`` (``sdc-telemetry dashboards`` regenerates them). Uids are fixed, so links between
the two dashboards and provisioning survive regeneration, and the output is byte-for-byte deterministic.

The overview reads the ``sdc:*`` recording rules of ``sdc_telemetry.ops.alerts`` (per host and per job) and per-rank
series only for the suspects table and top-k panels, so that it stays fast at 16,384 ranks; the GPU dashboard is per
GPU and filters by host and GPU first; its fleet panel lists the strikes of the GPU ledger
(``sdc_fleet_gpu_strikes``, exported by the responder, not by the ranks).

``panel_queries(job=..., host=..., rank=...)`` lists every panel query with the dashboard variables substituted, so a
test can run each against a real Prometheus.

SDC and GPU series join ``on (host_name, hw_id)``: the SDC series carry the rank's GPU UUID as ``hw_id``, and so do the
GPU families exported by the ranks. DCGM exporter series join after ``label_replace(DCGM_..., "hw_id", "$1", "UUID",
"(.*)")`` and a ``Hostname`` -> ``host_name`` replace the same way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grafanalib._gen import DashboardEncoder
from grafanalib.core import (
    SORT_ALPHA_ASC,
    SORT_NUMERIC_ASC,
    Dashboard,
    DashboardLink,
    GridPos,
    RowPanel,
    Stat,
    StateTimeline,
    Table,
    Target,
    Template,
    Templating,
    Time,
    TimeSeries,
)

from sdc_telemetry.ops.alerts import RECORDING_RULES
from sdc_telemetry.sinks.metrics import GPU, Family, family

__all__ = ["OVERVIEW_UID", "GPU_UID", "PanelQuery", "dashboards", "dashboard_json", "panel_queries", "generate"]

OVERVIEW_UID = "sdc-overview"
GPU_UID = "sdc-gpu-health"
FILES = {OVERVIEW_UID: "sdc-overview.json", GPU_UID: "sdc-gpu-health.json"}
SCHEMA_VERSION = 39  # Grafana 10/11: the panel JSON below is already in that shape, nothing to migrate
DS = {"type": "prometheus", "uid": "${datasource}"}
# Exact replay matches (delta 0) cannot sit on a log axis: they are drawn at this floor.
LOG_FLOOR = "1e-12"
DEFAULT_TOLERANCE = "1e-5"  # the replay check's auto-tolerance floor; set the variable to the job's SDCConfig.tolerance

_STEPS = family("sdc_steps_total").name
_NORM = family("sdc_grad_norm").name
_LOSS_DELTA = family("sdc_replay_loss_delta").name
_GRAD_DELTA = family("sdc_replay_grad_delta").name
_SUSPECT = family("sdc_suspect").name
_AMBIGUOUS = family("sdc_suspect_ambiguous").name
_STRIKES = family("sdc_fleet_gpu_strikes").name
_TEMPERATURE = family("hw_temperature_celsius").name
_POWER = family("hw_power_watts").name
_ECC = family("hw_errors_total").name
_XID = family("gpu_xid_errors_total").name
_UTILIZATION = family("hw_gpu_utilization").name

_RECORDED = {r.record for r in RECORDING_RULES}


def _recorded(name: str) -> str:
    """A recording rule of ``sdc_telemetry.ops.alerts`` by name; ``KeyError`` if the rule file has no such rule."""
    if name not in _RECORDED:
        raise KeyError(f"no recording rule {name!r} in sdc_telemetry.ops.alerts")
    return name


# The overview reads these per-host/per-job rollups, so it stays fast at 16,384 ranks.
_CHECKS_R = _recorded("sdc:checks:rate5m")
_COVERAGE_R = _recorded("sdc:checks:coverage5m")
_STEPS_R = _recorded("sdc:steps:rate5m")
_RANKS_R = _recorded("sdc:ranks:count")
_CLOSED_R = _recorded("sdc:ranks_closed:count")
_SUSPECTS_R = _recorded("sdc:suspect_ranks:count")
_AMBIGUOUS_R = _recorded("sdc:ambiguous_suspect_ranks:count")
_PAGER_FAILURES_R = _recorded("sdc:pager_failures:sum")
_INCIDENTS_R = _recorded("sdc:incidents:max")
_ERRORS_R = _recorded("sdc:internal_errors:sum")
_NONFINITE_R = _recorded("sdc:grad_nonfinite:max")
_REPLAY_MISMATCHES_R = _recorded("sdc:replay_mismatches:sum")
_AGREEMENT_R = _recorded("sdc:weight_fingerprint_agreement:min")
_WEIGHT_MISMATCHES_R = _recorded("sdc:weight_fingerprint_mismatches:sum")
_DURATION_R = _recorded("sdc:check_duration_seconds_bucket:rate5m")
_DURATION_SUM_R = _recorded("sdc:check_duration_seconds_sum:rate5m")
_AGE_R = _recorded("sdc:check_last_run_age_seconds:max")
_STALLED_R = _recorded("sdc:checks_stalled:count")
# Per-rank panels show only this many ranks (or hosts): the interesting extremes, not 16,384 lines.
TOP_K = 10

_UNITS = {"1": "short", "s": "s", "W": "watt", "Cel": "celsius", "By": "bytes", "Hz": "hertz"}

JOB = 'service_name=~"$job"'
HOSTS = f'{JOB}, host_name=~"$host"'
RANKS = f'{JOB}, host_name=~"$host", rank=~"$rank"'
GPUS = 'host_name=~"$host", hw_id=~"$gpu"'
RANK_ID = "service_name, host_name, rank, hw_id"


def _t(expr: str, legend: str = "", ref: str = "A", *, table: bool = False) -> Target:
    return Target(expr=expr, legendFormat=legend, refId=ref, instant=table, format="table" if table else
                  "time_series", datasource=DS)


def _pos(x: int, y: int, w: int, h: int) -> GridPos:
    return GridPos(h=h, w=w, x=x, y=y)


def _green_red(red_at: float = 1) -> list[dict[str, Any]]:
    return [{"color": "green", "value": None}, {"color": "red", "value": red_at}]


def _variable(name: str, label: str, query: str, *, numeric: bool = False) -> Template:
    return Template(name=name, label=label, query=query, dataSource=DS, includeAll=True, multi=True,
                    allValue=".*", default="$__all", refresh=2, sort=SORT_NUMERIC_ASC if numeric else SORT_ALPHA_ASC)


def _datasource() -> Template:
    return Template(name="datasource", label="Data source", query="prometheus", type="datasource",
                    default="Prometheus")


def _job_host() -> list[Template]:
    return [_datasource(),
            _variable("job", "Job (service_name)", f"label_values({_STEPS}, service_name)"),
            _variable("host", "Host", f"label_values({_STEPS}{{{JOB}}}, host_name)")]


def _stat(title: str, expr: str, x: int, description: str, *, red_at: float = 1, unit: str = "none",
          legend: str = "", more: tuple[Target, ...] = ()) -> Stat:
    return Stat(title=title, description=description, dataSource=DS, targets=[_t(expr, legend), *more],
                gridPos=_pos(x, 1, 4, 4),
                reduceCalc="lastNotNull", graphMode="none", colorMode="background", format=unit,
                thresholds=_green_red(red_at), noValue="0")


def _series(title: str, targets: list[Target], pos: GridPos, description: str, **kwargs: Any) -> TimeSeries:
    return TimeSeries(title=title, description=description, dataSource=DS, targets=targets, gridPos=pos,
                      legendDisplayMode="table", legendPlacement="right", legendCalcs=["lastNotNull", "max"],
                      tooltipMode="multi", **kwargs)


def _row(title: str, y: int) -> RowPanel:
    return RowPanel(title=title, gridPos=_pos(0, y, 24, 1))


def _gpu_link(job: str, host: str, gpu: str) -> dict[str, Any]:
    return {"title": "GPU health of this GPU", "targetBlank": False,
            "url": f"/d/{GPU_UID}/gpu-health?var-datasource=${{datasource}}&var-job={job}&var-host={host}"
                   f"&var-gpu={gpu}&${{__url_time_range}}"}


def _table_overrides(names: Mapping[str, str], time_unit: str | None = None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"matcher": {"id": "byName", "options": "Time"},
                                  "properties": [{"id": "custom.hidden", "value": True}]}]
    for field, display in names.items():
        props: list[dict[str, Any]] = [{"id": "displayName", "value": display}]
        if field == "Value" and time_unit:
            props.append({"id": "unit", "value": time_unit})
        out.append({"matcher": {"id": "byName", "options": field}, "properties": props})
    return out


# -- SDC overview -----------------------------------------------------------------------------------------------------

def _overview() -> Dashboard:
    ids = "service_name, host_name, rank, hw_id, check"
    suspect_since = (
        f"1000 * (\n  min by ({ids}) (min_over_time(timestamp({_SUSPECT}{{{RANKS}}} == 1)[$__range:$__interval]))\n"
        # The subquery has no point yet for a suspect younger than one interval: its current sample stands in.
        f"  or\n  min by ({ids}) (timestamp({_SUSPECT}{{{RANKS}}} == 1))\n)")
    suspects = Table(
        title="Suspects (click a row for its GPU)", dataSource=DS, gridPos=_pos(0, 5, 24, 6),
        description="Every rank a check named in the time range: host, rank, GPU UUID, check and when it was first "
                    "named. sdc_suspect latches until the process ends.",
        targets=[_t(suspect_since, table=True)], sortBy=[],
        overrides=_table_overrides({"service_name": "Job", "host_name": "Host", "rank": "Rank",
                                    "hw_id": "GPU UUID", "check": "Check", "Value": "Suspect since"},
                                   time_unit="dateTimeAsIso"),
        extraJson={"fieldConfig": {"defaults": {"links": [_gpu_link("${__data.fields.service_name}",
                                                                   "${__data.fields.host_name}",
                                                                   "${__data.fields.hw_id}")]}}},
    )
    tolerance = [_t("vector($tolerance)", "tolerance", "B")]
    dashed_red = [{"matcher": {"id": "byName", "options": "tolerance"},
                   "properties": [{"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}},
                                  {"id": "color", "value": {"fixedColor": "red", "mode": "fixed"}}]}]
    top = f"topk({TOP_K}, "
    panels: list[Any] = [
        _row("Now", 0),
        _stat("Open incidents", f"sum({_INCIDENTS_R}{{{JOB}}}) or vector(0)", 0,
              "Incidents decided by the running job(s), all checks (every rank counts each one; max over ranks)."),
        _stat("Current suspects", f"sum({_SUSPECTS_R}{{{HOSTS}}}) or vector(0)", 4,
              "Hardware suspect ranks, counted once per check that named them (sdc_suspect latches until the "
              "process ends). 'ambiguous': ranks named by a verdict that cannot tell which side is faulty "
              "(sdc_suspect_ambiguous; warned, never paged).", legend="suspects",
              more=(_t(f"sum({_AMBIGUOUS_R}{{{HOSTS}}}) or vector(0)", "ambiguous", "B"),)),
        _stat("Checks stalled", f"sum({_STALLED_R}{{{HOSTS}}}) or vector(0)", 8,
              "Rank x check pairs whose last run is too old while steps advance (the SDCChecksStalled condition)."),
        Stat(title="Ranks reporting", dataSource=DS, gridPos=_pos(12, 1, 4, 4), reduceCalc="lastNotNull",
             graphMode="none", colorMode="value", format="none", noValue="0", thresholds=_green_red(1e9),
             description="Ranks whose metrics Prometheus scrapes now; 'ended' counts those whose monitor closed "
                         "cleanly (sdc_monitor_closed 1).",
             targets=[_t(f"sum({_RANKS_R}{{{HOSTS}}}) or vector(0)", "reporting"),
                      _t(f"sum({_CLOSED_R}{{{HOSTS}}}) or vector(0)", "ended", "B")]),
        _stat("Steps / s", f"sum({_STEPS_R}{{{HOSTS}}}) / sum({_RANKS_R}{{{HOSTS}}}) or vector(0)", 16,
              "Optimizer steps per second, averaged over ranks.", red_at=1e9),
        _stat("Monitor errors", f"sum({_ERRORS_R}{{{HOSTS}}}) or vector(0)", 20,
              "Contained failures of the monitor (exporter, NVML, replay...): the checks may be blind. 'pager': "
              "failed direct pushes of a page to Alertmanager (retried; SDCPagerFailing warns).", legend="errors",
              more=(_t(f"sum({_PAGER_FAILURES_R}{{{HOSTS}}}) or vector(0)", "pager", "B"),)),
        suspects,
        _row("Coverage and verdicts (rolled up per host)", 11),
        _series("Check coverage (ran / due)",
                [_t(f"min by (check) ({_COVERAGE_R}{{{JOB}}})", "{{check}}")],
                _pos(0, 12, 8, 8), "Share of the due runs of each check that reached a verdict (pass or fail) "
                "rather than error or skipped, over 5 minutes. Below 100% the check is partly blind; "
                "SDCCheckFailing warns when a rank has no verdict for 30 minutes.", unit="percentunit",
                thresholds=[{"color": "red", "value": None}, {"color": "green", "value": 0.99}],
                thresholdsStyleMode="line"),
        _series("Check runs per minute by result",
                [_t(f"60 * sum by (check, result) ({_CHECKS_R}{{{HOSTS}}})", "{{check}} {{result}}")],
                _pos(8, 12, 8, 8), "Check outcomes per minute over the selected hosts; fail is drawn in red.",
                overrides=[{"matcher": {"id": "byRegexp", "options": ".* fail"},
                            "properties": [{"id": "color", "value": {"fixedColor": "red", "mode": "fixed"}}]}]),
        _series(f"Non-finite gradient steps, top {TOP_K} hosts",
                [_t(f"{top}max by (host_name, phase) ({_NONFINITE_R}{{{HOSTS}}}))", "{{host_name}} {{phase}}")],
                _pos(16, 12, 8, 8), "Most steps with NaN/Inf gradients on any rank of a host (cumulative). On every "
                "host at once: numerics (SDCTrainingNonFinite). On one: see the suspects.",
                thresholds=_green_red(), thresholdsStyleMode="line"),
        _row(f"Per rank: the {TOP_K} most extreme", 20),
        _series(f"Gradient norm, top {TOP_K} ranks",
                [_t(f"{top}max by (host_name, rank, phase) ({_NORM}{{{RANKS}}}))",
                    "{{host_name}} rank {{rank}} {{phase}}")],
                _pos(0, 21, 8, 8), "L2 norm of the gradients before (local) and after (reduced) the all-reduce, "
                "largest ranks. +Inf: NaN or Inf.", scaleDistributionType="log", scaleDistributionLog=10),
        _series(f"Replay loss delta, top {TOP_K} ranks",
                [_t(f"{top}clamp_min(max by (host_name, rank) ({_LOSS_DELTA}{{{RANKS}}}), {LOG_FLOOR}))",
                    "{{host_name}} rank {{rank}}"), *tolerance],
                _pos(8, 21, 8, 8), "Relative loss difference of each rank's last replay of its partner's "
                f"micro-batches, largest ranks. Exact matches are drawn at {LOG_FLOOR}; the dashed line is the "
                "$tolerance variable.", scaleDistributionType="log", scaleDistributionLog=10, overrides=dashed_red),
        _series(f"Replay gradient delta, top {TOP_K} ranks",
                [_t(f"{top}clamp_min(max by (host_name, rank) ({_GRAD_DELTA}{{{RANKS}}}), {LOG_FLOOR}))",
                    "{{host_name}} rank {{rank}}"), *tolerance],
                _pos(16, 21, 8, 8), "Relative gradient-sketch difference of the replay; same scale and floor.",
                scaleDistributionType="log", scaleDistributionLog=10, overrides=dashed_red),
        _row("Weights and replay (rolled up per host)", 29),
        StateTimeline(title=f"Weight-fingerprint agreement, {TOP_K} lowest hosts", dataSource=DS,
                      gridPos=_pos(0, 30, 8, 8),
                      description="1: every rank of the host holds the replicas' majority weights; 0: one differs.",
                      targets=[_t(f"bottomk({TOP_K}, min by (host_name) ({_AGREEMENT_R}{{{HOSTS}}}))",
                                  "{{host_name}}")],
                      mappings=[{"type": "value", "options": {
                          "0": {"text": "DIFFERS", "color": "red", "index": 0},
                          "1": {"text": "agrees", "color": "green", "index": 1}}}],
                      thresholds=[{"color": "red", "value": None}, {"color": "green", "value": 1}]),
        _series(f"Weight-fingerprint mismatches, top {TOP_K} hosts",
                [_t(f"{top}sum by (host_name) ({_WEIGHT_MISMATCHES_R}{{{HOSTS}}}))", "{{host_name}}")],
                _pos(8, 30, 8, 8), "Cumulative weight checks in which a rank of the host disagreed with the "
                "majority.", thresholds=_green_red(), thresholdsStyleMode="line"),
        _series(f"Replay mismatches, top {TOP_K} hosts",
                [_t(f"{top}sum by (host_name) ({_REPLAY_MISMATCHES_R}{{{HOSTS}}}))", "{{host_name}}")],
                _pos(16, 30, 8, 8), "Cumulative replay audits of the host's ranks whose recomputation did not "
                "match.", thresholds=_green_red(), thresholdsStyleMode="line"),
        _row("Checks: cadence and overhead", 38),
        _series("Check duration p99",
                [_t(f"histogram_quantile(0.99, sum by (le, check) ({_DURATION_R}{{{JOB}}}))", "{{check}}")],
                _pos(0, 39, 8, 8), "99th percentile wall time of one check on one rank.", unit="s"),
        _series("Check time per step",
                [_t(f"sum by (check) ({_DURATION_SUM_R}{{{HOSTS}}})\n/ ignoring (check) group_left\n"
                    f"sum({_STEPS_R}{{{HOSTS}}})", "{{check}}")],
                _pos(8, 39, 8, 8), "Seconds each check adds to an optimizer step (averaged over ranks).", unit="s"),
        _series(f"Check overhead, top {TOP_K} hosts",
                [_t(f"{top}sum by (host_name) ({_DURATION_SUM_R}{{{HOSTS}}})\n/ on (host_name)\n"
                    f"sum by (host_name) ({_RANKS_R}{{{HOSTS}}}))", "{{host_name}}")],
                _pos(16, 39, 8, 8), "Share of wall time a host's ranks spend in the checks (average per rank).",
                unit="percentunit"),
        _series(f"Time since each check last ran, top {TOP_K} hosts",
                [_t(f"{top}max by (host_name, check) ({_AGE_R}{{{HOSTS}}}))", "{{host_name}} {{check}}")],
                _pos(0, 47, 24, 8), "Age of each check's last run on the host's slowest rank; SDCChecksStalled "
                "warns when it grows while steps advance.", unit="s"),
    ]
    templating = [*_job_host(),
                  _variable("rank", "Rank", f'label_values({_STEPS}{{{JOB}, host_name=~"$host"}}, rank)', numeric=True),
                  Template(name="tolerance", label="Replay tolerance", query=DEFAULT_TOLERANCE, type="textbox",
                           default=DEFAULT_TOLERANCE)]
    return Dashboard(
        title="SDC overview", uid=OVERVIEW_UID, tags=["sdc"], timezone="browser", refresh="10s",
        description="Silent data corruption checks of data-parallel training: suspects, coverage, gradients, replay, "
                    "weights. Reads the sdc:* recording rules (per host and job), per-rank series only for the "
                    "suspects and the top ranks.",
        time=Time("now-1h", "now"), schemaVersion=SCHEMA_VERSION, panels=panels,
        templating=Templating(list=templating),
        links=[DashboardLink(title="GPU health", type="link", uri=f"/d/{GPU_UID}/gpu-health", includeVars=True,
                             keepTime=True, icon="dashboard")],
    ).auto_panel_ids()


# -- GPU health -------------------------------------------------------------------------------------------------------

def _gpu_panel(f: Family, x: int, y: int) -> TimeSeries:
    extra = [label for label in f.labels if label != "hw_type"]
    matchers = f'{GPUS}, hw_type="gpu"' if "hw_type" in f.labels else GPUS
    legend = "{{host_name}} {{hw_id}}" + "".join(f" {{{{{label}}}}}" for label in extra)
    unit = "percentunit" if f.name == _UTILIZATION else _UNITS[f.unit]
    counter = " (cumulative since the rank started)" if f.kind == "counter" else ""
    return _series(f.description.rstrip("."), [_t(f"max by ({', '.join(['host_name', 'hw_id', *extra])}) "
                                                 f"({f.name}{{{matchers}}})", legend)],
                   _pos(x, y, 8, 7), f"{f.name}{counter}. Left out where the GPU does not support it.", unit=unit)


def _joined(gpu_expr: str) -> str:
    """``gpu_expr`` (one series per host_name, hw_id) on every rank computing on that GPU: the SDC-GPU join."""
    return (f"max by ({RANK_ID}) ({_STEPS}{{{JOB}, {GPUS}}}) * 0\n"
            f"+ on (host_name, hw_id) group_left\nmax by (host_name, hw_id) ({gpu_expr})")


def _gpu() -> Dashboard:
    suspects = Table(
        title="Suspect GPUs (click to select)", dataSource=DS, gridPos=_pos(0, 0, 12, 7),
        description="GPUs of the ranks a check named in the time range; a click selects the GPU on this dashboard.",
        targets=[_t(f"max by ({RANK_ID}, check) (max_over_time({_SUSPECT}{{{JOB}}}[$__range])) == 1", table=True)],
        overrides=_table_overrides({"service_name": "Job", "host_name": "Host", "rank": "Rank", "hw_id": "GPU UUID",
                                    "check": "Check", "Value": "Suspect"}),
        extraJson={"fieldConfig": {"defaults": {"links": [_gpu_link("${__data.fields.service_name}",
                                                                   "${__data.fields.host_name}",
                                                                   "${__data.fields.hw_id}")]}}},
    )
    health = Table(
        title="Ranks and their GPUs now", dataSource=DS, gridPos=_pos(12, 0, 12, 7),
        description="Each rank's GPU with its temperature, power and uncorrected ECC errors, joined on "
                    "(host_name, hw_id).",
        targets=[_t(f"max by ({RANK_ID}) ({_STEPS}{{{JOB}, {GPUS}}})", ref="A", table=True),
                 _t(_joined(f"{_TEMPERATURE}{{{GPUS}}}"), ref="B", table=True),
                 _t(_joined(f"{_POWER}{{{GPUS}}}"), ref="C", table=True),
                 _t(_joined(f'{_ECC}{{{GPUS}, hw_type="gpu", error_type="uncorrected"}}'), ref="D", table=True)],
        transformations=[{"id": "merge", "options": {}}],
        overrides=[*_table_overrides({"service_name": "Job", "host_name": "Host", "rank": "Rank", "hw_id": "GPU UUID",
                                      "Value #A": "Steps", "Value #B": "Temperature", "Value #C": "Power",
                                      "Value #D": "Uncorrected ECC"}),
                   {"matcher": {"id": "byName", "options": "Value #B"},
                    "properties": [{"id": "unit", "value": "celsius"}]},
                   {"matcher": {"id": "byName", "options": "Value #C"},
                    "properties": [{"id": "unit", "value": "watt"}]}],
    )
    verdicts = _series(
        "SDC verdicts next to GPU errors",
        [_t(f"max by (host_name, hw_id, check) ({_SUSPECT}{{{JOB}, {GPUS}}})", "suspect {{check}} {{hw_id}}", "A"),
         _t(f"max by (host_name, hw_id, check) ({_AMBIGUOUS}{{{JOB}, {GPUS}}})", "ambiguous {{check}} {{hw_id}}",
            "D"),
         _t(f'sum by (host_name, hw_id) ({_ECC}{{{GPUS}, hw_type="gpu", error_type="uncorrected"}})\n'
            f"and on (host_name, hw_id)\ngroup by (host_name, hw_id) ({_STEPS}{{{JOB}}})",
            "uncorrected ECC {{hw_id}}", "B"),
         _t(f"sum by (host_name, hw_id) ({_XID}{{{GPUS}}})\nand on (host_name, hw_id)\n"
            f"group by (host_name, hw_id) ({_STEPS}{{{JOB}}})", "XIDs {{hw_id}}", "C")],
        _pos(0, 7, 24, 7), "sdc_suspect of the ranks on the selected GPUs (and sdc_suspect_ambiguous, a verdict "
        "that could not tell which side is faulty) against their uncorrected ECC and XID counters: a verdict that "
        "coincides with hardware errors points at the hardware.")
    fleet = Table(
        title="Fleet: GPU strikes in the ledger", dataSource=DS, gridPos=_pos(0, 14, 24, 7),
        description="Strikes per GPU in the responder's ledger (sdc_fleet_gpu_strikes, from the responder's "
                    "/metrics): every page the responder acted on is a strike for its GPU, and a second strike within "
                    "the strike window runs the replace command. Passing a screen does not clear strikes; "
                    "`sdc-telemetry fleet` prints the same list. The selected job's GPUs without a strike show 0. The "
                    "Host and GPU variables narrow it (All: the whole fleet).",
        # The job's GPUs without a strike are listed at 0, so a clean GPU reads as clean rather than as missing.
        targets=[_t(f"sort_desc(\n  max by (hw_id, host_name) ({_STRIKES}{{{GPUS}}})\n  or\n"
                    f"  0 * max by (hw_id, host_name) ({_STEPS}{{{JOB}, {GPUS}}})\n)", table=True)],
        overrides=[*_table_overrides({"hw_id": "GPU UUID", "host_name": "Host", "Value": "Strikes"}),
                   # One strike: watch it; a second within the window: replace it.
                   {"matcher": {"id": "byName", "options": "Value"},
                    "properties": [{"id": "custom.cellOptions", "value": {"type": "color-background"}},
                                   {"id": "thresholds", "value": {"mode": "absolute", "steps": [
                                       {"color": "transparent", "value": None}, {"color": "orange", "value": 1},
                                       {"color": "red", "value": 2}]}}]}],
    )
    panels: list[Any] = [suspects, health, verdicts, fleet]
    for i, f in enumerate(GPU):
        panels.append(_gpu_panel(f, 8 * (i % 3), 21 + 7 * (i // 3)))
    templating = [*_job_host(),
                  _variable("gpu", "GPU (hw_id)", f'label_values({_STEPS}{{{JOB}, host_name=~"$host"}}, hw_id)')]
    return Dashboard(
        title="GPU health", uid=GPU_UID, tags=["sdc", "gpu"], timezone="browser", refresh="30s",
        description="NVML counters of the training GPUs, per host and GPU, next to the SDC verdicts.",
        time=Time("now-6h", "now"), schemaVersion=SCHEMA_VERSION, panels=panels,
        templating=Templating(list=templating),
        links=[DashboardLink(title="SDC overview", type="link", uri=f"/d/{OVERVIEW_UID}/sdc-overview",
                             includeVars=True, keepTime=True, icon="dashboard")],
    ).auto_panel_ids()


# -- output -----------------------------------------------------------------------------------------------------------

def dashboards() -> dict[str, Dashboard]:
    """The grafanalib dashboards by uid."""
    return {OVERVIEW_UID: _overview(), GPU_UID: _gpu()}


def dashboard_json(dashboard: Dashboard) -> str:
    """Deterministic JSON text of a dashboard (sorted keys, two-space indent, trailing newline)."""
    return json.dumps(dashboard.to_json_data(), sort_keys=True, indent=2, cls=DashboardEncoder) + "\n"


def generate(out_dir: str | Path) -> list[Path]:
    """Write every dashboard as ``<out_dir>/<file>.json``; return the paths.

    >>> generate("dashboards")                                      # doctest: +SKIP
    [PosixPath('dashboards/sdc-overview.json'), PosixPath('dashboards/sdc-gpu-health.json')]
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for uid, dash in dashboards().items():
        path = out / FILES[uid]
        path.write_text(dashboard_json(dash), encoding="utf-8")
        paths.append(path)
    return paths


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref: str
    expr: str


def _panels(doc: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for panel in doc.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def panel_queries(job: str = ".*", host: str = ".*", rank: str = ".*", gpu: str = ".*", *,
                  tolerance: str = DEFAULT_TOLERANCE, rate_interval: str = "1m", interval: str = "15s",
                  range_: str = "1h", docs: Iterable[Mapping[str, Any]] | None = None) -> list[PanelQuery]:
    """Every panel query of every dashboard with the variables substituted (values are regexes, as Grafana sends
    them for multi-value variables). ``docs`` are dashboard JSON documents (default: the generated ones)."""
    if docs is None:
        docs = [json.loads(dashboard_json(d)) for d in dashboards().values()]
    values = {"job": job, "host": host, "rank": rank, "gpu": gpu, "tolerance": tolerance,
              "__rate_interval": rate_interval, "__interval": interval, "__range": range_}
    pattern = re.compile(r"\$\{?(" + "|".join(sorted(values, key=len, reverse=True)) + r")\}?")
    out = []
    for doc in docs:
        for panel in _panels(doc):
            for target in panel.get("targets", []):
                expr = pattern.sub(lambda m: values[m.group(1)], target["expr"])
                if "$" in expr:
                    raise ValueError(f"unsubstituted variable in {doc['title']} / {panel['title']}: {expr}")
                out.append(PanelQuery(doc["title"], panel["title"], target["refId"], expr))
    return out
