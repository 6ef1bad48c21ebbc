"""SDCConfig validation and SDC_* environment parsing."""

from __future__ import annotations

import pytest
import torch

import sdc_telemetry as sdc
from sdc_telemetry import SDCConfig
from sdc_telemetry.core.config import DEFAULT_METRICS_PORT


def test_defaults_are_production_ready() -> None:
    """Weights every step, replay every 100, record, verdicts before the update, metrics on a port clear of
    node_exporter and dcgm."""
    c = SDCConfig()
    assert (c.weights_every, c.replay_every, c.grad_checks, c.on_suspect) == (1, 100, True, "record")
    assert c.verdicts == "immediate"
    assert c.metrics_port == DEFAULT_METRICS_PORT
    assert not any(DEFAULT_METRICS_PORT <= p < DEFAULT_METRICS_PORT + 8 for p in (9100, 9400, 9464))


@pytest.mark.parametrize("field,value", [
    ("weights_every", -1), ("replay_every", 1.5), ("replay_every", True), ("grad_checks", "yes"),
    ("mode", "fuzzy"), ("tolerance", 0.0), ("tolerance", 2.0), ("tolerance", "big"), ("on_suspect", "panic"),
    ("metrics_port", 70000), ("metrics_port", 0), ("metrics_host", ""), ("otlp_endpoint", "collector:4318"),
    ("job_name", ""), ("nvml", 1), ("verdicts", "later"), ("verdicts", None), ("otlp_endpoint", "http://"),
    ("otlp_endpoint", "http://otel:4318/v1/metrics?x=1"), ("incident_dir", ""), ("incident_dir", "  "),
    ("metrics_host", "not a host!"), ("metrics_host", "-bad.example"), ("metrics_host", "a..b"),
])
def test_bad_values_raise_naming_the_field(field: str, value: object) -> None:
    """Each invalid value raises ValueError whose message names the field."""
    with pytest.raises(ValueError, match=field):
        SDCConfig(**{field: value})  # type: ignore[arg-type]


def test_from_env_reads_sdc_variables() -> None:
    """SDC_* variables fill the fields; none/off disable optional ones; overrides win."""
    env = {"SDC_REPLAY_EVERY": "50", "SDC_METRICS_PORT": "none", "SDC_ON_SUSPECT": "raise", "SDC_GRAD_CHECKS": "0",
           "SDC_TOLERANCE": "0.01", "SDC_JOB_NAME": "llm", "SDC_OTLP_ENDPOINT": "http://otel:4318/v1/metrics",
           "SDC_VERDICTS": "deferred"}
    c = SDCConfig.from_env(env, weights_every=5)
    assert c.verdicts == "deferred"
    assert (c.replay_every, c.metrics_port, c.on_suspect, c.grad_checks, c.tolerance, c.job_name) == \
        (50, None, "raise", False, 0.01, "llm")
    assert c.weights_every == 5 and c.otlp_endpoint == "http://otel:4318/v1/metrics"


def test_from_env_names_the_bad_variable() -> None:
    """A malformed variable's error names the variable."""
    with pytest.raises(ValueError, match="SDC_WEIGHTS_EVERY"):
        SDCConfig.from_env({"SDC_WEIGHTS_EVERY": "often"})
    with pytest.raises(ValueError, match="SDC_NVML"):
        SDCConfig.from_env({"SDC_NVML": "maybe"})


def test_numerics_signature_sees_the_settings_that_choose_kernels(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """cuDNN autotuning, TF32, matmul precision and deterministic algorithms each change the signature; auto mode
    is exact on the CPU and on a GPU only with deterministic algorithms and no autotuning."""
    from sdc_telemetry.core.identity import bitwise_reproducible, numerics_signature
    from sdc_telemetry.core.setup import resolve_mode

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    base = numerics_signature(cpu)
    for flag, value in ((torch.backends.cudnn, "benchmark"), (torch.backends.cudnn, "allow_tf32"),
                        (torch.backends.cuda.matmul, "allow_tf32")):
        before = getattr(flag, value)
        try:
            setattr(flag, value, not before)
            assert numerics_signature(cpu) != base, value
        finally:
            setattr(flag, value, before)
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium" if precision != "medium" else "highest")
        assert numerics_signature(cpu) != base
    finally:
        torch.set_float32_matmul_precision(precision)
    auto = sdc.SDCConfig(metrics_port=None, nvml=False)
    assert bitwise_reproducible(cpu) and resolve_mode(auto, None, cpu, False) == "exact"
    assert resolve_mode(auto, None, gpu, False) == "tolerance"  # non-deterministic kernels by default
    try:
        torch.use_deterministic_algorithms(True)
        assert numerics_signature(cpu) != base
        assert resolve_mode(auto, None, gpu, False) == "exact"
        monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
        assert resolve_mode(auto, None, gpu, False) == "tolerance"  # autotuning picks kernels per process
    finally:
        torch.use_deterministic_algorithms(False)
    assert resolve_mode(auto, [1, 2], cpu, False) == "tolerance"  # mixed stacks: tolerance whatever the device


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "127.0.0.1", "[::1]", "localhost", "node-7.cluster", "gpu07."])
def test_interface_addresses_and_host_names_are_accepted(host: str) -> None:
    """metrics_host takes IP literals and host names (whether this machine can bind it is checked at set-up)."""
    assert SDCConfig(metrics_host=host).metrics_host == host


def test_unknown_sdc_variables_are_named_in_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A typo such as SDC_ONSUSPECT is named (with the field it resembles) instead of ignored silently; the
    package's other variables are not."""
    env = {"SDC_ONSUSPECT": "raise", "SDC_FOO": "1", "SDC_HOST_NAME": "n1", "SDC_STATE_DIR": "/x",
           "SDC_DEMO_STEPS": "3", "SDC_REPLAY_EVERY": "5"}
    with caplog.at_level("WARNING", logger="sdc_telemetry"):
        c = SDCConfig.from_env(env)
    assert c.replay_every == 5 and c.on_suspect == "record"
    [record] = [r for r in caplog.records if "not SDCConfig fields" in r.getMessage()]
    assert record.getMessage().endswith("SDC_FOO, SDC_ONSUSPECT (did you mean SDC_ON_SUSPECT?)")
    caplog.clear()
    with caplog.at_level("WARNING", logger="sdc_telemetry"):
        SDCConfig.from_env({"SDC_HOST_NAME": "n1", "SDC_REPLAY_EVERY": "5"})
    assert not caplog.records
