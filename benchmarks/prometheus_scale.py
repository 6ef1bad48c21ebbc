"""How fast the alert rules and the dashboards are on a large job: a real Prometheus over synthetic history.

    python benchmarks/prometheus_scale.py                 # 1,024 ranks, 40 minutes at 15 s (about 3 minutes)
    python benchmarks/prometheus_scale.py --hours 3       # a few hours (backfill grows with it: ~10 min here)
    python benchmarks/prometheus_scale.py --quick         # 16 ranks, 20 minutes: the smoke test

It writes every series a rank exports (each ``sdc_`` family of the metric table with realistic label values, the
NVML GPU families, ``up``) for ``--ranks`` ranks, 8 per host, as OpenMetrics text, backfills it with
``promtool tsdb create-blocks-from openmetrics``, backfills the recording rules over the same hours with
``promtool tsdb create-blocks-from rules`` (Prometheus evaluates rules only from the moment it starts), then starts
Prometheus on loopback over that data and times every alert expression and recording rule (instant queries at the
end of the history) and every dashboard panel query (range queries over the last hour at 15 s, the variables set
to all jobs, hosts and ranks). Prints a table of the median seconds of ``--repeat`` runs per query; writes
``benchmarks/results/prometheus_scale.json``.

One rank (rank 7) is a latched weights suspect from the middle of the history, with an XID 79 on its GPU, so the
suspect and XID panels have rows.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, table, write_json

from sdc_telemetry.ops import alerts, dashboards
from sdc_telemetry.sinks.metrics import CHECK_DURATION_BUCKETS, FLEET, GPU, SDC

RANKS_PER_HOST = 8
CHECKS = ("grad_local", "grad_reduced", "weights", "replay")
SUSPECT_RANK = 7
STEPS_PER_S = 2.0
RANKS_PER_FILE = 64  # backfill in slices: the text of 1,024 ranks would be gigabytes at once

# Label values of the families with labels (what the monitor and the NVML collector export).
VALUES: dict[str, dict[str, tuple[str, ...]]] = {
    "sdc_checks_total": {"check": CHECKS, "result": ("pass", "skipped")},
    "sdc_check_duration_seconds": {"check": CHECKS},
    "sdc_check_last_run_timestamp_seconds": {"check": CHECKS},
    "sdc_grad_nonfinite_total": {"phase": ("local", "reduced")},
    "sdc_grad_norm": {"phase": ("local", "reduced")},
    "sdc_suspect": {"check": CHECKS},
    "sdc_suspect_ambiguous": {"check": CHECKS},
    "sdc_incidents_total": {"check": CHECKS},
    "sdc_internal_errors_total": {"component": ("telemetry",)},
    "hw_errors_total": {"hw_type": ("gpu",), "error_type": ("corrected", "uncorrected")},
    "gpu_retired_pages": {"cause": ("single_bit_ecc", "double_bit_ecc")},
    "gpu_remapped_rows": {"kind": ("correctable", "uncorrectable")},
    "gpu_nvlink_errors_total": {"type": ("crc_flit", "replay")},
    "gpu_clock_event_reasons": {"reason": ("sw_power_cap", "hw_slowdown")},
    "gpu_xid_errors_total": {"xid": ("79",)},
}


def _combos(name: str) -> Iterator[dict[str, str]]:
    combos: list[dict[str, str]] = [{}]
    for label, values in VALUES.get(name, {}).items():
        combos = [{**c, label: v} for c in combos for v in values]
    yield from combos


def _labels(d: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in d.items()) + "}"


def _value(name: str, lab: dict[str, str], rank: int, i: int, t: float, half: int) -> float:
    """A plausible value of series ``name`` of ``rank`` at sample ``i`` (time ``t``)."""
    steps = i * 15 * STEPS_PER_S
    if name == "sdc_steps_total":
        return steps
    if name == "sdc_checks_total":
        if lab["result"] == "skipped":
            return float(i // 40)
        return steps / (50 if lab["check"] == "replay" else 1)
    if name == "sdc_check_last_run_timestamp_seconds":
        return t - (30 if lab["check"] == "replay" else 0.5)
    if name in ("sdc_grad_norm",):
        return 1.0 + (rank % 13) * 0.01
    if name in ("sdc_replay_loss_delta", "sdc_replay_grad_delta"):
        return 1e-7 * (1 + rank % 5)
    if name == "sdc_weight_fingerprint_agreement":
        return 0.0 if rank == SUSPECT_RANK and i >= half else 1.0
    if name == "sdc_weight_fingerprint_mismatches_total":
        return float(i - half + 1) if rank == SUSPECT_RANK and i >= half else 0.0
    if name == "sdc_suspect":
        return 1.0 if rank == SUSPECT_RANK and lab["check"] == "weights" and i >= half else 0.0
    if name == "sdc_incidents_total":
        return 1.0 if lab["check"] == "weights" and i >= half else 0.0
    if name == "gpu_xid_errors_total":
        return 1.0 if i >= half else 0.0
    if name == "up":
        return 1.0
    if name == "hw_errors_total":
        return float(i // 100) if lab["error_type"] == "corrected" else 0.0
    if name == "hw_temperature_celsius":
        return 60.0 + rank % 10
    if name == "hw_power_watts":
        return 500.0 + rank % 50
    if name == "hw_gpu_utilization":
        return 0.95
    if name == "hw_gpu_memory_usage_bytes":
        return 7.0e10
    if name == "gpu_clock_sm_hertz":
        return 1.98e9
    return 0.0


def _histogram_lines(prefix: dict[str, str], rank: int, ts: list[str]) -> Iterator[tuple[str, list[str]]]:
    """Bucket, sum and count series of one check's duration histogram: every run lands in one bucket."""
    runs = [i * 15 * STEPS_PER_S for i in range(len(ts))]
    bucket_of = 3 + rank % 4  # 1-5 ms
    for j, le in enumerate((*CHECK_DURATION_BUCKETS, float("inf"))):
        le_s = "+Inf" if le == float("inf") else repr(le)
        vals = runs if j >= bucket_of else [0.0] * len(runs)
        yield _labels({**prefix, "le": le_s}), [f"{v:g}" for v in vals]
    yield _labels(prefix), [f"{v * 0.002:g}" for v in runs]
    yield _labels(prefix), [f"{v:g}" for v in runs]


