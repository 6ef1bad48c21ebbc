"""The scripts in examples/ (the samples of docs/integrations.md) run under torchrun with gloo on CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import sdc_telemetry as sdc

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# No endpoint (ports are shared with other runs on this machine), no NVML, and no replay/weight check warnings.
ENV = {**os.environ, "SDC_METRICS_PORT": "none", "SDC_NVML": "0", "OMP_NUM_THREADS": "1"}
CHECK_WARNING = re.compile(r"sdc_telemetry: step \d+: (replay|weight)")
TEARDOWN_ABORT = "terminate called without an active exception"


def assert_finished(proc: subprocess.CompletedProcess[str], done: str) -> None:
    """Training finished (rank 0 printed ``done``) and the launcher saw no failure but gloo's teardown abort."""
    out = proc.stdout + proc.stderr
    assert done in proc.stdout, out[-3000:]
    if proc.returncode != 0:
        # With gloo on this torch a finished process can abort in interpreter teardown, after
        # destroy_process_group (SIGABRT, then torchrun SIGTERMs the others). Tolerated only after every step ran.
        codes = set(re.findall(r"exitcode\s+: (-?\d+) \(pid", out))
        assert TEARDOWN_ABORT in out and codes <= {"-6", "-15"}, out[-3000:]


def torchrun(script: str, *args: str, ranks: int = 2, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--standalone",
           str(EXAMPLES / script), *args]
    return subprocess.run(cmd, env=ENV, cwd=cwd, capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("script,args,done", [
    ("ddp_accumulate.py", ("--steps", "4"), "4 steps of 4 micro-batches (no_sync) without incident"),
    ("ddp_accumulate.py", ("--steps", "4", "--toggle"), "4 steps of 4 micro-batches (toggle) without incident"),
    ("ddp_grad_scaler.py", (), "8 mixed-precision steps with a GradScaler without incident"),
], ids=["no_sync", "require_backward_grad_sync", "grad_scaler"])
def test_accumulation_and_grad_scaler_examples_train_cleanly(script: str, args: tuple[str, ...], done: str) -> None:
    """The accumulation (both sync styles) and GradScaler samples train, replay and finish with no incident."""
    proc = torchrun(script, *args)
    out = proc.stdout + proc.stderr
    assert_finished(proc, done)
    assert "replay every 2" in out  # the replay check was on
    assert not CHECK_WARNING.search(out), out[-3000:]


def test_ddp_example_fire_drill_stops_every_rank_then_resumes_from_certified_checkpoint(tmp_path: Path) -> None:
    """A bit flipped on rank 2 after the step-9 checkpoint stops all 3 ranks at step 12 with exit code 75 naming
    rank 2; --resume verifies the certified checkpoint and goes on from step 10."""
    ckpt = str(tmp_path / "ck.pt")
    drill = torchrun("ddp_train.py", "--steps", "14", "--checkpoint", ckpt, "--flip-bit-at", "12", ranks=3)
    out = drill.stdout + drill.stderr
    assert drill.returncode != 0
    assert len(re.findall(rf"exitcode\s+: {sdc.EXIT_SDC} \(pid", out)) == 3, out[-3000:]
    # Ranks print concurrently to one pipe, so two lines can run together: match each message on its own.
    stops = re.findall(r"rank (\d): stopping: SDC incident: check=weights step=12 suspects: host=\S+ rank=(\d)", out)
    assert sorted(stops) == [("0", "2"), ("1", "2"), ("2", "2")], out[-3000:]

    resumed = torchrun("ddp_train.py", "--steps", "14", "--checkpoint", ckpt, "--resume")
    assert_finished(resumed, "trained steps 10..13 without incident")
    assert "from step 10" in resumed.stdout + resumed.stderr
