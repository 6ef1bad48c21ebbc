"""Megatron-core: its ``DistributedDataParallel``, with or without its distributed optimizer, and tensor parallelism.

What each check reads (nothing here imports Megatron-core: its DDP and optimizers are read by attribute):

- **Local gradients**: Megatron's DDP accumulates each parameter's gradient into ``main_grad``, a view of its
  contiguous gradient buffer, and reduces the buffer bucket group by bucket group (``start_grad_sync``: from its
  backward hooks with ``overlap_grad_reduce``, else from ``finish_grad_sync``). That call is wrapped on each bucket
  group: it measures the group's ``main_grad`` views just before they are scaled and reduced, once per optimizer
  step whatever the number of micro-batches (the others run under ``no_sync``).
- **Reduced gradients**: without the distributed optimizer every rank holds the averaged ``main_grad`` after
  ``finish_grad_sync``. With it, the buffer is reduce-scattered: each rank holds only its own 1/DP slice of each
  bucket reduced, read as the pieces of the parameters it covers and compared with no replica
  (``reduced_shards``).
- **Weights**: after ``optimizer.step()`` every data-parallel rank holds every parameter of its tensor-parallel
  shard (the distributed optimizer all-gathers the updated slices), so the vote runs among the data-parallel
  replicas of each shard (the DP group).
- **Update and at rest**: the torch optimizer inside Megatron's updates this rank's tensors. With the distributed
  optimizer they are this rank's slices of the parameters (fp32 master copies under bf16), held by no other rank: the
  at-rest check and the update audit read them (``updated``), named ``param[start:end]``. Without it, the state is
  replicated and voted as for DDP.
- **Replay**: ``autograd.grad`` on the DDP's module (it accumulates nothing, so Megatron's gradient hooks stay idle).
  Megatron's activation recomputation refuses ``autograd.grad``; the replay then recomputes through ``.grad`` with
  the DDP's hooks quieted (``recomputing``). Megatron's RNG tracker (dropout inside its fork) is captured with each
  micro-batch and restored for the replay (``rng_state``). Under tensor parallelism the ranks of a data-parallel
  replica recompute a partner replica's micro-batches together (``lockstep``), each tensor-parallel rank the same
  rank's.

Refused by name: pipeline or context parallelism, sequence parallelism, expert (MoE) layers, Megatron FSDP, several
distributed-optimizer instances, ``overlap_param_gather`` (its forward hooks would gather during the replay),
``gradient_accumulation_fusion`` (its kernel adds the weight gradients into ``main_grad`` inside backward, a replay
too), fp16 (Megatron's loss scaler), and optimizers other than one ``DistributedOptimizer``, ``FP32Optimizer`` or
``Float16OptimizerWithFloat16Params`` (bf16).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from sdc_telemetry.core.collective import group_ranks
from sdc_telemetry.parallel.base import GradSink, Layout, LayoutError

__all__ = ["MegatronDDP", "is_megatron_ddp"]

_OPTIMIZERS = ("DistributedOptimizer", "FP32Optimizer", "Float16OptimizerWithFloat16Params")


def is_megatron_ddp(model: Any) -> bool:
    """``model`` is Megatron-core's ``DistributedDataParallel``, told without importing Megatron-core."""
    return any(c.__name__ == "DistributedDataParallel" and c.__module__.startswith("megatron.core.")
               for c in type(model).__mro__)


def _size(group: Any) -> int:
    group = group[0] if isinstance(group, list) else group  # a list: one group per model chunk
    return 1 if group is None else dist.get_world_size(group)


