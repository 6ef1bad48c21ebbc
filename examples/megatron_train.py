"""Megatron-core training with sdc_telemetry: the loop as Megatron-core's users write it (a ``GPTModel`` in its
``DistributedDataParallel``, ``get_megatron_optimizer``, the schedule of ``get_forward_backward_func()`` with
``finalize_model_grads``, then ``optimizer.step()``), plus two lines in ``forward_step``.

    python -m torch.distributed.run --nproc-per-node 4 --standalone examples/megatron_train.py --steps 8 --tp 2

It runs on GPUs (one per rank): Megatron-core assumes CUDA; the project's tests run it on CPU gloo ranks through a
small run-time shim of theirs. ``--tp N``: tensor parallelism over N ranks, data
parallelism over the rest; ``--replicated-optimizer``: Megatron's optimizer without its distributed (sharded) form.
``--nan-at STEP`` puts a NaN into the loss mask of the last data-parallel rank's micro-batch at step STEP (bad data:
verdict ``data``, nobody named; the loop skips that update and goes on). ``--wrong-update STEP`` makes the last
rank's optimizer kernel write one element of its slice 1e-3 off from step STEP on (a faulty unit no other rank sees:
the distributed optimizer all-gathers the wrong value into every replica): the update audit names that rank and every
rank leaves with exit code 75.
"""

from __future__ import annotations

import argparse
import os
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

import sdc_telemetry as sdc
from sdc_telemetry.faults import FaultInjector
from sdc_telemetry.megatron import SDCMegatron

SEQ, VOCAB, MICRO_BATCH = 32, 128, 4


Loss = tuple[torch.Tensor, torch.Tensor, dict[str, Any]]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> Loss:
    """Megatron's form: the masked token losses' sum and the token count (the schedule divides)."""
    total = torch.sum(output_tensor.float().view(-1) * loss_mask.view(-1))
    return total, loss_mask.sum().to(torch.int), {"lm loss": total.detach()}


def replay_loss(module: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One micro-batch's loss for the replay, as the schedule divides it by its token count."""
    output = module(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    total, tokens, _ = loss_func(batch["loss_mask"], output)
    return total / torch.clamp(tokens, min=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--replicated-optimizer", action="store_true")
    parser.add_argument("--nan-at", type=int, default=None, metavar="STEP")
    parser.add_argument("--wrong-update", type=int, default=None, metavar="STEP")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    model_parallel_cuda_manual_seed(1234)  # the same initial weights on every data-parallel rank
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=not cuda,
                               tensor_model_parallel_size=args.tp, hidden_dropout=0.1, attention_dropout=0.1,
                               gradient_accumulation_fusion=False, pipeline_dtype=torch.float32)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                   max_sequence_length=SEQ)
    distributed = not args.replicated_optimizer
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=distributed), gpt)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01,
                                                       use_distributed_optimizer=distributed), [ddp])
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync

    run = SDCMegatron(ddp, optimizer, loss_fn=replay_loss,
                      config=sdc.SDCConfig.from_env(replay_every=4, on_suspect="raise"))
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    if args.wrong_update is not None:  # a test of the update audit: the torch optimizer inside Megatron's, one rank
        FaultInjector(gpt, optimizer.chained_optimizers[0].optimizer).corrupt_update(
            rank=world - 1, step=args.wrong_update, index=3)
    gen = torch.Generator().manual_seed(100 + dp_rank)  # the tensor-parallel ranks of a replica read the same data

    def batches(step: int) -> list[dict[str, torch.Tensor]]:
        out = []
        for _ in range(args.micro_batches):
            tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=gen)
            mask = torch.ones(MICRO_BATCH, SEQ)
            if step == args.nan_at and dp_rank == dp - 1 and not out:
                mask[0, 0] = float("nan")  # bad data in one rank's micro-batch
            batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask,
                     "position_ids": torch.arange(SEQ).expand(MICRO_BATCH, SEQ)}
            out.append({k: v.contiguous().to("cuda" if cuda else "cpu") for k, v in batch.items()})
        return out

    def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        batch = next(data_iterator)
        run.micro_batch(batch)                                     # before the forward pass: the replay's input
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return output, run.loss_func(partial(loss_func, batch["loss_mask"]))   # the loss recorded as it is returned

    forward_backward = get_forward_backward_func()
    updates = 0
    with sdc.exit_on_sdc(run):
        for step in range(args.steps):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            forward_backward(forward_step_func=forward_step, data_iterator=iter(batches(step)), model=[ddp],
                             num_microbatches=args.micro_batches, seq_length=SEQ, micro_batch_size=MICRO_BATCH)
            if run.finite:   # the same answer on every rank: a bad batch's update is skipped everywhere
                optimizer.step()
                updates += 1
    run.close()
    if rank == 0:
        verdicts = [(i.step, i.check, i.evidence.get("verdict"), list(i.suspect_ranks)) for i in run.incidents]
        print(f"{args.steps} steps ({updates} updates) at tp={args.tp} dp={dp}; incidents: {verdicts}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
