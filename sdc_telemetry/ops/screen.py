"""Screen a node with the workload: seeded known-answer kernels on every local device, compared bit for bit.

Offline diagnostics miss many GPUs that corrupt data silently; what catches them is running the arithmetic training
runs and comparing it against the same arithmetic elsewhere. ``sdc-telemetry screen`` runs a fixed set of seeded
workloads (matmul in fp32, bf16 and fp16, reductions, a small convolution, an attention block) on every local device,
``repeat`` times, and compares the results' fingerprints bit for bit:

- across repetitions on each device (a device that does not reproduce its own results is named), and
- across devices of the same model (the device that disagrees with the majority is named; with two devices that
  disagree there is no majority and both are named for a second look),

and checks each result against a float64 reference within the precision of its dtype (the known answer, which a
single device can fail on its own). On a host without CUDA, ``cpu_workers`` worker processes stand in for devices,
each single-threaded so that their results are bit-identical; ``drill_fault`` flips one bit in one device's results
for drills (``drill_kind="hang"`` or ``"die"`` makes that device's worker hang or be killed instead).

Every device is screened in a worker process of its own, bounded by ``worker_timeout_s``: a worker that hangs (a
stuck kernel) is killed at the deadline and one that dies (a crash, the OOM killer) is seen at once; either names
its device as odd (``hung: ...`` or ``died: ...``), and the other devices' results still count. Exit codes of the
CLI: 0 consistent, 1 an odd device found, 2 unusable input.

Python::

    report = run_screen(cpu_workers=3, repeat=2, drill_fault=1)
    report.odd            # ['cpu-worker:1']
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import shutil
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from sdc_telemetry.core.fingerprint import digest, fingerprint

__all__ = ["WORKLOADS", "DeviceResult", "ScreenReport", "ScreenError", "run_screen", "run_dcgm"]

# name -> (dtype of the result, normwise tolerance against the float64 reference)
WORKLOADS: dict[str, tuple[torch.dtype, float]] = {
    "matmul_fp32": (torch.float32, 1e-4),
    "matmul_bf16": (torch.bfloat16, 3e-2),
    "matmul_fp16": (torch.float16, 5e-3),
    "reduce_sum_fp32": (torch.float32, 1e-4),
    "reduce_softmax_norm_fp32": (torch.float32, 1e-4),
    "conv2d_fp32": (torch.float32, 1e-4),
    "attention_fp32": (torch.float32, 1e-4),
}
DRILL_WORKLOAD = "matmul_fp32"
_N = 128


class ScreenError(ValueError):
    """The screen cannot run as asked (no devices, a bad drill device, an unknown device type)."""


@dataclass
class DeviceResult:
    device: str                     # cuda:0, cpu-worker:1
    hw_id: str                      # GPU UUID, or cpu:<host>:<index> for a CPU worker
    model: str                      # device model: results are compared among devices of one model
    digests: list[dict[str, str]]   # per repetition: workload -> digest (hex)
    errors: dict[str, float]        # workload -> largest normwise error against the float64 reference
    seconds: float = 0.0
    passed: bool = True
    problems: list[str] = field(default_factory=list)


@dataclass
class ScreenReport:
    host_name: str
    seed: int
    repeat: int
    devices: list[DeviceResult]
    odd: list[str]                  # devices named: disagree with the majority, with themselves, or the known answer
    undecided: list[str]            # devices in a disagreement with no majority
    dcgm: dict[str, Any] | None = None

    @property
    def passed(self) -> bool:
        return not self.odd and not self.undecided and (self.dcgm is None or self.dcgm.get("rc") in (0, None))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


# -- the workloads ------------------------------------------------------------------------------------------------

def _inputs(seed: int) -> dict[str, list[torch.Tensor]]:
    """The workloads' inputs, made on the CPU from ``seed`` (the same on every device)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    a, b = randn(_N, _N), randn(_N, _N)
    return {
        "matmul": [a, b],
        "reduce": [randn(1 << 16)],
        "softmax": [randn(64, 256)],
        "conv2d": [randn(2, 3, 16, 16), randn(8, 3, 3, 3), randn(8)],
        "attention": [randn(1, 16, 32), randn(32, 96), randn(32, 32), randn(32)],
    }


