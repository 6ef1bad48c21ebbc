"""torchtitan's own trainer (0.3.0, its llama3 debug model) with an SDCMonitor in its training step, gloo CPU ranks
under torchrun, the recipe of docs/integrations.md (examples/torchtitan): pipeline x FSDP (pp=2 x dp_shard=2, 1F1B
and Interleaved1F1B), FSDP x tensor parallelism (dp_shard=2 x tp=2, sequence-parallel norms, vocab-parallel loss)
on 4 ranks, and all three (pp=2 x dp_shard=2 x tp=2, and pp=2 x dp_replicate=2 x tp=2) on 8; its deepseek_v3 MoE
debug model with expert parallelism (dp_shard=4, ep=2) on 4."""

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
FAULT_RANK = 3   # pp: stage 1 (the last stage, which holds ``norm``), dp_shard 1; tp: dp_shard 1, tp 1
REPLICA = {1, 3}  # pp: the ranks of data-parallel replica dp_shard=1: stage 0 and stage 1
TP_REPLICA = {2, 3}  # tp: torchtitan's mesh is (fsdp, tp), so dp_shard=1 is ranks 2 (tp 0) and 3 (tp 1)

Run = tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]


def run_titan(tmp_path: Path, *args: str, ranks: int = 4, fault_rank: int = FAULT_RANK,
              config: str = "llama3_cpu_debugmodel_sdc") -> Run:
    """torchrun ``ranks`` ranks of examples/torchtitan/train.py with a fault drill at FAULT_STEP on ``fault_rank``;
    the per-rank reports the SDCTrainer wrote."""
    if os.environ.get("CI"):
        import torchtitan  # noqa: F401  (in CI a missing torchtitan fails here, never skips)
    report = tmp_path / "report"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SDC_TITAN_ASSETS": str(tmp_path / "tokenizer"),
           "SDC_TITAN_DUMP": str(tmp_path / "outputs")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--standalone", str(TRAIN),
           "--config", config, "--training.steps", str(STEPS), "--sdc.report", str(report),
           "--sdc.weights_every", "1", "--sdc.replay_every", "2", "--sdc.on_suspect", "record",
           "--sdc.perturb_output_at", str(FAULT_STEP), "--sdc.fault_rank", str(fault_rank), *args]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    reports = [json.loads(p.read_text()) for p in sorted(report.glob("rank*.json"))]
    return proc, reports


def check_run(run: Run, layout: str | None, checks_expected: set[str], fault_rank: int = FAULT_RANK
              ) -> list[dict[str, Any]]:
    """Shared assertions: it trained every step with the monitor on every rank, no refusal, the expected checks
    counted and none erroring, the healthy audit (step 0) passing and nothing found before the fault."""
    proc, reports = run
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"TITAN_DONE steps={STEPS}" in proc.stdout, out[-4000:]
    losses = [float(x) for x in re.findall(r"step:\s+\d+\s+loss:\s+([\d.]+)", re.sub(r"\x1b\[[0-9;]*m", "", out))]
    assert losses and losses[-1] < losses[0], losses  # it trains
    assert [r["rank"] for r in reports] == list(range(len(reports))) and len(reports) >= 4, out[-4000:]
    for r in reports:
        assert r["refusal"] is None, r
        assert layout is None or r["layout"] == layout, r
        assert r["monitored_steps"] == STEPS and r["steps"] == STEPS, r
        checks = r["checks"]
        assert set(checks) == checks_expected, (r["rank"], checks)
        assert checks["grad_local"].get("pass", 0) >= STEPS - 1, (r["rank"], checks)
        assert checks["replay"].get("pass", 0) >= 1, (r["rank"], checks)
        # no replica of a shard in these layouts: the weights are checked at rest, from the first update on
        assert checks["weights"].get("pass", 0) >= STEPS - 1, (r["rank"], checks)
        assert not any(result == "error" for per in checks.values() for result in per), (r["rank"], checks)
        assert not [i for i in r["incidents"] if i["step"] < FAULT_STEP], r
    assert reports[fault_rank]["faults_fired"], reports[fault_rank]
    return reports


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_titan(tmp_path_factory.mktemp("titan-pp"),
                     "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2")


@pytest.fixture(scope="module")
def interleaved_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_titan(tmp_path_factory.mktemp("titan-interleaved"),
                     "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                     "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                     "--parallelism.pipeline_parallel_layers_per_stage", "2", "--sdc.fault_module", "1.norm")


