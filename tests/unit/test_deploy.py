"""docker-compose.yml and deploy/: structure checks (Docker itself only where it runs), promtool on the config, the
responder's command and the trainer run for real."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from sdc_telemetry.ops import alerts, dashboards
from sdc_telemetry.ops.stack import prometheus_config

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DEPLOY = ROOT / "deploy"
TOKEN = DEPLOY / "demo-only.sdc-responder.token"


def _compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return doc


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, DEPLOY / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """container path -> host path (relative to the repository)."""
    out = {}
    for v in service.get("volumes", []):
        host, container = v.split(":")[:2]
        out[container] = host
    return out


def test_compose_has_the_stack_services() -> None:
    """Prometheus, Alertmanager, Grafana, the demo trainer and the webhook sink are services."""
    services = _compose()["services"]
    assert set(services) >= {"prometheus", "alertmanager", "grafana", "trainer", "webhook-sink", "sdc-responder"}
    build = services["trainer"]["build"]
    assert (ROOT / build["context"] / build["dockerfile"]).is_file()


def test_compose_mounts_exist_and_wire_the_configs() -> None:
    """Every bind mount exists; Prometheus gets deploy/prometheus.yml and alerts/, Alertmanager alerts/alertmanager.yml,
    Grafana the provisioning and dashboards/."""
    services = _compose()["services"]
    for name, svc in services.items():
        for container, host in _mounts(svc).items():
            assert (ROOT / host).exists(), (name, host, container)
    prom = _mounts(services["prometheus"])
    assert prom["/etc/prometheus/prometheus.yml"] == "./deploy/prometheus.yml"
    assert prom["/etc/prometheus/rules"] == "./alerts"
    am = _mounts(services["alertmanager"])
    assert am["/etc/alertmanager/alertmanager.yml"] == "./alerts/alertmanager.yml"
    assert am[alerts.RESPONDER_CREDENTIALS_FILE] == f"./{TOKEN.relative_to(ROOT)}"
    graf = _mounts(services["grafana"])
    assert graf["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    assert graf["/var/lib/grafana/dashboards"] == "./dashboards"


def test_prometheus_config_scrapes_the_trainer_as_job_sdc_and_loads_the_rules() -> None:
    """deploy/prometheus.yml: job sdc on the trainer's four rank ports, the responder's /metrics (the fleet panel's
    strikes) as a job of its own, the rules file, the Alertmanager."""
    doc = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in doc["scrape_configs"]}
    assert jobs["sdc"]["static_configs"][0]["targets"] == [f"trainer:{9860 + r}" for r in range(4)]
    assert jobs["sdc-responder"]["static_configs"][0]["targets"] == ["sdc-responder:9095"]
    assert doc["rule_files"] == [f"/etc/prometheus/rules/{alerts.RULES_FILE}"]
    assert doc["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]
    assert set(doc) == set(prometheus_config([], [], []))  # the shape LocalStack uses


def test_promtool_check_config(tmp_path: Path) -> None:
    """promtool accepts deploy/prometheus.yml with the rules path pointed at alerts/."""
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is not on PATH (CI=true: a missing binary is a failure)")
        pytest.skip("promtool is not on PATH")
    doc = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    doc["rule_files"] = [str(ROOT / "alerts" / alerts.RULES_FILE)]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(doc))
    out = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_alertmanager_webhooks_reach_the_sink_and_responder_services() -> None:
    """The checked-in Alertmanager config posts pages and tickets to the compose webhook-sink, and critical SDC alerts
    to the sdc-responder service running `sdc-telemetry respond` on the port it listens on."""
    services = _compose()["services"]
    sink = services["webhook-sink"]
    port = sink["command"][sink["command"].index("--port") + 1]
    doc = yaml.safe_load((ROOT / "alerts" / alerts.ALERTMANAGER_FILE).read_text())
    urls = {r["name"]: r["webhook_configs"][0]["url"] for r in doc["receivers"]}
    assert urls.pop("responder") == "http://sdc-responder:9095/alerts"
    for url in urls.values():
        assert url.startswith(f"http://webhook-sink:{port}/")
    responder = services["sdc-responder"]["command"]
    assert responder[:4] == ["sdc-telemetry", "respond", "--listen", "0.0.0.0:9095"] and "--command" in responder
    webhook = next(r for r in doc["receivers"] if r["name"] == "responder")["webhook_configs"][0]
    assert webhook["http_config"]["authorization"]["credentials_file"] == alerts.RESPONDER_CREDENTIALS_FILE


def test_responder_and_alertmanager_share_the_demo_only_token() -> None:
    """sdc-responder runs with --bearer-token-file (never --insecure-no-auth), and the file it reads is the file
    Alertmanager sends from: the demo-only token, one word that says so."""
    services = _compose()["services"]
    command = services["sdc-responder"]["command"]
    assert "--insecure-no-auth" not in command
    token_path = command[command.index("--bearer-token-file") + 1]
    assert _mounts(services["sdc-responder"])[token_path] == \
        _mounts(services["alertmanager"])[alerts.RESPONDER_CREDENTIALS_FILE] == f"./{TOKEN.relative_to(ROOT)}"
    token = TOKEN.read_text()
    assert token.strip() and not any(c.isspace() for c in token.strip()) and "DEMO-ONLY" in token
    assert "DEMO-ONLY" in COMPOSE.read_text()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, token: str | None) -> int:
    body = json.dumps({"alerts": [{"status": "firing", "labels": {
        "alertname": "SDCWeightFingerprintMismatch", "severity": "critical", "host_name": "gpu-node-7", "rank": "2",
        "hw_id": "GPU-2", "service_name": "sdc-demo"}}]}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_compose_responder_command_starts_and_takes_only_the_token(tmp_path: Path) -> None:
    """The sdc-responder service's command, run here with its mounts mapped to the repository files: it starts
    (it would refuse without authentication), a page without the token gets 401, the demo token's page 200 and a
    (dry-run) action."""
    services = _compose()["services"]
    mounts = _mounts(services["sdc-responder"])
    command = [ROOT / mounts[a] if a in mounts else a for a in services["sdc-responder"]["command"]]
    port = _free_port()
    command[command.index("--listen") + 1] = f"127.0.0.1:{port}"
    argv = [sys.executable, "-m", "sdc_telemetry.ops.cli", *map(str, command[1:])]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "SDC_STATE_DIR": str(tmp_path)})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        while line and "listening on" not in line:
            line = proc.stdout.readline()
        assert "listening on" in line, f"the responder did not start (exit {proc.poll()})"
        url = f"http://127.0.0.1:{port}/alerts"
        assert _post(url, None) == 401
        assert _post(url, "not-the-token") == 401
        assert _post(url, TOKEN.read_text().strip()) == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
            health = json.loads(r.read())
        assert (health["unauthorized"], health["actions"], health["dry_run"]) == (2, 1, True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_demo_trainer_runs_under_torchrun_and_names_the_faulty_rank(tmp_path: Path) -> None:
    """deploy/demo_trainer.py as the image runs it (torchrun, one process per rank), short: 3 ranks, a weight bit
    flip on rank 2 at step 3; it exits 0 and its incident file names rank 2."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this interpreter")
    env = {**os.environ, "SDC_DEMO_STEPS": "6", "SDC_DEMO_FAULT_STEP": "3", "SDC_DEMO_STEP_DELAY": "0",
           "SDC_DEMO_SERVE_AFTER": "0", "SDC_METRICS_PORT": "0", "SDC_INCIDENT_DIR": str(tmp_path)}
    out = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node=3", str(DEPLOY / "demo_trainer.py")],
                         capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    incidents = [json.loads(line) for line in (tmp_path / "incidents.jsonl").read_text().splitlines()]
    assert [(i["check"], i["step"], i["suspect_ranks"]) for i in incidents[:1]] == [("weights", 3, [2])]