def write_openmetrics(path: Path, ranks: range, start: int, points: int, service: str = "llm") -> int:
    """OpenMetrics text of ``ranks`` over ``points`` samples from ``start`` every 15 s; returns the sample count."""
    ts = [str(start + 15 * i) for i in range(points)]
    half = points // 2
    idents = []
    for r in ranks:
        host = f"gpu-node-{r // RANKS_PER_HOST:05d}"
        lr = r % RANKS_PER_HOST
        idents.append((r, {"service_name": service, "service_instance_id": f"{host}-rank{r}", "host_name": host,
                           "rank": str(r), "local_rank": str(lr), "hw_id": f"GPU-{r:08x}-1111-2222-3333-444455556666",
                           "job": alerts.SCRAPE_JOB, "instance": f"{host}:{9860 + lr}"}))
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for fam in (*SDC, *GPU):
            if fam.kind == "histogram":
                for part in ("bucket", "sum", "count"):
                    name = f"{fam.name}_{part}"
                    f.write(f"# TYPE {name} unknown\n")
                    for _, ident in idents:
                        for combo in _combos(fam.name):
                            series = list(_histogram_lines({**ident, **combo}, int(ident["rank"]), ts))
                            chosen = series[:-2] if part == "bucket" else [series[-2 if part == "sum" else -1]]
                            for labels, vals in chosen:
                                f.write("".join(f"{name}{labels} {v} {t}\n" for v, t in zip(vals, ts, strict=True)))
                                n += points
                continue
            f.write(f"# TYPE {fam.name} unknown\n")
            for r, ident in idents:
                if fam.name == "gpu_xid_errors_total" and r != SUSPECT_RANK:
                    continue  # born only by an XID: the suspect's GPU fell off the bus once
                for combo in _combos(fam.name):
                    labels = _labels({**ident, **combo})
                    f.write("".join(f"{fam.name}{labels} {_value(fam.name, combo, r, i, start + 15 * i, half):g} "
                                    f"{t}\n" for i, t in enumerate(ts)))
                    n += points
        # The responder's GPU ledger (its own /metrics, no rank identity): the suspect's GPU got a strike.
        for fam in FLEET:
            f.write(f"# TYPE {fam.name} unknown\n")
            for r, ident in idents:
                if r != SUSPECT_RANK:
                    continue
                labels = _labels({"hw_id": ident["hw_id"], "host_name": ident["host_name"], "job": "sdc-responder",
                                  "instance": "sdc-responder:9095"})
                f.write("".join(f"{fam.name}{labels} 1 {t}\n" for t in ts[half:]))
                n += points - half
        f.write("# TYPE up unknown\n")
        for _, ident in idents:
            labels = _labels({"job": ident["job"], "instance": ident["instance"]})
            f.write("".join(f"up{labels} 1 {t}\n" for t in ts))
            n += points
        f.write("# EOF\n")
    return n


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, params: dict[str, str], timeout: float = 300) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}?{urllib.parse.urlencode(params)}", timeout=timeout) as r:
        doc: dict[str, Any] = json.loads(r.read())
    return doc


