"""The demo command, as `make demo` runs it: a fault named as predicted, and a healthy run with no incident."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _demo(*flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "sdc_telemetry.ops.cli", "demo", "--no-stack", "--metrics-port", "0", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("flags,needle", [
    (("--steps", "24"), "check weights suspects host"),
    (("--fault", "compute", "--fault-rank", "1", "--fault-step", "3", "--replay-every", "5", "--steps", "8"),
     "check replay suspects host"),
])
def test_demo_names_the_faulty_rank_and_exits_0(flags: tuple[str, ...], needle: str) -> None:
    """With a fault the demo prints progress, names the suspect's check, host, rank and GPU, and exits 0."""
    out = _demo(*flags)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "step    5/" in out.stdout and needle in out.stdout and "outcome: as predicted" in out.stdout
    assert "every rank stopped at step" in out.stdout


def test_demo_healthy_run_exits_0_without_incidents() -> None:
    """--fault none: no incident, exit 0."""
    out = _demo("--fault", "none", "--steps", "12")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 incident(s)" in out.stdout and "outcome: healthy run" in out.stdout


def test_demo_refuses_a_rank_outside_the_world() -> None:
    """A fault rank that does not exist is a usage error (exit 2) naming the flag."""
    out = _demo("--fault-rank", "9")
    assert out.returncode == 2 and "--fault-rank" in out.stderr
