"""The fingerprints of many tensors in one kernel launch (Triton, on GPUs).

``fingerprint(tensors)`` defines one int64 row per tensor (``core/fingerprint.py``, algorithm ``sdc-fp2``): the
tensor's bytes as int64 words, cut into rows of ``K`` words; the column sums of every block of ``B`` rows, then each
word after the last whole row, are the partial sums ``p[j]``; the row is ``sum_j h[j] * mix(p[j])`` mod 2**64. Written
with torch operations that is a few launches per tensor (a block reduction, a dot), so a model's weights, optimizer
state and gradients cost thousands of launches a step on a GPU, whatever their size.

Here one program computes the partial sums of one tile (``B`` rows x ``BC`` columns of one tensor, or ``BC`` words of
its tail), mixes and weights them, and adds its share of the tensor's row with an integer atomic add: integer
addition wraps and is associative, so the order in which programs finish cannot change a bit, and the rows are the
same integers as the torch operations give (tested against them, shape by shape, with Triton's interpreter on CPU).
One launch per call, plus a zero fill of the output; the table of tiles is built once per set of tensors (their
addresses and sizes) and cached on the device, so parameters and optimizer state, which keep their storage, cost no
host work after the first step.

Used where Triton is importable and the tensors are on a CUDA device. ``SDC_FINGERPRINT_KERNEL=torch`` turns it off;
``SDC_FINGERPRINT_KERNEL=triton`` uses it on CPU tensors too, through Triton's interpreter (``TRITON_INTERPRET=1`` set
before the first import of triton): how the tests check it and how ``benchmarks/launches.py`` counts launches.
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["available", "direct", "fingerprint_many", "launches"]

_BC = 128      # columns (or tail words) per program
_RB = 8        # rows loaded at a time by a program
_CACHE = 16    # tile tables kept (one per set of tensors fingerprinted every step: weights, each optimizer state...)
_ENV = "SDC_FINGERPRINT_KERNEL"
LAUNCH = "sdc_telemetry.fingerprint_kernel"  # the profiler's name of a launch

_lock = threading.Lock()
_tables: OrderedDict[tuple[Any, ...], tuple[Any, ...]] = OrderedDict()
_kernel: Any = None
_import_error: str | None = None
launches = [0]  # kernel launches so far (the launch-count benchmark reads it: a profiler does not see Triton's)


def available(device: torch.device) -> bool:
    """Whether ``fingerprint_many`` serves tensors on ``device``: a CUDA device with Triton importable (or any device
    with ``SDC_FINGERPRINT_KERNEL=triton``), unless ``SDC_FINGERPRINT_KERNEL=torch``."""
    choice = os.environ.get(_ENV, "")
    if choice == "torch" or (device.type != "cuda" and choice != "triton"):
        return False
    return _compiled() is not None


def _compiled() -> Any:
    global _kernel, _import_error
    if _kernel is not None or _import_error is not None:
        return _kernel
    try:
        from sdc_telemetry.core import _fingerprint_triton
    except Exception as e:  # noqa: BLE001 - no Triton: the torch operations serve
        _import_error = f"{type(e).__name__}: {e}"
        return None
    _kernel = _fingerprint_triton.fingerprint_tiles
    return _kernel


def _table(spans: Sequence[tuple[int, int]], device: torch.device, k: int, b: int) -> tuple[Any, ...]:
    """(per-tensor info [address, bytes, rows, blocks], per-program [tensor, tile], programs, the largest number of
    partial sums (the weights needed), the CUDA event after which they are on the device or None, what must stay
    referenced) for tensors given as (address, bytes), cached per set of them."""
    key = (device, k, b, *spans)
    with _lock:
        found = _tables.get(key)
        if found is not None:
            _tables.move_to_end(key)
            return found
    ncol = math.ceil(k / _BC)
    info, counts, most = [], [], 1
    for address, nbytes in spans:
        n = -(-nbytes // 8)
        rows = n // k
        blocks = -(-rows // b)
        info.append([address, nbytes, rows, blocks])
        counts.append(blocks * ncol + math.ceil((n - rows * k) / _BC))
        most = max(most, blocks * k + n - rows * k)  # partial sums: one per column of a block, one per tail word
    total = sum(counts)
    per = torch.tensor(counts, dtype=torch.int64)
    tensor = torch.repeat_interleave(torch.arange(len(spans), dtype=torch.int64), per)
    start = torch.repeat_interleave(torch.cumsum(per, 0) - per, per)
    work = torch.stack([tensor, torch.arange(total, dtype=torch.int64) - start], dim=1).contiguous()
    host = torch.tensor(info, dtype=torch.int64)
    if device.type == "cuda":
        # No host wait, even once: pinned copies on this stream, and an event that a launch on another stream (DDP's
        # reduction callbacks) waits for on the device. The pinned tensors stay referenced with the table.
        host, work = host.pin_memory(), work.pin_memory()
        on_device = (host.to(device, non_blocking=True), work.to(device, non_blocking=True))
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record()
        found = (*on_device, total, most, ready, (host, work))
    else:
        found = (host, work, total, most, None, ())
    with _lock:
        _tables[key] = found
        while len(_tables) > _CACHE:
            _tables.popitem(last=False)
    return found


def direct(t: torch.Tensor) -> bool:
    """Whether the kernel reads ``t``'s own memory (its bytes in logical order, from an 8-byte aligned address): a
    contiguous dense tensor, as parameters, gradients and optimizer state are. Others go through a copy."""
    return (t.layout == torch.strided and not t.is_sparse and not t.is_quantized and t.is_contiguous()
            and not t.is_conj() and not t.is_neg() and t.data_ptr() % 8 == 0)


def fingerprint_many(tensors: Sequence[torch.Tensor], weights: Callable[[int], torch.Tensor], k: int, b: int,
                     golden: int, m1: int) -> torch.Tensor:
    """(len(tensors), 1) int64 rows of ``tensors`` (on one device, each ``direct`` or a 1-D int64 word copy made by
    ``fingerprint._words``) with the definition's weights (``weights(n)``: the first n on the device) and
    constants."""
    kernel = _compiled()
    if kernel is None:
        raise RuntimeError(f"Triton is not available: {_import_error}")
    device = tensors[0].device
    out = torch.zeros(len(tensors), dtype=torch.int64, device=device)
    spans = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
    info, work, total, most, ready, _ = _table(spans, device, k, b)
    if ready is not None:
        torch.cuda.current_stream(device).wait_event(ready)
    if total:
        # Named for the profiler: one launch (Triton's interpreter, on CPU tensors, runs tensor copies in it)
        with torch.profiler.record_function(LAUNCH):
            kernel[(total,)](info, work, weights(most), out, K=k, B=b, BC=_BC, RB=_RB, NCOL=math.ceil(k / _BC),
                             GOLDEN=golden, M1=m1, LOW32=(1 << 32) - 1, LOW31=(1 << 33) - 1)
        launches[0] += 1
    return out.unsqueeze(1)
