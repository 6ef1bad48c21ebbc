"""SDCTrainer in a real Hugging Face Trainer DDP run of a tiny GPT-2 on 3 gloo ranks (CPU): a weight bit flip, and
healthy audited runs with gradient accumulation (loss normalised by the Trainer, and by the model's token count)."""

from __future__ import annotations

import os

import pytest

import sdc_telemetry as sdc
from sdc_telemetry.testing import spawn_ranks

if not os.environ.get("CI"):
    pytest.importorskip("transformers")

from . import _transformers_ranks
from ._ranks import assert_healthy_and_replayed, launcher_env

WORLD = 3
QUIET = {"metrics_port": None, "nvml": False}


@pytest.fixture(scope="module")
def runs() -> list[list[dict]]:
    healthy = sdc.SDCConfig(weights_every=1, replay_every=2, on_suspect="raise", **QUIET)
    plan = [
        {"config": sdc.SDCConfig(weights_every=1, replay_every=0, on_suspect="raise", **QUIET), "steps": 6,
         "flip": (1, 2)},
        {"config": healthy, "steps": 4, "accumulate": 2},
        {"config": healthy, "steps": 4, "accumulate": 3, "token_normalised": False},
    ]
    return spawn_ranks(_transformers_ranks.run, WORLD, (plan,), timeout=300, rank_env=launcher_env(WORLD))


def test_weight_bit_flip_stops_training_on_every_rank(runs: list[list[dict]]) -> None:
    """A bit flipped in one rank's weights before step 2 is found by the weight check at step 2, naming that rank,
    and SDCDetected ends train() on every rank before the update."""
    for rank, per_run in enumerate(runs):
        r = per_run[0]
        assert r["model_type"] == "DistributedDataParallel"
        assert r["raised"] == (2, "weights", [1]), f"rank {rank}: {r}"
        assert r["incidents"] == [(2, "weights", [1])]
        assert r["global_step"] == 2  # stopped before step 2's update
        assert r["closed"]


@pytest.mark.parametrize("run", [1, 2], ids=["token-normalised-accumulate-2", "trainer-divided-accumulate-3"])
def test_healthy_accumulated_training_replays_without_incident(runs: list[list[dict]], run: int) -> None:
    """With gradient accumulation and replay_every=2, four healthy steps raise nothing, and steps 0 and 2 are
    replayed bit for bit on every rank (two replay passes; weights pass every step)."""
    assert_healthy_and_replayed([per_run[run] for per_run in runs])


def test_bad_arguments_are_named() -> None:
    """A sdc_config that is not an SDCConfig, or a sdc_loss_fn that is not callable, is refused naming it."""
    from sdc_telemetry.transformers import SDCTrainer

    with pytest.raises(TypeError, match="sdc_config must be an SDCConfig"):
        SDCTrainer(sdc_config={"replay_every": 2})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sdc_loss_fn must be callable"):
        SDCTrainer(sdc_loss_fn="loss")  # type: ignore[arg-type]
