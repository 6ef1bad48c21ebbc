"""DeepSpeed's engine, ZeRO stages 0 to 3: a sharded optimizer from stage 1 on, sharded parameters at stage 3.

What each check reads (nothing here imports DeepSpeed: the engine and its ZeRO optimizer are read by attribute):

- **Local gradients**: a tensor hook on each parameter sees its gradient as backward produces it, before DeepSpeed's
  own hooks reduce it (stage 2 reduces during backward, bucket by bucket, and frees ``.grad``). The hooks act only
  while the integration says DeepSpeed's backward runs (``armed``), never during the replay's recomputation. With
  ``gradient_accumulation_steps`` > 1 each micro-batch's norm is folded into the step's (a NaN in any of them
  shows) and the replay, which compares a whole step's local gradients, is skipped (``repeats_why``).
- **Reduced gradients**: stage 0 leaves them in ``.grad``; stages 1 to 3 keep only this rank's partition, averaged,
  in the ZeRO optimizer's ``averaged_gradients`` (per parameter group, or stage 3's sub-group, one piece per
  parameter in the partition) between the boundary micro-batch's backward and ``engine.step()``: read there. Each
  rank holds a different partition, so a non-finite partition is compared with no replica (``reduced_shards``).
- **Weights**: at stages 0 to 2 every rank holds every module parameter (ZeRO all-gathers the updated partitions
  into them), so the weight vote runs across the data-parallel group as for DDP. At stage 3 a parameter's partition
  (``ds_tensor``) lives on one rank only: no vote (``weight_replicas`` False), the at-rest check below instead.
- **Update and at rest**: the torch optimizer inside ZeRO updates this rank's fp32 partition (its master weights)
  and holds its state; no other rank holds either, and a wrong update is all-gathered into every replica's module
  before any vote could see it. The at-rest check and the update audit (``checks/update.py``) therefore read those
  partitions (``updated``) and the optimizer state keyed by them; the vote leaves the state out.
- **Replay**: ``autograd.grad`` on ``engine.module`` (it accumulates nothing into ``.grad``, so DeepSpeed's reduction
  hooks stay idle). At stage 3 DeepSpeed's module hooks all-gather each parameter in the recomputation's forward
  and backward: every rank recomputes at once (``lockstep``), each its partner's micro-batch, so that the gathers
  line up (``recompute.by_grad``: the lockstep replay still runs ``autograd.grad``).

Refused by name: fp16 (DeepSpeed's dynamic loss scaler) and torch_autocast, pipeline engines, MoE layers, model,
sequence or AutoTP parallelism, optimizer or parameter offload, unmanaged gradient accumulation, bf16 at stage 0
(DeepSpeed's own ``BF16_Optimizer``). A reentrant activation checkpoint makes the replay an error (``grad_fields``):
a recomputation through ``.grad`` would fire DeepSpeed's reduction hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from sdc_telemetry.core.collective import group_ranks
from sdc_telemetry.parallel.base import GradSink, Layout, LayoutError

__all__ = ["DeepSpeedZeRO", "is_engine"]


def is_engine(model: Any) -> bool:
    """``model`` is a DeepSpeed engine (``deepspeed.initialize``'s first result), told without importing DeepSpeed."""
    return any(c.__name__ == "DeepSpeedEngine" and c.__module__.startswith("deepspeed.")
               for c in type(model).__mro__)


def _refusal(engine: Any) -> str | None:
    if type(engine).__name__ != "DeepSpeedEngine":
        return f"{type(engine).__name__} (a pipeline engine) is not supported: only deepspeed.DeepSpeedEngine"
    stage = engine.zero_optimization_stage()
    if getattr(engine, "has_moe_layers", False):
        return ("DeepSpeed MoE layers are not supported (expert weights differ across the data-parallel group and "
                "their partitions live in expert groups)")
    for what, size in (("model (tensor) parallelism", getattr(engine, "mp_world_size", 1)),
                       ("sequence parallelism", getattr(engine, "sequence_parallel_size", 1)),
                       ("AutoTP", engine.autotp_size() if callable(getattr(engine, "autotp_size", None)) else 0)):
        if (size or 1) > 1:
            return f"DeepSpeed {what} of size {size} is not supported: data parallelism only"
    if callable(getattr(engine, "managed_gradient_accumulation", None)) and not engine.managed_gradient_accumulation():
        return ("unmanaged gradient accumulation (the reduction runs in engine.step(), after the checks) is not "
                "supported")
    if callable(getattr(engine, "torch_autocast_enabled", None)) and engine.torch_autocast_enabled():
        return ("DeepSpeed's torch_autocast is not supported yet (the replay recomputes on engine.module, outside the "
                "engine's autocast): use DeepSpeed's bf16 instead")
    if engine.fp16_enabled():
        return "fp16 with DeepSpeed's dynamic loss scaler is not supported yet: use bf16 or fp32"
    zero = engine.optimizer
    if not stage and not isinstance(zero, torch.optim.Optimizer):
        return (f"at ZeRO stage 0 DeepSpeed steps {type(zero).__name__} (bf16 at stage 0 shards fp32 master weights "
                "its own way): use ZeRO stage 1 or 2")
    if stage and (getattr(zero, "cpu_offload", False) or getattr(zero, "offload_optimizer", False)
                  or getattr(zero, "offload_param", False)):
        return "ZeRO offload (offload_optimizer, offload_param) is not supported yet"
    needs = ("fp16_groups", "fp32_partitioned_groups_flat") if stage == 3 else \
        ("params_in_partition", "single_partition_of_fp32_groups")
    if stage and not all(hasattr(zero, a) for a in ("averaged_gradients", *needs)):
        return f"the ZeRO optimizer {type(zero).__name__} is not DeepSpeed's stage {stage} optimizer"
    return None


class DeepSpeedZeRO(Layout):
    """A ``deepspeed.DeepSpeedEngine`` at ZeRO stage 0 to 3, across its data-parallel group."""

    name = "deepspeed"
    distributed = True
    reduces = True
    lockstep = False

    def __init__(self, engine: Any) -> None:
        why = _refusal(engine)
        if why is not None:
            raise LayoutError(f"SDCMonitor with DeepSpeed: {why}")
        self.stage = int(engine.zero_optimization_stage())
        self.zero = engine.optimizer if self.stage else None
        group = self.zero.dp_process_group if self.zero is not None else \
            (getattr(engine, "seq_data_parallel_group", None) or engine.data_parallel_group)
        super().__init__(engine, engine.module, group, group_ranks(group), dist.get_rank())
        self.gas = int(engine.gradient_accumulation_steps())
        self.lockstep = self.stage == 3
        self.steps_in_parts = self.zero is not None
        if self.stage == 3:
            self.shard_of = list(range(self.world))
        self.armed = False  # DeepSpeed's backward of a monitored step runs: the hooks measure
        self._enabled = True
        self._handles: list[Any] = []
        self._sink: GradSink | None = None
        self._folded: torch.Tensor | None = None  # gas > 1: the step's per-parameter norms so far
        self._count = 0  # the parameters the hooks measure (install)
        self._generation = -1

    @property
    def reduced_shards(self) -> list[int] | None:
        return list(range(self.world)) if self.zero is not None else None

    @property
    def optimizer_replicas(self) -> bool:
        return self.zero is None

    @property
    def weight_replicas(self) -> bool:
        return self.world > 1 and self.stage < 3

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """Stage 3: this rank's partition of a parameter (``ds_tensor``, flat); the tensor itself below."""
        return getattr(t, "ds_tensor", t) if self.stage == 3 else t

    def whole(self, named: Sequence[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        if self.stage < 3:
            yield from named
            return
        from deepspeed.runtime.zero import GatheredParameters  # a collective per parameter, every rank in turn

        for name, p in named:
            with GatheredParameters([p]):
                full = p.detach().clone()
            yield name, full

    def whole_shape(self, t: torch.Tensor) -> tuple[int, ...]:
        """Stage 3: a parameter's own shape (``ds_shape``) while its tensor is an empty placeholder."""
        return tuple(getattr(t, "ds_shape", t.shape))

    def recompute(self, params: Sequence[torch.nn.Parameter], run_backward: Callable[[], None],
                  take: Callable[[int, torch.Tensor, float | None], None]) -> None:
        raise NotImplementedError("a ZeRO-3 replay recomputes with autograd.grad (by_grad), every rank at once")

    recompute.by_grad = True  # type: ignore[attr-defined]

    @property
    def repeats_why(self) -> str:
        return (f"DeepSpeed accumulates {self.gas} micro-batches per step (gradient_accumulation_steps) and the replay "
                "compares one step's whole local gradients, which ZeRO never holds at once: the replay is skipped, "
                "the gradient, weight, at-rest and update checks run")

    #: the replay may not recompute through ``.grad`` (reentrant activation checkpointing's fallback): a real
    #: backward would fire DeepSpeed's reduction hooks
    grad_fields = False

    # -- local gradients ---------------------------------------------------------------------------------------------

    def install(self, sink: GradSink, *, reduced_checks: bool = True) -> None:
        self._sink = sink
        params = [p for p in self.module.parameters() if p.requires_grad]
        self._handles = [p.register_hook(self._hook(i)) for i, p in enumerate(params)]  # type: ignore[no-untyped-call]
        self._count = len(params)

    def _hook(self, i: int) -> Any:
        def measure(grad: torch.Tensor) -> None:
            sink = self._sink
            if not (self.armed and self._enabled) or sink is None:
                return
            try:
                if self.gas == 1:
                    sink.note_call(i)
                    sink.store([i], [grad])
                    return
                if self._generation != sink.generation or self._folded is None:
                    self._generation = sink.generation
                    self._folded = torch.zeros(self._count, dtype=torch.float32, device=grad.device)
                norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
                self._folded[i] = torch.hypot(self._folded[i], norm)
            except Exception:  # noqa: BLE001 - telemetry never breaks training: the step's measurement fails
                sink.fail()
        return measure

    def after_backward(self, sink: GradSink) -> None:
        """With accumulation: the step's folded norms (a NaN in any micro-batch stays NaN); the second call says the
        step's local gradients were measured in parts (the replay skips it: ``repeats_why``)."""
        if self.gas == 1 or self._folded is None or self._generation != sink.generation:
            return
        sink.note_call(0)
        sink.note_call(0)
        sink.store_norms(list(range(self._count)), list(self._folded.unbind()))

    def disable(self) -> None:
        self._enabled = False
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- reduced gradients -------------------------------------------------------------------------------------------

    def reduced(self, params: Sequence[torch.nn.Parameter]) -> list[tuple[int, torch.Tensor]]:
        zero = self.zero
        if zero is None:
            return super().reduced(params)
        index = {id(p): i for i, p in enumerate(params)}
        out = []
        for g, held in zero.averaged_gradients.items():
            if held is None:
                continue
            # Stage 3: one partition-shaped piece per parameter of the sub-group, every parameter
            inside = zero.fp16_groups[g] if self.stage == 3 else zero.params_in_partition[g]
            # One piece per parameter of the partition, cut to it (the first from ``first_offset``, the last at the
            # partition's end). Padding: marked where DeepSpeed aligns parameters (between pieces and at the end),
            # unmarked as the last partition's tail otherwise (after every piece).
            pieces = [t for t in held if not getattr(t, "_zero_padding", False)]
            if len(pieces) < len(inside):
                raise RuntimeError(f"ZeRO's averaged gradients of group {g}: {len(pieces)} tensors for "
                                   f"{len(inside)} parameters in the partition")
            out += [(index[id(p)], t) for p, t in zip(inside, pieces[:len(inside)], strict=True) if id(p) in index]
        return out

    # -- the optimizer's own tensors ---------------------------------------------------------------------------------

    def updated(self, named: Sequence[tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer
                ) -> tuple[list[tuple[str, torch.Tensor]], bool]:
        if self.zero is None:
            return super().updated(named, optimizer)
        parts = list(self.zero.fp32_partitioned_groups_flat if self.stage == 3 else
                     self.zero.single_partition_of_fp32_groups)
        return [(f"zero.fp32_partition.group{g}", t) for g, t in enumerate(parts)], False

    def weights_off_reason(self) -> str | None:
        if self.stage == 3:
            return ("ZeRO stage 3 holds each parameter's partition on one rank only: the weight vote has nothing to "
                    "compare and is off (the update audit checks each rank's update)")
        return None if self.world > 1 else super().weights_off_reason()

    def describe(self) -> str:
        return f"DeepSpeed ZeRO stage {self.stage} over {self.world} rank(s)"
