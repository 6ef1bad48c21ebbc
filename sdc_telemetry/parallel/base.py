"""The Layout interface: what the checks need to know about how a parallelism lays a model over the ranks.

The monitor asks its layout and never the model's type. A layout answers:

- **who**: the process group the monitor's collectives run in (``group``; None for the default group), the global
  rank of each of its positions (``ranks``), and whether there is more than one process at all (``distributed``);
- **where gradients are read**: ``install(sink)`` taps the local gradients as the reduction consumes them (a DDP
  comm hook, an FSDP2 reduce-scatter wrapper), ``after_backward(sink)`` reads them where no reduction exists
  (one process); ``reduces`` says whether reduced gradients exist to be checked (``grad_reduced``);
- **which ranks hold replicas of which tensor**: ``shard_of`` (each position's shard index, for sharded models;
  None when every rank holds whole tensors), ``weight_replicas`` (some other rank holds a copy of every tensor
  this rank holds, so the weight vote has something to compare) and ``digest_keys``/``digest_key`` (how many
  distinct shards there are and which one this rank holds: the replicas of a shard compare their weight digests
  among themselves, in the layout's replica group ``digest_group``, before the step's agreement);
- **how a tensor is read in place**: ``local(t)`` (this rank's share, never a collective: what the weight
  fingerprint and the reduced-gradient norm read) and ``whole(named)`` (whole tensors for a certificate, one at a
  time);
- **how a replica recomputes a micro-batch**: ``lockstep`` (the recomputation runs collectives, so every rank
  recomputes at once) and ``recompute(params, run_backward, take)`` (run forward and backward without touching
  ``.grad`` or the training state, handing ``take(i, grad, divide)`` each parameter's local gradient the moment it is
  accumulated, so that it is measured and dropped; only lockstep layouts: elsewhere plain autograd does it).

Adding a parallelism means adding an adapter module here and one line in ``layout_for``: no change to the monitor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch
import torch.distributed as dist

from sdc_telemetry.core.collective import gather_objects, gather_rows, group_ranks

__all__ = ["Layout", "GradSink", "LayoutError"]


class LayoutError(TypeError):
    """A model laid out in a way the monitor does not support (yet): the message names what and why."""


class GradSink(Protocol):
    """Where a layout's gradient tap hands the local gradients of the step (``checks.grad.GradRecord``)."""

    detail: bool
    generation: int  # counts the steps opened (a tap that keeps state across calls within a step checks it)

    def note_call(self, key: int) -> None: ...

    def store(self, index: list[int], grads: list[torch.Tensor], fp_grads: list[torch.Tensor] | None = None
              ) -> None: ...

    def fail(self) -> None: ...

    def store_norms(self, index: list[int], norms: list[torch.Tensor]) -> None: ...

    def measure_local(self) -> None: ...