class _Prometheus:
    def __init__(self, binary: str, data: Path, config: Path, log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "ab")
        self.proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={data}",
                                      "--storage.tsdb.retention.time=100y",
                                      f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: see {log}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("prometheus not ready within 120 s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _timed(fn: Any, repeat: int) -> tuple[float, int]:
    times, n = [], 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        doc = fn()
        times.append(time.perf_counter() - t0)
        if doc.get("status") != "success":
            raise RuntimeError(f"query failed: {doc}")
        n = len(doc["data"]["result"]) if isinstance(doc["data"]["result"], list) else 1
    return median(times), n


def run(ranks: int, hours: float, repeat: int, workdir: Path) -> dict[str, Any]:
    promtool, prometheus = shutil.which("promtool"), shutil.which("prometheus")
    if not promtool or not prometheus:
        raise RuntimeError("needs the promtool and prometheus binaries on PATH")
    points = int(hours * 3600 / 15)
    end = int(time.time()) // 15 * 15 - 60
    start = end - 15 * (points - 1)
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    samples = 0
    for lo in range(0, ranks, RANKS_PER_FILE):
        text = workdir / "slice.om"
        samples += write_openmetrics(text, range(lo, min(ranks, lo + RANKS_PER_FILE)), start, points)
        subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", str(text), str(data)], check=True,
                       capture_output=True)
        text.unlink()
    backfill_s = time.perf_counter() - t0

    rules = workdir / alerts.RULES_FILE
    rules.write_text(alerts.rules_yaml())
    rollups = workdir / "rollups.yml"
    doc = alerts.rules_document()
    rollups.write_text(yaml.safe_dump({"groups": [g for g in doc["groups"] if g["name"] == "sdc-rollups"]}))
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
                                      "rule_files": [str(rules)]}))
    log = workdir / "prometheus.log"
    prom = _Prometheus(prometheus, data, config, log)
    t0 = time.perf_counter()
    try:
        subprocess.run([promtool, "tsdb", "create-blocks-from", "rules", f"--start={start}", f"--end={end}",
                        f"--url={prom.url}", f"--output-dir={workdir / 'rules-data'}", "--eval-interval=15s",
                        str(rollups)], check=True, capture_output=True)
    finally:
        prom.stop()
    for block in (workdir / "rules-data").iterdir():
        block.rename(data / block.name)
    rules_backfill_s = time.perf_counter() - t0

    prom = _Prometheus(prometheus, data, config, log)
    rows: list[dict[str, Any]] = []
    try:
        for r in alerts.RULES:
            s, n = _timed(lambda r=r: _get(f"{prom.url}/api/v1/query", {"query": r.expr, "time": str(end)}), repeat)
            rows.append({"kind": "alert", "name": r.name, "median_s": s, "series": n})
        for rr in alerts.RECORDING_RULES:
            s, n = _timed(lambda rr=rr: _get(f"{prom.url}/api/v1/query", {"query": rr.expr, "time": str(end)}),
                          repeat)
            rows.append({"kind": "record", "name": rr.record, "median_s": s, "series": n})
        range_start = str(max(start, end - 3600))
        for q in dashboards.panel_queries(rate_interval="1m", interval="15s", range_="1h"):
            s, n = _timed(lambda q=q: _get(f"{prom.url}/api/v1/query_range",
                                           {"query": q.expr, "start": range_start, "end": str(end), "step": "15"}),
                          repeat)
            rows.append({"kind": "panel", "name": f"{q.dashboard} / {q.panel} [{q.ref}]", "median_s": s,
                         "series": n})
    finally:
        prom.stop()
    return {"spec": {"ranks": ranks, "hours": hours, "interval_s": 15, "repeat": repeat, "samples": samples,
                     "series_per_rank": samples // (ranks * points)},
            "backfill_s": backfill_s, "rules_backfill_s": rules_backfill_s, "queries": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1024)
    # 1,024 ranks x 125 series backfill at ~0.2 M samples/s on 2 cores: 40 minutes keeps the run near 3 minutes.
    p.add_argument("--hours", type=float, default=2 / 3)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="16 ranks, 20 minutes, one repetition (smoke test)")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.ranks, args.hours, args.repeat = 16, 1 / 3, 1
    if args.ranks < 8 or args.hours <= 0 or args.repeat < 1:
        p.error("--ranks must be >= 8 (the suspect is rank 7), --hours > 0, --repeat >= 1")
    with tempfile.TemporaryDirectory(prefix="sdc-prom-scale-") as tmp:
        result = run(args.ranks, args.hours, args.repeat, Path(tmp))
    spec = result["spec"]
    print(f"{spec['ranks']} ranks x {spec['series_per_rank']} series, {spec['hours']:g} h at 15 s: "
          f"{spec['samples'] / 1e6:.1f} M samples backfilled in {result['backfill_s']:.0f} s, rollups in "
          f"{result['rules_backfill_s']:.0f} s")
    rows = sorted(result["queries"], key=lambda r: -r["median_s"])
    print(table(["kind", "query", "median s", "series"],
                [[r["kind"], r["name"], f"{r['median_s']:.4f}", r["series"]] for r in rows],
                title="Prometheus query time (slowest first)"))
    for kind in ("alert", "record", "panel"):
        ts = [r["median_s"] for r in rows if r["kind"] == kind]
        print(f"{kind}: {len(ts)} queries, slowest {max(ts):.3f} s, total {sum(ts):.3f} s")
    write_json("prometheus_scale", result, args.out_dir)
    return result


if __name__ == "__main__":
    main()
