"""Rank side of the Megatron-core tests: loops written as Megatron-core's users write them (a ``GPTModel`` wrapped in
its ``DistributedDataParallel``, ``get_megatron_optimizer``, the schedule of ``get_forward_backward_func()`` with
``finalize_model_grads``, then ``optimizer.step()``), in one process group, on the CPU through ``_megatron_cpu``.

Each run builds its model, DDP and optimizer on Megatron's model-parallel groups (tensor parallelism 1 or 2,
data parallelism over the rest) and trains a small GPT with dropout, with ``SDCMegatron`` attached (or not, for the
baseline the healthy run must reproduce bit for bit). Faults are planned on the GPT module and on the torch
optimizer inside Megatron's, whose parameters are this rank's slices under the distributed optimizer.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

import sdc_telemetry as sdc
from sdc_telemetry.faults import FaultInjector, flip_bit

from . import _megatron_cpu
from ._ranks import ResultCounter, each_in_turn, summary

SEQ, VOCAB, MICRO = 16, 64, 2
_tp = [0]  # the tensor-parallel size parallel_state was initialised with


def _groups(tp: int) -> None:
    from megatron.core import parallel_state

    if _tp[0] != tp:
        if _tp[0]:
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        _tp[0] = tp


def batches(dp_rank: int, count: int, nan_at: tuple[int, int] | None) -> list[dict[str, torch.Tensor]]:
    """``count`` micro-batches of ``MICRO`` sequences for data-parallel rank ``dp_rank`` (the same on the tensor-
    parallel ranks of a replica); ``nan_at`` (dp rank, index): a NaN in that micro-batch's loss mask (bad data)."""
    gen = torch.Generator().manual_seed(100 + dp_rank)
    out = []
    for i in range(count):
        tokens = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=gen)
        mask = torch.ones(MICRO, SEQ)
        if nan_at is not None and nan_at == (dp_rank, i):
            mask[0, 3] = float("nan")
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "loss_mask": mask,
                    "position_ids": torch.arange(SEQ).expand(MICRO, SEQ).contiguous()})
    return out