@pytest.fixture(scope="module")
def pp_tp_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_titan(tmp_path_factory.mktemp("titan-pp-tp"), "--parallelism.pipeline_parallel_degree", "2",
                     "--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2",
                     ranks=8, fault_rank=7)


@pytest.fixture(scope="module")
def replicate_tp_pp_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_titan(tmp_path_factory.mktemp("titan-dp-tp-pp"), "--parallelism.pipeline_parallel_degree", "2",
                     "--parallelism.data_parallel_replicate_degree", "2",
                     "--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2",
                     ranks=8, fault_rank=7)


@pytest.fixture(scope="module")
def moe_ep_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_titan(tmp_path_factory.mktemp("titan-moe-ep"), "--parallelism.data_parallel_shard_degree", "4",
                     "--parallelism.expert_parallel_degree", "2", "--sdc.mesh", "dense",
                     config="deepseek_v3_cpu_moe_debugmodel_sdc")


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_titan(tmp_path_factory.mktemp("titan-tp"),
                     "--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2")


def test_pipeline_fsdp_trainer_runs_every_check_and_names_the_faulty_stage(pipeline_run: Run) -> None:
    """torchtitan's Trainer (pp=2 x dp_shard=2, FSDP2 stage modules, 1F1B) trains 4 steps with the monitor on every
    rank: gradient checks and the replay pass on the healthy audit (step 0) with no check erroring, and a transient
    compute fault on rank 3 (stage 1) at step 2 is found by the replay, naming rank 3 among the ranks of its replica
    (dp_shard=1: the perturbed activations' gradients flow back into stage 0 too) and no rank of the other."""
    reports = check_run(pipeline_run, None, {"grad_local", "grad_reduced", "replay", "weights"})
    for r in reports:
        replay = [i for i in r["incidents"] if i["check"] == "replay"]
        assert [i["step"] for i in replay] == [FAULT_STEP], r
        suspects = set(replay[0]["suspect_ranks"])
        assert FAULT_RANK in suspects and suspects <= REPLICA, r
        assert replay[0]["coordinate"]["dp_shard"] == 1, replay[0]


def test_interleaved_trainer_passes_its_model_parts_and_names_the_faulty_stage(interleaved_run: Run) -> None:
    """torchtitan's Trainer with its Interleaved1F1B schedule: 4 stages of the debug model on pp=2 x dp_shard=2,
    two FSDP2 stage modules per rank, handed to the monitor as torchtitan's ``model_parts``. Every check passes on
    the healthy audit; a transient compute fault in the last stage's ``norm`` on rank 3 (pp rank 1's second stage,
    ``1.norm``) at step 2 is found by the replay and named on rank 3 alone, at stage 3 (the only stage after it:
    its output is the first that differs)."""
    reports = check_run(interleaved_run, None, {"grad_local", "grad_reduced", "replay", "weights"})
    for r in reports:
        pp = r["rank"] // 2  # torchtitan's mesh is (pp, dp_shard): pp rank q runs stages q and q + 2
        assert f"pipeline stages [{pp}, {pp + 2}] of 4" in r["describe"], r
        assert "ScheduleInterleaved1F1B" in r["describe"], r
        replay = [i for i in r["incidents"] if i["check"] == "replay"]
        assert [(i["step"], i["suspect_ranks"], i["stage"]) for i in replay] == [(FAULT_STEP, [FAULT_RANK], 3)], r


def test_fsdp_tp_trainer_runs_every_check_and_names_the_faulty_replica(tp_run: Run) -> None:
    """torchtitan's Trainer (dp_shard=2 x tp=2: its flat 'world' mesh unflattened to (fsdp, tp), sequence-parallel
    norms, vocab-parallel loss) trains 4 steps with the monitor on every rank: grad_local, grad_reduced and the exact
    replay pass on the healthy audit (step 0), none erroring, the weight check off (no dp_replicate replicas); a
    transient compute fault on rank 3 (dp_shard 1, tp 1) at step 2 is found by the replay, naming the ranks of its
    replica (the fault spreads to tp 0 through the tensor-parallel collectives) with their mesh coordinates."""
    reports = check_run(tp_run, "dp_shard x tp", {"grad_local", "grad_reduced", "replay", "weights"})
    for r in reports:
        assert r["checks"]["grad_reduced"].get("pass", 0) >= STEPS - 1, r
        replay = [i for i in r["incidents"] if i["check"] == "replay"]
        assert [i["step"] for i in replay] == [FAULT_STEP], r
        incident = replay[0]
        assert FAULT_RANK in incident["suspect_ranks"] and set(incident["suspect_ranks"]) <= TP_REPLICA, incident
        assert incident["coordinate"]["dp_shard"] == 1 and set(incident["coordinate"]) == {"dp_shard", "tp"}, incident
        assert incident["coordinates"][str(FAULT_RANK)] == {"dp_shard": 1, "tp": 1}, incident
        assert incident["verdict"] == "transient", incident


