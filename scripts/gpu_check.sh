#!/usr/bin/env bash
# GPU check (issue 4), on one CUDA device; CI never runs it. Three parts, each under a timeout (about 8 minutes in
# all at most, usually under 2):
#   1. the unit tests marked `gpu` (real NVML through the collector and through Telemetry);
#   2. the real NVML counters of this GPU read by the collector, served on a Prometheus endpoint, scraped over HTTP
#      and printed per family (fields the GPU does not support are listed as left out);
#   3. sdc.fingerprint against torch.sum on 1 GiB of bf16 and of fp32 (median of CUDA-event timings, GB/s, ratio).
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
echo "== 1/3 unit tests marked gpu"
timeout 240 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/unit

echo
echo "== 2/3 real NVML counters through the collector, scraped over HTTP"
timeout 90 "$PY" - <<'PYEOF'
import json
import socket
import urllib.request

import torch
from prometheus_client.parser import text_string_to_metric_families

from sdc_telemetry import RankIdentity, SDCConfig
from sdc_telemetry.metrics import GPU, IDENTITY_LABELS
from sdc_telemetry.telemetry import Telemetry

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
echo "== 3/3 sdc.fingerprint vs torch.sum on 1 GiB"
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
echo "gpu_check: OK"
