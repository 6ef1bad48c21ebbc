"""The generated alert rules, their promtool unit tests and the Alertmanager routing (DESIGN.md section 5)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from sdc_telemetry import alerts
from sdc_telemetry.metrics import FAMILIES, IDENTITY_LABELS

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "alerts"
RUNBOOK = ROOT / "docs" / "runbook.md"

CONTRACT = {
    "SDCWeightFingerprintMismatch": "critical",
    "SDCReplayMismatch": "critical",
    "SDCNonFiniteGradient": "critical",
    "SDCCommunicationCorruption": "critical",
    "SDCChecksStalled": "warning",
    "SDCExporterDown": "critical",
    "GPUUncorrectableECCErrors": "warning",
    "GPUXidErrors": "warning",
}
ABOUT_ONE_RANK = set(CONTRACT) - {"GPUUncorrectableECCErrors", "GPUXidErrors"}


def _tool(name: str) -> str:
    """Path of a real binary; a skip with the reason when it is missing, a failure when CI=true."""
    path = shutil.which(name)
    if path:
        return path
    if os.environ.get("CI") == "true":
        pytest.fail(f"{name} is not on PATH (CI=true: a missing binary is a failure)")
    pytest.skip(f"{name} is not on PATH")


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((ALERTS / alerts.RULES_FILE).read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def _slugs(markdown: str) -> set[str]:
    """GitHub heading anchors."""
    out = set()
    for line in markdown.splitlines():
        m = re.match(r"#+\s+(.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_regenerating_gives_the_checked_in_files(tmp_path: Path) -> None:
    """alerts/ holds exactly what generate() writes, byte for byte."""
    paths = alerts.generate(tmp_path)
    assert sorted(p.name for p in paths) == sorted(p.name for p in ALERTS.iterdir())
    for p in paths:
        assert p.read_bytes() == (ALERTS / p.name).read_bytes(), f"alerts/{p.name} is stale: run sdc-telemetry alerts"


def test_rules_have_the_contract_names_severities_and_annotations() -> None:
    """Every contract alert exists with its severity, summary, description and a runbook_url to an existing anchor."""
    rules = _rules()
    assert {r["alert"] for r in rules} == set(CONTRACT)
    anchors = _slugs(RUNBOOK.read_text())
    for r in rules:
        assert r["labels"]["severity"] == CONTRACT[r["alert"]], r["alert"]
        ann = r["annotations"]
        assert ann["summary"] and ann["description"], r["alert"]
        path, anchor = ann["runbook_url"].split("#")
        assert path.endswith("docs/runbook.md") and anchor in anchors, (r["alert"], anchor)


def test_per_rank_alerts_keep_and_template_the_suspects_identity() -> None:
    """Alerts about one rank aggregate by host_name, rank, hw_id and name them in summary or description."""
    for r in _rules():
        text = r["annotations"]["summary"] + r["annotations"]["description"]
        for label in ("host_name", "rank", "hw_id") if r["alert"] in ABOUT_ONE_RANK else ("host_name", "hw_id"):
            assert f"$labels.{label}" in text, (r["alert"], label)
        if r["alert"] in ABOUT_ONE_RANK and r["alert"] != "SDCExporterDown":
            assert re.search(r"by \([^)]*host_name[^)]*rank[^)]*hw_id", r["expr"]), r["alert"]
    phases = {r["labels"].get("phase") for r in _rules() if r["alert"] == "SDCNonFiniteGradient"}
    assert phases == {"local", "reduced"}


def test_rules_take_metric_names_from_the_table() -> None:
    """Every metric a rule reads is a family of sdc_telemetry.metrics (or Prometheus's own up)."""
    names = {f.name for f in FAMILIES}
    labels = set(IDENTITY_LABELS) | {label for f in FAMILIES for label in f.labels}
    for r in _rules():
        for word in set(re.findall(r"\b((?:sdc|hw|gpu)_[a-z_]+)\b", r["expr"])) - labels:
            assert word in names, (r["alert"], word)
    down = next(r for r in _rules() if r["alert"] == "SDCExporterDown")
    assert 'up{job="sdc"}' in down["expr"]


def test_single_step_events_use_a_window_over_the_latched_gauge() -> None:
    """SDC verdict alerts read the latched sdc_suspect over a window, so one scraped sample pages."""
    for name, check in (("SDCWeightFingerprintMismatch", "weights"), ("SDCReplayMismatch", "replay"),
                        ("SDCCommunicationCorruption", "grad_reduced")):
        expr = next(r["expr"] for r in _rules() if r["alert"] == name)
        assert f'max_over_time(sdc_suspect{{check="{check}"}}[{alerts.EVENT_WINDOW}])' in expr, name


def test_promtool_tests_cover_every_alert_firing_and_quiet() -> None:
    """The promtool unit tests expect every alert to fire somewhere and to stay quiet somewhere."""
    doc = yaml.safe_load((ALERTS / alerts.TESTS_FILE).read_text())
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in doc["tests"]:
        for check in case["alert_rule_test"]:
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    assert fired == set(CONTRACT) and quiet == set(CONTRACT)
    names = [case["name"] for case in doc["tests"]]
    assert any("healthy job pages nothing" in n for n in names)
    assert any("dead exporter pages" in n for n in names)


def test_promtool_check_rules() -> None:
    """promtool accepts the rule file."""
    out = _run(_tool("promtool"), "check", "rules", str(ALERTS / alerts.RULES_FILE))
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_unit_tests_pass() -> None:
    """promtool test rules passes for every alerts/*.test.yml."""
    tests = sorted(ALERTS.glob("*.test.yml"))
    assert tests
    out = _run(_tool("promtool"), "test", "rules", *map(str, tests))
    assert out.returncode == 0, out.stdout + out.stderr


def test_amtool_check_config() -> None:
    """amtool accepts the Alertmanager config."""
    out = _run(_tool("amtool"), "check-config", str(ALERTS / alerts.ALERTMANAGER_FILE))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize(("labels", "receiver"), [
    (["severity=critical", "alertname=SDCWeightFingerprintMismatch"], "pager"),
    (["severity=warning", "alertname=GPUXidErrors"], "ticket"),
])
def test_amtool_routes_critical_to_pager_and_warnings_to_ticket(labels: list[str], receiver: str) -> None:
    """Alertmanager's routing tree sends critical alerts to the pager and warnings to the ticket receiver."""
    out = _run(_tool("amtool"), "config", "routes", "test", f"--config.file={ALERTS / alerts.ALERTMANAGER_FILE}",
               *labels)
    assert out.returncode == 0 and out.stdout.strip() == receiver, out.stdout + out.stderr


def test_alertmanager_groups_by_job_and_host_and_inhibits_a_paged_hosts_warnings() -> None:
    """Grouping, receivers, inhibition and the commented PagerDuty/Slack examples of alertmanager.yml."""
    text = (ALERTS / alerts.ALERTMANAGER_FILE).read_text()
    doc = yaml.safe_load(text)
    assert doc["route"]["group_by"] == ["service_name", "host_name"]
    receivers = {r["name"]: r for r in doc["receivers"]}
    assert receivers["pager"]["webhook_configs"][0]["url"].endswith("/pager")
    assert receivers["ticket"]["webhook_configs"][0]["url"].endswith("/ticket")
    inhibit = doc["inhibit_rules"][0]
    assert inhibit == {"source_matchers": ['severity="critical"'], "target_matchers": ['severity="warning"'],
                       "equal": ["host_name"]}
    assert "  # pagerduty_configs:" in text and "  # slack_configs:" in text


def test_render_matches_what_the_promtool_expectations_assume() -> None:
    """The mini template renderer used to write expected annotations handles every construct the rules use."""
    for r in alerts.RULES:
        for text in (r.summary, r.description):
            rendered = alerts._render(text, {"rank": "1", "host_name": "h", "hw_id": "g", "check": "c",
                                             "instance": "i:1", "xid": "79"}, "3")
            assert "{{" not in rendered, (r.name, rendered)
