"""`sdc-telemetry screen`: seeded known-answer workloads on three CPU worker processes standing in for devices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sdc_telemetry.ops.cli import main
from sdc_telemetry.ops.ledger import Ledger
from sdc_telemetry.ops.screen import WORKLOADS, DeviceResult, _judge, screen_device


def test_consistent_devices_exit_0_and_a_drill_fault_names_the_device(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Three CPU workers agree bit for bit (exit 0); --drill-fault 1 flips one bit in worker 1's results, which
    is named as the odd device (exit 1); both results are in the ledger."""
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    args = ["screen", "--cpu-workers", "3", "--repeat", "2", "--ledger", url, "--host-name", "node-s"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and sum(line.endswith("  consistent") for line in out.splitlines()) == 3
    assert main([*args, "--drill-fault", "1"]) == 1
    out = capsys.readouterr().out
    assert "ODD DEVICE: cpu-worker:1 (cpu:node-s:1)" in out and "ODD DEVICE: cpu-worker:0" not in out
    assert "matmul_fp32 differs bit for bit" in out
    with Ledger(url) as ledger:
        got = [(r.device, r.hw_id, r.passed) for r in ledger.screens("node-s")]
    assert got[:3] == [(f"cpu-worker:{i}", f"cpu:node-s:{i}", True) for i in range(3)]
    assert got[3:] == [("cpu-worker:0", "cpu:node-s:0", True), ("cpu-worker:1", "cpu:node-s:1", False),
                       ("cpu-worker:2", "cpu:node-s:2", True)]


def test_unusable_input_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """A drill device that does not exist, or zero workers, exit 2 naming the problem."""
    assert main(["screen", "--no-ledger", "--device-type", "cpu", "--drill-fault", "7"]) == 2
    assert "--drill-fault '7' names no device" in capsys.readouterr().err
    assert main(["screen", "--no-ledger", "--device-type", "cpu", "--cpu-workers", "0"]) == 2
    assert "--cpu-workers" in capsys.readouterr().err


def test_dcgm_absent_is_said_clearly(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """--dcgm without dcgmi installed says so and screens with the workloads anyway."""
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["screen", "--no-ledger", "--device-type", "cpu", "--cpu-workers", "2", "--repeat", "1", "--dcgm",
                 "--json"]) == 0
    captured = capsys.readouterr()
    assert "dcgmi not found" in captured.err
    assert json.loads(captured.out)["passed"] is True


def test_workloads_meet_their_known_answers() -> None:
    """On this CPU every workload is within its dtype's tolerance of the float64 reference, and repeats agree."""
    out = screen_device("cpu", seed=3, repeat=2, fault=False)
    assert set(out["errors"]) == set(WORKLOADS)
    assert all(out["errors"][w] <= WORKLOADS[w][1] for w in WORKLOADS), out["errors"]
    assert out["digests"][0] == out["digests"][1]


def _result(name: str, digest: str, reps: int = 1, model: str = "m") -> DeviceResult:
    return DeviceResult(name, name, model, [dict.fromkeys(WORKLOADS, digest) for _ in range(reps)],
                        dict.fromkeys(WORKLOADS, 0.0))


def test_judge_majority_no_majority_and_unstable_devices() -> None:
    """The minority device is odd; two that disagree are undecided; a device that does not repeat itself is odd;
    devices of different models are not compared with each other."""
    assert _judge([_result("a", "1"), _result("b", "2"), _result("c", "1")]) == (["b"], [])
    assert _judge([_result("a", "1"), _result("b", "2")]) == ([], ["a", "b"])
    unstable = _result("a", "1", reps=2)
    unstable.digests[1]["conv2d_fp32"] = "9"
    assert _judge([unstable, _result("b", "1", reps=2)]) == (["a"], [])
    assert _judge([_result("a", "1", model="x"), _result("b", "2", model="y")]) == ([], [])
    wrong = _result("w", "1")
    wrong.errors["matmul_bf16"] = 1.0
    assert _judge([wrong])[0] == ["w"] and "wrong answer" in wrong.problems[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_cuda_device_repeats_bit_for_bit() -> None:
    """On a GPU every workload repeats bit for bit and meets its known answer."""
    out = screen_device("cuda:0", seed=0, repeat=3, fault=False)
    assert out["digests"][0] == out["digests"][1] == out["digests"][2]
    assert all(out["errors"][w] <= WORKLOADS[w][1] for w in WORKLOADS), out["errors"]


def test_a_hung_or_killed_worker_names_its_device_in_bounded_time(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A worker that hangs is killed at --worker-timeout and one that is killed is seen at once: either names its
    device (exit 1, recorded as failed in the ledger) while the other devices' results still count."""
    import time

    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    base = ["screen", "--cpu-workers", "3", "--repeat", "1", "--ledger", url, "--host-name", "node-h",
            "--drill-fault", "2"]
    for kind, why in (("hang", "hung: no result within 3s"), ("die", "died: its worker process ended without a "
                                                                     "result (killed by signal 9)")):
        start = time.monotonic()
        assert main([*base, "--drill-kind", kind, "--worker-timeout", "3s"]) == 1
        took = time.monotonic() - start
        out = capsys.readouterr().out
        assert f"cpu-worker:2  cpu:node-h:2  ODD: {why}" in out, out
        assert "ODD DEVICE: cpu-worker:2 (cpu:node-h:2)" in out
        assert "ODD DEVICE: cpu-worker:0" not in out and "ODD DEVICE: cpu-worker:1" not in out
        assert took < 60, took
    with Ledger(url) as ledger:
        got = [(r.device, r.passed) for r in ledger.screens("node-h")]
    assert got == [("cpu-worker:0", True), ("cpu-worker:1", True), ("cpu-worker:2", False)] * 2
