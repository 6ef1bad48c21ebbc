#!/usr/bin/env bash
# GPU check, on one CUDA device; CI never runs it. Six parts, each under a timeout (about 14 minutes in all at most,
# usually under 6):
#   1. the unit tests marked `gpu` (real NVML through the collector and through Telemetry; the one-launch Triton
#      fingerprint kernel against the torch operations on CUDA tensors);
#   2. the real NVML counters of this GPU read by the collector, served on a Prometheus endpoint, scraped over HTTP
#      and printed per family (fields the GPU does not support are listed as left out);
#   3. sdc.fingerprint against torch.sum on 1 GiB of bf16 and of fp32 (median of CUDA-event timings, GB/s, ratio);
#   4. the NCCL path: a one-rank NCCL process group, DDP and the monitor; with verdicts="deferred" healthy steps run
#      under torch.cuda.set_sync_debug_mode("error") (any host synchronisation raises) and a NaN gradient is still
#      reported at its own step; with verdicts="immediate" (the default) the host waits of a healthy step are counted
#      (one: the agreement) and the CPU time per step of both paths is printed;
#   5. replay noise on real kernels: 2 gloo ranks sharing the GPU train a small GPT under bf16 autocast with
#      mode="tolerance", tolerance="auto" and an audit every step (benchmarks/replay_noise.py): every audit must pass,
#      and the measured loss/gradient deltas, the calibrated threshold and its headroom are printed;
#   6. the attribution scenarios on CUDA, on both verdict paths (scripts/attribution_check.py: 3 gloo ranks share the
#      GPU): a NaN in one rank's batch is data, one rank's NaN and a one-step x8 fault name that rank, a heavy batch
#      is data, a healthy run passes.
# Usage: scripts/gpu_check.sh            (PY=/path/to/python to use another interpreter than .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
export LOCAL_RANK=0 RANK=0

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device visible to torch; nothing to check" >&2
  exit 2
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv || true

echo
echo "== 1/6 unit tests marked gpu"
timeout 240 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/unit

echo
echo "== 2/6 real NVML counters through the collector, scraped over HTTP"
timeout 90 "$PY" - <<'PYEOF'
import json
import socket
import urllib.request

import torch
from prometheus_client.parser import text_string_to_metric_families

from sdc_telemetry import RankIdentity, SDCConfig
from sdc_telemetry.sinks.metrics import GPU, IDENTITY_LABELS
from sdc_telemetry.sinks.telemetry import Telemetry

identity = RankIdentity.local(torch.device("cuda", 0))
print("rank identity:", identity.describe())
assert identity.hw_id.startswith("GPU-"), f"expected a GPU UUID, got {identity.hw_id}"
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1] - identity.local_rank
telemetry = Telemetry(SDCConfig(metrics_port=port, metrics_host="127.0.0.1", nvml=True, job_name="gpu-check"),
                      identity)
try:
    assert telemetry.port is not None, "the metrics endpoint did not start"
    x = torch.randn(8192, 8192, device="cuda")
    for _ in range(20):  # some load, so utilisation, power and clocks are not idle values
        x = torch.tanh(x @ x)
    torch.cuda.synchronize()
    with urllib.request.urlopen(f"http://127.0.0.1:{telemetry.port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    snapshot = telemetry.gpu_snapshot()
finally:
    telemetry.close()

gpu_names = {f.name for f in GPU}
seen = set()
for family in text_string_to_metric_families(text):
    for s in family.samples:
        if s.name not in gpu_names:
            continue
        seen.add(s.name)
        own = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k not in IDENTITY_LABELS)
        print(f"  {s.name}{{{own}}} {s.value:g}")
        assert s.labels["hw_id"] == identity.hw_id, s.labels
        assert s.labels["host_name"] == identity.host_name, s.labels
print("identity labels on every GPU series: hw_id=%s host_name=%s" % (identity.hw_id, identity.host_name))
print("left out (not supported by this GPU/driver, or no event yet):", sorted(gpu_names - seen) or "none")
print("incident evidence snapshot:", json.dumps(snapshot, sort_keys=True))
assert {"hw_temperature_celsius", "hw_gpu_memory_usage_bytes"} <= seen, "basic NVML fields missing"
PYEOF

echo
echo "== 3/6 sdc.fingerprint vs torch.sum on 1 GiB"
timeout 180 "$PY" - <<'PYEOF'
import torch

import sdc_telemetry as sdc

GIB = 1 << 30
device = torch.device("cuda", 0)
print(torch.cuda.get_device_name(device))


def median_seconds(fn, x, iters=25):
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


