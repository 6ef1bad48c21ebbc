"""torchtitan's own trainer (0.3.0, its llama3 debug model) with an SDCMonitor in its training step, 4 gloo CPU ranks
under torchrun: pipeline x FSDP (pp=2 x dp_shard=2), the recipe of docs/integrations.md (examples/torchtitan)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torchtitan")

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "torchtitan" / "train.py"
STEPS = 4
FAULT_STEP = 2   # an audit step (replay_every=2): steps 0 and 2 are replayed
FAULT_RANK = 3   # pp stage 1 (the last stage, which holds ``norm``), dp_shard index 1
REPLICA = {1, 3}  # the ranks of data-parallel replica dp_shard=1: stage 0 and stage 1


def run_titan(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """torchrun 4 ranks of examples/torchtitan/train.py; the per-rank reports the SDCTrainer wrote."""
    report = tmp_path / "report"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SDC_TITAN_ASSETS": str(tmp_path / "tokenizer"),
           "SDC_TITAN_DUMP": str(tmp_path / "outputs")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone", str(TRAIN),
           "--config", "llama3_cpu_debugmodel_sdc", "--training.steps", str(STEPS), "--sdc.report", str(report),
           *args]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    reports = [json.loads(p.read_text()) for p in sorted(report.glob("rank*.json"))]
    return proc, reports


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str],
                                                                    list[dict[str, Any]]]:
    if os.environ.get("CI"):
        import torchtitan  # noqa: F401  (in CI a missing torchtitan fails here, never skips)
    return run_titan(tmp_path_factory.mktemp("titan-pp"),
                     "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                     "--sdc.weights_every", "1", "--sdc.replay_every", "2", "--sdc.on_suspect", "record",
                     "--sdc.perturb_output_at", str(FAULT_STEP), "--sdc.fault_rank", str(FAULT_RANK))


def test_pipeline_fsdp_trainer_runs_every_check_and_names_the_faulty_stage(
        pipeline_run: tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]) -> None:
    """torchtitan's Trainer (pp=2 x dp_shard=2, FSDP2 stage modules, 1F1B) trains 4 steps with the monitor on every
    rank: gradient checks and the replay pass on the healthy audit (step 0) with no check erroring, and a transient
    compute fault on rank 3 (stage 1) at step 2 is found by the replay, naming rank 3 among the ranks of its replica
    (dp_shard=1: the perturbed activations' gradients flow back into stage 0 too) and no rank of the other."""
    proc, reports = pipeline_run
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"TITAN_DONE steps={STEPS}" in proc.stdout, out[-4000:]
    losses = [float(x) for x in re.findall(r"step:\s+\d+\s+loss:\s+([\d.]+)", re.sub(r"\x1b\[[0-9;]*m", "", out))]
    assert losses and losses[-1] < losses[0], losses  # it trains
    assert [r["rank"] for r in reports] == [0, 1, 2, 3], out[-4000:]
    for r in reports:
        assert r["refusal"] is None, r
        assert r["monitored_steps"] == STEPS and r["steps"] == STEPS, r
        checks = r["checks"]
        assert checks.get("grad_local", {}).get("pass", 0) >= STEPS - 1, (r["rank"], checks)
        assert checks.get("replay", {}).get("pass", 0) >= 1, (r["rank"], checks)
        assert not any(result == "error" for per in checks.values() for result in per), (r["rank"], checks)
        replay = [i for i in r["incidents"] if i["check"] == "replay"]
        assert [i["step"] for i in replay] == [FAULT_STEP], r
        suspects = set(replay[0]["suspect_ranks"])
        assert FAULT_RANK in suspects and suspects <= REPLICA, r
        assert replay[0]["coordinate"]["dp_shard"] == 1, replay[0]
        assert not [i for i in r["incidents"] if i["step"] < FAULT_STEP], r
    assert reports[FAULT_RANK]["faults_fired"], reports[FAULT_RANK]
