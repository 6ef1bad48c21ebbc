"""SDCConfig validation and SDC_* environment parsing."""

from __future__ import annotations

import pytest

from sdc_telemetry import SDCConfig
from sdc_telemetry.core.config import DEFAULT_METRICS_PORT


def test_defaults_are_production_ready() -> None:
    """Weights every step, replay every 100, record, metrics on a port clear of node_exporter and dcgm."""
    c = SDCConfig()
    assert (c.weights_every, c.replay_every, c.grad_checks, c.on_suspect) == (1, 100, True, "record")
    assert c.metrics_port == DEFAULT_METRICS_PORT
    assert not any(DEFAULT_METRICS_PORT <= p < DEFAULT_METRICS_PORT + 8 for p in (9100, 9400, 9464))


@pytest.mark.parametrize("field,value", [
    ("weights_every", -1), ("replay_every", 1.5), ("replay_every", True), ("grad_checks", "yes"),
    ("mode", "fuzzy"), ("tolerance", 0.0), ("tolerance", 2.0), ("tolerance", "big"), ("on_suspect", "panic"),
    ("metrics_port", 70000), ("metrics_port", 0), ("metrics_host", ""), ("otlp_endpoint", "collector:4318"),
    ("job_name", ""), ("nvml", 1),
])
def test_bad_values_raise_naming_the_field(field: str, value: object) -> None:
    """Each invalid value raises ValueError whose message names the field."""
    with pytest.raises(ValueError, match=field):
        SDCConfig(**{field: value})  # type: ignore[arg-type]


def test_from_env_reads_sdc_variables() -> None:
    """SDC_* variables fill the fields; none/off disable optional ones; overrides win."""
    env = {"SDC_REPLAY_EVERY": "50", "SDC_METRICS_PORT": "none", "SDC_ON_SUSPECT": "raise", "SDC_GRAD_CHECKS": "0",
           "SDC_TOLERANCE": "0.01", "SDC_JOB_NAME": "llm", "SDC_OTLP_ENDPOINT": "http://otel:4318/v1/metrics"}
    c = SDCConfig.from_env(env, weights_every=5)
    assert (c.replay_every, c.metrics_port, c.on_suspect, c.grad_checks, c.tolerance, c.job_name) == \
        (50, None, "raise", False, 0.01, "llm")
    assert c.weights_every == 5 and c.otlp_endpoint == "http://otel:4318/v1/metrics"


def test_from_env_names_the_bad_variable() -> None:
    """A malformed variable's error names the variable."""
    with pytest.raises(ValueError, match="SDC_WEIGHTS_EVERY"):
        SDCConfig.from_env({"SDC_WEIGHTS_EVERY": "often"})
    with pytest.raises(ValueError, match="SDC_NVML"):
        SDCConfig.from_env({"SDC_NVML": "maybe"})
