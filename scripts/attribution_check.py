"""The attribution scenarios of the trust tests on a chosen device, on both verdict paths.

    python scripts/attribution_check.py --device cuda    # scripts/gpu_check.sh part 6: 3 gloo ranks share the GPU
    python scripts/attribution_check.py --device cpu     # the same harness on CPU ranks

Each scenario must give the same verdict decided before the update (``verdicts="immediate"``) and read one step
later (``"deferred"``, loops following the documented ``if step.finite:`` guard): a NaN in one rank's batch is
data (nobody named), a NaN that only one rank's computation makes names that rank, a one-step x8 fault off the
audit schedule names its rank through the outlier trigger, a heavy batch is data, and a healthy run passes every
check. Exits 1 naming the first scenario that differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdc_telemetry.testing import spawn_ranks
from tests.distributed._scenarios import on_path, run_scenarios

HW_NAN = {"kind": "nonfinite_grad", "rank": 2, "step": 2, "param": "fc1.weight", "index": 4}
HW = ("transient", "persistent")  # the fault hits every backward of its step: a rerun within the step reproduces it
SCENARIOS: dict[str, tuple[dict[str, Any], tuple[int, str, list[int], tuple[str, ...]] | None]] = {
    # name: (scenario, the first incident expected: (step, check, suspects, verdicts allowed), or None for none)
    "data_nan": ({"config": {"replay_every": 0}, "steps": 5, "loss_always": True, "guard": True,
                  "nan_rank_at": {"rank": 1, "step": 2}}, (2, "grad_local", [], ("data",))),
    "hw_nan": ({"config": {"replay_every": 0}, "steps": 5, "loss_always": True, "guard": True, "fault": HW_NAN},
               (2, "grad_local", [2], HW)),
    "hw_nan_scaler": ({"config": {"replay_every": 0}, "steps": 5, "loss_always": True, "scaler": True,
                       "fault": HW_NAN}, (2, "grad_local", [2], HW)),
    "outlier_fault": ({"config": {"replay_every": 0}, "steps": 16, "loss_always": True,
                       "fault": {"kind": "perturb_output", "rank": 1, "step": 13, "module": "act", "relative": 7.0,
                                 "transient": True}}, (13, "replay", [1], ("transient",))),
    "outlier_data": ({"config": {"replay_every": 0}, "steps": 16, "loss_always": True, "loss": "weighted",
                      "heavy_batch_at": {"rank": 1, "step": 13, "weight": 50.0}}, (13, "replay", [], ("data",))),
    "healthy": ({"config": {"replay_every": 2}, "steps": 8, "loss_always": True}, None),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (the ranks share GPU 0) or cpu")
    p.add_argument("--mode", default="auto", choices=("auto", "exact", "tolerance"),
                   help="SDCConfig.mode (auto: tolerance on a GPU without deterministic kernels)")
    a = p.parse_args(argv)
    names = list(SCENARIOS)
    failures = []
    for verdicts in ("immediate", "deferred"):
        plan = [{**SCENARIOS[n][0], "device": a.device} for n in names]
        plan = [{**sc, "config": {**sc["config"], "mode": a.mode}} for sc in on_path(plan, verdicts)]
        results = spawn_ranks(run_scenarios, 3, (plan,), timeout=600,
                              rank_env=lambda r: {"SDC_HOST_NAME": ["node-a", "node-a", "node-b"][r],
                                                  "LOCAL_RANK": str(r % 2)})
        for i, name in enumerate(names):
            per_rank = [results[r][i] for r in range(3)]
            got = [(x["step"], x["check"], x["suspect_ranks"], x["evidence"].get("verdict"))
                   for x in per_rank[0]["incidents"]]
            expected = SCENARIOS[name][1]
            same = all([(x["step"], x["check"], x["suspect_ranks"]) for x in r["incidents"]]
                       == [g[:3] for g in got] for r in per_rank)
            first = got[0] if got else None
            ok = same and not per_rank[0]["errors"] and (
                first is not None and first[:3] == expected[:3] and first[3] in expected[3] if expected else not got)
            print(f"{verdicts:9s} {name:14s} {'ok  ' if ok else 'FAIL'} mode={per_rank[0]['mode']} "
                  f"incidents={got[:2]} checks={per_rank[0]['counts']}", flush=True)
            if not ok:
                failures.append(f"{verdicts}/{name}")
    if failures:
        print(f"attribution_check: {len(failures)} scenario(s) differ: {failures}")
        return 1
    print(f"attribution_check: every scenario on {a.device} gives the expected verdict on both verdict paths")
    return 0


if __name__ == "__main__":
    sys.exit(main())