small = torch.randn(1000, 37)
assert torch.equal(sdc.fingerprint([small.to(device)]).cpu(), sdc.fingerprint([small])), "device-dependent result"
for dtype in (torch.bfloat16, torch.float32):
    n = GIB // torch.empty((), dtype=dtype).element_size()
    x = torch.randn(n, device=device, dtype=dtype)
    before = sdc.fingerprint([x]).clone()
    flat = x.view(-1).view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    flat[n // 2] ^= 1 << 3  # one bit flip in the middle must change the fingerprint
    assert not torch.equal(before, sdc.fingerprint([x])), "bit flip not seen"
    flat[n // 2] ^= 1 << 3
    assert torch.equal(before, sdc.fingerprint([x]))
    t_fp = median_seconds(lambda t: sdc.fingerprint([t]), x)
    t_sum = median_seconds(lambda t: torch.sum(t), x)
    print(f"{str(dtype):15s} 1 GiB: fingerprint {t_fp * 1e3:7.3f} ms ({GIB / t_fp / 1e9:6.0f} GB/s)   "
          f"torch.sum {t_sum * 1e3:7.3f} ms ({GIB / t_sum / 1e9:6.0f} GB/s)   fingerprint/sum = {t_fp / t_sum:.2f}")
    del x, flat
    torch.cuda.empty_cache()
PYEOF

echo
echo "== 4/6 NCCL path: deferred verdicts make no host synchronisation, immediate ones one wait per step"
timeout 120 "$PY" - <<'PYEOF'
import os
import socket

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sdc_telemetry as sdc

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1)
model = DistributedDataParallel(nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 16)).cuda(),
                                device_ids=[0])
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
monitor = sdc.SDCMonitor(model, opt, config=sdc.SDCConfig(replay_every=0, metrics_port=None, nvml=False,
                                                          verdicts="deferred"))


def step(poison: bool = False) -> None:
    x = torch.randn(64, 256, device="cuda")
    if poison:
        x[0, 0] = float("nan")
    with monitor.step() as st:
        st.backward(model(x).square().mean())
    opt.step()
    opt.zero_grad(set_to_none=False)


for _ in range(3):  # warm-up: DDP bucket rebuild, cached index tensors, pinned-memory pool
    step()
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")
try:
    for _ in range(10):
        step()
    fps = sdc.fingerprint([p.detach() for p in model.parameters()])
    sdc.digest(fps)
finally:
    torch.cuda.set_sync_debug_mode(0)
print("10 healthy monitored steps and a weight digest ran with set_sync_debug_mode('error'): no host sync")
poisoned = monitor.current_step + 1
step(poison=True)
step()
monitor.close()
found = [(i.step, i.check, i.evidence.get("verdict")) for i in monitor.incidents]
print("incidents:", found)
assert found and found[0][:2] == (poisoned, "grad_local"), found

# verdicts="immediate" (the default): each healthy step waits for its agreement once (Event.synchronize).
import time

waits = [0]
real_sync = torch.cuda.Event.synchronize


def counted(self):  # type: ignore[no-untyped-def]
    waits[0] += 1
    return real_sync(self)


cpu = {}
for verdicts in ("immediate", "deferred"):
    # A fresh DDP model per monitor: DDP takes one comm hook for its lifetime.
    model = DistributedDataParallel(nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 16)).cuda(),
                                    device_ids=[0])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = sdc.SDCMonitor(model, opt, config=sdc.SDCConfig(replay_every=0, metrics_port=None, nvml=False,
                                                              verdicts=verdicts))
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.Event.synchronize = counted
    waits[0] = 0
    c0 = time.process_time()
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    cpu[verdicts] = (time.process_time() - c0) / 20
    torch.cuda.Event.synchronize = real_sync
    print(f"verdicts={verdicts}: {waits[0] / 20:.2f} host waits per healthy step, "
          f"{cpu[verdicts] * 1e3:.2f} ms CPU per step")
    assert waits[0] <= (20 if verdicts == "immediate" else 0), waits
    monitor.close()
print(f"CPU time per step, immediate / deferred: {cpu['immediate'] / cpu['deferred']:.3f}")
dist.destroy_process_group()
PYEOF

echo
echo "== 5/6 replay noise on real kernels: 2 gloo ranks on this GPU, bf16, tolerance=auto, an audit every step"
timeout 240 "$PY" benchmarks/replay_noise.py --check --device cuda --dtype bf16 --steps 40 --out-dir "${OUT:-/tmp}/gpu_check"
timeout 120 "$PY" benchmarks/replay_noise.py --check --device cuda --dtype fp32 --steps 20 --out-dir "${OUT:-/tmp}/gpu_check"

echo
echo "== 6/6 attribution on CUDA, decided before the update and read one step later"
timeout 300 "$PY" scripts/attribution_check.py --device cuda

echo
echo "gpu_check: OK"
