"""SDCCallback in a real Lightning DDP fit on 3 gloo ranks (CPU): a weight bit flip and a healthy audited run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import sdc_telemetry as sdc
from sdc_telemetry.faults import flip_bit
from sdc_telemetry.testing import spawn_ranks

if not os.environ.get("CI"):
    pytest.importorskip("lightning")

from . import _lightning_ranks
from ._ranks import assert_healthy_and_replayed, launcher_env, verify_cli

WORLD = 3
QUIET = {"metrics_port": None, "nvml": False}


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lightning-ckpt")


@pytest.fixture(scope="module")
def fits(checkpoint_dir: Path) -> list[list[dict]]:
    runs = [
        {"config": sdc.SDCConfig(weights_every=1, replay_every=0, on_suspect="raise", **QUIET), "steps": 6,
         "flip": (1, 2)},
        {"config": sdc.SDCConfig(weights_every=1, replay_every=2, on_suspect="raise", **QUIET), "steps": 4,
         "accumulate": 2, "checkpoint_dir": str(checkpoint_dir)},
        {"config": sdc.SDCConfig(weights_every=1, replay_every=0, on_suspect="raise", **QUIET), "steps": 4,
         "nan": (1, 2), "skip_nonfinite": True},
        {"config": sdc.SDCConfig(weights_every=1, replay_every=0, on_suspect="raise", verdicts="deferred", **QUIET),
         "steps": 4, "nan": (1, 2), "skip_nonfinite": True},
    ]
    return spawn_ranks(_lightning_ranks.run, WORLD, (runs,), timeout=300, rank_env=launcher_env(WORLD))


def test_weight_bit_flip_stops_fit_on_every_rank(fits: list[list[dict]]) -> None:
    """A bit flipped in one rank's weights before step 2 is found by the weight check at step 2, naming that rank,
    and SDCDetected ends fit on every rank before the update."""
    for rank, per_run in enumerate(fits):
        r = per_run[0]
        assert r["model_type"] == "DistributedDataParallel"
        assert r["raised"] == (2, "weights", [1]), f"rank {rank}: {r}"
        assert r["incidents"] == [(2, "weights", [1])]
        assert r["global_step"] == 2  # stopped before step 2's update
        assert r["closed"]


def test_a_nan_in_one_ranks_batch_is_data_and_skip_nonfinite_keeps_it_out_of_the_weights(
        fits: list[list[dict]]) -> None:
    """SDCCallback(skip_nonfinite=True), one rank's batch with a NaN at step 2, decided before the update or one step
    later: a numerics incident with verdict data (nobody named, fit goes on under on_suspect="raise"), and every
    rank skipped that update, so the weights stay finite."""
    for path in (2, 3):
        for rank, per_run in enumerate(fits):
            r = per_run[path]
            assert r["raised"] is None and r["global_step"] == 4, f"rank {rank}: {r}"
            assert r["incidents"] == [(2, "grad_local", [])] and r["verdicts"] == ["data"], r
            assert r["weights_finite"], f"rank {rank}: the NaN update reached the weights"


def test_healthy_accumulated_fit_replays_without_incident(fits: list[list[dict]]) -> None:
    """With accumulate_grad_batches=2 and replay_every=2, four healthy steps raise nothing, and steps 0 and 2 are
    replayed on every rank (two replay passes, weights pass every step and at each of the two checkpoints)."""
    assert_healthy_and_replayed([per_run[1] for per_run in fits], certificates=2)


def test_checkpoints_carry_a_certificate_of_their_global_step(fits: list[list[dict]], checkpoint_dir: Path) -> None:
    """Every .ckpt ModelCheckpoint saved holds a certificate labelled with the checkpoint's own global_step and the
    last audit that had passed (audits at steps 0 and 2); verify-checkpoint exits 0 on it, and 1 naming the tensor
    after one element of the saved weights is flipped."""
    assert fits[0][1]["global_step"] == 4
    saved = sorted(checkpoint_dir.glob("ckpt-*.ckpt"))
    assert [p.name for p in saved] == ["ckpt-2.ckpt", "ckpt-4.ckpt"]
    for path, audit in zip(saved, (0, 2), strict=True):
        ckpt = torch.load(path, weights_only=True)
        cert = ckpt["sdc_certificate"]
        step = int(path.stem.removeprefix("ckpt-"))
        assert (cert["step"], ckpt["global_step"], cert["last_passing_audit"]) == (step, step, audit)
        assert set(cert["fingerprints"]) == set(ckpt["state_dict"]) == {"net.0.weight", "net.0.bias", "net.3.weight",
                                                                        "net.3.bias"}
        assert cert["world_size"] == WORLD
        r = verify_cli(path)
        assert r.returncode == 0 and "intact: 4 tensors verified" in r.stdout, r.stderr
        flip_bit(ckpt["state_dict"]["net.3.weight"], index=4, bit=1)
        torch.save(ckpt, checkpoint_dir / f"flipped-{path.name}")
        r = verify_cli(checkpoint_dir / f"flipped-{path.name}")
        assert r.returncode == 1 and r.stdout.splitlines()[1:] == ["  net.3.weight"], r.stdout


def test_bad_arguments_are_named() -> None:
    """A config that is not an SDCConfig, a loss_fn that is not callable, or a skip_nonfinite that is not a bool, is
    refused naming the argument."""
    from sdc_telemetry.lightning import SDCCallback

    with pytest.raises(TypeError, match="config must be an SDCConfig"):
        SDCCallback(config={"replay_every": 2})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        SDCCallback(loss_fn="loss")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="skip_nonfinite must be a bool"):
        SDCCallback(skip_nonfinite=1)  # type: ignore[arg-type]
