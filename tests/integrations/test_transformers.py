"""SDCTrainer in a real Hugging Face Trainer DDP run of a tiny GPT-2 on 3 gloo ranks (CPU): a weight bit flip, and
healthy audited runs with gradient accumulation (loss normalised by the Trainer, and by the model's token count)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import sdc_telemetry as sdc
from sdc_telemetry.faults import flip_bit
from sdc_telemetry.testing import spawn_ranks

if not os.environ.get("CI"):
    pytest.importorskip("transformers")

from . import _transformers_ranks
from ._ranks import assert_healthy_and_replayed, launcher_env, verify_cli

WORLD = 3
QUIET = {"metrics_port": None, "nvml": False}


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf-out")


@pytest.fixture(scope="module")
def runs(save_dir: Path) -> list[list[dict]]:
    healthy = sdc.SDCConfig(weights_every=1, replay_every=2, on_suspect="raise", **QUIET)
    plan = [
        {"config": sdc.SDCConfig(weights_every=1, replay_every=0, on_suspect="raise", **QUIET), "steps": 6,
         "flip": (1, 2)},
        {"config": healthy, "steps": 4, "accumulate": 2, "save_dir": str(save_dir)},
        {"config": healthy, "steps": 4, "accumulate": 3, "token_normalised": False},
        {"config": sdc.SDCConfig(weights_every=1, replay_every=0, **QUIET), "steps": 4, "nan_grad": (1, 2),
         "skip_nonfinite": True},
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
    replayed bit for bit on every rank (two replay passes; weights pass every step, and at each of the first run's
    two checkpoints)."""
    assert_healthy_and_replayed([per_run[run] for per_run in runs], certificates=2 if run == 1 else 0)


def test_a_nan_one_ranks_computation_makes_is_named_and_skip_nonfinite_keeps_it_out_of_the_weights(
        runs: list[list[dict]]) -> None:
    """SDCTrainer(sdc_skip_nonfinite=True), a NaN made in one rank's local gradient at step 2: the triggered audit
    names that rank (a partner recomputing the micro-batch gets finite gradients), and every rank skipped that
    update, so the weights stay finite and training goes on to the end."""
    for rank, per_run in enumerate(runs):
        r = per_run[3]
        assert r["incidents"] == [(2, "grad_local", [1])] and r["verdicts"] == ["transient"], f"rank {rank}: {r}"
        assert r["global_step"] == 4 and r["weights_finite"], f"rank {rank}: {r}"


def test_checkpoint_directories_carry_a_certificate_of_their_step(runs: list[list[dict]], save_dir: Path) -> None:
    """checkpoint-2 and checkpoint-4 each hold sdc_certificate.json labelled with the directory's own step (the
    Trainer's global_step, not the monitor's last step index) and the last audit that had passed (steps 0 and 2);
    verify-checkpoint exits 0 on the directory, and 1 naming the tensor after one element of model.safetensors is
    flipped."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    assert runs[0][1]["global_step"] == 4
    dirs = sorted(save_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert [d.name for d in dirs] == ["checkpoint-2", "checkpoint-4"]
    for directory, audit in zip(dirs, (0, 2), strict=True):
        cert = json.loads((directory / "sdc_certificate.json").read_text())
        state = json.loads((directory / "trainer_state.json").read_text())
        step = int(directory.name.split("-")[1])
        assert (cert["step"], state["global_step"], cert["last_passing_audit"]) == (step, step, audit)
        assert cert["world_size"] == WORLD and "transformer.wte.weight" in cert["fingerprints"]
        r = verify_cli(directory)
        assert r.returncode == 0 and f"(step {step}, last passing audit {audit})" in r.stdout, r.stdout + r.stderr
        weights = directory / "model.safetensors"
        with safe_open(str(weights), framework="pt") as f:
            tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        flip_bit(tensors["transformer.h.0.mlp.c_proj.weight"], index=9, bit=4)
        save_file(tensors, str(weights), metadata=meta)
        r = verify_cli(directory)
        assert r.returncode == 1 and r.stdout.splitlines()[1:] == ["  transformer.h.0.mlp.c_proj.weight"], r.stdout


def test_bad_arguments_are_named() -> None:
    """A sdc_config that is not an SDCConfig, a sdc_loss_fn that is not callable, or a sdc_skip_nonfinite that is
    not a bool, is refused naming it."""
    from sdc_telemetry.transformers import SDCTrainer

    with pytest.raises(TypeError, match="sdc_config must be an SDCConfig"):
        SDCTrainer(sdc_config={"replay_every": 2})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sdc_loss_fn must be callable"):
        SDCTrainer(sdc_loss_fn="loss")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sdc_skip_nonfinite must be a bool"):
        SDCTrainer(sdc_skip_nonfinite="yes")  # type: ignore[arg-type]