def _compute(name: str, x: dict[str, list[torch.Tensor]], dtype: torch.dtype | None = None) -> torch.Tensor:
    """One workload on the inputs' device, in its own dtype (or ``dtype``, float64 for the reference)."""
    want = WORKLOADS[name][0] if dtype is None else dtype
    if name.startswith("matmul"):
        a, b = (t.to(want) for t in x["matmul"])
        return (a @ b) @ a.T
    if name == "reduce_sum_fp32":
        (v,) = (t.to(want) for t in x["reduce"])
        return torch.stack([v.sum(), (v * v).sum(), v.abs().max(), v.cumsum(0)[-1]])
    if name == "reduce_softmax_norm_fp32":
        (v,) = (t.to(want) for t in x["softmax"])
        return torch.cat([torch.softmax(v, dim=-1).sum(0), torch.linalg.vector_norm(v, dim=0)])
    if name == "conv2d_fp32":
        inp, w, bias = (t.to(want) for t in x["conv2d"])
        return torch.nn.functional.conv2d(inp, w, bias, padding=1)
    if name == "attention_fp32":
        h, w_qkv, w_o, ln_w = (t.to(want) for t in x["attention"])
        h = torch.nn.functional.layer_norm(h, (h.shape[-1],), ln_w)
        qkv = h @ w_qkv
        q, k, v = qkv[..., :32], qkv[..., 32:64], qkv[..., 64:]
        scores = torch.softmax((q @ k.transpose(-1, -2)) / 32 ** 0.5, dim=-1)
        out: torch.Tensor = (scores @ v) @ w_o
        return out
    raise KeyError(name)


