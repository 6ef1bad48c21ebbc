"""The certificate the framework integrations save with a checkpoint, in one process: labelled with the framework's
step, absent (never stale) when nothing can be certified, and never breaking the save unless asked to raise."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import sdc_telemetry as sdc
from sdc_telemetry.core.certificate import WeightCertificate
from sdc_telemetry.integrations._certify import CERTIFICATE_FILE, certify, write_certificate


def _monitor(verdicts: str = "immediate") -> sdc.SDCMonitor:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    config = sdc.SDCConfig(replay_every=0, metrics_port=None, nvml=False, verdicts=verdicts)  # type: ignore[arg-type]
    return sdc.SDCMonitor(model, torch.optim.SGD(model.parameters(), lr=0.1), config=config)


@pytest.mark.parametrize("verdicts", ["immediate", "deferred"])
def test_certificate_is_labelled_with_the_framework_step_and_lists_buffers(verdicts: str) -> None:
    """certify() returns the monitor's certificate with the framework's step and the module's buffer names, so that
    the saved state dict (buffers included) verifies against it; with deferred verdicts after a step whose verdict
    is still pending (decided first)."""
    monitor = _monitor(verdicts)
    try:
        x = torch.randn(3, 4)
        with monitor.step(x) as step:
            step.backward(monitor.module(x).square().mean())
        monitor.optimizer.step()
        cert = certify(monitor, 10, "checkpoint-10")
        assert cert is not None and cert.step == 10
        assert set(cert.buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
        assert cert.verify(monitor.module.state_dict()) == []
    finally:
        monitor.close()
    assert certify(monitor, 11, "checkpoint-11") is None  # closed: nothing is checked across replicas any more


class _Refusing:
    """A running monitor whose certificate() refuses, as while a hardware episode is open."""

    def __init__(self, on_suspect: str, error: Exception) -> None:
        self.closed = False
        self.config = SimpleNamespace(on_suspect=on_suspect)
        self.error = error
        self.counted: list[str] = []
        self.sinks = SimpleNamespace(internal_error=self.counted.append)

    def certificate(self) -> WeightCertificate:
        raise self.error


def _open_episode() -> sdc.SDCDetected:
    suspect = sdc.RankIdentity(rank=1, local_rank=1, host_name="node-b", hw_id="cpu:node-b:1")
    return sdc.SDCDetected(sdc.Incident(step=6, check="replay", suspect_ranks=(1,), suspects=(suspect,)))


def test_open_hardware_episode_saves_uncertified_or_raises(caplog: pytest.LogCaptureFixture) -> None:
    """With on_suspect="record" an open hardware episode leaves the checkpoint uncertified (logged); with "raise"
    the SDCDetected propagates; any other failure is logged and counted, and the save goes on."""
    record: Any = _Refusing("record", _open_episode())
    with caplog.at_level(logging.WARNING, logger="sdc_telemetry"):
        assert certify(record, 8, "checkpoint-8") is None
    assert "hardware suspect is open (replay at step 6)" in caplog.text
    with pytest.raises(sdc.SDCDetected):
        certify(_Refusing("raise", _open_episode()), 8, "checkpoint-8")  # type: ignore[arg-type]
    broken: Any = _Refusing("raise", RuntimeError("boom"))
    assert certify(broken, 8, "checkpoint-8") is None and broken.counted == ["certificate"]


def test_write_certificate_is_atomic_and_removes_a_stale_one(tmp_path: Path) -> None:
    """write_certificate writes sdc_certificate.json (no temporary file left) and, with None, removes an older one so
    that a checkpoint saved again into its directory never keeps a certificate of other weights."""
    cert = WeightCertificate.from_tensors(4, {"w": torch.ones(3)})
    directory = tmp_path / "checkpoint-4"
    write_certificate(str(directory), cert)
    assert [p.name for p in directory.iterdir()] == [CERTIFICATE_FILE]
    assert WeightCertificate.from_dict(json.loads((directory / CERTIFICATE_FILE).read_text())) == cert
    write_certificate(str(directory), None)
    assert not (directory / CERTIFICATE_FILE).exists()
    write_certificate(str(directory), None)  # nothing to remove: no error
