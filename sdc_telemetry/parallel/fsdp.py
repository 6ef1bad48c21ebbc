"""FSDP2 (``fully_shard``) on a 1-D mesh: the layout of a sharded model, the gradient tap, the replay recomputation.

Every rank holds one shard of every parameter and no other rank holds the same shard, so the weight vote has
nothing to compare (HSDP, ``parallel.hsdp``, adds the replicas); the gradient checks and the replay run.

Layout: everything comes from the DTensor parameters. A 1-D mesh places ``(Shard(0),)`` (every rank holds one shard
of every parameter: no replica); a 2-D HSDP mesh places ``(Replicate(), Shard(0))`` (ranks with the same shard index
hold the same shard: a replicate group). Other layouts are refused by name.

``grad_local``: each FSDP parameter group's reduce-scatter comm is wrapped (as ``FSDPModule.set_custom_reduce_scatter``
sets it, per group: a module may own several, one per mesh, as torchtitan's MoE blocks do). Its
input is the flat unsharded local gradient of the group, in the reduce dtype: row r of ``input.view(shard_size, -1)``
holds shard r's padded chunk of every parameter, in the group's parameter order. The tap takes per-parameter norms of
strided views (no copy) and, on replay audit steps, per-parameter fingerprints of the unpadded flat gradients (equal
to the fingerprint of the unsharded gradient: dim-0 padding sits at the end). Then the wrapped collective runs.

Replay: every rank recomputes its origin's micro-batches through the FSDP model at the same time (the all-gathers of
every shard group line up), with gradient sync off and a post-accumulate-grad hook on each unsharded parameter that
takes the gradient off ``.grad`` (in the reduce dtype, as FSDP reduces it) and hands it to the replay, which measures
it once final and drops it, so nothing is reduced into ``.grad`` and the reshard state, optimizer and RNG are
unchanged. Memory: one unsharded gradient at a time (one micro-batch), plus the running sums of the step's earlier
micro-batches under gradient accumulation (as FSDP itself holds them). ``whole`` gathers one tensor at a time and
keeps no reference to it.

Parts of FSDP2 read here that are not public API (torch 2.13): ``FSDPModule._get_fsdp_state()._fsdp_param_groups``,
``FSDPParamGroup.fsdp_params / _reduce_scatter_comm (set) / _reduce_dtype / reduce_grads / all_reduce_grads /
mesh_info / gradient_divide_factor / force_sum_reduction_for_comms``, ``_get_gradient_divide_factors``,
``FSDPParam.sharded_param / unsharded_param / padded_sharded_param_size / _orig_size / is_dtensor / fsdp_placement /
_get_grad_inner_tensor``, the ``ReduceScatter``
protocol in ``torch.distributed.fsdp._fully_shard._fsdp_api``, and, for a shard group of one rank, the order in which
``foreach_reduce`` allocates through it (the input, filled by the copy-in, then the output).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sdc_telemetry.core.collective import gather_rows
from sdc_telemetry.parallel.base import GradSink, Layout, LayoutError, world_ranks

__all__ = ["FSDP", "FSDPLayout", "is_fully_sharded", "layout_of", "fsdp_groups", "GradTap", "recompute_grads"]


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule  # type: ignore[no-any-return]


def is_fully_sharded(model: torch.nn.Module) -> bool:
    """``fully_shard`` was applied to ``model`` or to one of its submodules."""
    fsdp = _fsdp_module_type()
    return fsdp is not None and any(isinstance(m, fsdp) for m in model.modules())


@dataclass(frozen=True)
class FSDPLayout:
    """Where this rank sits in a fully_shard-ed model's mesh."""

    shard_group: dist.ProcessGroup
    shard_size: int
    shard_index: int
    replicate_group: dist.ProcessGroup | None   # None on a 1-D mesh: no replica holds this rank's shard
    replicas: int
    groups: tuple[tuple[Any, Any], ...]          # (FSDPModule, FSDPParamGroup) that own parameters

    @property
    def hsdp(self) -> bool:
        return self.replicate_group is not None


