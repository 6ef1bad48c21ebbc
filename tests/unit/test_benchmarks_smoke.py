"""The benchmarks run end to end in their ``--quick`` configuration and write results of the documented shape.

Shape only: performance figures are printed by the benchmarks, never asserted here.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], ModuleType]:
    """Import a benchmark script as a module (spawned ranks import it by the same name through sys.path)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))

    def load(name: str) -> ModuleType:
        return importlib.import_module(name)

    return load


def _result(tmp_path: Path, name: str) -> dict:
    path = tmp_path / f"{name}.json"
    assert path.is_file(), f"{name}.json was not written"
    data = json.loads(path.read_text())
    assert data["benchmark"] == name
    assert {"torch", "cpus", "time"} <= set(data["environment"])
    return data


def test_fingerprint_quick_writes_bandwidth_table(bench, tmp_path, capsys):
    """fingerprint.py --quick prints both tables and the two target lines, and writes GB/s for every method."""
    bench("fingerprint").main(["--quick", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "fingerprint GB/s" in out and "Parameter list" in out
    assert out.count("target:") == 2
    data = _result(tmp_path, "fingerprint")
    methods = {"fingerprint", "torch.sum", "hash_tensor", "sha1_cpu_copy"}
    assert {r["dtype"] for r in data["tensors"]} == {"fp32", "bf16", "fp16"}
    for row in data["tensors"] + data["parameter_list"]:
        assert set(row["gbps"]) == methods
        assert row["ratio_to_sum"] > 0
    realistic = [r for r in data["parameter_list"] if r["list"] == "GPT-2 small"]
    assert {r["dtype"] for r in realistic} == {"fp32", "bf16"}
    assert all(set(r["us_per_tensor"]) == methods for r in data["parameter_list"])
    assert {"large_tensor_met", "list_met", "large_tensor_ratio_min", "list_ratio_min"} <= set(data["targets"])


def test_overhead_parts_quick_reports_every_variant_and_restores_the_hook(bench, tmp_path, capsys):
    """overhead_parts.py --quick times every variant against the unmonitored model; its patches take effect (the
    local side switched off makes the checksum mismatch) and are undone after each segment."""
    from sdc_telemetry.parallel import ddp

    parts = bench("overhead_parts")
    originals = (ddp._norms, ddp._sums, ddp.ReduceChecksum.reduced)
    with parts.switched_off("both off"):
        assert (ddp._norms, ddp._sums, ddp.ReduceChecksum.reduced) != originals
    assert (ddp._norms, ddp._sums, ddp.ReduceChecksum.reduced) == originals
    parts.main(["--quick", "--out-dir", str(tmp_path)])
    assert "Overhead by part of the DDP hook" in capsys.readouterr().out
    data = _result(tmp_path, "overhead_parts")
    assert list(data["variants"]) == list(parts.VARIANTS)
    for v in data["variants"].values():
        assert len(v["ratio_median_per_rank"]) == 2 and all(0 < x < math.inf for x in v["ratio_median_per_rank"])
        assert len(v["rank0_ratios"]) == 2
    assert data["incidents"] > 0


def test_replay_noise_quick_measures_deltas_and_the_calibrated_headroom(bench, tmp_path, capsys):
    """replay_noise.py --quick on CPU with emulated run-to-run noise: every step is an audit and passes on both ranks,
    the measured deltas are non-zero (the noise reached the replay) and the calibrated tolerance sits above them; bad
    input is refused by name."""
    noise = bench("replay_noise")
    noise.main(["--quick", "--check", "--dtype", "fp32", "--emulate", "1e-6", "--out-dir", str(tmp_path)])
    assert "target: every audit passes with no incident on real kernels: met" in capsys.readouterr().out
    data = _result(tmp_path, "replay_noise")
    assert data["every_audit_passed"] and len(data["ranks"]) == 2
    for r in data["ranks"]:
        assert r["counts"] == {"pass": data["spec"]["steps"]} and r["incidents"] == []
        assert 0 < r["grad_delta_max"] < r["tolerance"] and r["headroom"] > 1
    assert data["rounding_floor"] == 0.0
    # bf16: the report says how far below the 16-bit rounding floor the measured noise lies
    noise.main(["--quick", "--check", "--dtype", "bf16", "--emulate", "1e-6", "--out-dir", str(tmp_path)])
    assert "16-bit rounding floor" in capsys.readouterr().out
    data = _result(tmp_path, "replay_noise")
    assert data["every_audit_passed"] and data["rounding_floor"] == 2**-7
    assert 0 < data["largest_delta"] < data["rounding_floor"]
    with pytest.raises(ValueError, match="emulate"):
        noise.run(device="cpu", emulate=0.7)
    with pytest.raises(ValueError, match="dtype"):
        noise.run(device="cpu", dtype="fp8")


def test_overhead_quick_reports_every_configuration(bench, tmp_path, capsys):
    """overhead.py --quick runs every configuration interleaved on 2 ranks (deferred verdicts beside immediate ones)
    and reports ratios with their spread."""
    bench("overhead").main(["--quick", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "per-step ratio" in out and "Where the time goes" in out
    assert out.count("target:") == 6
    data = _result(tmp_path, "overhead")
    labels = ["no monitor", "no monitor, Python allreduce comm hook", "no monitor, one read each (floor)",
              "grad checks", "grad + weights/1", "grad + weights/1, verdicts deferred",
              "grad + weights/1, at-rest check off", "grad + weights/1 + replay/4", "grad + weights/1 + replay/2",
              "grad + weights/1 + update/4", "grad + weights/1 + update/2"]
    assert list(data["configs"]) == labels
    # the floor read every local gradient, every reduced gradient and every parameter at every step
    assert data["floor_reads_per_step"] == 3 * data["parameter_tensors"] > 0
    assert "floor_ratio" in data["targets"]
    assert len(data["rounds"]) == data["spec"]["rounds"] == 2
    for rnd in data["rounds"]:
        assert set(rnd) == set(labels)
        assert all(len(rnd[c]["step_s"]) == data["spec"]["segment"] for c in labels)
    for c in data["configs"].values():
        assert c["step_ratio_q1"] <= c["step_ratio_median"] <= c["step_ratio_q3"]
    assert data["configs"]["no monitor"]["step_ratio_median"] == pytest.approx(1.0)
    # every configuration is timed over whole replay periods: 8 timed steps hold 2 audits of replay/4, 4 of replay/2
    assert data["configs"]["grad + weights/1 + replay/4"]["audits"] == 2
    assert data["configs"]["grad + weights/1 + replay/2"]["audits"] == 4
    # the update audit of step k runs in step k+1: steps 1 and 5 of 0..7 for update/4, 1, 3, 5, 7 for update/2
    assert data["configs"]["grad + weights/1 + update/4"]["audits"] == 2
    assert data["configs"]["grad + weights/1 + update/2"]["audits"] == 4
    assert data["incidents"] == dict.fromkeys(labels, 0)
    assert {"weights_met", "replay_met", "weights_ratio", "at_rest_added", "update_met"} <= set(data["targets"])


def _campaign_shape(campaign: ModuleType, data: dict) -> None:
    """What every campaign payload carries, whatever the layout or mode."""
    assert set(data["data_faults"]) == set(campaign.DATA_KINDS)
    assert [m["magnitude"] for m in data["magnitudes"]] == list(campaign.MAGNITUDES)
    assert all(m["injected"] >= 1 and 0 <= m["right"] <= m["detected"] <= m["injected"] for m in data["magnitudes"])
    assert set(data["false_triggers_per_10000"]) == {"audits", "incidents"}
    assert data["armed_rank_steps"] > 0  # healthy steps past the triggers' warm-up exist
    cost = data["trigger_cost"]
    assert "error" not in cost, cost
    assert cost["steps"] > 0 and cost["ratio_q1"] <= cost["ratio_median"] <= cost["ratio_q3"]
    assert cost["step_ms_on"] > 0 and cost["step_ms_off"] > 0 and cost["cpu_ratio_of_means"] > 0


def test_campaign_quick_scores_every_fault_kind(bench, tmp_path, capsys):
    """campaign.py --quick injects one fault of each kind plus a healthy run and scores them without harness errors,
    with the per-magnitude, data-fault, false-trigger and trigger-cost tables."""
    campaign = bench("campaign")
    campaign.main(["--quick", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "Fault-injection campaign" in out and "False incidents" in out and "GradScaler" in out
    assert "per magnitude" in out and "Data faults" in out and "False triggers" in out
    assert out.count("target:") == 2
    data = _result(tmp_path, "campaign")
    assert data["errors"] == [] and data["mode"] == "exact" and data["noise"] == 0.0
    assert {t["kind"] for t in data["plan"]} == set(campaign.KINDS)
    assert set(data["by_scaler"]) == {"no scaler", "with GradScaler"}
    assert data["nan_every_rank"]["trials"] == 1
    assert {"numerics_recorded", "false_suspect_incidents"} <= set(data["nan_every_rank"])
    faulty = sum(1 for t in data["plan"] if t["kind"] != "healthy")
    assert sum(r["injected"] for r in data["rows"]) == faulty
    for r in data["rows"]:
        assert set(r["by_check"]) == set(r["first_by_check"]) == set(campaign.CHECKS)
        assert 0 <= r["detected"] <= r["injected"]
        assert r["right"] + r["ambiguous"] <= r["detected"]
        assert 0 <= r["triggered"] <= r["injected"] and 0 <= r["named"] <= r["injected"]
    assert data["healthy_rank_steps"] > 0
    assert set(data["false_incidents_per_1000_rank_steps"]) == set(campaign.CHECKS)
    assert set(data["false_incidents_per_1000_upper95"]) == set(campaign.CHECKS)
    assert set(data["false_incidents_per_10000"]) == set(campaign.CHECKS)
    _campaign_shape(campaign, data)


def test_campaign_tolerance_mode_runs_under_emulated_gpu_numerics(bench, tmp_path, capsys):
    """campaign.run(mode="tolerance", kernel_deviation=True) trains under the GPU-behaviour harness (noise 1e-6 on
    every rank, one rank 1e-5 off) and writes campaign_tolerance.json saying so; --kernel-deviation needs it."""
    campaign = bench("campaign")
    data = campaign.run(trials=2, steps=5, replay_every=2, trigger_steps=12, cost_steps=0, per_spawn=2,
                        mode="tolerance", kernel_deviation=True, out_dir=tmp_path)
    out = capsys.readouterr().out
    assert "tolerance mode, one rank's kernels deviating by 1e-05" in out and "cost_steps=0: not measured" in out
    written = _result(tmp_path, "campaign_tolerance")
    assert written["errors"] == [] and written["mode"] == data["mode"] == "tolerance"
    assert (written["noise"], written["kernel_deviation"]) == (1e-6, 1e-5)
    assert sorted(t["kind"] for t in written["plan"]) == ["healthy", "weight_bitflip"]
    assert sum(r["injected"] for r in written["rows"]) == 1 and written["healthy_rank_steps"] > 0
    with pytest.raises(ValueError, match="tolerance"):
        campaign.run(trials=1, mode="exact", kernel_deviation=True, quiet=True, out_dir=tmp_path)


def test_campaign_sweep_quick_scores_every_magnitude_in_bf16(bench, tmp_path, capsys):
    """campaign.py --sweep --quick (tolerance mode, bf16 autocast): one persistent compute fault of each magnitude
    and one healthy run, after calibrating audits, scored per magnitude with the false-incident line; --sweep needs
    --mode tolerance."""
    campaign = bench("campaign")
    campaign.main(["--mode", "tolerance", "--kernel-deviation", "--sweep", "--quick", "--precision", "bf16",
                   "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "Persistent compute faults" in out and "bf16 autocast" in out and "false incidents:" in out
    data = _result(tmp_path, "campaign_sweep_bf16")
    assert data["errors"] == [] and data["precision"] == "bf16" and data["kernel_deviation"] == 1e-5
    assert list(data["magnitudes"]) == [f"{m:g}" for m in campaign.sweep_magnitudes("bf16")]
    assert all(r["trials"] == 1 and r["named_right"] + r["ambiguous"] + r["wrong"] + r["missed"] == 1
               for r in data["magnitudes"].values())
    assert data["healthy_rank_steps"] > 0 and {t["precision"] for t in data["plan"]} == {"bf16"}
    with pytest.raises(SystemExit):
        campaign.main(["--sweep", "--quick", "--out-dir", str(tmp_path)])


def test_launches_quick_counts_both_schedules(bench, tmp_path, capsys):
    """launches.py --quick counts one healthy step's operations on the GPU schedule (the Triton fingerprint kernel
    through its interpreter) and the CPU schedule, with every check of the counted step passing."""
    pytest.importorskip("triton", reason="Triton is installed with the torchtitan extra (make setup)")
    data = bench("launches").run(model=bench("launches").QUICK_MODEL, out_dir=tmp_path)
    out = capsys.readouterr().out
    assert "Device operations of one healthy DDP step" in out and out.count("target:") == 1
    written = _result(tmp_path, "launches")
    for schedule in ("gpu", "cpu"):
        r = written[schedule]
        assert r["incidents"] == 0 and r["results"] == {"grad_local": "pass", "grad_reduced": "pass",
                                                        "weights": "pass"}, r
        assert r["added"] == r["monitored"] - r["unmonitored"] and r["tensors"] == data[schedule]["tensors"] > 0
    assert written["gpu"]["by_operation"].get("triton kernel", 0) >= 2  # the vote's and the at-rest fingerprints
    assert "triton kernel" not in written["cpu"]["by_operation"]


def test_campaign_hsdp_quick_scores_every_hsdp_kind(bench, tmp_path, capsys):
    """campaign.py --layout hsdp --quick runs one trial of each HSDP kind on a (3, 2) fully_shard mesh of 6 ranks
    without harness errors, scores them in the DDP tables and names the DDP-only kinds it skips."""
    campaign = bench("campaign")
    campaign.main(["--layout", "hsdp", "--quick", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "HSDP: 3 replicas x 2 shards" in out and "False incidents" in out and "GradScaler" in out
    assert out.count("target:") == 2
    assert all(f"not run on HSDP: {kind} (" in out for kind in ("nonfinite_grad", "reduced_grad"))
    data = _result(tmp_path, "campaign_hsdp")
    assert data["errors"] == [] and data["world"] == 6 and data["mesh"] == [3, 2]
    assert sorted(t["kind"] for t in data["plan"]) == sorted(campaign.HSDP_KINDS)
    assert set(data["skipped"]) == {"nonfinite_grad", "reduced_grad"}
    assert sum(r["injected"] for r in data["rows"]) == len(campaign.HSDP_KINDS) - 1  # every kind but healthy
    assert {r["kind"] for r in data["rows"]} == set(campaign.HSDP_KINDS) - {"healthy"}
    assert all(0 <= r["right"] + r["ambiguous"] <= r["detected"] <= r["injected"] for r in data["rows"])
    assert data["healthy_rank_steps"] > 0 and data["nan_every_rank"]["trials"] == 1
    assert data["data_faults"][campaign.NAN_ONE]["trials"] == 1
    _campaign_shape(campaign, data)


def test_campaign_hsdp_plan_draws_in_the_local_shard(bench):
    """On HSDP, flipped elements and swapped rows lie in the faulty rank's shard (half of dim 0), DDP-only kinds are
    never drawn, and a NaN in one rank's batch names a rank of the MLP."""
    campaign = bench("campaign")
    a = campaign.plan(6 * len(campaign.HSDP_KINDS), seed=2, world=6, steps=10, layout="hsdp")
    assert {t["kind"] for t in a} == set(campaign.HSDP_KINDS)
    full = {m: {n: p for n, p in campaign.build(m, 0).named_parameters()} for m in ("gpt", "mlp")}
    for t in a:
        if t["kind"] in ("weight_bitflip", "row_swap"):
            p = full[t["model"]][t["param"]]
            local = p.chunk(2)[t["rank"] % 2]
            assert t.get("index", 0) < local.numel() and max(t.get("rows", [0])) < local.shape[0], t
    ones = [t for t in a if t["kind"] == campaign.NAN_ONE]
    assert ones and all(t["model"] == "mlp" and 0 <= t["rank"] < 6 for t in ones)
    with pytest.raises(ValueError, match="layout"):
        campaign.plan(7, seed=0, world=6, steps=10, layout="fsdp1")


def test_poisson_upper_bound(bench):
    """No events in n trials bounds the rate by ln(20)/n, about 3/n (the rule of three); more events raise it."""
    campaign = bench("campaign")
    assert campaign.poisson_upper(0, 1000) == pytest.approx(math.log(20) / 1000, rel=1e-3)
    assert campaign.poisson_upper(1, 1000) == pytest.approx(4.744 / 1000, rel=1e-3)
    assert campaign.poisson_upper(5, 1000) > campaign.poisson_upper(1, 1000)


def test_campaign_plan_is_seeded_and_stratified(bench):
    """The same seed gives the same campaign, and every fault kind is drawn equally often."""
    campaign = bench("campaign")
    n = 3 * len(campaign.KINDS)
    a = campaign.plan(n, seed=3, world=3, steps=10)
    assert a == campaign.plan(n, seed=3, world=3, steps=10)
    assert a != campaign.plan(n, seed=4, world=3, steps=10)
    kinds = [t["kind"] for t in a]
    assert all(kinds.count(k) == 3 for k in campaign.KINDS)
    short = [t for t in a if t["kind"] not in campaign.LONG_KINDS]
    assert all(t["steps"] == 10 and (t["step"] is None or 0 <= t["step"] <= 6) for t in short)


def test_campaign_plan_puts_trigger_faults_off_the_schedule_after_the_warm_up(bench):
    """Transient faults x2..x16 (relative m - 1) and heavy batches hit a step of a 16-step trial after the 10-step
    warm-up that replay_every does not audit; healthy runs last 16 steps; a trial too short for that is refused."""
    campaign = bench("campaign")
    a = campaign.plan(2 * len(campaign.KINDS), seed=1, world=3, steps=10, replay_every=3, trigger_steps=16)
    late = [t for t in a if t["kind"] in (campaign.HEAVY, *campaign.TRANSIENT_KINDS)]
    assert len(late) == 2 * 5
    for t in late:
        assert t["steps"] == 16 and 10 <= t["step"] < 16 and t["step"] % 3, t
        if t["kind"] != campaign.HEAVY:
            assert t["relative"] == int(t["kind"].removeprefix("transient_x")) - 1 and "module" in t
    assert all(t["steps"] == 16 and t["step"] is None for t in a if t["kind"] == "healthy")
    assert all(t["model"] == "mlp" for t in a if t["kind"] in campaign.DATA_KINDS)
    with pytest.raises(ValueError, match="warm-up"):
        campaign.plan(4, seed=1, world=3, steps=10, trigger_steps=10)


def test_campaign_plan_scaler_row_swaps_and_nan_runs(bench):
    """Every kind runs with a GradScaler on one trial in three; row swaps name two distinct rows; NaN runs use the
    MLP (float inputs) and name no faulty rank."""
    campaign = bench("campaign")
    a = campaign.plan(3 * len(campaign.KINDS), seed=5, world=3, steps=10)
    for kind in campaign.KINDS:
        assert sum(t["scaler"] for t in a if t["kind"] == kind) == 1, kind
    swaps = [t for t in a if t["kind"] == "row_swap"]
    assert swaps and all(len(set(t["rows"])) == 2 for t in swaps)
    nans = [t for t in a if t["kind"] == campaign.NAN_KIND]
    assert nans and all(t["model"] == "mlp" and t["rank"] is None for t in nans)


def test_scale_quick_reports_bytes_pairing_and_cost_model(bench, tmp_path, capsys):
    """scale.py --quick measures monitor bytes per rank on 2 and 3 ranks, times the simulated decisions (all with
    the right verdict) and prints the cost model."""
    bench("scale").main(["--quick", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "Monitor collectives per rank and step" in out and "Partner choice before" in out
    assert "Cost model for 1,024 ranks" in out
    data = _result(tmp_path, "scale")
    assert set(data["ranks"]) == {"2", "3"}
    for r in data["ranks"].values():
        assert r["healthy"]["steps"] > 0 and r["audit"]["steps"] > 0
        assert r["healthy"]["sent"] > 0 and r["audit"]["sent"] > r["healthy"]["sent"]
        assert r["same_on_every_rank"]
    assert len(data["simulated"]["plans"]) == 3 and len(data["simulated"]["pairing"]) == 2
    assert all(d["correct"] for d in data["simulated"]["decisions"])
    assert len(data["cost_model"]) == 5
    assert {"plan_met", "healthy_bytes_constant"} <= set(data["targets"])


def test_scale_byte_count_of_each_collective(bench):
    """The byte counter reads what a rank sends and receives: an all-reduce both ways, a gather W parts back, only
    the isend side of point-to-point ops as sent."""
    scale = bench("scale")
    vec = torch.zeros(22, dtype=torch.int64)
    assert scale._payload("all_reduce", (vec,)) == (176, 176)
    assert scale._payload("all_gather_into_tensor", (torch.zeros(4, 3), torch.zeros(3))) == (12, 48)

    class Op:
        def __init__(self, op: object, tensor: torch.Tensor) -> None:
            self.op, self.tensor = op, tensor

    def isend() -> None: ...

    def irecv() -> None: ...

    ops = [Op(isend, torch.zeros(10, dtype=torch.uint8)), Op(irecv, torch.zeros(7, dtype=torch.uint8))]
    assert scale._payload("batch_isend_irecv", (ops,)) == (10, 7)


def test_pick_shifts_before_is_the_old_host_crossing_choice(bench):
    """The copied pre-restructure partner choice keeps only host-crossing shifts, like plan_pairs' first shift."""
    scale = bench("scale")
    hosts = scale.hosts_of(8, 4)
    assert scale.pick_shifts_before(hosts) == [4]
    assert scale.pick_shifts_before(scale.hosts_of(4, 4)) == [1, 2, 3]


def test_audit_quick_measures_passing_audits(bench, tmp_path, capsys):
    """audit.py --quick times 4 audits of an accumulated no_sync step, every one a pass, in baseline steps."""
    bench("audit").main(["--quick", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "Replay audit cost" in out and out.count("target:") == 1
    data = _result(tmp_path, "audit")
    assert data["audits"] == 4 and data["replay_results"] == {"pass": 4}
    assert data["incidents"] == 0
    assert data["audit_cost_q1"] <= data["audit_cost_steps_median"] <= data["audit_cost_q3"]



def test_hsdp_quick_reports_ratios_against_unmonitored_fsdp(bench, tmp_path, capsys):
    """hsdp.py --quick: 6 ranks on a (3, 2) mesh, every configuration timed against the unmonitored FSDP2 model,
    and every monitored check passed."""
    bench("hsdp").main(["--quick", "--out-dir", str(tmp_path)])
    assert "HSDP (3 replicas x 2 shards" in capsys.readouterr().out
    summary = _result(tmp_path, "hsdp")["summary"]
    assert summary["FSDP2 HSDP, no monitor"]["ratio"] == 1.0
    replay = summary["grad + weights/1 + replay/10"]["results"]
    assert replay["replay:pass"] >= 1 and not any(k.endswith((":fail", ":error", ":skipped")) for k in replay)


def test_campaign_runs_with_deferred_verdicts_and_names_no_data_fault(bench, tmp_path, capsys):
    """campaign.py --verdicts deferred --quick: one fault of each kind read one step later, scored without harness
    errors into campaign_deferred.json; the data faults (a NaN in one rank's batch, a heavy batch) name nobody."""
    campaign = bench("campaign")
    campaign.main(["--quick", "--verdicts", "deferred", "--out-dir", str(tmp_path)])
    assert "verdicts read one step later (deferred)" in capsys.readouterr().out
    data = _result(tmp_path, "campaign_deferred")
    assert data["errors"] == [] and data["verdicts"] == "deferred"
    assert all(r["named"] == 0 for r in data["rows"] if r["kind"] in campaign.DATA_KINDS)
    _campaign_shape(campaign, data)