def _output(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out: torch.Tensor = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return out


def loss_func(loss_mask: torch.Tensor, three: bool, output_tensor: torch.Tensor) -> tuple[Any, ...]:
    """As Megatron's examples write it: the masked token losses' sum, with the token count (three values) or divided
    by it (two)."""
    total = torch.sum(output_tensor.float().view(-1) * loss_mask.view(-1))
    tokens = loss_mask.sum().to(torch.int)
    if three:
        return total, tokens, {"lm loss": total.detach()}
    return total / loss_mask.sum(), {"lm loss": total.detach()}


def replay_loss(three: bool, module: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What the schedule divides by the number of micro-batches (SDCMegatron's loss_fn)."""
    out = loss_func(batch["loss_mask"], three, _output(module, batch))
    return out[0] / torch.clamp(out[1], min=1) if three else out[0]


def train(config: sdc.SDCConfig | None, *, tp: int = 1, steps: int = 4, micro: int = 1, distopt: bool = True,
          bf16: bool = False, dropout: float = 0.1, recompute: str | None = None, three: bool = False,
          flip: tuple[int, int] | None = None, perturb: tuple[int, int] | None = None,
          nan_at: tuple[int, int] | None = None, wrong_update: tuple[int, int] | None = None,
          at_rest: tuple[int, int, str] | None = None, refuse: str | None = None, evaluate: str | None = None
          ) -> dict[str, Any]:
    """``steps`` optimizer steps of ``micro`` micro-batches each; ``config`` None trains without the monitor.
    ``distopt``: Megatron's distributed optimizer (else its replicated one); ``recompute``: Megatron's activation
    recomputation ("full"); ``three``: loss_func returns (sum, tokens, report). Faults, each (rank, step):
    ``flip`` a bit of the first MLP's weight; ``perturb`` the first MLP's output by 1e-3; ``nan_at`` (dp rank,
    micro-batch) a NaN in its loss mask; ``wrong_update`` a faulty optimizer kernel on that rank from that step on;
    ``at_rest`` (rank, step, what): a bit of that rank's first optimizer tensor (``"param"``) or of its first Adam
    moment (``"exp_avg"``) flipped before step ``step``'s forward pass. ``refuse``: what SDCMegatron says of a
    configuration it does not support. ``evaluate``: after each update, an evaluation pass through the same
    ``forward_step`` (``forward_only`` in eval mode), under ``torch.no_grad()`` (``"no_grad"``, as Megatron-LM
    evaluates) or with gradients on (``"grad"``)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from sdc_telemetry.megatron import SDCMegatron

    _groups(tp)
    model_parallel_cuda_manual_seed(123)  # the same initial weights on every data-parallel rank
    gpt = _megatron_cpu.tiny_gpt(tp=tp, dropout=dropout, recompute=recompute, bf16=bf16, vocab=VOCAB, seq=SEQ)
    module = Float16Module(gpt.config, gpt) if bf16 else gpt
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distopt, bucket_size=3000,
                                               grad_reduce_in_fp32=bf16, overlap_param_gather=refuse == "overlap",
                                               overlap_grad_reduce=refuse == "overlap")
    ddp = DistributedDataParallel(gpt.config, ddp_config, module)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, bf16=bf16,
                                                 use_distributed_optimizer=distopt), [ddp])
    gpt.config.finalize_model_grads_func = finalize_model_grads
    gpt.config.no_sync_func = ddp.no_sync
    if refuse is not None:
        return _refused(ddp, opt, refuse, SDCMegatron)
    rank, dp_rank = dist.get_rank(), parallel_state.get_data_parallel_rank()
    counter = ResultCounter()
    run = None if config is None else SDCMegatron(ddp, opt, loss_fn=partial(replay_loss, three), config=config,
                                                  observer=counter)
    torch_opt = opt.chained_optimizers[0].optimizer
    faults = FaultInjector(gpt, torch_opt)
    if flip is not None:
        faults.flip_weight_bit(rank=flip[0], step=flip[1], param="decoder.layers.0.mlp.linear_fc1.weight", index=5,
                               bit=27)
    if perturb is not None:
        faults.perturb_output(rank=perturb[0], step=perturb[1], module="decoder.layers.0.mlp", relative=1e-3)
    if wrong_update is not None:
        faults.corrupt_update(rank=wrong_update[0], step=wrong_update[1], index=7, relative=1e-3)
    handle = None
    current = [0]
    if at_rest is not None and rank == at_rest[0]:
        held = torch_opt.param_groups[0]["params"][0]

        def corrupt(*_: Any) -> None:
            if current[0] == at_rest[1] and "at rest" not in faults.fired:
                flip_bit(held if at_rest[2] == "param" else torch_opt.state[held][at_rest[2]], 3, 22)
                faults.fired.append("at rest")

        handle = gpt.register_forward_pre_hook(corrupt)

    def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        batch = next(data_iterator)
        if run is not None:
            run.micro_batch(batch)
        fn = partial(loss_func, batch["loss_mask"], three)
        return _output(model, batch), (run.loss_func(fn) if run is not None else fn)

    forward_backward = get_forward_backward_func()
    data = batches(dp_rank, steps * micro, nan_at)
    raised, updates = None, 0
    try:
        for step in range(steps):
            current[0] = step
            ddp.zero_grad_buffer()
            opt.zero_grad()
            forward_backward(forward_step_func=forward_step, data_iterator=iter(data[step * micro:(step + 1) * micro]),
                             model=[ddp], num_microbatches=micro, seq_length=SEQ, micro_batch_size=MICRO)
            if run is None or run.finite:
                opt.step()
                updates += 1
            if evaluate:
                ddp.eval()
                with torch.no_grad() if evaluate == "no_grad" else contextlib.nullcontext():
                    forward_backward(forward_step_func=forward_step, data_iterator=iter(data[:1]), model=[ddp],
                                     num_microbatches=1, seq_length=SEQ, micro_batch_size=MICRO, forward_only=True)
                ddp.train()
    except sdc.SDCDetected as e:
        raised = e
    finally:
        if run is not None:
            run.close()
        faults.close()
        if handle is not None:
            handle.remove()
    final = [p.detach().float() for p in gpt.parameters()]
    out: dict[str, Any] = {"weights": sdc.fingerprint(final).tolist(), "updates": updates, "fired": faults.fired,
                           "weights_finite": all(bool(torch.isfinite(p).all()) for p in final),
                           "restored": not {"finish_grad_sync", "zero_grad_buffer"} & set(vars(ddp))}
    if run is None:
        return out
    return summary(run.incidents, counter, raised, global_step=updates, closed=run.monitor.closed,
                   layout=run.monitor.layout.describe(), verdicts=[i.evidence.get("verdict") for i in run.incidents],
                   evidence=[i.evidence for i in run.incidents], **out)


def _refused(ddp: Any, opt: Any, what: str, cls: Any) -> dict[str, Any]:
    if what == "fusion":  # its CUDA kernel cannot be built here: the setting as a job with it reads
        ddp.config.gradient_accumulation_fusion = True
    try:
        cls(ddp, opt, loss_fn=partial(replay_loss, False), config=sdc.SDCConfig(metrics_port=None, nvml=False)).close()
        refused = ""
    except (TypeError, ValueError) as e:
        refused = str(e)
    finally:
        ddp.config.gradient_accumulation_fusion = False
    return {"refused": refused}


def run(rank: int, world: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    _megatron_cpu.install()
    return each_in_turn(train, runs)