def _refusal(ddp: Any) -> str | None:
    cfg, model_cfg = ddp.ddp_config, ddp.config
    if getattr(cfg, "use_megatron_fsdp", False) or getattr(cfg, "use_custom_fsdp", False):
        return "Megatron FSDP is not supported: use its DistributedDataParallel with the distributed optimizer"
    if getattr(cfg, "num_distributed_optimizer_instances", 1) > 1:
        return "several distributed-optimizer instances (num_distributed_optimizer_instances > 1) are not supported"
    if getattr(cfg, "overlap_param_gather", False):
        return ("overlap_param_gather is not supported (the DDP's forward hooks would all-gather parameters during the "
                "replay's recomputation): set it False")
    if getattr(model_cfg, "gradient_accumulation_fusion", False):
        return ("gradient_accumulation_fusion is not supported (its kernel adds weight gradients into main_grad inside "
                "backward, a replay's recomputation too): set TransformerConfig(gradient_accumulation_fusion=False)")
    if getattr(model_cfg, "fp16", False):
        return "fp16 with Megatron's loss scaler is not supported yet: use bf16 or fp32"
    if getattr(model_cfg, "fp8", None) or getattr(cfg, "fp8_param_gather", False) \
            or getattr(cfg, "reuse_grad_buf_for_mxfp8_param_ag", False):
        return "fp8 is not supported yet (Transformer Engine's scaling state changes with every forward pass)"
    if getattr(cfg, "delay_wgrad_compute", False) or getattr(model_cfg, "delay_wgrad_compute", False):
        return "delay_wgrad_compute is not supported (weight gradients computed after the backward's hooks)"
    if getattr(model_cfg, "cuda_graph_impl", "none") not in ("none", None) \
            or getattr(model_cfg, "enable_cuda_graph", False) or getattr(model_cfg, "external_cuda_graph", False):
        return "CUDA graphs are not supported yet (the DDP's gradient hooks do not run while a graph is captured)"
    if _size(ddp.pp_group) > 1:
        return f"Megatron pipeline parallelism ({_size(ddp.pp_group)} stages) is not supported yet"
    if _size(ddp.dp_cp_group) != _size(ddp.dp_group):
        return "Megatron context parallelism is not supported yet"
    if getattr(model_cfg, "sequence_parallel", False):
        return "Megatron sequence parallelism is not supported yet"
    if getattr(ddp, "expert_parallel_bucket_groups", None) or getattr(model_cfg, "num_moe_experts", None):
        return "Megatron MoE (expert) layers are not supported yet"
    return None


