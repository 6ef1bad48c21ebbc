"""DistributedDataParallel: every rank holds the whole model; gradients are all-reduced bucket by bucket.

Local gradients are read in a comm hook that wraps the all-reduce (the user's hook, or ``allreduce_as_ddp`` on
DDP's own process group: DDP's built-in averaging reproduced bit for bit, so training is unchanged): the hook
measures the bucket, then runs the wrapped all-reduce. Reduced gradients are read as each bucket's reduction comes
back (what DDP copies into ``.grad``), in the checksum's pass; where that pass does not run, ``.grad`` after
backward. Every rank of the replica group (``replica_group``, default the DDP model's process group) holds a
replica of every tensor; the replay recomputes a partner's micro-batches with plain autograd on the unwrapped
module (no collective).

Reduce-phase checksum (``ReduceChecksum``, algorithm-based fault tolerance): a fault inside the all-reduce (a wrong
partial sum in a reduce-scatter, spread by the all-gather) hands every rank the same wrong gradient, so the replicas
still agree and the replay, which compares gradients before the reduction, never sees it. In ``allreduce_as_ddp``,
after DDP's scaling and before the sum, each bucket is cut into chunks of at most ``CHUNK`` elements, each laid out
as ``BLOCK`` = 16 rows of ``COLS`` = 4093 consecutive elements; each chunk gives S = sum(w_i * x_i) (w: a fixed
pseudo-random sign per column; 4093 is an odd prime, so two runs of elements a power-of-two distance apart that
trade places change S unless their columns' signs happen to agree everywhere), each column summed in float32 (16
elements), the rest in float64; and A = sum(|x_i|), summed in float32 over the chunk; on the device. The per-chunk
S and A of every bucket, summed over the ranks, travel in one small float64 all-reduce launched right behind the last
bucket's (appending them to the bucket itself would change how the backend splits the bucket, and with it the
rounding of the sum at W >= 3: training would no longer be bitwise that of unmonitored DDP). When a bucket's
reduced result comes back, S' = sum(w_i * R_i) is taken on exactly what DDP receives, with the reduced gradients'
norms in the same pass; at the end of backward ``mismatch()`` compares S' with the sum of S per chunk (on the device,
no host synchronisation): see ``tolerance``.

Cost: on CPU a bucket is read piece by piece (``PIECE`` elements, whole chunks): the local norms, DDP's scaling
and the chunk sums of a piece run back to back while it is in the core's cache, so that the local side reads each
gradient from memory about once (twice for a gradient larger than a piece: its norm is taken whole) and the reduced
side once. GPUs run each of these passes at memory bandwidth in one launch per bucket.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sdc_telemetry.core.collective import group_ranks, wait_work
from sdc_telemetry.core.schedule import gpu_schedule
from sdc_telemetry.parallel.base import GradSink, Layout

__all__ = ["DDP", "CommHook", "CommHookState", "comm_hook", "allreduce_as_ddp", "DDPScaling", "ReduceChecksum",
           "CHUNK", "chunk_sums", "weighted_sums", "tolerance", "chunk_constants", "compare"]

log = logging.getLogger("sdc_telemetry")

GradBucket = Any  # torch.distributed.GradBucket (a pybind class the type checker cannot see)
CommHook = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]


# -- the reduce-phase checksum -------------------------------------------------------------------------------------

#: columns of a checksum chunk: an odd prime, so that positions a power-of-two distance apart never share a column
COLS = 4093
#: rows of a checksum chunk: the elements of one column, which share one weight and are first summed in float32
#: (float64 buckets: float64), so that float64 arithmetic runs on 1/16 of the elements (a float64 sum of every
#: element is 16x slower than a float32 one on CPUs)
BLOCK = 16
#: elements per checksum chunk (at most): one S and one A per chunk
CHUNK = BLOCK * COLS
#: CPU: elements per piece of a bucket (a few chunks, whole parameters): each piece's norms, scaling and sums run
#: back to back while it sits in the core's cache, so that the bucket is read from memory about once
PIECE = 4 * CHUNK
_CHECKED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_U64 = 2.0 ** -53  # unit roundoff of float64, where the checksums are summed
_SIGNS: dict[torch.device, torch.Tensor] = {}
_ACTIVE = threading.local()  # the checksum (and local norms to take) of the bucket being reduced


def _signs(device: torch.device) -> torch.Tensor:
    """The +-1 weight of each column of a chunk (fixed, pseudo-random), float64 on ``device``, made once."""
    w = _SIGNS.get(device)
    if w is None:
        bits = torch.randint(0, 2, (COLS,), generator=torch.Generator().manual_seed(0x5DC))
        w = _SIGNS[device] = (bits * 2 - 1).to(device=device, dtype=torch.float64)
    return w


def _partial_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _span(flat: torch.Tensor, c0: int, c1: int) -> tuple[int, int, int, torch.dtype]:
    """Chunks ``c0 .. c1`` of ``flat``: (first element, end element, whole chunks among them, partial dtype)."""
    lo, hi = c0 * CHUNK, min(c1 * CHUNK, flat.numel())
    return lo, hi, (hi - lo) // CHUNK, _partial_dtype(flat.dtype)


def _columns(flat: torch.Tensor, c0: int, c1: int) -> torch.Tensor:
    """Column sums (in the partial dtype) of chunks ``c0 .. c1`` of ``flat``: shape (c1 - c0, COLS). A chunk is
    ``BLOCK`` rows of ``COLS`` consecutive elements (the last chunk of a bucket may have fewer rows and a partial last
    row: missing elements count as zeros, without a padded copy)."""
    lo, hi, whole, p = _span(flat, c0, c1)
    parts = []
    if whole:
        parts.append(flat[lo:lo + whole * CHUNK].view(whole, BLOCK, COLS).sum(1, dtype=p))
    if hi > lo + whole * CHUNK:  # the bucket's last, partial chunk
        tail = flat[lo + whole * CHUNK:hi]
        rows, rest = divmod(tail.numel(), COLS)
        col = tail[:rows * COLS].view(rows, COLS).sum(0, dtype=p) if rows else \
            torch.zeros(COLS, dtype=p, device=flat.device)
        if rest:
            col[:rest] += tail[rows * COLS:].to(p)
        parts.append(col.unsqueeze(0))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _absolute(flat: torch.Tensor, c0: int, c1: int, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """A = sum(|x_i|) of each of chunks ``c0 .. c1`` of ``flat`` (float64 out, (c1 - c0,)), summed in the partial
    dtype over the chunk's contiguous elements (it may read low by n * u_p, which ``tolerance`` allows for): one
    contiguous reduction, not the strided column sums S needs. On CPU ``|x|`` of whole chunks lands in ``scratch``
    (at least their size), which stays in cache, instead of a fresh temporary; GPUs take the 1-norm in one pass."""
    lo, hi, whole, p = _span(flat, c0, c1)
    parts = []
    if whole:
        rows = flat[lo:lo + whole * CHUNK].view(whole, CHUNK)
        if not gpu_schedule(rows.device):  # CPU has no fast fused sum of |x| (its 1-norm kernel is slower than both)
            out = scratch[:whole * CHUNK] if scratch is not None and scratch.numel() >= whole * CHUNK \
                and scratch.dtype == rows.dtype else None
            parts.append((torch.abs(rows, out=out.view(whole, CHUNK)) if out is not None else rows.abs())
                         .sum(1, dtype=p))
        else:
            parts.append(torch.linalg.vector_norm(rows, 1, dim=1, dtype=p))
    if hi > lo + whole * CHUNK:  # the bucket's last, partial chunk
        parts.append(flat[lo + whole * CHUNK:hi].abs().sum(dtype=p).reshape(1))
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).to(torch.float64)


def _weighted(cols: torch.Tensor) -> torch.Tensor:
    """S per chunk from its column sums: sum_c w_c * cols[c], in float64. One ``mv`` on CPU; on CUDA a multiply and
    a sum instead of cuBLAS: the reduced side runs here in a future's callback, on the next stream of torch's pool
    each time, and cuBLAS keeps a workspace (up to 32 MiB) for every stream it meets, for good."""
    c = cols.to(torch.float64)
    w = _signs(cols.device)
    return (c * w).sum(1) if gpu_schedule(c.device) else torch.mv(c, w)


def _sums(flat: torch.Tensor, c0: int, c1: int, scratch: torch.Tensor | None = None) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
    """(S, A) of chunks ``c0 .. c1`` of ``flat`` (float64, (c1 - c0,) each); on CPU a few chunks at a time, so that
    the second read (``|x|``) comes from cache."""
    step = c1 - c0 if gpu_schedule(flat.device) else max(1, PIECE // CHUNK)
    s, a = [], []
    for c in range(c0, c1, step):
        e = min(c + step, c1)
        s.append(_weighted(_columns(flat, c, e)))
        a.append(_absolute(flat, c, e, scratch))
    if len(s) == 1:
        return s[0], a[0]
    return torch.cat(s), torch.cat(a)


def _chunks(n: int) -> int:
    return -(-n // CHUNK)


def weighted_sums(flat: torch.Tensor) -> torch.Tensor:
    """Per chunk of at most ``CHUNK`` elements, S = sum(w_i * x_i) (shape (k,), k = ceil(n / CHUNK), float64):
    element i of a chunk sits in row i // COLS and column i % COLS, and w_i is the sign of its column; each column
    (``BLOCK`` elements) is summed in float32 (float64 buckets: float64), the rest in float64."""
    if flat.numel() == 0:
        return torch.zeros(0, dtype=torch.float64, device=flat.device)
    return _weighted(_columns(flat, 0, _chunks(flat.numel())))


def chunk_sums(flat: torch.Tensor) -> torch.Tensor:
    """Per chunk, S (``weighted_sums``) and A = sum(|x_i|) (summed in float32 for sub-float64 dtypes): (2, k)
    float64."""
    if flat.numel() == 0:
        return torch.zeros((2, 0), dtype=torch.float64, device=flat.device)
    return torch.stack(_sums(flat, 0, _chunks(flat.numel())))


@dataclass(frozen=True)
class _View:
    """A gradient's place in its bucket: offset and size, and its index among the monitored parameters (-1: not
    monitored, a parameter frozen after DDP was built)."""

    offset: int
    numel: int
    index: int


def _bucket_views(buffer: torch.Tensor, grads: Sequence[torch.Tensor], indices: Sequence[int]
                  ) -> tuple[_View, ...] | None:
    """Where each gradient view lies in the flat bucket ``buffer``; None when they are not contiguous, ordered,
    non-overlapping views of it (then nothing is fused)."""
    size = buffer.element_size()
    base = buffer.data_ptr()
    out = []
    end = 0
    for g, i in zip(grads, indices, strict=True):
        off, rem = divmod(g.data_ptr() - base, size)
        if rem or g.dtype != buffer.dtype or not g.is_contiguous() or off < end or off + g.numel() > buffer.numel():
            return None
        out.append(_View(off, g.numel(), i))
        end = off + g.numel()
    return tuple(out)


class _Plan:
    """How a bucket is read piece by piece: pieces of ``PIECE`` elements on CPU (whole chunks; the last piece ends
    at the bucket's end and holds the last chunk), one piece elsewhere. Each gradient's norm is taken whole, in the
    piece where it starts, with the kernel every other norm of the package uses (``_foreach_norm``: the replay
    compares these norms with recomputed ones, and float32 norms of large tensors depend on how they are summed)."""

    def __init__(self, n: int, views: Sequence[_View], piece: int) -> None:
        step = max(CHUNK, piece // CHUNK * CHUNK)
        bounds = [*range(step, n, step), n] if n else [0]
        # (start, end, first chunk, end chunk, [(view, lo, hi)] of the views in the piece, [(lo, hi)] of the
        # monitored views that start in it)
        self.pieces: list[tuple[int, int, int, int, list[tuple[int, int, int]], list[tuple[int, int]]]] = []
        start = j0 = 0
        for end in bounds:
            slices, starting = [], []
            while j0 < len(views) and views[j0].offset + views[j0].numel <= start and views[j0].offset < start:
                j0 += 1
            j = j0
            while j < len(views) and (views[j].offset < end or (end == n and views[j].offset == n)):
                v = views[j]
                lo, hi = max(v.offset, start), min(v.offset + v.numel, end)
                if hi > lo:
                    slices.append((j, lo, hi))
                if v.index >= 0 and v.offset >= start:
                    starting.append((v.offset, v.offset + v.numel))
                j += 1
            self.pieces.append((start, end, start // CHUNK, _chunks(n) if end == n else end // CHUNK, slices,
                                starting))
            start = end
        self.monitored = [v.index for v in views if v.index >= 0]
        if sum(len(p[5]) for p in self.pieces) != len(self.monitored):
            raise RuntimeError("a gradient view lies outside its bucket")


def _norms(flat: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """float32 L2 norms of ``flat[lo:hi]`` for each range (one ``_foreach_norm``, as ``GradRecord`` takes them)."""
    return list(torch._foreach_norm([flat[lo:hi] for lo, hi in ranges], 2, dtype=torch.float32)) if ranges else []


_PLANS: dict[tuple[int, tuple[_View, ...], int], _Plan] = {}


def _plan(n: int, views: tuple[_View, ...], device: torch.device) -> _Plan:
    """The bucket's plan, made once per layout (DDP's bucket layouts are fixed after its first-step rebuild)."""
    piece = max(n, 1) if gpu_schedule(device) else PIECE
    key = (n, views, piece)
    found = _PLANS.get(key)
    if found is None:
        found = _PLANS[key] = _Plan(n, views, piece)
        if len(_PLANS) > 256:
            _PLANS.pop(next(iter(_PLANS)))
    return found


def tolerance(world: int, dtype: torch.dtype, n: int) -> float:
    """How far S' may be from the sum of the ranks' S, per unit of the sum of their A, for a healthy reduction of a
    chunk of ``n`` elements of ``dtype`` over ``world`` ranks.

    The backend sums W values per element in ``dtype``, in an order of its choosing (ring, tree, in-switch): with
    unit roundoff u = eps/2, any order errs by at most gamma_{W-1} * sum_r |x_ri| ~ (W-1) * u * sum_r |x_ri| (a sum
    whose result is subnormal is exact, so there is no absolute term). Weighted by +-1 and summed over the chunk,
    that is at most (W-1) * u * sum_r A_r. Each column (16 elements) is summed in the partial dtype p (float32, or
    float64 for float64 buckets): at most 15 * u_p * sum|x| for each rank's S and again for S'. The float64 sums
    add at most (2n + W) * u64 * sum_r A_r. A itself, summed in p, may read low by n * u_p. Twice each bound:
    ((W-1) * eps + 30 * eps_p) * (1 + n * eps_p) + 4 * (2n + W) * 2**-53, i.e. (W + 29) * eps for float32. The bound
    holds for every input and order, so a healthy reduction never exceeds it (no calibration, no false alarm); one
    element changed by d shows when |d| exceeds it times sum_r A (fp32, W=8, a full chunk: about 0.29 times the
    chunk's mean |reduced gradient|)."""
    eps_p = torch.finfo(_partial_dtype(dtype)).eps
    return ((max(world - 1, 0) * torch.finfo(dtype).eps + 2 * (BLOCK - 1) * eps_p) * (1 + n * eps_p)
            + 4 * (2 * n + world) * _U64)


def compare(sums: torch.Tensor, reduced: torch.Tensor, coef: torch.Tensor, limit: torch.Tensor,
            world: int) -> torch.Tensor:
    """0-d int64 on the device: 1 when a chunk's reduced checksum is off (``sums``: [sum S, sum A, ranks that
    measured] over the ranks; ``reduced``: S' per chunk; ``coef``: ``tolerance`` per chunk; ``limit``: per chunk, the
    sum of |x| from which a correct sum may overflow the dtype). Chunks with non-finite inputs are left to
    ``grad_local``; a non-finite S' from finite inputs is a mismatch, unless the inputs could overflow (numerics)."""
    k = reduced.numel()
    s_sum, a_sum = sums[:k], sums[k:2 * k]
    finite_in = torch.isfinite(s_sum) & torch.isfinite(a_sum)
    off = torch.where(torch.isfinite(reduced), (reduced - s_sum).abs() > coef * a_sum, a_sum < limit)
    return ((finite_in & off).any() & (sums[2 * k] == world)).to(torch.int64)


@dataclass
class _Round:
    """One reduction of every bucket (one backward pass that synchronised)."""

    order: list[int] = field(default_factory=list)             # buckets in the order they were reduced
    chunks: dict[int, int] = field(default_factory=dict)      # bucket -> chunks (0: not checked)
    sizes: dict[int, tuple[int, torch.dtype]] = field(default_factory=dict)
    local: dict[int, torch.Tensor] = field(default_factory=dict)    # bucket -> (2, k) this rank's S and A
    reduced: dict[int, torch.Tensor] = field(default_factory=dict)  # bucket -> (k,) S' of what DDP received
    # bucket -> (monitored parameter indices, their reduced gradients' norms), taken with S'
    norms: dict[int, tuple[list[int], torch.Tensor]] = field(default_factory=dict)
    events: list[Any] = field(default_factory=list)           # CUDA: S' computed on the future's callback stream
    work: Any = None
    sums: torch.Tensor | None = None
    world: int = 1
    failed: bool = False


def checkable(buffer: torch.Tensor) -> bool:
    """The checksum reads this bucket: a dense contiguous floating-point buffer."""
    return buffer.layout == torch.strided and buffer.dtype in _CHECKED and buffer.is_contiguous()


class ReduceChecksum:
    """The reduce-phase checksum of one DDP model (see the module docstring): fed by ``allreduce_as_ddp`` (the
    local sums, the launch) and by the monitor's comm hook (S' of each reduced bucket, and the reduced gradients'
    norms read in the same pass); read once per step by ``mismatch()``. Never raises into the reduction: a failure
    is reported by ``mismatch()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._round = _Round()
        self._pending: torch.Tensor | None = None  # the OR of the rounds compared since the last mismatch()
        self._error = False
        self._constants: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
        self._norms: tuple[list[int], torch.Tensor] | None = None  # of the last round compared
        self._scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.rounds = 0   # rounds compared
        self.skipped = 0  # rounds that could not be compared (a rank failed to measure, a bucket not checked)

    def took(self, index: int) -> bool:
        """Bucket ``index`` of the current round was checksummed: its reduced result must be read."""
        return self._round.chunks.get(index, 0) > 0

    def scratch(self, buffer: torch.Tensor) -> torch.Tensor | None:
        """CPU: a reusable buffer for ``|x|`` of a few chunks (no fresh allocation per piece and step)."""
        if gpu_schedule(buffer.device):
            return None
        key = (buffer.device, buffer.dtype)
        found = self._scratch.get(key)
        if found is None:
            found = self._scratch[key] = torch.empty(max(1, PIECE // CHUNK) * CHUNK, dtype=buffer.dtype)
        return found

    def local(self, index: int, buffer: torch.Tensor, sums: torch.Tensor | None = None, failed: bool = False
              ) -> None:
        """This rank's (scaled) bucket, before the sum; ``sums``: its (2, k) chunk sums where the caller took them
        while scaling (None: taken here); ``failed``: the caller failed to take them."""
        with self._lock:
            if index == 0 or index in self._round.chunks:  # a new reduction round (accumulation without no_sync)
                self._fold()
            r = self._round
            k = _chunks(buffer.numel()) if checkable(buffer) else 0
            r.order.append(index)
            r.chunks[index] = k
            if not k:
                return
            r.sizes[index] = (buffer.numel(), buffer.dtype)
            try:
                if failed:
                    raise RuntimeError("taking the chunk sums while scaling failed")
                r.local[index] = sums if sums is not None else chunk_sums(buffer.view(-1))
            except Exception:  # the reduction must go on; the round is marked and not compared
                log.exception("sdc_telemetry: the reduce-phase checksum of bucket %d failed; training goes on", index)
                r.failed = True
                r.local[index] = torch.zeros((2, k), dtype=torch.float64, device=buffer.device)

    def launch(self, group: dist.ProcessGroup, device: torch.device) -> None:
        """At the last bucket: all-reduce [S of every chunk, A of every chunk, 1] (0 where this rank failed)."""
        with self._lock:
            r = self._round
            checked = [i for i in r.order if r.chunks[i]]
            total = sum(r.chunks[i] for i in checked)
            if not total:
                return
            try:
                vec = torch.cat([*(r.local[i][0] for i in checked), *(r.local[i][1] for i in checked),
                                 (torch.zeros if r.failed else torch.ones)(1, dtype=torch.float64, device=device)])
            except Exception:  # every rank must still join the all-reduce, with the same size
                log.exception("sdc_telemetry: packing the reduce-phase checksum failed; training goes on")
                r.failed = True
                vec = torch.zeros(2 * total + 1, dtype=torch.float64, device=device)
            r.world = group.size()
            r.sums = vec
            r.work = dist.all_reduce(vec, group=group, async_op=True)

    def reduced(self, index: int, value: torch.Tensor, views: tuple[_View, ...] | None = None) -> None:
        """S' of bucket ``index`` as DDP receives it (called when the bucket's future completes) and, given the
        gradients' ``views`` of it, their norms, read in the same pass (piece by piece on CPU)."""
        try:
            flat = value.reshape(-1)
            norms: tuple[list[int], torch.Tensor] | None = None
            if views is None:
                s = weighted_sums(flat)
            else:
                plan = _plan(flat.numel(), views, flat.device)
                parts, found = [], []
                for _, _, c0, c1, _, starting in plan.pieces:
                    found += _norms(flat, starting)
                    if c1 > c0:
                        parts.append(_weighted(_columns(flat, c0, c1)))
                s = parts[0] if len(parts) == 1 else torch.cat(parts)
                norms = (plan.monitored, torch.stack(found) if found else torch.zeros(0, device=flat.device))
            event = None
            if s.is_cuda:
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record()
            with self._lock:
                self._round.reduced[index] = s
                if norms is not None:
                    self._round.norms[index] = norms
                if event is not None:
                    self._round.events.append(event)
        except Exception:  # the reduced gradient must still reach DDP
            log.exception("sdc_telemetry: the reduced checksum of bucket %d failed; training goes on", index)
            with self._lock:
                self._round.failed = True
                self._error = True

    def mismatch(self) -> torch.Tensor | None:
        """At the end of backward: 1 (0-d int64, on the device) when a reduction since the last call did not sum
        the ranks' buckets; None when none was compared. Raises when this rank failed to measure (an error)."""
        with self._lock:
            self._fold()
            flag, self._pending = self._pending, None
            error, self._error = self._error, False
        if error:
            raise RuntimeError("the reduce-phase checksum failed on this rank")
        return flag

    def reduced_norms(self) -> tuple[list[int], torch.Tensor] | None:
        """The reduced gradients' norms read with S' in the round ``mismatch()`` compared last (every bucket's:
        monitored parameter indices and norms), once; None where not every bucket's were read."""
        with self._lock:
            norms, self._norms = self._norms, None
        return norms

    def _fold(self) -> None:
        """Compare the finished round and OR it into the pending flag; start a new round."""
        r, self._round = self._round, _Round()
        self._norms = None
        checked = [i for i in r.order if r.chunks[i]]
        if not checked:
            return
        if r.work is None or r.sums is None or r.failed or any(i not in r.reduced for i in checked):
            self.skipped += 1
            return
        wait_work(r.work)  # CUDA: the current stream waits for the all-reduce, the host does not
        current = torch.cuda.current_stream(r.sums.device) if r.sums.is_cuda else None
        for event in r.events:
            current.wait_event(event)  # type: ignore[union-attr]
        reduced = [r.reduced[i] for i in checked]
        if current is not None:
            # Made on the callback's (or the autograd thread's) stream, read on this one.
            for t in [*reduced, *(n for _, n in r.norms.values()), r.sums]:
                t.record_stream(current)
        coef, limit = self._constants_for(tuple((i, *r.sizes[i]) for i in checked), r.world, r.sums.device)
        flag = compare(r.sums, torch.cat(reduced), coef, limit, r.world)
        self._pending = flag if self._pending is None else self._pending | flag
        self.rounds += 1
        if len(checked) == len(r.order) and all(i in r.norms for i in checked):
            parts = [r.norms[i] for i in r.order]
            self._norms = ([j for idx, _ in parts for j in idx], torch.cat([n for _, n in parts]))

    def _constants_for(self, layout: tuple[tuple[int, int, torch.dtype], ...], world: int, device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layout, world, device)
        found = self._constants.get(key)
        if found is None:
            found = self._constants[key] = chunk_constants([(n, dtype) for _, n, dtype in layout], world, device)
            if len(self._constants) > 8:  # bucket layouts change once (DDP's rebuild after the first step)
                self._constants.pop(next(iter(self._constants)))
        return found