def _flip_one_bit(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the lowest bit of its first element flipped (a drill fault, within any tolerance)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    out = t.clone().contiguous()
    flat = out.view(-1).view(ints)
    flat[0] ^= 1
    return out


def _deterministic() -> None:
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def screen_device(device: str, seed: int, repeat: int, fault: bool) -> dict[str, Any]:
    """Run every workload ``repeat`` times on ``device`` (a torch device string); returns the digests and the
    errors against the float64 reference. A CPU worker process calls it with one thread."""
    start = time.monotonic()
    _deterministic()
    dev = torch.device(device)
    cpu_inputs = _inputs(seed)
    refs = {name: _compute(name, cpu_inputs, torch.float64) for name in WORKLOADS}
    inputs = {k: [t.to(dev) for t in v] for k, v in cpu_inputs.items()}
    digests: list[dict[str, str]] = []
    errors = dict.fromkeys(WORKLOADS, 0.0)
    for _ in range(repeat):
        row = {}
        for name in WORKLOADS:
            out = _compute(name, inputs)
            if fault and name == DRILL_WORKLOAD:
                out = _flip_one_bit(out)
            row[name] = f"{int(digest(fingerprint([out]))) % (1 << 64):016x}"
            ref = refs[name]
            err = float((out.double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            errors[name] = max(errors[name], err if err == err else float("inf"))
        digests.append(row)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return {"digests": digests, "errors": errors, "seconds": time.monotonic() - start}


DRILL_KINDS = ("bitflip", "hang", "die")


def _worker(conn: Any, device: str, seed: int, repeat: int, fault: bool, drill: str) -> None:
    """One device's screen in a process of its own; the result (or the error) goes back through ``conn``."""
    try:
        if fault and drill == "hang":
            time.sleep(1e9)  # a stuck kernel, for drills
        if fault and drill == "die":
            os.kill(os.getpid(), 9)  # killed (the OOM killer, a crash), for drills
        if device == "cpu":
            torch.set_num_threads(1)  # one thread: the same summation order in every worker
        conn.send(screen_device(device, seed, repeat, fault and drill == "bitflip"))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which names the device
        conn.send({"error": f"{type(e).__name__}: {e}"})
    finally:
        conn.close()


def _run_workers(ctx: Any, devices: Sequence[str], seed: int, repeat: int, fault: int | None, drill: str,
                 timeout_s: float) -> list[dict[str, Any]]:
    """Each device's screen in its own process, at once; a worker that hangs past ``timeout_s`` is killed and one
    that dies is seen when it does: their entries are ``{"failure": why}``."""
    procs, conns = [], []
    for i, device in enumerate(devices):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker, args=(child, device, seed, repeat, fault == i, drill),
                           name=f"sdc-screen-{i}", daemon=True)
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    out: list[dict[str, Any] | None] = [None] * len(devices)
    deadline = time.monotonic() + timeout_s
    waiting = set(range(len(devices)))
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        multiprocessing.connection.wait([conns[i] for i in waiting] + [procs[i].sentinel for i in waiting],
                                        timeout=left)
        for i in sorted(waiting):
            got = None
            if conns[i].poll():
                try:
                    got = conns[i].recv()
                except (EOFError, OSError):
                    got = None  # the worker is gone without a result: how, below
            if got is not None:
                out[i] = {"failure": f"failed: {got['error']}"} if "error" in got else got
                waiting.discard(i)
            elif not procs[i].is_alive():
                procs[i].join()
                code = procs[i].exitcode
                how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                out[i] = {"failure": f"died: its worker process ended without a result ({how})"}
                waiting.discard(i)
    for i in waiting:
        procs[i].kill()
        out[i] = {"failure": f"hung: no result within {timeout_s:g}s; its worker process was killed"}
    for proc, conn in zip(procs, conns, strict=True):
        proc.join(5)
        conn.close()
    return [o if o is not None else {"failure": "no result"} for o in out]


# -- comparing ----------------------------------------------------------------------------------------------------

def _judge(all_results: list[DeviceResult]) -> tuple[list[str], list[str]]:
    odd: set[str] = {r.device for r in all_results if not r.digests}  # hung or died: named, not compared
    undecided: set[str] = set()
    results = [r for r in all_results if r.digests]
    for r in results:
        unstable = [w for w in WORKLOADS if len({rep[w] for rep in r.digests}) > 1]
        if unstable:
            r.problems.append(f"results differ between repetitions: {', '.join(unstable)}")
            odd.add(r.device)
        wrong = [f"{w} (error {r.errors[w]:.2g} > {WORKLOADS[w][1]:.0e})" for w in WORKLOADS
                 if not r.errors[w] <= WORKLOADS[w][1]]
        if wrong:
            r.problems.append(f"wrong answer against the float64 reference: {', '.join(wrong)}")
            odd.add(r.device)
    by_model: dict[str, list[DeviceResult]] = {}
    for r in results:
        by_model.setdefault(r.model, []).append(r)
    for group in by_model.values():
        if len(group) < 2:
            continue
        for w in WORKLOADS:
            votes = Counter(r.digests[0][w] for r in group)
            if len(votes) == 1:
                continue
            top, count = votes.most_common(1)[0]
            if count * 2 > len(group):
                for r in group:
                    if r.digests[0][w] != top:
                        r.problems.append(f"{w} differs bit for bit from the other {count} device(s)")
                        odd.add(r.device)
            else:
                for r in group:
                    r.problems.append(f"{w}: the {len(group)} devices disagree with no majority")
                    undecided.add(r.device)
    undecided -= odd
    for r in all_results:
        r.passed = r.device not in odd and r.device not in undecided
    order = [r.device for r in all_results]
    return [d for d in order if d in odd], [d for d in order if d in undecided]


# -- running ------------------------------------------------------------------------------------------------------

def _host_name() -> str:
    from sdc_telemetry.core.identity import HOST_NAME_ENV

    return os.environ.get(HOST_NAME_ENV) or socket.gethostname()


def _resolve_drill(drill_fault: str | int | None, names: Sequence[str]) -> int | None:
    if drill_fault is None:
        return None
    text = str(drill_fault)
    if text in names:
        return list(names).index(text)
    if text.isdigit() and int(text) < len(names):
        return int(text)
    raise ScreenError(f"--drill-fault {text!r} names no device: give an index 0..{len(names) - 1} or one of "
                      f"{', '.join(names)}")


def run_screen(*, device_type: str = "auto", cpu_workers: int = 3, repeat: int = 3, seed: int = 0,
               drill_fault: str | int | None = None, host_name: str | None = None,
               progress: Callable[[str], None] | None = None, worker_timeout_s: float = 1800.0,
               drill_kind: str = "bitflip") -> ScreenReport:
    """Screen this host's devices (see the module docstring); ScreenError for unusable input.

    ``device_type``: ``auto`` (CUDA devices when present, else CPU workers), ``cuda`` or ``cpu``.
    ``worker_timeout_s``: how long every device's worker may take (all run at once).
    """
    if device_type not in ("auto", "cuda", "cpu"):
        raise ScreenError(f"device type must be auto, cuda or cpu, got {device_type!r}")
    if drill_kind not in DRILL_KINDS:
        raise ScreenError(f"drill kind must be one of {', '.join(DRILL_KINDS)}, got {drill_kind!r}")
    if isinstance(worker_timeout_s, bool) or not isinstance(worker_timeout_s, (int, float)) or \
            not 0 < worker_timeout_s < float("inf"):
        raise ScreenError(f"worker_timeout_s must be a number of seconds > 0, got {worker_timeout_s!r}")
    for name, value, low in (("cpu_workers", cpu_workers, 1), ("repeat", repeat, 1), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ScreenError(f"{name} must be an integer >= {low}, got {value!r}")
    host = host_name or _host_name()
    use_cuda = device_type == "cuda" or (device_type == "auto" and torch.cuda.is_available())
    # forkserver: a fresh process imports torch once and forks the workers from it (no threads of this process,
    # which may have used torch or CUDA already, are inherited; cheaper than one interpreter per worker).
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in multiprocessing.get_all_start_methods()
                                      else "spawn")
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(["sdc_telemetry.ops.screen"])
    if use_cuda:
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            raise ScreenError("--device-type cuda: no CUDA device is visible")
        from sdc_telemetry.core.identity import RankIdentity

        count = torch.cuda.device_count()
        names = [f"cuda:{i}" for i in range(count)]
        fault = _resolve_drill(drill_fault, names)
        if progress:
            progress(f"screening {count} CUDA device(s): " + ", ".join(
                f"{name} ({torch.cuda.get_device_name(i)})" for i, name in enumerate(names)))
        outs = _run_workers(ctx, names, seed, repeat, fault, drill_kind, worker_timeout_s)
        identity = [(RankIdentity.local(torch.device("cuda", i)).hw_id, torch.cuda.get_device_name(i))
                    for i in range(count)]
    else:
        names = [f"cpu-worker:{i}" for i in range(cpu_workers)]
        fault = _resolve_drill(drill_fault, names)
        if progress:
            progress(f"screening {cpu_workers} CPU worker process(es) standing in for devices")
        outs = _run_workers(ctx, ["cpu"] * cpu_workers, seed, repeat, fault, drill_kind, worker_timeout_s)
        model = f"cpu ({torch.backends.cpu.get_cpu_capability()})"
        identity = [(f"cpu:{host}:{i}", model) for i in range(cpu_workers)]
    results = []
    for name, (hw_id, model), o in zip(names, identity, outs, strict=True):
        if "failure" in o:
            results.append(DeviceResult(name, hw_id, model, [], {}, passed=False, problems=[o["failure"]]))
        else:
            results.append(DeviceResult(name, hw_id, model, o["digests"], o["errors"], o["seconds"]))
    odd, undecided = _judge(results)
    return ScreenReport(host, seed, repeat, results, odd, undecided)


def run_dcgm(level: int = 3, timeout_s: float = 3600.0) -> dict[str, Any]:
    """``dcgmi diag -r LEVEL``: {"rc", "output"}; rc None when dcgmi is not installed."""
    binary = shutil.which("dcgmi")
    if binary is None:
        return {"rc": None, "output": "dcgmi not found on PATH (install NVIDIA DCGM to run its diagnostics)"}
    try:
        proc = subprocess.run([binary, "diag", "-r", str(level)], stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"rc": -1, "output": f"dcgmi diag -r {level} timed out after {timeout_s:.0f}s"}
    except OSError as e:
        return {"rc": -1, "output": f"could not run dcgmi: {e}"}
    text = (proc.stdout + proc.stderr).decode(errors="replace")
    return {"rc": proc.returncode, "output": text[-4000:]}
