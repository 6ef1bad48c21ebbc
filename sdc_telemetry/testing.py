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
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["spawn_ranks", "RankFailed", "FAILURE_GRACE_S"]

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