class Layout:
    """Base adapter: one process, or any layout whose tensors are whole on every rank. Subclasses override."""

    name = "single"
    #: more than one process takes part (the agreement is all-reduced, identities gathered)
    distributed = False
    #: gradients are reduced across ranks: ``grad_reduced`` has something to read
    reduces = False
    #: the replay's recomputation runs collectives: every rank recomputes at once
    lockstep = False
    #: a pipeline stage: the step runs ``schedule.step`` (``pipeline_step``) and the replay reruns the schedule
    pipelined = False

    def __init__(self, model: torch.nn.Module, module: torch.nn.Module, group: dist.ProcessGroup | None,
                 ranks: Sequence[int], rank: int) -> None:
        self.model = model          # what the training loop calls (a wrapper, or the module itself)
        self.module = module        # the unwrapped module: parameter names of certificates and evidence
        self.group = group
        self.ranks = list(ranks)
        self.rank = rank
        self.world = len(self.ranks)
        self.position = self.ranks.index(rank)
        self.shard_of: list[int] | None = None
        # N-D layouts: every position's mesh coordinate (``parallel.coordinates.Coordinates``); None when flat.
        self.coordinates: Any = None

    # -- who holds what ------------------------------------------------------------------------------------------

    @property
    def replicas(self) -> bool:
        """More than one rank computes the same model: the replay has partners."""
        return self.world > 1

    @property
    def weight_replicas(self) -> bool:
        """Every tensor this rank holds has a replica on another rank: the weight vote can run."""
        return self.world > 1

    def weights_off_reason(self) -> str | None:
        """Why the weight check has nothing to compare (said once), or None when it has."""
        if self.weight_replicas:
            return None
        return "one replica: weight and replay checks need several ranks and are off"

    @property
    def digest_keys(self) -> int:
        """Distinct shards whose replicas compare weight digests among themselves (0: every rank holds whole
        tensors, one digest for the group)."""
        return 0

    @property
    def digest_key(self) -> int:
        return 0

    @property
    def digest_group(self) -> dist.ProcessGroup | None:
        """With ``digest_keys``: the process group of the ranks that hold this rank's shard (its replicas), in which
        their digests are compared; an existing group of the layout, never one made for the monitor."""
        return None

    @property
    def repeats_why(self) -> str:
        """Why the replay skips a step whose gradient tap ran more than once for the same bucket."""
        return ("a gradient bucket was all-reduced more than once in the step: with gradient accumulation, run all but "
                "the last micro-batch under ddp_model.no_sync()")

    @property
    def reduced_shards(self) -> list[int] | None:
        """Per position, the index of the reduced-gradient shard it holds (compared only among its replicas), or
        None when every rank holds whole reduced gradients: ``shard_of`` unless the layout partitions gradients
        differently from weights (ZeRO stage 1 and 2: whole weights, partitioned gradients)."""
        return self.shard_of

    def reduced(self, params: Sequence[torch.nn.Parameter]) -> list[tuple[int, torch.Tensor]]:
        """After backward, the reduced gradients this rank holds: (index in ``params``, tensor), never a collective;
        by default each parameter's ``.grad`` as this rank holds it. Empty: nothing was reduced this step."""
        return [(i, self.local(p.grad)) for i, p in enumerate(params) if p.grad is not None]

    def updated(self, named: Sequence[tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer
                ) -> tuple[list[tuple[str, torch.Tensor]], bool]:
        """The tensors ``optimizer`` updates as this rank holds them, named, for the at-rest check and the update
        audit, and whether they are the module's parameters (``named``, then read through ``local``) rather than
        the optimizer's own copies (a ZeRO optimizer's fp32 partitions)."""
        return list(named), True

    #: the replay may fall back to recomputing through ``.grad`` (saved and restored) where ``autograd.grad`` is
    #: refused (reentrant activation checkpointing); False where accumulating into ``.grad`` fires a framework's hooks
    grad_fields = True
    #: the optimizer's step runs its torch optimizer once per parameter group (a ZeRO optimizer): the step
    #: post-hook fires several times per update
    steps_in_parts = False

    def recomputing(self) -> AbstractContextManager[None]:
        """A context the replay's recomputation through ``.grad`` runs in (the fallback for reentrant activation
        checkpointing): a layout whose framework acts on accumulated gradients quiets that here. Nothing by
        default."""
        return nullcontext()

    def accumulates_in(self, params: Sequence[torch.nn.Parameter]) -> list[torch.dtype | None] | None:
        """Per parameter, the dtype of a zeroed buffer the framework adds each local gradient into (the replay adds
        each recomputed piece into zeros of that dtype, as the framework does: ``0.0 + g`` turns -0.0 into +0.0, and
        bf16 pieces sum in fp32), or None for a parameter whose gradient autograd accumulates; None: every one."""
        return None

    def rng_state(self) -> Any:
        """A framework's own RNG states (captured with each micro-batch for the replay, restored for its
        recomputation), or None: torch's CPU and device generators are captured anyway."""
        return None

    def set_rng_state(self, state: Any) -> None:
        """Restore what ``rng_state`` returned."""

    def torch_optimizer(self, optimizer: Any) -> Any:
        """The torch optimizer that updates this rank's tensors, inside a framework's wrapper: Accelerate's
        ``AcceleratedOptimizer`` (an ``Optimizer`` subclass without its set-up, whose ``step()`` calls the inner
        optimizer's) or DeepSpeed's ZeRO optimizer (no ``Optimizer`` at all); ``optimizer`` itself otherwise."""
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(optimizer, torch.optim.Optimizer) and isinstance(inner, torch.optim.Optimizer) \
                and "_optimizer_step_post_hooks" not in vars(optimizer):
            return inner
        if not isinstance(optimizer, torch.optim.Optimizer) and isinstance(inner, torch.optim.Optimizer) \
                and type(optimizer).__module__.startswith("deepspeed."):
            return inner
        return optimizer

    @property
    def optimizer_replicas(self) -> bool:
        """Some other rank holds a copy of this rank's optimizer state and of what its update writes (its master
        weights): the weight vote sees a wrong update. False where the optimizer is sharded (ZeRO): then the update
        audit is the only check of an update."""
        return self.weight_replicas

    def weight_classes(self, classes: Sequence[int] | None) -> list[Any] | None:
        """Per position, the class of ranks whose weights must be bit-identical (numerics signature, shard)."""
        return list(classes) if classes is not None else None

    def coordinate_of(self, rank: int) -> dict[str, int] | None:
        """The mesh coordinate of ``rank`` (N-D layouts, for evidence and pages), or None for a flat layout."""
        if self.coordinates is None or rank not in self.ranks:
            return None
        return dict(self.coordinates.of[self.ranks.index(rank)])

    def replay_units(self) -> tuple[list[int], list[int]] | None:
        """By position: (replica index, slot within the replica) when several ranks compute one micro-batch together
        (tensor, context or pipeline parallelism): the replay pairs replicas and each slot compares with the same
        slot. None: every rank computes its own micro-batch (positions are paired directly)."""
        if self.coordinates is None:
            return None
        c = self.coordinates
        return list(c.replica_of), [c.slot_of(p) for p in range(self.world)]

    # -- the rare path's gathers -----------------------------------------------------------------------------------

    def gather_rows(self, row: torch.Tensor, device: torch.device) -> list[list[int]]:
        """Every position's int64 row, on every rank (one process: its own)."""
        return gather_rows(row, self.group, device) if self.distributed else [row.tolist()]

    def gather_objects(self, obj: object) -> list[object]:
        return gather_objects(obj, self.group) if self.distributed else [obj]

    # -- where gradients are read --------------------------------------------------------------------------------

    def install(self, sink: GradSink, *, reduced_checks: bool = True) -> None:
        """Tap the local gradients into ``sink`` as the reduction consumes them (nothing to tap by default);
        ``reduced_checks``: the reduced gradients are checked (what a reduction-side measurement is for)."""

    def after_backward(self, sink: GradSink) -> None:
        """Read the local gradients at the end of backward where no reduction tapped them (one process)."""
        sink.measure_local()

    def reduction_mismatch(self) -> torch.Tensor | None:
        """At the end of backward: a 0-d int64 device tensor, 1 when the reduction's checksum says the reduced
        gradients are not the sum of the ranks' local ones (a fault inside the reduction), 0 when they are; None
        when it was not measured (the default: no reduction, or no checksum travels with it)."""
        return None

    def disable(self) -> None:
        """Stop measuring (``close()``): taps that cannot be removed only forward from now on."""

    # -- reading tensors in place --------------------------------------------------------------------------------

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's share of ``t`` (a view, never a collective)."""
        return t

    def whole(self, named: Sequence[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Whole tensors, one at a time (a sharded layout gathers each in turn: collective)."""
        yield from named

    def whole_shape(self, t: torch.Tensor) -> tuple[int, ...]:
        """The shape of ``t`` as a whole tensor (a DTensor's is its global shape already)."""
        return tuple(t.shape)

    # -- replay --------------------------------------------------------------------------------------------------

    def recompute(self, params: Sequence[torch.nn.Parameter], run_backward: Callable[[], None],
                  take: Callable[[int, torch.Tensor, float | None], None]) -> None:
        """Recompute through collectives (``lockstep`` layouts), handing ``take(i, grad, divide)`` each accumulation
        of parameter i's local gradient (owned by ``take``; ``divide``: the factor the reduction divides the
        accumulated input by, None for none); other layouts are recomputed with plain autograd by the replay."""
        raise NotImplementedError(f"the {self.name} layout does not recompute in lockstep")

    def stage_outputs(self) -> Any:
        """Pipeline layouts: the recorder of this rank's stage outputs (``parallel.outputs.StageOutputs``), with
        which the replay names the first stage whose output differs; None elsewhere."""
        return None

    def describe(self) -> str:
        return f"{self.name} over {self.world} rank(s)"


def world_ranks() -> tuple[list[int], int]:
    """Every rank of the default group, and this one."""
    return group_ranks(None), dist.get_rank()