def test_grafana_provisioning_points_at_prometheus_and_the_dashboards() -> None:
    """The datasource is the compose Prometheus; the dashboard provider reads the mounted dashboards/."""
    prov = DEPLOY / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert (ds["type"], ds["url"]) == ("prometheus", "http://prometheus:9090")
    provider = yaml.safe_load((prov / "dashboards" / "sdc.yml").read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    home = _compose()["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.endswith(dashboards.FILES[dashboards.OVERVIEW_UID])


def test_demo_trainer_runs_four_ranks_with_torchrun_and_a_late_fault() -> None:
    """The trainer image runs torchrun with 4 processes; its plan injects a fault minutes in and keeps serving."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "torchrun" in dockerfile and "--nproc-per-node=4" in dockerfile and "download.pytorch.org/whl/cpu" \
        in dockerfile
    plan = _module("demo_trainer").plan_from_env({})
    assert plan.fault == "weight-bitflip" and plan.on_suspect == "record"
    assert plan.fault_step * plan.step_delay >= 120, "the fault should come after a few minutes"
    assert plan.steps > plan.fault_step and plan.serve_after > 0


def test_webhook_sink_prints_a_line_per_alert() -> None:
    """The sink's log line names alert, status, severity, host, rank and GPU."""
    sink = _module("webhook_sink")
    lines = sink.describe("/pager", {"alerts": [{"status": "firing", "labels": {
        "alertname": "SDCWeightFingerprintMismatch", "severity": "critical", "host_name": "gpu-node-7", "rank": "2",
        "hw_id": "GPU-1", "service_name": "sdc-demo"}, "annotations": {"summary": "weights differ"}}]})
    assert lines == ["[pager] FIRING SDCWeightFingerprintMismatch severity=critical host=gpu-node-7 rank=2 gpu=GPU-1 "
                     "job=sdc-demo: weights differ"]


def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker:
        try:
            if subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30).returncode == 0:
                return [docker, "compose"]
        except (OSError, subprocess.TimeoutExpired):
            pass
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def test_docker_compose_config_validates() -> None:
    """`docker compose config` accepts the file (only where Docker Compose is installed)."""
    cli = _compose_cli()
    if cli is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true: docker-compose must be installed (.ci/run installs Debian's package)")
        pytest.skip("neither `docker compose` nor docker-compose is installed")
    # Without our PYTHONPATH: the legacy docker-compose is a Python program and must not import this interpreter's
    # standard library (its _ssl fails to load under another Python).
    out = subprocess.run([*cli, "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stdout + out.stderr