def layout_of(model: torch.nn.Module) -> FSDPLayout:
    """The layout of a fully_shard-ed model, or ``LayoutError`` naming what is not supported."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    fsdp = _fsdp_module_type()
    assert fsdp is not None
    if not isinstance(model, fsdp):
        raise LayoutError("apply fully_shard to the root module too (fully_shard(model) after its submodules): the "
                          "monitor needs the root FSDPModule")
    params: list[Any] = list(model.parameters())
    if not params or not all(isinstance(p, DTensor) for p in params):
        raise LayoutError("every parameter of a fully_shard-ed model must be a DTensor (a module left unsharded "
                          "inside a sharded model is not supported)")
    mesh = params[0].device_mesh
    if any(p.device_mesh != mesh for p in params):
        raise LayoutError("parameters on different device meshes (per-parameter meshes) are not supported")
    placements = params[0].placements
    if any(p.placements != placements for p in params):
        raise LayoutError(f"parameters with different placements are not supported (for example "
                          f"{placements} and {next(p.placements for p in params if p.placements != placements)})")
    kinds = tuple(type(pl).__name__ for pl in placements)
    if kinds == ("Shard",) and placements[0] == Shard(0):
        shard_dim, rep_dim = 0, None
    elif kinds == ("Replicate", "Shard") and placements[1] == Shard(0):
        shard_dim, rep_dim = 1, 0
    else:
        raise LayoutError(f"mesh placements {placements} are not supported: FSDP2 on a 1-D mesh (Shard(0)) or HSDP "
                          "on a 2-D (replicate, shard) mesh (Replicate(), Shard(0)); tensor or context parallel "
                          "dimensions are not")
    assert isinstance(placements[shard_dim], Shard) and (rep_dim is None or isinstance(placements[rep_dim], Replicate))
    shard_size = mesh.size(shard_dim)
    if shard_size < 2 and rep_dim is None:
        raise LayoutError("fully_shard on a mesh of one rank reduces nothing: there are no gradients of other ranks "
                          "to check")
    groups = fsdp_groups(model)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    return FSDPLayout(shard_group=mesh.get_group(shard_dim), shard_size=shard_size,
                      shard_index=coordinate[shard_dim],
                      replicate_group=mesh.get_group(rep_dim) if rep_dim is not None else None,
                      replicas=mesh.size(rep_dim) if rep_dim is not None else 1, groups=tuple(groups))


def fsdp_groups(model: torch.nn.Module) -> list[tuple[Any, Any]]:
    """Every (FSDPModule, FSDPParamGroup) of a fully_shard-ed model that owns parameters, in module order."""
    fsdp = _fsdp_module_type()
    assert fsdp is not None
    groups = []
    for m in model.modules():
        if isinstance(m, fsdp):
            # several groups: per-parameter meshes (torchtitan's MoE blocks under expert parallelism, the experts on
            # the efsdp mesh); each group is tapped and recomputed on its own
            owned = list(m._get_fsdp_state()._fsdp_param_groups)  # type: ignore[operator]
            for pg in owned:
                dims = {getattr(fp, "fsdp_placement", None) for fp in pg.fsdp_params} - {None}
                if any(getattr(d, "dim", 0) != 0 for d in dims):
                    raise LayoutError(f"{type(m).__name__} shards parameters on another dim than 0 "
                                      f"({', '.join(sorted(map(str, dims)))}: a shard_placement_fn): not supported, "
                                      "the gradient tap reads dim-0 shards")
            groups += [(m, pg) for pg in owned]
    if not groups:
        raise LayoutError("no FSDP parameter group owns parameters: apply fully_shard to the modules with parameters")
    return groups


class GradTap:
    """Wraps every parameter group's reduce-scatter: measures its input (the unsharded local gradients) into
    ``sink.store(index, norm_views, fp_tensors)`` before the collective runs (``sink.note_call(group)`` first, and
    ``sink.fail()`` when measuring fails: the collective runs regardless). ``enabled`` switches measuring off."""

    def __init__(self, layout: FSDPLayout, params: Sequence[torch.nn.Parameter], sink: GradSink) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

        index = {id(p): i for i, p in enumerate(params)}
        tap = self
        self.enabled = True

        class _Tapped(_OneRankShards, ReduceScatter):  # type: ignore[misc,valid-type]
            def __init__(self, inner: Any, gid: int, pg: Any) -> None:
                super().__init__(inner, pg, lambda: sink.generation)
                self.gid = gid

            def _input(self, input_tensor: torch.Tensor, shards: int) -> None:
                if tap.enabled:
                    try:
                        sink.note_call(self.gid)
                        tap._measure(self.pg, self._divided(input_tensor, shards), shards, index, sink.store,
                                     sink.detail)
                    except Exception:  # noqa: BLE001 - reported through the status vector; the collective must run
                        sink.fail()

        for gid, (_, pg) in enumerate(layout.groups):
            # per group, as FSDPModule.set_custom_reduce_scatter sets it (which refuses a module of several groups)
            pg._reduce_scatter_comm = _Tapped(pg._reduce_scatter_comm, gid, pg)

    @staticmethod
    def _measure(pg: Any, inp: torch.Tensor, shards: int, index: dict[int, int],
                 store: Callable[[list[int], list[torch.Tensor], list[torch.Tensor] | None], None],
                 detail: bool) -> None:
        views, fps, idx = [], [], []
        for fp, view in _param_views(pg, inp, shards):
            i = index.get(id(fp.sharded_param))
            if i is None:
                continue
            idx.append(i)
            views.append(view)
            if detail:
                fps.append(_unpadded(fp, view))
        store(idx, views, fps if detail else None)


class _OneRankShards:
    """A reduce-scatter wrapper (``ReduceScatter``) that hands its input, the group's unsharded local gradients, to
    ``_input(input, shards)`` before the collective runs. Where the shard group is one rank (HSDP with a dp_shard of
    1: replicas that shard nothing), FSDP never calls the reduce-scatter: in ``foreach_reduce`` it allocates the
    input, copies the local gradients into it, allocates the output, divides the input where the reduce dtype risks
    overflow (fp16) and copies it over (then all-reduces across the replicas). The input is then handed over at the
    second allocation, once the copy-in is complete; ``_divided`` divides it as FSDP is about to (out of place: the
    same bits). An allocation is the second only when the first came in the same step (``generation``): a
    ``foreach_reduce`` that raised between the two (an out-of-memory error a trainer skips) cannot leave the
    alternation out of step."""

    def __init__(self, inner: Any, pg: Any, generation: Callable[[], int]) -> None:
        self.inner, self.pg = inner, pg
        self.one_rank = pg.mesh_info.shard_mesh_size == 1
        self._generation = generation
        self._pending: tuple[torch.Tensor, int] | None = None

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        out: torch.Tensor = self.inner.allocate(size, dtype=dtype, device=device)
        if self.one_rank:
            now = self._generation()
            if self._pending is None or self._pending[1] != now:
                self._pending = (out, now)  # the input: FSDP copies the local gradients into it next
            else:
                filled, self._pending = self._pending[0], None
                self._input(filled, 1)
        return out

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> Any:
        self._input(input_tensor, group.size())
        return self.inner(output_tensor, input_tensor, group, op, async_op)

    def _input(self, input_tensor: torch.Tensor, shards: int) -> None:
        raise NotImplementedError

    def _divided(self, input_tensor: torch.Tensor, shards: int) -> torch.Tensor:
        """The input as the collective reduces it: a shard group of one rank's before FSDP's pre-division."""
        if shards > 1 or not self.one_rank:
            return input_tensor  # the reduce-scatter's input, already divided
        factor = _predivide_factor(self.pg)  # the reduce dtype is known once FSDP initialised lazily
        return input_tensor.div(factor) if factor not in (None, 1) else input_tensor


def _param_views(pg: Any, inp: torch.Tensor, shards: int) -> list[tuple[Any, torch.Tensor]]:
    """Each FSDP parameter of group ``pg`` with its padded unsharded gradient inside the reduce-scatter input ``inp``
    (over ``shards`` ranks): a (shards, padded shard numel) view, no copy."""
    rows = inp.view(shards, -1)
    sizes = [fp.padded_sharded_param_size.numel() for fp in pg.fsdp_params]
    if sum(sizes) * shards != inp.numel():
        raise RuntimeError("the reduce-scatter input does not hold every parameter of the group (parameters "
                           "without gradients): not measured")
    out, off = [], 0
    for fp, n in zip(pg.fsdp_params, sizes, strict=True):
        out.append((fp, rows[:, off:off + n]))
        off += n
    return out


def _unpadded(fp: Any, view: torch.Tensor) -> torch.Tensor:
    """The parameter's gradient flattened, padding dropped (shard-major rows: the original elements come first)."""
    return view.reshape(-1)[:fp._orig_size.numel()]