def test_pp_tp_trainer_runs_every_check_and_names_the_faulty_stage_tp_group(pp_tp_run: Run) -> None:
    """torchtitan's Trainer on 8 ranks, pp=2 x dp_shard=2 x tp=2 (tensor parallelism inside FSDP2 stage modules,
    sequence-parallel norms, loss parallelism; torchtitan's dense mesh handed over as ``mesh=``): every check passes
    on the healthy audit, among them the replay, whose rerun must sum the norms' Partial gradients over the
    micro-batches before redistributing them, as FSDP does; a transient compute fault in the last stage's ``norm``
    on rank 7 (pp 1, dp_shard 1, tp 1) is named on the tp ranks of that stage in that replica, 6 and 7, at stage 1."""
    reports = check_run(pp_tp_run, None, {"grad_local", "grad_reduced", "replay", "weights"}, fault_rank=7)
    for r in reports:
        assert "pp=2 x dp_shard=2 x tp=2" in r["describe"], r
        replay = [i for i in r["incidents"] if i["check"] == "replay"]
        assert [(i["step"], i["suspect_ranks"], i["stage"]) for i in replay] == [(FAULT_STEP, [6, 7], 1)], r
        assert replay[0]["coordinate"] == {"pp": 1, "dp_shard": 1, "tp": 0}, replay[0]


def test_replicate_tp_pp_trainer_votes_weights_and_names_the_faulty_stage_tp_group(replicate_tp_pp_run: Run) -> None:
    """torchtitan's Trainer on 8 ranks, dp_replicate=2 x tp=2 x pp=2 with no dp_shard (its stage modules HSDP over a
    shard dimension of 1: FSDP copies the local gradients instead of reduce-scattering them, and the monitor reads
    them at that copy): every check passes on the healthy audit, the weight vote across the two replicas from the
    first step; a transient compute fault in the last stage's ``norm`` on rank 7 (pp 1, dp_replicate 1, tp 1) is
    named on the tp ranks of that stage in that replica, 6 and 7, at stage 1."""
    reports = check_run(replicate_tp_pp_run, None, {"grad_local", "grad_reduced", "replay", "weights"}, fault_rank=7)
    for r in reports:
        assert "pp=2 x dp_replicate=2 x dp_shard=1 x tp=2" in r["describe"], r
        assert r["checks"]["weights"] == {"pass": STEPS}, r
        replay = [i for i in r["incidents"] if i["check"] == "replay"]
        assert [(i["step"], i["suspect_ranks"], i["stage"]) for i in replay] == [(FAULT_STEP, [6, 7], 1)], r
        assert replay[0]["coordinate"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 0, "tp": 0}, replay[0]


def test_moe_expert_parallel_trainer_runs_every_check_and_names_the_faulty_ep_group(moe_ep_run: Run) -> None:
    """torchtitan's Trainer with its deepseek_v3 MoE debug model (8 routed experts, top 3, 2 shared) under expert
    parallelism, dp_shard=4 x ep=2, unchanged: each MoE block one fully_shard whose shard_placement_fn puts the
    experts on the efsdp mesh (two FSDP parameter groups in one module), tokens exchanged by its all-to-all token
    dispatcher. Every check passes on the healthy audit (the replay of the partner ep group through its own
    all-to-alls); a transient compute fault in the final ``norm`` on rank 3 at step 2 (after every MoE layer: no
    expert record differs) is named on the ranks of its ep group, 2 and 3, with their ep coordinates."""
    reports = check_run(moe_ep_run, "dp_shard x ep", {"grad_local", "grad_reduced", "replay", "weights"})
    for r in reports:
        assert "dp_shard=4 x tp=1 x ep=2" in r["describe"], r
        replay = [i for i in r["incidents"] if i["check"] == "replay"]
        assert [(i["step"], i["suspect_ranks"], i["verdict"]) for i in replay] == [(FAULT_STEP, [2, 3], "transient")]
        assert replay[0]["coordinates"]["3"]["ep"] == 1 and replay[0]["coordinates"]["2"]["ep"] == 0, replay[0]
