"""Rank side of the Accelerate tests: several loops written as Accelerate's users write them, in one process group.

Each run builds its own ``Accelerator`` (Accelerate's state is a per-process singleton: it is reset between runs,
the process group is kept) and trains a small MLP with dropout through ``accelerator.accumulate``,
``accelerator.backward`` and the prepared optimizer, with ``SDCAccelerate`` attached (or not, for the baseline the
healthy run must reproduce bit for bit).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch import nn

import sdc_telemetry as sdc
from sdc_telemetry.accelerate import SDCAccelerate
from sdc_telemetry.faults import FaultInjector

from ._ranks import ResultCounter, batches, each_in_turn, summary

Batch = tuple[torch.Tensor, torch.Tensor]


def compute_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x).float(), y)


def train(config: sdc.SDCConfig | None, *, steps: int = 4, accumulate: int = 2, mixed_precision: str = "no",
          scaler: bool = False, fsdp2: bool = False, flip: tuple[int, int] | None = None,
          perturb: tuple[int, int] | None = None, nan_at: tuple[int, int] | None = None,
          skip_nonfinite: bool = False) -> dict[str, Any]:
    """One training loop of ``steps`` optimizer steps of ``accumulate`` micro-batches each; ``config`` None trains
    without the monitor. ``flip``/``perturb``: (rank, step) of a weight bit flip / a 1e-3 compute fault in the first
    layer's output; ``nan_at``: (rank, micro-batch index) of a NaN in the data."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    plugin = None
    if fsdp2:
        from accelerate.utils import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulate, mixed_precision=mixed_precision,
                              fsdp_plugin=plugin)
    if fsdp2:
        # Accelerate enables its FSDP plugin only on GPU process types (not MULTI_CPU): set the state it would have
        # set on GPUs, so that prepare() runs its real FSDP2 path (fully_shard on a 1-D mesh) on the gloo ranks.
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType

        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # AcceleratorState reads it back
    if scaler:
        # fp16 mixed precision's GradScaler, which Accelerate only makes on a GPU: the same object on the CPU path
        # (scaled backward, unscale and skip in the optimizer's step), so the replay must reproduce the scaling.
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    torch.manual_seed(0)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 32), nn.GELU(),
                        nn.Linear(32, 4))
    model, optimizer = accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    rank = dist.get_rank()
    counter = ResultCounter()
    run = None if config is None else SDCAccelerate(accelerator, model, optimizer, loss_fn=compute_loss,
                                                    config=config, observer=counter,
                                                    skip_nonfinite=skip_nonfinite)
    faults = FaultInjector(model, optimizer.optimizer)  # the torch optimizer inside AcceleratedOptimizer
    if flip is not None:  # under FSDP2, an element of that rank's shard
        faults.flip_weight_bit(rank=flip[0], step=flip[1], param="0.weight", index=5, bit=27)
    if perturb is not None:
        faults.perturb_output(rank=perturb[0], step=perturb[1], module="0", relative=1e-3)
    raised = None
    updates = 0
    try:
        for batch in batches(rank, steps * accumulate, nan_at):
            with accelerator.accumulate(model):
                if run is not None:
                    run.micro_batch(batch)
                loss = compute_loss(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    updates += 1
                    if run is not None and not run.finite:
                        faults.skipped_update()
                optimizer.step()
                optimizer.zero_grad()
    except sdc.SDCDetected as e:
        raised = e
    finally:
        if run is not None:
            run.close()
        faults.close()
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in net.parameters()]
    weights = sdc.fingerprint([p.detach() for p in params]).tolist()
    out: dict[str, Any] = {"weights": weights, "updates": updates, "model_type": type(model).__name__,
                           "weights_finite": all(bool(torch.isfinite(p).all()) for p in params),
                           "backward_restored": "backward" not in vars(accelerator)}
    if run is None:
        return out
    return summary(run.incidents, counter, raised, global_step=updates, closed=run.monitor.closed,
                   verdicts=[i.evidence.get("verdict") for i in run.incidents], **out)


def run(rank: int, world: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    return each_in_turn(train, runs)