def recompute_grads(layout: FSDPLayout, params: Sequence[torch.nn.Parameter], run_backward: Callable[[], None],
                    take: Callable[[int, torch.Tensor, float | None], None]) -> None:
    """Run ``run_backward`` (forward and backward of the micro-batches, on every rank at once) with gradient sync off,
    handing ``take(i, grad, divide)`` each accumulation of parameter i's unsharded gradient, in the reduce dtype, the
    moment it is accumulated; ``divide``: the factor FSDP divides the reduce-scatter input by (fp16), None where it
    does not. Nothing reaches ``.grad`` and nothing is kept here: the caller drops each gradient once measured."""
    index = {id(p): i for i, p in enumerate(params)}
    handles = []
    saved = [(pg.reduce_grads, pg.all_reduce_grads) for _, pg in layout.groups]
    # Tensor-parallel gradients FSDP redistributes before its reduce-scatter (Partial: sequence-parallel norms,
    # row-parallel biases): FSDP accumulates them over micro-batches as DTensors and redistributes the sum once
    # (one all-reduce of a1 + a2, not a1's plus a2's, which round differently), so they are summed here the same
    # way and handed over after the backward. Small tensors; every other gradient streams.
    partial: dict[int, tuple[Any, torch.Tensor, torch.dtype | None, float | None]] = {}

    def hook_for(i: int, fp: Any, dtype: torch.dtype | None, divide: float | None) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            grad, p.grad = p.grad, None  # FSDP's post-backward then has nothing to reduce or accumulate
            if grad is not None:
                if fp.is_dtensor and _redistributes(fp, grad):
                    prev = partial.get(i)
                    partial[i] = (fp, grad if prev is None else prev[1] + grad, dtype, divide)
                    return
                if fp.is_dtensor:  # read as FSDP reads it: the local tensor of the parameter's placements
                    grad = fp._get_grad_inner_tensor(grad)
                grad = grad.to(dtype or grad.dtype)
                take(i, grad, divide)
            del grad
        return hook

    try:
        for _, pg in layout.groups:
            # FSDP divides the reduce-scatter input before the collective when the reduce dtype risks overflow
            # (fp16): the tap saw the divided gradients, so the recomputation divides the same way.
            factor = _predivide_factor(pg)
            divide = factor if factor is not None and factor != 1 else None
            for fp in pg.fsdp_params:
                i = index.get(id(fp.sharded_param))
                if i is not None:
                    handles.append(fp.unsharded_param.register_post_accumulate_grad_hook(
                        hook_for(i, fp, pg._reduce_dtype, divide)))
        for module, _ in layout.groups:
            module.set_requires_gradient_sync(False, recurse=False)
        run_backward()
        for i in sorted(partial):  # the same order on every rank of the tp group: one redistribute each
            fp, grad, dtype, divide = partial.pop(i)
            inner = fp._get_grad_inner_tensor(grad)
            take(i, inner.to(dtype or inner.dtype), divide)
    finally:
        for (_, pg), (reduce, all_reduce) in zip(layout.groups, saved, strict=True):
            pg.reduce_grads, pg.all_reduce_grads = reduce, all_reduce
        for h in handles:
            h.remove()


