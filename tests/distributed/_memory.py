"""Rank side of the memory tests: live tensor bytes counted during a replay audit and a certificate.

``LiveBytes`` is a CPU allocation tracker (CPU tensors have no allocator statistics): a dispatch mode sees every
tensor an operator returns on this thread (the autograd engine's included), counts each new storage's bytes until
a weak-reference finalizer says it is freed, and follows ``UntypedStorage.resize_`` (FSDP2 frees and re-allocates its
unsharded parameters that way). Storages that existed before it started count from their size when first seen, so
``live`` is the change since the start and ``peak`` its maximum.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

import sdc_telemetry as sdc
from sdc_telemetry.checks import recompute

from ._scenarios import Recorder

WIDTH = 512   # each block: two 512 x 512 linear layers (1 MiB of fp32 weights each)
BLOCKS = 8


class LiveBytes(TorchDispatchMode):
    """Live tensor-storage bytes allocated since the start on this thread, and their peak (see module doc)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.live = 0
        self.peak = 0
        self._sizes: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._resize: Any = None

    def __enter__(self) -> LiveBytes:
        original = self._resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            tracker._see(st, new=False)
            out = original(st, size)
            tracker._set(st, st.nbytes())
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]

    def mark(self) -> int:
        """Start a new peak from the current live count; returns it."""
        self.peak = self.live
        return self.live

    def _see(self, st: torch.UntypedStorage, new: bool) -> None:
        if st in self._sizes:
            return
        box = [st.nbytes()]
        self._sizes[st] = box
        weakref.finalize(st, self._freed, box)
        if new:
            self._add(box[0])

    def _set(self, st: torch.UntypedStorage, size: int) -> None:
        box = self._sizes[st]
        self._add(size - box[0])
        box[0] = size

    def _freed(self, box: list[int]) -> None:
        self._add(-box[0])

    def _add(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                for st in get_untyped_storages(t):
                    self._see(st, new=False)  # inputs (and their aliases in the output) are not new memory
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for st in get_untyped_storages(t):
                    self._see(st, new=True)
        return out


class Blocks(nn.Module):
    """BLOCKS blocks of two WIDTH x WIDTH linear layers and a small head: gradients large, activations tiny."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH, bias=bias), nn.ReLU(),
                                                  nn.Linear(WIDTH, WIDTH, bias=bias))
                                    for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)  # type: ignore[no-any-return]


def loss_fn(module: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(module(x), y)


def _bare(module: nn.Module, batch: Any) -> None:
    """The recomputation's own forward and backward with no parameter gradient at all (the gradient of the input
    only): what any recomputation costs (activations, FSDP's all-gathered parameters), the baseline of the audit."""
    x, y = batch
    x = x.detach().requires_grad_()
    torch.autograd.grad(loss_fn(module, (x, y)), [x])


@contextmanager
def _audits(tracker: LiveBytes, module: nn.Module, out: list[dict[str, int]]) -> Iterator[None]:
    """Every recomputation of a replay audit, measured: peak growth of the audit's run and of a bare one."""
    original = recompute.Recomputer.run

    def run(self: recompute.Recomputer, micro: Any) -> Any:
        base = tracker.mark()
        result = original(self, micro)
        audit = tracker.peak - base
        base = tracker.mark()
        with _sync_off(module):
            _bare(module, micro[0].batch)
        out.append({"audit": audit, "bare": tracker.peak - base})
        return result

    recompute.Recomputer.run = run  # type: ignore[method-assign]
    try:
        yield
    finally:
        recompute.Recomputer.run = original  # type: ignore[method-assign]


@contextmanager
def _sync_off(module: nn.Module) -> Iterator[None]:
    fsdp = [m for m in module.modules() if hasattr(m, "set_requires_gradient_sync")]
    for m in fsdp:
        cast(Any, m).set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for m in fsdp:
            cast(Any, m).set_requires_gradient_sync(True, recurse=False)


def _grad_bytes(groups: list[list[nn.Parameter]]) -> list[int]:
    return [sum(p.numel() * p.element_size() for p in g) for g in groups]


def _train(rank: int, model: nn.Module, module: nn.Module, mode: Any, steps: int, certify: bool
           ) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    recorder = Recorder()
    monitor = sdc.SDCMonitor(model, opt, loss_fn=loss_fn, observer=recorder,
                             config=sdc.SDCConfig(metrics_port=None, nvml=False, replay_every=1, mode=mode))
    gen = torch.Generator().manual_seed(100 + rank)
    audits: list[dict[str, int]] = []
    certificate: dict[str, int] = {}
    with LiveBytes() as tracker, _audits(tracker, module, audits):
        for _ in range(steps):
            batch = (torch.randn(2, WIDTH, generator=gen), torch.randint(0, 4, (2,), generator=gen))
            with monitor.step(batch) as st:
                st.backward(loss_fn(model, batch))
            if certify:
                gc.collect()  # frees of earlier garbage inside the window would lower the net growth measured
                base = tracker.mark()
                monitor.certificate()
                certificate = {"growth": tracker.peak - base}
                # The tracker sees gathered tensors: keeping every whole tensor grows by the whole model.
                gc.collect()
                base = tracker.mark()
                held = list(monitor.layout.whole(list(module.named_parameters())))
                certificate["all_held"] = tracker.peak - base
                del held
            opt.step()
            opt.zero_grad()
    monitor.close()
    return {"audits": audits, "certificate": certificate, "replay": recorder.counts().get("replay", {}),
            "errors": recorder.errors, "incidents": [(i.step, i.check) for i in monitor.incidents]}


def run_memory(rank: int, world: int) -> dict[str, Any]:
    """FSDP2 (each block fully_shard-ed, a 1-D mesh of every rank) audits in exact and tolerance mode and a
    certificate, then DDP audits; per case the measured peak growths and the gradient sizes they are bounded by."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    out: dict[str, Any] = {}
    for mode in ("exact", "tolerance", "nobias"):
        torch.manual_seed(0)
        model = Blocks(bias=mode != "nobias")
        groups = [list(b.parameters()) for b in model.blocks] + [list(model.head.parameters())]
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        out[f"fsdp_{mode}"] = _train(rank, model, model, "exact" if mode == "nobias" else mode,
                                      steps=1 if mode == "nobias" else 2, certify=mode != "tolerance")
        out[f"fsdp_{mode}"]["groups"] = _grad_bytes(groups)
        dist.barrier()
    torch.manual_seed(0)
    module = Blocks()
    params = list(module.parameters())
    ddp = DistributedDataParallel(module)
    out["ddp"] = _train(rank, ddp, module, "exact", steps=2, certify=False)
    out["ddp"]["params"] = _grad_bytes([[p] for p in params])
    dist.barrier()
    return out



def run_update_memory(rank: int, world: int) -> dict[str, Any]:
    """FSDP2 on a 1-D mesh of every rank, AdamW, an update audit at every step: the peak growth of each audit (the
    exchange, the partner's recomputation, the own rerun, from the start of the audit) against one parameter
    group's unsharded size."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sdc_telemetry.checks import update

    torch.manual_seed(0)
    model = Blocks()
    groups = [list(b.parameters()) for b in model.blocks] + [list(model.head.parameters())]
    group_bytes = _grad_bytes(groups)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    recorder = Recorder()
    monitor = sdc.SDCMonitor(model, opt, loss_fn=loss_fn, observer=recorder,
                             config=sdc.SDCConfig(metrics_port=None, nvml=False, replay_every=0, update_every=1))
    gen = torch.Generator().manual_seed(100 + rank)
    growth: list[int] = []
    original = update.UpdateAudit.audit
    with LiveBytes() as tracker:
        def audit(self: update.UpdateAudit, *args: Any, **kwargs: Any) -> Any:
            gc.collect()
            base = tracker.mark()
            out = original(self, *args, **kwargs)
            growth.append(tracker.peak - base)
            return out

        update.UpdateAudit.audit = audit  # type: ignore[method-assign]
        try:
            for _ in range(4):
                batch = (torch.randn(2, WIDTH, generator=gen), torch.randint(0, 4, (2,), generator=gen))
                with monitor.step(batch) as st:
                    st.backward(loss_fn(model, batch))
                opt.step()
                opt.zero_grad()
        finally:
            update.UpdateAudit.audit = original  # type: ignore[method-assign]
    # what the whole local shard's audit inputs would weigh (parameters, gradients, two Adam moments)
    local = sum(4 * p.to_local().numel() * p.element_size() for p in model.parameters())  # type: ignore[operator]
    monitor.close()
    return {"growth": growth, "groups": group_bytes, "local_inputs": local, "update": recorder.counts().get("update"),
            "errors": recorder.errors, "incidents": [(i.step, i.check) for i in monitor.incidents]}