def _tracker_refusal() -> str | None:
    """The replay captures Megatron's RNG tracker states as tensors: a tracker holding generators (CUDA-graph-safe
    RNG, Transformer Engine's tracker) is not captured."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    if type(tracker).__name__ != "CudaRNGStatesTracker" or getattr(tracker, "use_cudagraphable_rng", False):
        return (f"the RNG tracker {type(tracker).__name__} (Transformer Engine's, or CUDA-graph-safe RNG) is not "
                "supported yet: the replay captures Megatron's own tracker's states")
    return None


class MegatronDDP(Layout):
    """Megatron-core's ``DistributedDataParallel`` over its data-parallel group, with tensor parallelism."""

    name = "megatron"
    distributed = True
    reduces = True

    def __init__(self, ddp: Any) -> None:
        why = _refusal(ddp) or _tracker_refusal()
        if why is not None:
            raise LayoutError(f"SDCMonitor with Megatron-core: {why}")
        self.ddp = ddp
        self.tp = _size(ddp.tp_group)
        dp_group = ddp.dp_group
        group = dp_group if self.tp == 1 else None  # with tensor parallelism the monitor spans every rank
        super().__init__(ddp, ddp.module, group, group_ranks(group), dist.get_rank())
        self.sharded_optimizer = bool(ddp.ddp_config.use_distributed_optimizer)
        self.dp = _size(dp_group)
        self.dp_index = dist.get_rank(dp_group)
        if self.tp > 1:
            if self.dp * self.tp != dist.get_world_size():
                raise LayoutError(f"SDCMonitor with Megatron-core: {self.dp} data-parallel x {self.tp} tensor-parallel "
                                  f"ranks, but the job has {dist.get_world_size()}")
            from sdc_telemetry.parallel.coordinates import Coordinates

            device = next(ddp.module.parameters()).device
            self.coordinates = Coordinates.gather({"dp_replicate": self.dp, "tp": self.tp},
                                                  {"dp_replicate": self.dp_index, "tp": dist.get_rank(ddp.tp_group)},
                                                  device)
            self.shard_of = list(self.coordinates.key_of)
            self.lockstep = True  # the tensor-parallel collectives of a replica's recomputation line up
        self.optimizer: Any = None  # Megatron's optimizer (torch_optimizer): names the tensors it updates
        self._enabled = True
        self._sink: GradSink | None = None
        self._index: dict[int, int] = {}
        self._wrapped: list[tuple[Any, Any]] = []  # (bucket group, its own start_grad_sync)

    # -- who holds what ----------------------------------------------------------------------------------------------

    @property
    def replicas(self) -> bool:
        return self.dp > 1

    @property
    def weight_replicas(self) -> bool:
        return self.dp > 1

    @property
    def digest_keys(self) -> int:
        return self.tp if self.tp > 1 else 0

    @property
    def digest_key(self) -> int:
        return int(self.coordinates.key_of[self.position]) if self.tp > 1 else 0

    @property
    def digest_group(self) -> dist.ProcessGroup | None:
        return self.ddp.dp_group if self.tp > 1 else None

    @property
    def reduced_shards(self) -> list[int] | None:
        return list(range(self.world)) if self.sharded_optimizer else self.shard_of

    @property
    def optimizer_replicas(self) -> bool:
        return not self.sharded_optimizer and self.dp > 1

    def weights_off_reason(self) -> str | None:
        return None if self.dp > 1 else "one data-parallel replica: weight and replay checks need several and are off"

    def torch_optimizer(self, optimizer: Any) -> Any:
        """The torch optimizer inside Megatron's (a ``ChainedOptimizer`` of one, as ``get_megatron_optimizer``
        returns); checked against the DDP's configuration."""
        if not type(optimizer).__module__.startswith("megatron.core."):
            return super().torch_optimizer(optimizer)
        chained = getattr(optimizer, "chained_optimizers", None)
        if chained is not None:
            if len(chained) != 1:
                raise LayoutError(f"SDCMonitor with Megatron-core: a ChainedOptimizer of {len(chained)} optimizers is "
                                  "not supported (one parameter dtype, no expert parameters): one optimizer")
            optimizer = chained[0]
        kind = type(optimizer).__name__
        if kind not in _OPTIMIZERS:
            raise LayoutError(f"SDCMonitor with Megatron-core: {kind} is not supported; supported: "
                              f"{', '.join(_OPTIMIZERS)}")
        if (kind == "DistributedOptimizer") != self.sharded_optimizer:
            raise LayoutError(f"SDCMonitor with Megatron-core: a {kind} with a DistributedDataParallel built with "
                              f"use_distributed_optimizer={self.sharded_optimizer}: build both from one setting")
        if getattr(optimizer, "grad_scaler", None) is not None:
            raise LayoutError("SDCMonitor with Megatron-core: a loss scaler (fp16) is not supported yet")
        if getattr(getattr(optimizer, "config", None), "use_precision_aware_optimizer", False):
            raise LayoutError("SDCMonitor with Megatron-core: use_precision_aware_optimizer is not supported yet (its "
                              "gradients and master weights live outside the torch optimizer's parameters)")
        if not isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
            raise LayoutError(f"SDCMonitor with Megatron-core: the optimizer inside {kind} is "
                              f"{type(getattr(optimizer, 'optimizer', None)).__name__}, not a torch optimizer "
                              "(optimizer CPU offloading is not supported)")
        self.optimizer = optimizer
        return optimizer.optimizer

    # -- local gradients ---------------------------------------------------------------------------------------------

    def install(self, sink: GradSink, *, reduced_checks: bool = True) -> None:
        self._sink = sink
        self._index = {id(p): i for i, p in enumerate(p for p in self.module.parameters() if p.requires_grad)}
        for key, bucket_group in enumerate(self.ddp.bucket_groups):
            own = bucket_group.start_grad_sync
            bucket_group.start_grad_sync = self._tap(key, bucket_group, own)
            self._wrapped.append((bucket_group, own))

    def _tap(self, key: int, bucket_group: Any, start: Callable[..., Any]) -> Callable[..., Any]:
        def start_grad_sync(*args: Any, **kwargs: Any) -> Any:
            sink = self._sink
            # Megatron's first batch may ask twice (from its hooks, then finish_grad_sync): the second does nothing
            repeat = bucket_group.is_first_batch and bucket_group.grad_reduce_handle is not None
            if self._enabled and sink is not None and not repeat:
                try:
                    sink.note_call(key)
                    pairs = [(self._index[id(p)], p.main_grad) for b in bucket_group.buckets for p in b.params_list
                             if id(p) in self._index]
                    if pairs:
                        sink.store([i for i, _ in pairs], [g for _, g in pairs])
                except Exception:  # noqa: BLE001 - telemetry never breaks training: the step's measurement fails
                    sink.fail()
            return start(*args, **kwargs)
        return start_grad_sync

    def after_backward(self, sink: GradSink) -> None:
        """The local gradients were measured where each bucket group was reduced."""

    def disable(self) -> None:
        self._enabled = False
        for bucket_group, _ in self._wrapped:
            del bucket_group.start_grad_sync  # the class's method again
        self._wrapped = []

    # -- reduced gradients -------------------------------------------------------------------------------------------

    def reduced(self, params: Sequence[torch.nn.Parameter]) -> list[tuple[int, torch.Tensor]]:
        index = {id(p): i for i, p in enumerate(params)}
        if not self.sharded_optimizer:
            return [(index[id(p)], p.main_grad) for p in params  # type: ignore[attr-defined]
                    if getattr(p, "main_grad", None) is not None]
        out = []
        for buffer in self.ddp.buffers:
            for bucket in buffer.buckets:
                size = bucket.grad_data.numel() // self.dp
                lo, hi = bucket.offset + self.dp_index * size, bucket.offset + (self.dp_index + 1) * size
                for p in bucket.params_list:
                    start, end, _ = buffer.param_index_map[p]
                    a, b = max(start, lo), min(end, hi)
                    if a < b and id(p) in index:
                        out.append((index[id(p)], p.main_grad.view(-1)[a - start:b - start]))
        return out

    # -- the optimizer's own tensors ---------------------------------------------------------------------------------

    def updated(self, named: Sequence[tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer
                ) -> tuple[list[tuple[str, torch.Tensor]], bool]:
        module_params = {id(p) for _, p in named}
        held = [p for g in optimizer.param_groups for p in g["params"]]
        if all(id(p) in module_params for p in held):
            return super().updated(named, optimizer)  # FP32Optimizer: the module's parameters themselves
        names = {**{id(p): n for n, p in named}, **self._names(named)}
        return [(names.get(id(p), f"megatron.optimizer.param{k}"), p) for k, p in enumerate(held)], False

    def _names(self, named: Sequence[tuple[str, torch.nn.Parameter]]) -> dict[int, str]:
        """id of each tensor the torch optimizer updates -> the module parameter it stands for (with the slice this
        rank owns under the distributed optimizer)."""
        opt, of = self.optimizer, {id(p): n for n, p in named}
        if opt is None:
            return {}
        out: dict[int, str] = {}
        if type(opt).__name__ == "DistributedOptimizer":
            for models, shards in ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                                   (opt.model_fp32_groups, opt.shard_fp32_groups)):
                for model_group, shard_group in zip(models, shards, strict=True):
                    for p, shard in zip(model_group, shard_group, strict=True):
                        r = opt._get_model_param_range_map(p)["param"]
                        out[id(shard)] = f"{of.get(id(p), 'param')}[{r.start}:{r.end}]"
        else:
            for model_group, master_group in zip(getattr(opt, "float16_groups", []),
                                                 getattr(opt, "fp32_from_float16_groups", []), strict=True):
                for p, master in zip(model_group, master_group, strict=True):
                    out[id(master)] = f"{of.get(id(p), 'param')}.fp32_master"
        return out

    # -- replay ------------------------------------------------------------------------------------------------------

    def recompute(self, params: Sequence[torch.nn.Parameter], run_backward: Callable[[], None],
                  take: Callable[[int, torch.Tensor, float | None], None]) -> None:
        raise NotImplementedError("a tensor-parallel replay recomputes with autograd.grad (by_grad), every rank "
                                  "at once")

    recompute.by_grad = True  # type: ignore[attr-defined]

    @contextmanager
    def recomputing(self) -> Iterator[None]:
        """Megatron's hooks add ``.grad`` into ``main_grad`` for the parameters of its bucket map: empty it while
        the replay recomputes through ``.grad``."""
        ddp = self.ddp
        held, ddp.param_to_bucket_group = ddp.param_to_bucket_group, {}
        try:
            yield
        finally:
            ddp.param_to_bucket_group = held

    def accumulates_in(self, params: Sequence[torch.nn.Parameter]) -> list[torch.dtype | None] | None:
        """Megatron adds each gradient into its zeroed ``main_grad`` (fp32 for bf16 parameters with
        ``grad_reduce_in_fp32``)."""
        into: list[torch.dtype | None] = []
        for p in params:
            held = getattr(p, "main_grad", None)
            into.append(held.dtype if held is not None else None)
        return into

    def rng_state(self) -> Any:
        """Megatron's RNG tracker states (dropout inside ``get_cuda_rng_tracker().fork()``), None when it has none."""
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        tracker = get_cuda_rng_tracker()
        states = tracker.get_states()
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in states.items()} if states else None

    def set_rng_state(self, state: Any) -> None:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        if state is not None:
            get_cuda_rng_tracker().set_states(dict(state))

    def describe(self) -> str:
        opt = "distributed optimizer" if self.sharded_optimizer else "replicated optimizer"
        tp = f" x tp={self.tp}" if self.tp > 1 else ""
        return f"Megatron-core DDP over dp={self.dp}{tp} ({opt})"