def capture_grads(layout: FSDPLayout, params: Sequence[torch.nn.Parameter], run_backward: Callable[[], None],
                  take: Callable[[int, torch.Tensor, float | None], None]) -> None:
    """Run ``run_backward`` (every rank at once) handing ``take(i, grad, None)`` each parameter's unsharded local
    gradient as FSDP's post-backward hands it to its reduce-scatter: the input the tap reads in a real step,
    captured in place of the tap (which must not count a rerun) before the collective runs. For backward passes whose
    weight gradients never go through autograd's accumulation (the zero-bubble pipeline schedules compute them with
    ``torch.autograd.grad`` and assign ``.grad``), where ``recompute_grads``' hooks see nothing. Holds each group's
    gradients until its reduce-scatter, as FSDP itself does across micro-batches."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    index = {id(p): i for i, p in enumerate(params)}

    class _Capture(_OneRankShards, ReduceScatter):  # type: ignore[misc,valid-type]
        def _input(self, input_tensor: torch.Tensor, shards: int) -> None:
            for fp, view in _param_views(self.pg, self._divided(input_tensor, shards), shards):
                i = index.get(id(fp.sharded_param))
                if i is not None:
                    take(i, _unpadded(fp, view).clone(), None)  # then the collective: the replicas rerun together

    saved = [(pg, pg._reduce_scatter_comm) for _, pg in layout.groups]
    try:
        for module, pg in layout.groups:
            current = pg._reduce_scatter_comm
            # the monitor's tap (GradTap) wraps the comm FSDP had: capture around that one, the tap bypassed
            pg._reduce_scatter_comm = _Capture(getattr(current, "inner", current), pg, lambda: 0)
            module.set_requires_gradient_sync(False, recurse=False)
        run_backward()
    finally:
        for pg, comm in saved:
            pg._reduce_scatter_comm = comm


def _redistributes(fp: Any, grad: torch.Tensor) -> bool:
    """Whether FSDP redistributes this DTensor gradient before reducing it (its placements are not the
    parameter's: a Partial sum over tp), the collective that makes accumulation order matter."""
    spec = getattr(fp, "_unsharded_dtensor_spec", None)
    placements = getattr(grad, "placements", None)
    return spec is not None and placements is not None and tuple(placements) != tuple(spec.placements)


def _predivide_factor(pg: Any) -> float | None:
    """The factor FSDP divides a group's reduce-scatter input by before the collective (None: it does not)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo

    reduce_scatter = pg._reduce_scatter_process_group if isinstance(pg.mesh_info, FSDPMeshInfo) else None
    all_reduce = pg._all_reduce_process_group if isinstance(pg.mesh_info, DDPMeshInfo) else None
    dtype = pg._reduce_dtype or pg.fsdp_params[0].unsharded_param.dtype
    factor, _, _, _ = _get_gradient_divide_factors(reduce_scatter, all_reduce, dtype, pg.device.type,
                                                   pg.gradient_divide_factor, pg.force_sum_reduction_for_comms)
    return factor


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's share of a DTensor (a view, never a collective); a plain tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t  # type: ignore[no-any-return]


class FSDP(Layout):
    """A fully_shard-ed model; the mesh comes from its DTensor parameters and spans every rank."""

    name = "fsdp"
    distributed = True
    reduces = True
    lockstep = True

    def __init__(self, model: torch.nn.Module, mesh: FSDPLayout | None = None) -> None:
        ranks, rank = world_ranks()
        super().__init__(model, model, None, ranks, rank)  # the mesh spans the world: collectives on the default group
        self.mesh = mesh if mesh is not None else layout_of(model)
        covered = self.mesh.shard_size * self.mesh.replicas
        if covered != dist.get_world_size():
            raise LayoutError(f"the model's device mesh covers {covered} of {dist.get_world_size()} ranks: it must "
                              "span every rank")
        self._tap: GradTap | None = None
        device = next(model.parameters()).device
        # Every position's shard index (set-up, once): reduced shards and weights are compared among replicas only.
        self.shard_of = [r[0] for r in gather_rows(torch.tensor([self.mesh.shard_index], dtype=torch.int64),
                                                   None, device)]

    @property
    def weight_replicas(self) -> bool:
        return False

    @property
    def digest_group(self) -> dist.ProcessGroup | None:
        return self.mesh.replicate_group  # the replicas of this rank's shard (HSDP, N-D meshes); None on a 1-D mesh

    def weights_off_reason(self) -> str | None:
        return ("a 1-D FSDP mesh holds no replica of any shard: the weight check has nothing to compare and is off "
                "(HSDP, a (replicate, shard) mesh, has replicas)")

    def install(self, sink: GradSink, *, reduced_checks: bool = True) -> None:
        params = [p for p in self.module.parameters() if p.requires_grad]
        self._tap = GradTap(self.mesh, params, sink)

    def after_backward(self, sink: GradSink) -> None:
        """The reduce-scatter tap measured every parameter group during backward."""

    def disable(self) -> None:
        if self._tap is not None:
            self._tap.enabled = False

    local = staticmethod(local_shard)

    def whole(self, named: Sequence[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in named:  # gathered from the shards on every rank (collective), one tensor at a time
            yield name, p.full_tensor()  # type: ignore[attr-defined]

    def recompute(self, params: Sequence[torch.nn.Parameter], run_backward: Callable[[], None],
                  take: Callable[[int, torch.Tensor, float | None], None]) -> None:
        recompute_grads(self.mesh, params, run_backward, take)

    def weight_classes(self, classes: Sequence[int] | None) -> list[Any] | None:
        """Per position: (numerics class, shard index): weights are compared among replicas of the same shard."""
        assert self.shard_of is not None
        return [(classes[i] if classes is not None else 0, shard) for i, shard in enumerate(self.shard_of)]
