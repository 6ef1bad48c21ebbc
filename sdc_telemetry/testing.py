"""Run a function on several real ``torch.distributed`` ranks (gloo, CPU) and collect what each returns.

Used by the demo, the benchmarks and the test suite, and by users' own fire drills::

    results = spawn_ranks(my_fn, world=4, args=(config,))   # my_fn(rank, world, *args) -> picklable

Each rank runs in a fresh ``spawn``-context process with a ``file://`` rendezvous, so nothing leaks between
runs. A rank that raises is reported with its traceback; a rank that hangs past ``timeout`` fails the run and every
process is killed.
"""

from __future__ import annotations

import os
import pickle
import queue
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["spawn_ranks", "RankFailed"]


class RankFailed(RuntimeError):
    """One or more ranks raised, died or hung."""


def _entry(fn: Callable[..., Any], rank: int, world: int, init_file: str, env: dict[str, str], args: tuple[Any, ...],
           results: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.setdefault("LOCAL_RANK", str(rank))
    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
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


def spawn_ranks(fn: Callable[..., Any], world: int, args: tuple[Any, ...] = (), *, timeout: float = 120.0,
                env: dict[str, str] | None = None, rank_env: Callable[[int], dict[str, str]] | None = None
                ) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the results ordered by rank.

    ``fn`` must be importable (module level). ``rank_env(rank)`` adds per-rank environment variables (for example
    ``SDC_HOST_NAME`` to make ranks look like several hosts).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="sdc-rdzv-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = []
        for rank in range(world):
            penv = dict(env or {})
            penv.update(rank_env(rank) if rank_env else {})
            p = ctx.Process(target=_entry, args=(fn, rank, world, init_file, penv, args, results), daemon=True)
            p.start()
            procs.append(p)
        out: dict[int, Any] = {}
        errors: list[str] = []
        try:
            while len(out) + len(errors) < world:
                try:
                    rank, status, value = results.get(timeout=timeout)
                except queue.Empty:
                    raise RankFailed(f"ranks {sorted(set(range(world)) - set(out))} did not finish within "
                                     f"{timeout:.0f}s") from None
                if status == "ok":
                    out[rank] = pickle.loads(value)  # noqa: S301 - our own child process's result
                else:
                    errors.append(f"rank {rank}: {value}")
            for p in procs:
                p.join(timeout=30)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
            results.close()
        if errors:
            raise RankFailed("\n".join(errors))
        bad_exit = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        if bad_exit:
            raise RankFailed(f"ranks exited with non-zero codes: {bad_exit}")
        return [out[r] for r in range(world)]
