"""The generated alert and recording rules, their promtool unit tests and the Alertmanager routing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from sdc_telemetry.ops import alerts
from sdc_telemetry.sinks.metrics import FAMILIES, IDENTITY_LABELS
from tests.promtool import rule_cases

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "alerts"
RUNBOOK = ROOT / "docs" / "runbook.md"

# Alert names and severities on-call routing relies on.
CONTRACT = {
    "SDCWeightFingerprintMismatch": "critical",
    "SDCUpdateMismatch": "critical",
    "SDCReplayMismatch": "critical",
    "SDCNonFiniteGradient": "critical",
    "SDCCommunicationCorruption": "critical",
    "SDCChecksStalled": "warning",
    "SDCCheckFailing": "warning",
    "SDCTrainingNonFinite": "warning",
    "SDCExporterDown": "warning",
    "SDCPagerFailing": "warning",
    "GPUUncorrectableECCErrors": "warning",
    "GPUXidErrors": "warning",
}
SUSPECT_CHECKS = {"SDCWeightFingerprintMismatch": "weights", "SDCUpdateMismatch": "update",
                  "SDCReplayMismatch": "replay", "SDCNonFiniteGradient": "grad_local",
                  "SDCCommunicationCorruption": "grad_reduced"}
ABOUT_ONE_RANK = set(CONTRACT) - {"GPUUncorrectableECCErrors", "GPUXidErrors", "SDCTrainingNonFinite"}


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


def _rules(kind: str = "alert") -> list[dict[str, Any]]:
    doc = yaml.safe_load((ALERTS / alerts.RULES_FILE).read_text())
    return [r for g in doc["groups"] for r in g["rules"] if kind in r]


def _slugs(markdown: str) -> set[str]:
    """GitHub heading anchors."""
    out = set()
    for line in markdown.splitlines():
        m = re.match(r"#+\s+(.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_regenerating_gives_the_checked_in_files(tmp_path: Path) -> None:
    """alerts/ holds exactly what generate() and the promtool case builder write, byte for byte."""
    paths = alerts.generate(tmp_path)
    assert sorted([p.name for p in paths] + [alerts.TESTS_FILE]) == sorted(p.name for p in ALERTS.iterdir())
    for p in paths:
        assert p.read_bytes() == (ALERTS / p.name).read_bytes(), f"alerts/{p.name} is stale: run sdc-telemetry alerts"
    assert rule_cases.text() == (ALERTS / alerts.TESTS_FILE).read_text(), \
        f"alerts/{alerts.TESTS_FILE} is stale: run python -m tests.promtool.rule_cases"


def _ambiguous(rule: dict[str, Any]) -> bool:
    return rule["labels"].get("ambiguous") == "true"


def test_rules_have_the_contract_names_severities_and_annotations() -> None:
    """Every contract alert exists with its severity (a suspect alert's ambiguous twin: warning), summary,
    description and a runbook_url to an existing anchor."""
    rules = _rules()
    assert {r["alert"] for r in rules} == set(CONTRACT)
    anchors = _slugs(RUNBOOK.read_text())
    for r in rules:
        severity = "warning" if _ambiguous(r) else CONTRACT[r["alert"]]
        assert r["labels"]["severity"] == severity, r["alert"]
        ann = r["annotations"]
        assert ann["summary"] and ann["description"], r["alert"]
        path, anchor = ann["runbook_url"].split("#")
        assert path.endswith("docs/runbook.md") and anchor in anchors, (r["alert"], anchor)


def test_critical_alerts_read_only_the_latched_suspect_gauge() -> None:
    """Each page fires on sdc_suspect{check} of its check over the event window, never on a raw non-finite counter,
    and carries the check label (SDCNonFiniteGradient also phase="local")."""
    critical = [r for r in _rules() if r["labels"]["severity"] == "critical"]
    assert {r["alert"] for r in critical} == set(SUSPECT_CHECKS)
    for r in critical:
        check = SUSPECT_CHECKS[r["alert"]]
        assert f'max_over_time(sdc_suspect{{check="{check}"}}[{alerts.EVENT_WINDOW}])' in r["expr"], r["alert"]
        assert set(re.findall(r"\b(sdc_[a-z_]+)\b", r["expr"])) == {"sdc_suspect"}, r["alert"]
        assert r["labels"]["check"] == check
    nonfinite = next(r for r in critical if r["alert"] == "SDCNonFiniteGradient")
    assert nonfinite["labels"]["phase"] == "local"
    assert not any(_ambiguous(r) for r in critical)


def test_each_suspect_alert_has_an_ambiguous_warning_twin_reading_the_ambiguous_gauge() -> None:
    """For each critical suspect alert one more rule with its name, severity warning and ambiguous="true" fires on
    sdc_suspect_ambiguous{check} over the event window, never on sdc_suspect."""
    twins = [r for r in _rules() if _ambiguous(r)]
    assert sorted(r["alert"] for r in twins) == sorted(SUSPECT_CHECKS)
    for r in twins:
        check = SUSPECT_CHECKS[r["alert"]]
        assert r["labels"]["severity"] == "warning" and r["labels"]["check"] == check
        assert f'max_over_time(sdc_suspect_ambiguous{{check="{check}"}}[{alerts.EVENT_WINDOW}])' in r["expr"]
        assert set(re.findall(r"\b(sdc_[a-z_]+)\b", r["expr"])) == {"sdc_suspect_ambiguous"}, r["alert"]
        assert "not paged" in r["annotations"]["summary"]
        assert r["annotations"]["runbook_url"].endswith("#ambiguous-sdc-verdicts")


def test_pager_failing_warns_per_rank_on_an_increase_of_the_pager_failure_counter() -> None:
    """SDCPagerFailing reads sdc_pager_failures_total per rank (an increase, or a counter born by a failure)."""
    rule = next(r for r in _rules() if r["alert"] == "SDCPagerFailing")
    assert rule["labels"] == {"severity": "warning"}
    assert f"increase(sdc_pager_failures_total[{alerts.EVENT_WINDOW}]) > 0" in rule["expr"]
    assert "unless sdc_pager_failures_total offset" in rule["expr"]
    assert rule["expr"].startswith("max by (service_name, host_name, rank, local_rank, hw_id)")


def test_per_rank_alerts_keep_and_template_the_suspects_identity() -> None:
    """Alerts about one rank aggregate by the identity labels and name host, rank and GPU in their text."""
    for r in _rules():
        text = r["annotations"]["summary"] + r["annotations"]["description"]
        wanted = ("host_name", "rank", "hw_id") if r["alert"] in ABOUT_ONE_RANK else \
            ("service_name",) if r["alert"] == "SDCTrainingNonFinite" else ("host_name", "hw_id")
        for label in wanted:
            assert f"$labels.{label}" in text, (r["alert"], label)
        if r["alert"] in ABOUT_ONE_RANK:
            assert "service_name, host_name, rank, local_rank, hw_id" in r["expr"], r["alert"]


def test_training_nonfinite_is_per_job_without_node_labels() -> None:
    """SDCTrainingNonFinite aggregates to service_name only: a numerics event names no node."""
    rule = next(r for r in _rules() if r["alert"] == "SDCTrainingNonFinite")
    assert rule["expr"].startswith("min by (service_name) (")
    assert "host_name" not in rule["labels"] and rule.get("for")


def test_exporter_down_needs_the_last_scrape_to_say_monitoring_was_on() -> None:
    """SDCExporterDown joins up == 0 with the carried last sdc_monitor_closed == 0, recorded in the same group first."""
    group = yaml.safe_load((ALERTS / alerts.RULES_FILE).read_text())["groups"][0]["rules"]
    assert group[0]["record"] == "sdc:monitor_closed:last_scraped" and "sdc_monitor_closed" in group[0]["expr"]
    down = next(r for r in group if r.get("alert") == "SDCExporterDown")
    assert 'up{job="sdc"} == 0' in down["expr"] and "(sdc:monitor_closed:last_scraped == 0)" in down["expr"]


def test_rules_take_metric_names_from_the_table() -> None:
    """Every metric a rule reads is a family of sdc_telemetry.sinks.metrics, a recording rule, or Prometheus's up."""
    names = {f.name for f in FAMILIES} | {f"{f.name}_{s}" for f in FAMILIES if f.kind == "histogram"
                                          for s in ("bucket", "sum", "count")}
    records = {r["record"] for r in _rules("record")}
    labels = set(IDENTITY_LABELS) | {label for f in FAMILIES for label in f.labels}
    for r in _rules() + _rules("record"):
        for word in set(re.findall(r"\b((?:sdc|hw|gpu)_[a-z_]+)\b", r["expr"])) - labels:
            assert word in names, (r.get("alert") or r["record"], word)
        for word in re.findall(r"\b(sdc:[a-z_:0-9]+)", r["expr"]):
            assert word in records, word


def test_recording_rules_roll_up_to_host_and_job() -> None:
    """Every rollup aggregates away rank, local_rank and hw_id (a rollup per rank would not be one)."""
    rollups = yaml.safe_load((ALERTS / alerts.RULES_FILE).read_text())["groups"][2]
    assert rollups["name"] == "sdc-rollups" and rollups["rules"]
    assert rollups["interval"] == "1m"  # the per-rank histogram rollup is heavy at 16,384 ranks
    for r in rollups["rules"]:
        for by in re.findall(r"by \(([^)]*)\)", r["expr"].split("\n")[0]):
            assert not {"rank", "hw_id", "local_rank"} & {x.strip() for x in by.split(",")}, r["record"]
    names = {r["record"] for r in rollups["rules"]}
    assert {"sdc:checks:rate5m", "sdc:checks:coverage5m", "sdc:steps:rate5m", "sdc:suspect_ranks:count"} <= names


def test_promtool_tests_cover_every_alert_firing_and_quiet() -> None:
    """The promtool unit tests expect every alert to fire somewhere and to stay quiet somewhere."""
    doc = yaml.safe_load((ALERTS / alerts.TESTS_FILE).read_text())
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in doc["tests"]:
        for check in case["alert_rule_test"]:
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    assert fired == set(CONTRACT) and quiet == set(CONTRACT)
    names = " | ".join(case["name"] for case in doc["tests"])
    for story in ("healthy job pages nothing", "replay broken on every audit", "NaN on every rank",
                  "ended with close()", "vanished while monitoring", "ambiguous weights suspect warns",
                  "failed direct pages warn SDCPagerFailing"):
        assert story in names, story


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


def test_suspect_alert_is_the_rules_alert() -> None:
    """suspect_alert() gives the rule's alertname, its labels plus the identity, and the rule's annotations rendered
    for that rank (promtool checks the same against Prometheus's own rendering)."""
    ident = {"host_name": "n7", "rank": 2, "local_rank": 1, "hw_id": "GPU-9", "service_instance_id": "ignored"}
    for name, check in SUSPECT_CHECKS.items():
        pushed = alerts.suspect_alert(check, ident, "llm")
        rule = next(r for r in _rules() if r["alert"] == name and not _ambiguous(r))
        assert pushed["labels"] == {"alertname": name, **rule["labels"], "service_name": "llm", "host_name": "n7",
                                    "rank": "2", "local_rank": "1", "hw_id": "GPU-9"}
        assert pushed["annotations"]["runbook_url"] == rule["annotations"]["runbook_url"]
        assert "rank 2 on host n7 (GPU GPU-9)" in pushed["annotations"]["summary"]
        assert "{{" not in pushed["annotations"]["description"]


def test_ambiguous_suspect_alert_is_the_ambiguous_rules_alert() -> None:
    """suspect_alert(ambiguous=True) gives the ambiguous twin rule's labels (severity warning, ambiguous="true") and
    its annotations rendered for the rank: never critical."""
    ident = {"host_name": "n7", "rank": 2, "local_rank": 1, "hw_id": "GPU-9"}
    for name, check in SUSPECT_CHECKS.items():
        pushed = alerts.suspect_alert(check, ident, "llm", ambiguous=True)
        rule = next(r for r in _rules() if r["alert"] == name and _ambiguous(r))
        assert pushed["labels"] == {"alertname": name, **rule["labels"], "service_name": "llm", "host_name": "n7",
                                    "rank": "2", "local_rank": "1", "hw_id": "GPU-9"}
        assert pushed["labels"]["severity"] == "warning" and pushed["labels"]["ambiguous"] == "true"
        assert pushed["annotations"] == {k: alerts.render_template(v, pushed["labels"])
                                         for k, v in rule["annotations"].items()}
        assert "{{" not in pushed["annotations"]["description"]


@pytest.mark.parametrize(("args", "message"), [
    (("bogus", {"host_name": "h", "rank": 0, "local_rank": 0, "hw_id": "g"}, "llm"), "check must be one of"),
    (("weights", {"host_name": "h", "rank": 0}, "llm"), "identity_labels lacks"),
    (("weights", {"host_name": "h", "rank": 0, "local_rank": 0, "hw_id": "g"}, ""), "service_name"),
])
def test_suspect_alert_refuses_bad_input(args: tuple[Any, ...], message: str) -> None:
    """An unknown check, a missing identity label or an empty job name is a ValueError naming it."""
    with pytest.raises(ValueError, match=message):
        alerts.suspect_alert(*args)


def test_amtool_check_config() -> None:
    """amtool accepts the Alertmanager config."""
    out = _run(_tool("amtool"), "check-config", str(ALERTS / alerts.ALERTMANAGER_FILE))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize(("labels", "receivers"), [
    (["severity=critical", "alertname=SDCWeightFingerprintMismatch"], "responder,pager"),
    (["severity=critical", "alertname=SDCNonFiniteGradient", "phase=local"], "responder,pager"),
    (["severity=critical", "alertname=SomeOtherCritical"], "pager"),
    (["severity=warning", "alertname=SDCWeightFingerprintMismatch", "ambiguous=true"], "ticket"),
    (["severity=critical", "alertname=SDCReplayMismatch", "ambiguous=true"], "pager"),
    (["severity=warning", "alertname=SDCPagerFailing"], "ticket"),
    (["severity=warning", "alertname=GPUXidErrors"], "ticket"),
    (["severity=warning", "alertname=SDCExporterDown"], "ticket"),
])
def test_amtool_routes_sdc_criticals_to_responder_and_pager_and_warnings_to_ticket(labels: list[str],
                                                                                   receivers: str) -> None:
    """Critical SDC alerts reach the responder and (continue) the pager; other criticals, and anything
    ambiguous="true", never the responder; warnings the ticket receiver."""
    out = _run(_tool("amtool"), "config", "routes", "test", f"--config.file={ALERTS / alerts.ALERTMANAGER_FILE}",
               *labels)
    assert out.returncode == 0 and out.stdout.strip() == receivers, out.stdout + out.stderr


def test_alertmanager_groups_by_job_and_host_and_inhibits_a_paged_hosts_warnings() -> None:
    """Grouping, receivers, inhibition and the commented PagerDuty/Slack examples of alertmanager.yml."""
    text = (ALERTS / alerts.ALERTMANAGER_FILE).read_text()
    doc = yaml.safe_load(text)
    assert doc["route"]["group_by"] == ["service_name", "host_name"]
    receivers = {r["name"]: r for r in doc["receivers"]}
    assert receivers["pager"]["webhook_configs"][0]["url"].endswith("/pager")
    assert receivers["ticket"]["webhook_configs"][0]["url"].endswith("/ticket")
    responder = receivers["responder"]["webhook_configs"][0]
    assert responder["url"] == "http://sdc-responder:9095/alerts"
    assert responder["http_config"] == {"authorization": {"type": "Bearer",
                                                          "credentials_file": alerts.RESPONDER_CREDENTIALS_FILE}}
    assert alerts.RESPONDER_CREDENTIALS_FILE == "/etc/alertmanager/sdc-responder.token"
    first = doc["route"]["routes"][0]
    assert first["receiver"] == "responder" and first["continue"] is True
    assert 'ambiguous!="true"' in first["matchers"] and 'severity="critical"' in first["matchers"]
    # Only this project's suspect alert names reach the responder.
    assert set(first["matchers"][1].split('"')[1].split("|")) == set(SUSPECT_CHECKS)
    assert doc["inhibit_rules"] == [{"source_matchers": ['severity="critical"'],
                                     "target_matchers": ['severity="warning"'], "equal": ["host_name"]}]
    assert "  # pagerduty_configs:" in text and "  # slack_configs:" in text


def test_alertmanager_config_without_responder() -> None:
    """responder_url=None leaves the responder route and receiver out (LocalStack's default)."""
    doc = alerts.alertmanager_config("http://x/pager", "http://x/ticket", responder_url=None)
    assert [r["receiver"] for r in doc["route"]["routes"]] == ["pager", "ticket"]
    assert {r["name"] for r in doc["receivers"]} == {"pager", "ticket"}


def test_alertmanager_config_sends_the_responder_token_file_only_when_given(tmp_path: Path) -> None:
    """responder_credentials_file becomes http_config.authorization.credentials_file of the responder webhook (and
    amtool accepts it); without it no authorization is configured."""
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    doc = alerts.alertmanager_config(responder_url="https://r:9095/alerts", responder_credentials_file=str(token))
    hook = next(r for r in doc["receivers"] if r["name"] == "responder")["webhook_configs"][0]
    assert hook["http_config"]["authorization"]["credentials_file"] == str(token)
    config = tmp_path / "am.yml"
    config.write_text(alerts.to_yaml(doc))
    out = _run(_tool("amtool"), "check-config", str(config))
    assert out.returncode == 0, out.stdout + out.stderr
    bare = alerts.alertmanager_config(responder_url="http://r:9095/alerts")
    assert "http_config" not in next(r for r in bare["receivers"] if r["name"] == "responder")["webhook_configs"][0]


def test_render_handles_every_construct_the_rules_use() -> None:
    """The template renderer used for pushed alerts and expectations leaves no template behind."""
    for r in alerts.RULES:
        for text in (r.summary, r.description):
            rendered = alerts.render_template(text, {"rank": "1", "host_name": "h", "hw_id": "g", "check": "c",
                                                     "instance": "i:1", "xid": "79", "service_name": "j"}, "3")
            assert "{{" not in rendered, (r.name, rendered)
