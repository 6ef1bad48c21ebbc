"""Run a function on several real ``torch.distributed`` ranks (gloo, CPU) and collect what each returns.

Used by the demo, the benchmarks and the test suite, and by users' own fire drills::

    results = spawn_ranks(my_fn, world=4, args=(config,))   # my_fn(rank, world, *args) -> picklable

Each rank runs in a fresh ``spawn``-context process with a ``file://`` rendezvous, so nothing leaks between
runs. Failures end the run as soon as they are known, not at the timeout: a rank that raises is reported with its
traceback when its error arrives, and a rank that dies without a result (killed, ``os._exit``, a segfault) is
reported with its exit code once it is gone. After the first failure the other ranks get ``FAILURE_GRACE_S`` seconds
to report (their own errors are often the useful half of the story), then every process left is killed and
``RankFailed`` lists each rank's outcome. Collectives use a process-group timeout of ``pg_timeout`` seconds, so a
collective that some rank never joins fails in that time instead of gloo's default 30 minutes.

``emulate_gpu_numerics`` puts GPU-like numerics on a CPU model (run-to-run noise, a rank whose kernels differ), so
that tolerance mode, calibration and attribution can be tested and benchmarked in the regime GPUs produce.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sdc_telemetry.faults import scaled

__all__ = ["spawn_ranks", "RankFailed", "FAILURE_GRACE_S", "emulate_gpu_numerics", "GPUNumerics"]

FAILURE_GRACE_S = 5.0  # after a first failure, how long the other ranks may still report before they are killed
_POLL_S = 0.2  # how often the parent looks for dead ranks while no result arrives


class RankFailed(RuntimeError):
    """One or more ranks raised, died or hung."""


def _entry(fn: Callable[..., Any], rank: int, world: int, init_file: str, env: dict[str, str], args: tuple[Any, ...],
           results: Any, pg_timeout: float) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.setdefault("LOCAL_RANK", str(rank))
    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        try:
            # Pickled by value here: torch's queue would share tensors through file descriptors that die with
            # this process before the parent reads them.
            results.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent with the traceback
        code = 1
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    # Flush the result, then skip interpreter teardown: gloo's C++ threads can abort a process that is already
    # done ("terminate called without an active exception") after the process group was destroyed.
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"killed by signal {-code} (exit code {code})"
    return f"exit code {code}"


def spawn_ranks(fn: Callable[..., Any], world: int, args: tuple[Any, ...] = (), *, timeout: float = 120.0,
                env: dict[str, str] | None = None, rank_env: Callable[[int], dict[str, str]] | None = None,
                pg_timeout: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the results ordered by rank.

    ``fn`` must be importable (module level). ``rank_env(rank)`` adds per-rank environment variables (for example
    ``SDC_HOST_NAME`` to make ranks look like several hosts). ``timeout`` bounds the whole run; ``pg_timeout`` is
    the process group's timeout for each collective. Raises ``RankFailed`` naming every rank's error, exit code or
    state as soon as one rank failed (after a short grace for the others), or when ``timeout`` ran out.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if timeout <= 0 or pg_timeout <= 0:
        raise ValueError(f"timeout and pg_timeout must be > 0, got timeout={timeout} pg_timeout={pg_timeout}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="sdc-rdzv-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = []
        try:
            for rank in range(world):
                penv = dict(env or {})
                penv.update(rank_env(rank) if rank_env else {})
                p = ctx.Process(target=_entry, args=(fn, rank, world, init_file, penv, args, results, pg_timeout),
                                daemon=True)
                p.start()
                procs.append(p)
            return _collect(procs, results, world, timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join()
            results.close()
            results.cancel_join_thread()


def _collect(procs: list[Any], results: Any, world: int, timeout: float) -> list[Any]:
    """Read results until every rank reported or died, a failure plus the grace passed, or the timeout; judge."""
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    dead: dict[int, int] = {}  # rank -> exit code of a process that ended without a result
    start = time.monotonic()
    failed_at: float | None = None
    timed_out = False

    def read(wait: float) -> bool:
        try:
            rank, status, value = results.get(timeout=wait)
        except queue.Empty:
            return False
        if status == "ok":
            out[rank] = pickle.loads(value)  # noqa: S301 - our own child process's result
        else:
            errors[rank] = value
        return True

    while len(out) + len(errors) + len(dead) < world:
        now = time.monotonic()
        if failed_at is not None and now - failed_at >= FAILURE_GRACE_S:
            break
        if now - start >= timeout:
            timed_out = True
            break
        if not read(_POLL_S):
            gone = [r for r, p in enumerate(procs)
                    if p.exitcode is not None and r not in out and r not in errors and r not in dead]
            if gone:
                while read(0.5):  # a rank that exited right after reporting: its result is already in the pipe
                    pass
                dead.update({r: procs[r].exitcode for r in gone if r not in out and r not in errors})
        if failed_at is None and (errors or dead):
            failed_at = time.monotonic()

    if len(out) == world:
        for p in procs:
            p.join(timeout=30)
        bad_exit = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        if bad_exit:
            raise RankFailed(f"ranks exited with non-zero codes after returning: {bad_exit}")
        return [out[r] for r in range(world)]

    missing = [r for r in range(world) if r not in out]
    lines = [f"{len(missing)} of {world} ranks failed" + (f" (ranks {sorted(out)} returned)" if out else "")]
    if timed_out:
        lines.append(f"ranks {[r for r in missing if r not in errors and r not in dead]} did not finish within "
                     f"{timeout:.0f}s")
    for r in missing:
        if r in errors:
            lines.append(f"rank {r}: {errors[r].rstrip()}")
        elif r in dead:
            lines.append(f"rank {r}: died without a result, {_exit_text(dead[r])}")
        elif timed_out:
            lines.append(f"rank {r}: still running at the timeout: killed")
        else:
            lines.append(f"rank {r}: no result {FAILURE_GRACE_S:.0f}s after the first failure: killed")
    raise RankFailed("\n".join(lines))


# -- emulated GPU numerics ------------------------------------------------------------------------------------------


class GPUNumerics:
    """The forward hooks of ``emulate_gpu_numerics`` on one model. ``remove()`` (or leaving a ``with`` block) takes
    them off; outputs are then exact again."""

    def __init__(self, noise: float, bias: float, seed: int, names: list[str], dither: bool = False) -> None:
        self.noise, self.bias, self.seed, self.dither = noise, bias, seed, dither
        self.modules = names          # the hooked submodules, by name ("" is the root)
        self.calls = 0                # forward calls perturbed so far
        self._handles: list[Any] = []
        self._noise_gens: dict[torch.device, torch.Generator] = {}

    @property
    def active(self) -> bool:
        """The hooks are on."""
        return bool(self._handles)

    def remove(self) -> None:
        """Take every hook off (a second call does nothing)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> GPUNumerics:
        return self

    def __exit__(self, *_: object) -> None:
        self.remove()

    def _uniform(self, like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Uniform in [-1, 1), shaped like ``like``, in float64 for float64 outputs and float32 otherwise."""
        dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
        return torch.rand(like.shape, generator=gen, device=like.device, dtype=dtype).mul_(2).sub_(1)

    def _perturb(self, index: int, out: torch.Tensor) -> torch.Tensor:
        if not out.is_floating_point() or out.numel() == 0:
            return out
        dtype = torch.float64 if out.dtype == torch.float64 else torch.float32  # as ``scaled`` computes
        factor = torch.ones(out.shape, device=out.device, dtype=dtype)
        gen = None
        if self.bias or (self.dither and not self.noise):
            # The same pattern on every call (a generator re-seeded per call): deterministic on this rank.
            gen = torch.Generator(device=out.device).manual_seed((self.seed * 1_000_003 + index) % 2**63)
            if self.bias:
                factor.add_(self._uniform(out, gen), alpha=self.bias)
        if self.noise:
            gen = self._noise_gens.get(out.device)
            if gen is None:
                gen = self._noise_gens[out.device] = torch.Generator(device=out.device).manual_seed(
                    (self.seed * 7_919 + 1) % 2**63)
            factor.add_(self._uniform(out, gen), alpha=self.noise)
        return scaled(out, factor, gen if self.dither else None)

    def _hook(self, index: int) -> Callable[[torch.nn.Module, Any, Any], Any]:
        def hook(_m: torch.nn.Module, _inp: Any, out: Any) -> Any:
            self.calls += 1
            return _map_outputs(out, lambda t: self._perturb(index, t))

        return hook


def emulate_gpu_numerics(module: torch.nn.Module, *, noise: float = 1e-6, bias: float = 0.0, seed: int | None = None,
                         modules: Iterable[str] | None = None, dither: bool = False) -> GPUNumerics:
    """Make a CPU model's arithmetic look like a GPU's: run-to-run noise and per-rank kernel differences.

    Forward hooks on the chosen submodules (``modules``: names as in ``named_modules()``, ``""`` for the root;
    default: every submodule that holds parameters of its own) multiply each floating-point output element by
    ``1 + bias * b + noise * u`` (computed in float32, float64 for float64 outputs), with ``b`` and ``u`` uniform
    in [-1, 1):

    - ``noise``: ``u`` is fresh on every forward call (a private generator, never the global RNG, so dropout and a
      replay's restored RNG state are untouched): two runs of the same micro-batch differ by about ``noise``
      relative, as with non-deterministic GPU kernels (atomics, split-K reductions).
    - ``bias``: ``b`` is a fixed pattern per submodule and output shape, the same on every call: the rank is
      bitwise self-consistent and differs from ranks without it by about ``bias`` relative, as when autotuning
      (``cudnn.benchmark``, ``torch.compile(mode="max-autotune")``) picks another kernel on one rank.

    Only module outputs change (gradients follow from them through autograd): parameters, buffers, gradients
    already accumulated and the monitor's fingerprints of them are never touched. Low-precision outputs absorb
    what their precision cannot hold (1e-6 rounds away in bf16), unless ``dither``: then 16-bit outputs are rounded
    stochastically, as when the difference arises inside a kernel's float32 accumulation before the result is
    rounded (``sdc_telemetry.faults.scaled``): some elements move by one unit in the last place. ``seed``
    (default: derived from the rank) makes the noise reproducible across runs; give every rank a different one. A
    DDP or other wrapper with ``.module`` is unwrapped. Returns a ``GPUNumerics`` handle; ``remove()`` restores exact
    outputs.

    >>> handle = emulate_gpu_numerics(ddp_model, noise=1e-6,                              # doctest: +SKIP
    ...                               bias=1e-5 if dist.get_rank() == 2 else 0.0)        # one rank autotunes
    >>> monitor = SDCMonitor(ddp_model, opt, loss_fn, SDCConfig(mode="tolerance"))       # doctest: +SKIP
    >>> ...                                                                               # doctest: +SKIP
    >>> handle.remove()                                                                   # doctest: +SKIP
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    for name, value in (("noise", noise), ("bias", bias)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= abs(value) < 0.5 \
                or (name == "noise" and value < 0):
            raise ValueError(f"{name} must be a relative size in [0, 0.5) (bias may be negative), got {value!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an int or None, got {seed!r}")
    if seed is None:
        seed = 1 + (dist.get_rank() if dist.is_available() and dist.is_initialized() else 0)
    root: torch.nn.Module = getattr(module, "module", module)
    named = dict(root.named_modules())
    if modules is None:
        names = [n for n, m in named.items() if next(m.parameters(recurse=False), None) is not None]
    else:
        names = [modules] if isinstance(modules, str) else list(modules)
        unknown = [n for n in names if n not in named]
        if unknown:
            raise ValueError(f"no submodule named {unknown[0]!r}; known: {[n for n in named if n][:20]}")
    if not names:
        raise ValueError("no submodule to perturb: the model has no submodule with parameters of its own; name "
                         "some with modules=")
    handle = GPUNumerics(float(noise), float(bias), seed, names, dither=bool(dither))
    handle._handles = [named[n].register_forward_hook(handle._hook(i)) for i, n in enumerate(names)]
    return handle


def _map_outputs(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_map_outputs(o, fn) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_outputs(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map_outputs(v, fn) for k, v in obj.items()}
    return obj