def chunk_constants(buckets: list[tuple[int, torch.dtype]], world: int, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk of ``buckets`` ((elements, dtype) each), the ``tolerance`` coefficient and the overflow limit (the
    sum of |x| from which a correct sum may overflow the dtype), as float64 tensors on ``device``."""
    coef: list[float] = []
    limit: list[float] = []
    for n, dtype in buckets:
        info = torch.finfo(dtype)
        for c in range(-(-n // CHUNK)):
            coef.append(tolerance(world, dtype, min(CHUNK, n - c * CHUNK)))
            # A (summed in the partial dtype) may read low by n * eps_p: the limit is lowered by as much.
            limit.append(info.max / (1 + world * info.eps) / (1 + n * torch.finfo(_partial_dtype(dtype)).eps))
    return (torch.tensor(coef, dtype=torch.float64).to(device), torch.tensor(limit, dtype=torch.float64).to(device))


# -- the hook ------------------------------------------------------------------------------------------------------

@dataclass
class CommHookState:
    """State handed to DDP with the hook: what to measure into and which all-reduce to wrap."""

    sink: GradSink
    inner_hook: CommHook
    inner_state: Any
    index: dict[int, int]
    enabled: bool = True
    checksum: ReduceChecksum | None = None


@dataclass
class _Pending:
    """The local norms the comm hook leaves to ``allreduce_as_ddp`` (its default wrapped hook), which takes them
    piece by piece together with the scaling and the chunk sums: one read of the bucket instead of three."""

    store: Callable[[list[int], list[torch.Tensor]], None]
    fail: Callable[[], None]
    views: tuple[_View, ...]
    taken: bool = False


def comm_hook(state: CommHookState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Measure the bucket's local gradients, then run the wrapped all-reduce hook (the user's or DDP's default).

    The reduce-phase checksum runs where the wrapped hook reduces through ``allreduce_as_ddp`` (the default; a
    user's hook may call it too): S' is taken on the tensor the wrapped hook hands back to DDP, and, in the same
    pass, the reduced gradients' norms. With the default hook on a healthy step, the local norms are taken inside
    ``allreduce_as_ddp``, piece by piece just before each piece is scaled."""
    views: tuple[_View, ...] | None = None
    pending: _Pending | None = None
    if state.enabled:
        try:
            state.sink.note_call(bucket.index())
            params, grads = bucket.parameters(), bucket.gradients()
            # Parameters frozen after DDP was built still sit in its buckets: they are not checked.
            indices = [state.index.get(id(p), -1) for p in params]
            views = _bucket_views(bucket.buffer(), grads, indices)
            store = getattr(state.sink, "store_norms", None)
            if (views is not None and store is not None and not state.sink.detail
                    and state.inner_hook is allreduce_as_ddp):
                pending = _Pending(store, state.sink.fail, views)
            else:
                pairs = [(i, g) for i, g in zip(indices, grads, strict=True) if i >= 0]
                if pairs:
                    state.sink.store([i for i, _ in pairs], [g for _, g in pairs])
        except Exception:  # noqa: BLE001 - reported through the status vector; the all-reduce must still happen
            state.sink.fail()
    checksum = state.checksum if state.enabled else None
    if checksum is None and pending is None:
        return state.inner_hook(state.inner_state, bucket)
    index = bucket.index()
    _ACTIVE.checksum, _ACTIVE.pending = checksum, pending
    try:
        future = state.inner_hook(state.inner_state, bucket)
    finally:
        _ACTIVE.checksum = _ACTIVE.pending = None
    if pending is not None and not pending.taken:  # cannot happen with allreduce_as_ddp; never count a pass
        state.sink.fail()
    if checksum is None or not checksum.took(index):
        return future

    def reduced(fut: torch.futures.Future[Any]) -> Any:
        value = fut.value()
        checksum.reduced(index, value[0] if isinstance(value, list) else value, views)
        return value

    return future.then(reduced)


# DDP compares the annotations with the real classes; postponed (string) annotations would fail that check.
comm_hook.__annotations__ = {}


@dataclass
class DDPScaling:
    """State of ``allreduce_as_ddp``: the group, and, with ``gradient_as_bucket_view``, where each parameter's
    gradient lived before backward (filled by a forward hook): a gradient accumulated in place in its bucket
    view is divided, a fresh one multiplied, as DDP's reducer does."""

    group: dist.ProcessGroup
    before: dict[int, int] = field(default_factory=dict)  # id(param) -> data_ptr of its .grad before backward


def allreduce_as_ddp(state: DDPScaling, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's built-in reduction, bit for bit, as a comm hook: the monitor must not change training.

    Without a hook DDP scales each gradient while copying it into the bucket, ``grad * (1 / W)`` with the factor a
    double scalar, or, where the gradient already was the bucket's view (``gradient_as_bucket_view`` with gradients
    kept between steps), ``view / W`` in place; then it sums. ``x * (1/W)`` and ``x / W`` differ in the last bit for
    many ``x`` when W is not a power of two, so ``default_hooks.allreduce_hook`` (which divides the whole bucket)
    drifts from unmonitored training at W=3.

    Under the monitor's hook, the scaled bucket is checksummed before the sum and, at the last bucket, the checksums
    are all-reduced right behind it (``ReduceChecksum``); the bucket itself is reduced exactly as DDP would. On
    CPU the bucket is scaled piece by piece (a few chunks of whole parameters; elementwise, so the bits are those
    of one pass), and each piece's local norms (before scaling) and chunk sums (after) are taken while it is in
    cache."""
    world = state.group.size()
    buffer = bucket.buffer()
    views = bucket.gradients()
    aliased = [state.before.get(id(p)) == v.data_ptr() for p, v in zip(bucket.parameters(), views, strict=True)]
    checksum: ReduceChecksum | None = getattr(_ACTIVE, "checksum", None)
    pending: _Pending | None = getattr(_ACTIVE, "pending", None)
    flat = buffer.view(-1)
    summing = checksum is not None and checkable(buffer)
    places = pending.views if pending is not None else _bucket_views(buffer, views, [-1] * len(views))
    if places is None or (pending is None and not summing):  # nothing to take while scaling: as DDP does it
        _scale(flat, views, aliased, world, 0, flat.numel())
        if checksum is not None:
            checksum.local(bucket.index(), buffer)
    else:
        _scale_and_measure(flat, views, aliased, world, places, pending, checksum if summing else None,
                           bucket.index())
        if checksum is not None and not summing:
            checksum.local(bucket.index(), buffer)
    work = dist.all_reduce(buffer, group=state.group, async_op=True)
    future: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda fut: fut.value()[0])
    if checksum is not None and bucket.is_last():
        checksum.launch(state.group, buffer.device)
    return future


allreduce_as_ddp.__annotations__ = {}


def _scale(flat: torch.Tensor, views: Sequence[torch.Tensor], aliased: Sequence[bool], world: int, start: int,
           end: int, slices: Sequence[tuple[int, int, int]] | None = None) -> None:
    """DDP's scaling of elements ``start .. end`` of the bucket: ``x * (1/W)`` for fresh gradients, ``x / W`` for
    gradients accumulated in their bucket view (a mix: per view, ``slices`` giving (view, lo, hi) in the range)."""
    if not any(aliased):
        flat[start:end].mul_(1.0 / world)
    elif all(aliased):
        flat[start:end].div_(world)
    elif slices is None:
        for view, alias in zip(views, aliased, strict=True):
            if alias:
                view.div_(world)
            else:
                view.mul_(1.0 / world)
    else:
        for j, lo, hi in slices:
            if aliased[j]:
                flat[lo:hi].div_(world)
            else:
                flat[lo:hi].mul_(1.0 / world)


def _scale_and_measure(flat: torch.Tensor, views: Sequence[torch.Tensor], aliased: Sequence[bool], world: int,
                       places: tuple[_View, ...], pending: _Pending | None, checksum: ReduceChecksum | None,
                       index: int) -> None:
    """Scale the bucket piece by piece; before each piece is scaled, its local norms (``pending``), after, its
    chunks' sums (``checksum``). A failure to measure stops measuring, never the scaling."""
    plan = _plan(flat.numel(), places, flat.device)
    norms: list[torch.Tensor] = []
    s: list[torch.Tensor] = []
    a: list[torch.Tensor] = []
    norms_ok = pending is not None
    sums_ok = checksum is not None
    scratch = checksum.scratch(flat) if checksum is not None else None
    for start, end, c0, c1, slices, starting in plan.pieces:
        if norms_ok:
            try:
                norms += _norms(flat, starting)
            except Exception:  # the bucket must still be scaled and reduced
                log.exception("sdc_telemetry: the local norms of bucket %d failed; training goes on", index)
                norms_ok = False
        _scale(flat, views, aliased, world, start, end, slices)
        if sums_ok and c1 > c0:
            try:
                ps, pa = _sums(flat, c0, c1, scratch)
                s.append(ps)
                a.append(pa)
            except Exception:  # reported by checksum.local below (the round is not compared)
                log.exception("sdc_telemetry: the chunk sums of bucket %d failed; training goes on", index)
                sums_ok = False
    if pending is not None:
        pending.taken = True
        if norms_ok and plan.monitored:
            try:
                pending.store(plan.monitored, norms)
            except Exception:
                log.exception("sdc_telemetry: the local norms of bucket %d failed; training goes on", index)
                norms_ok = False
        if not norms_ok:
            pending.fail()
    if checksum is not None:
        sums = torch.stack([torch.cat(s), torch.cat(a)]) if sums_ok and s else None
        checksum.local(index, flat, sums, failed=not sums_ok)


class DDP(Layout):
    name = "ddp"
    distributed = True
    reduces = True

    def __init__(self, model: DistributedDataParallel, *, replica_group: dist.ProcessGroup | None = None,
                 comm_hook: CommHook | None = None, comm_state: Any = None) -> None:
        group = replica_group if replica_group is not None else model.process_group
        super().__init__(model, model.module, group, group_ranks(group), dist.get_rank())
        self._ddp = model
        self._hook, self._hook_state_arg = comm_hook, comm_state
        self._state: CommHookState | None = None
        self._checksum: ReduceChecksum | None = None

    def install(self, sink: GradSink, *, reduced_checks: bool = True) -> None:
        inner = self._hook if self._hook is not None else allreduce_as_ddp
        # DDP's own group, whatever replica_group is: the monitor must not change how gradients are averaged.
        inner_state = self._hook_state_arg if self._hook is not None else self._scaling()
        index = {id(p): i for i, p in enumerate(p for p in self.module.parameters() if p.requires_grad)}
        # The reduce-phase checksum (and its small all-reduce) only where the reduced gradients are checked.
        self._checksum = ReduceChecksum() if reduced_checks else None
        self._state = CommHookState(sink, inner, inner_state, index, checksum=self._checksum)
        try:
            self._ddp.register_comm_hook(self._state, comm_hook)
        except RuntimeError as e:
            raise ValueError("the DDP model already has a communication hook; the monitor must wrap it to see local "
                             "gradients before the all-reduce. Register none, and pass yours as "
                             "SDCMonitor(..., comm_hook=your_hook, comm_state=your_state)") from e

    def _scaling(self) -> DDPScaling:
        scaling = DDPScaling(self._ddp.process_group)
        if self._ddp.gradient_as_bucket_view:
            params = [p for p in self._ddp.parameters() if p.requires_grad]

            def note(*_: Any) -> None:
                scaling.before = {id(p): p.grad.data_ptr() for p in params if p.grad is not None}

            # After DDP's forward (which may rebuild its buckets and re-point gradients at the new views), before
            # backward. Stays registered after close(), like the comm hook that reads it.
            self._ddp.register_forward_hook(note)
        return scaling

    def after_backward(self, sink: GradSink) -> None:
        """The comm hook measured every bucket during backward."""

    def reduction_mismatch(self) -> torch.Tensor | None:
        """The reduce-phase checksum of this step's reductions (0-d int64 on the device: 1 = the reduced gradients
        are not the sum of the ranks' local ones), or None where it did not run (no synchronising backward, or a
        wrapped hook that does not reduce through ``allreduce_as_ddp``)."""
        if self._state is None or not self._state.enabled or self._checksum is None:
            return None
        flag = self._checksum.mismatch()
        norms = self._checksum.reduced_norms()
        store = getattr(self._state.sink, "store_reduced", None)
        if norms is not None and store is not None:
            store(*norms)
        return flag

    @property
    def reduction_checks(self) -> int:
        """Reductions the checksum compared so far (each synchronising backward pass is one)."""
        return self._checksum.rounds if self._checksum is not None else 0

    def disable(self) -> None:
        # DDP cannot remove a comm hook: it stays registered and only forwards to the wrapped all-reduce.
        if self._state is not None:
            self._state.enabled = False

