"""The demo command, as `make demo` runs it without Prometheus/Alertmanager (--no-stack): a fault named as predicted,
the page posted to the authenticated responder, the drain, the strike in the ledger, the drill screen naming the
device, and the checkpoint to resume from chosen by the last passing audit; a healthy run with no incident."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


def _demo(*flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "sdc_telemetry.ops.cli", "demo", "--no-stack", "--metrics-port", "0", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("flags,check,rank,alert,chosen,passed_over", [
    (("--steps", "24"), "weights", 2, "SDCWeightFingerprintMismatch", 10, 15),
    (("--fault", "compute", "--fault-rank", "1", "--fault-step", "3", "--replay-every", "5", "--steps", "8"),
     "replay", 1, "SDCReplayMismatch", 0, 3),
])
def test_demo_shows_the_whole_response_loop_and_exits_0(flags: tuple[str, ...], check: str, rank: int, alert: str,
                                                        chosen: int, passed_over: int) -> None:
    """With a fault the demo names the suspect, a page without the token gets 401, the page with it drains the
    suspect's host, the ledger holds one strike for its GPU, the drill screen names that GPU's stand-in, and the
    checkpoint at the last passing audit is chosen over a later certified one; exit 0."""
    out = _demo(*flags)
    text = out.stdout
    assert out.returncode == 0, text + out.stderr
    assert "step    5/" in text and "every rank stopped at step" in text and "outcome: as predicted" in text
    m = re.search(rf"check {check} suspects host (\S+) rank {rank} GPU (\S+)", text)
    assert m, text
    host, gpu = m.groups()
    assert "responder refused a page posted without the bearer token: HTTP 401, nothing ran" in text
    assert f"page posted to the responder with the bearer token as Alertmanager would (no stack here): HTTP 200: " \
           f"{alert} [critical] host={host} rank={rank} gpu={gpu}" in text
    assert f"responder (authenticated) drained the node (recorder in place of scontrol): drain {host} rank={rank} " \
           f"gpu={gpu} alert={alert}" in text
    assert f"strike 1 for GPU {gpu} on {host} ({alert}, job sdc-demo, check {check})" in text
    fleet = [line.split() for line in text.splitlines() if line.startswith(f"{gpu} ")]
    assert fleet and fleet[0][:4] == [gpu, host, "1", "1"] and "0 pass / 1 fail" in " ".join(fleet[0]), text
    assert f"a DRILL, it flips one bit in cpu-worker:{rank}'s results" in text
    odd = [line for line in text.splitlines() if "ODD:" in line and line.startswith("  cpu-worker:")]
    assert len(odd) == 1 and odd[0].split()[:2] == [f"cpu-worker:{rank}", gpu], text
    assert f"screen verdict: odd device cpu-worker:{rank} ({gpu}) named and recorded in the ledger" in text
    step = re.search(r"expected check \w+ at step (\d+)", text)
    assert step and f"--before-step {step.group(1)}" in text, text
    assert f"checkpoint-{passed_over}.pt: passed over: step {passed_over} is after the last audit that passed " \
           f"before the incident (step {chosen})" in text
    assert f"resume from checkpoint-{chosen}.pt (step {chosen})" in text


def test_demo_healthy_run_exits_0_without_incidents() -> None:
    """--fault none: no incident, nothing paged or drained, the checkpoint verifies intact, exit 0."""
    out = _demo("--fault", "none", "--steps", "12")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 incident(s)" in out.stdout and "outcome: healthy run" in out.stdout
    assert "checkpoint of step 6: intact" in out.stdout
    assert "drained" not in out.stdout and "responder" not in out.stdout


def test_demo_exits_1_when_the_predicted_incident_never_comes() -> None:
    """A run that ends before its fault step: no incident, no page, no drain, so the demo says so and exits 1."""
    out = _demo("--steps", "12")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "outcome: NOT as predicted" in out.stdout
    assert "FAILED: no page to post" in out.stderr and "drained the node" not in out.stdout


def test_demo_refuses_a_rank_outside_the_world() -> None:
    """A fault rank that does not exist is a usage error (exit 2) naming the flag."""
    out = _demo("--fault-rank", "9")
    assert out.returncode == 2 and "--fault-rank" in out.stderr
