"""Rank side of the DeepSpeed tests: loops written as DeepSpeed's users write them (``deepspeed.initialize``,
``engine(batch)``, ``engine.backward(loss)``, ``engine.step()`` after every micro-batch), in one process group.

Each run builds its own engine on the already initialised gloo group (DeepSpeed's CPU accelerator) and trains a small
MLP with dropout under ZeRO stage 0, 1 or 2, with ``SDCDeepSpeed`` attached (or not, for the baseline the healthy run
must reproduce bit for bit). Faults are planned on the module and on the torch optimizer inside ZeRO, whose
parameters are this rank's fp32 partitions.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import sdc_telemetry as sdc
from sdc_telemetry.deepspeed import SDCDeepSpeed
from sdc_telemetry.faults import FaultInjector, flip_bit

from ._ranks import ResultCounter, batches, each_in_turn, summary

Batch = tuple[torch.Tensor, torch.Tensor]


def compute_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x.to(next(model.parameters()).dtype)).float(), y)


def _config(stage: int, accumulate: int, bf16: bool) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": accumulate,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
            # stage 3: every parameter partitioned and gathered by DeepSpeed's hooks (none kept whole as "persistent")
            "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0,
                                                      "stage3_gather_16bit_weights_on_model_save": True}
                                                     if stage == 3 else {})},
            "bf16": {"enabled": bf16}, "steps_per_print": 10**6,
            "wall_clock_breakdown": False}


def train(config: sdc.SDCConfig | None, *, stage: int = 2, steps: int = 4, accumulate: int = 1, bf16: bool = False,
          groups: int = 1, flip: tuple[int, int] | None = None, perturb: tuple[int, int] | None = None,
          nan_at: tuple[int, int] | None = None, wrong_update: tuple[int, int] | None = None,
          at_rest: tuple[int, int, str] | None = None, refuse: int | None = None,
          certify: str | None = None, reentrant: bool = False) -> dict[str, Any]:
    """``steps`` optimizer steps of ``accumulate`` micro-batches each; ``config`` None trains without the monitor.
    ``groups`` 2: weight decay on the weights only (two parameter groups, which ZeRO steps one at a time).
    Faults, each (rank, step): ``flip`` a bit of the module's first-layer weight; ``perturb`` the first layer's
    output by 1e-3; ``nan_at`` (rank, micro-batch) a NaN sample; ``wrong_update`` a faulty optimizer kernel on that
    rank from that step on; ``at_rest`` (rank, step, what) a bit of that rank's fp32 partition (``"param"``) or of
    its first Adam moment (``"exp_avg"``) flipped before step ``step``'s forward pass. ``refuse``: build a bf16
    engine at that ZeRO stage and return what SDCDeepSpeed says of it. ``reentrant``: the model under reentrant
    activation checkpointing. ``certify``: a directory: after training,
    certify the weights (every rank), save DeepSpeed's checkpoint there (ZeRO-3: its 16-bit consolidated model too)
    and verify what was saved against the certificate."""
    import deepspeed

    if refuse is not None:
        return _refused(refuse)

    torch.manual_seed(0)  # the same initial weights on every rank
    net: nn.Module = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 32), nn.GELU(),
                                   nn.Linear(32, 4))
    if reentrant:
        net = _Reentrant(net)  # type: ignore[arg-type]
    params: Any = net.parameters()
    if groups == 2:
        params = [{"params": [p for n, p in net.named_parameters() if n.endswith("weight")]},
                  {"params": [p for n, p in net.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=params,
                                           config=_config(stage, accumulate, bf16))
    rank = dist.get_rank()
    counter = ResultCounter()
    run = None if config is None else SDCDeepSpeed(engine, loss_fn=compute_loss, config=config, observer=counter)
    zero = engine.optimizer if stage else None
    torch_opt = zero.optimizer if zero is not None else engine.optimizer
    faults = FaultInjector(engine.module, torch_opt)
    if flip is not None:
        faults.flip_weight_bit(rank=flip[0], step=flip[1], param="0.weight", index=5, bit=27)
    if perturb is not None:
        faults.perturb_output(rank=perturb[0], step=perturb[1], module="0", relative=1e-3)
    if wrong_update is not None:
        faults.corrupt_update(rank=wrong_update[0], step=wrong_update[1], index=7, relative=1e-3)
    handle = None
    current = [0]  # the loop's step (the injector counts the torch optimizer's steps: one per group under ZeRO)
    if at_rest is not None and rank == at_rest[0]:
        assert zero is not None
        part = (zero.fp32_partitioned_groups_flat if stage == 3 else zero.single_partition_of_fp32_groups)[0]

        def corrupt(*_: Any) -> None:
            if current[0] == at_rest[1] and "at rest" not in faults.fired:
                target = part if at_rest[2] == "param" else torch_opt.state[part][at_rest[2]]
                flip_bit(target, 3, 22)
                faults.fired.append("at rest")

        handle = engine.module.register_forward_pre_hook(corrupt)
    raised = None
    updates = 0
    verified: list[str] | None = None
    try:
        for i, batch in enumerate(batches(rank, steps * accumulate, nan_at)):
            current[0] = i // accumulate
            if run is not None:
                run.micro_batch(batch)
            loss = compute_loss(engine, batch)
            engine.backward(loss)
            if (i + 1) % accumulate == 0:
                updates += 1
            engine.step()
        if certify is not None and run is not None:
            verified = _certify(engine, run, certify, stage)
    except sdc.SDCDetected as e:
        raised = e
    finally:
        if run is not None:
            run.close()
        faults.close()
        if handle is not None:
            handle.remove()
    if stage == 3 and raised is None:  # the module holds empty placeholders: the whole weights, gathered
        from deepspeed.runtime.zero import GatheredParameters

        with GatheredParameters(list(net.parameters())):
            final = [p.detach().float().clone() for p in net.parameters()]
    elif stage == 3:  # a step left before engine.step(): DeepSpeed still holds its modules active; this rank's share
        final = [p.ds_tensor.detach().float() for p in net.parameters()]
    else:
        final = [p.detach().float() for p in net.parameters()]
    weights = sdc.fingerprint(final).tolist()
    out: dict[str, Any] = {"weights": weights, "updates": updates, "fired": faults.fired,
                           "weights_finite": all(bool(torch.isfinite(p).all()) for p in final),
                           "backward_restored": "backward" not in vars(engine), "verified": verified}
    engine.destroy()
    if run is None:
        return out
    return summary(run.incidents, counter, raised, global_step=updates, closed=run.monitor.closed,
                   verdicts=[i.evidence.get("verdict") for i in run.incidents],
                   evidence=[i.evidence for i in run.incidents], **out)


class _Reentrant(nn.Module):
    """The MLP with all but its first layer under reentrant activation checkpointing, as transformer blocks are:
    the checkpoint runs its own backward into .grad and refuses autograd.grad()."""

    def __init__(self, body: nn.Sequential) -> None:
        super().__init__()
        self.first = body[0]
        self.rest = nn.Sequential(*list(body)[1:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.utils.checkpoint.checkpoint(self.rest, self.first(x), use_reentrant=True)
        return out


def _certify(engine: Any, run: SDCDeepSpeed, where: str, stage: int) -> list[str]:
    """Certify (collective), save DeepSpeed's checkpoint, read back the saved module weights and verify them: the
    names of parameters that do not verify, then ``|``, then those of the same weights with one bit flipped."""
    import os

    cert = run.monitor.certificate()
    engine.save_checkpoint(where, tag="last")
    if stage == 3:  # the checkpoint's module holds empty placeholders: DeepSpeed's consolidated 16-bit model instead
        engine.save_16bit_model(where, "model.bin")
    dist.barrier()
    path = os.path.join(where, "model.bin") if stage == 3 else \
        os.path.join(where, "last", "mp_rank_00_model_states.pt")
    saved = torch.load(path, map_location="cpu", weights_only=False)
    weights = saved if stage == 3 else saved["module"]
    intact = cert.verify(weights)
    flip_bit(weights["3.weight"], 7, 30)  # the same checkpoint with one bit changed on disk
    return [*intact, "|", *cert.verify(weights)]


def _refused(stage: int) -> dict[str, Any]:
    import deepspeed

    net = nn.Linear(16, 4)
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                           config=_config(stage, 1, True))
    try:
        SDCDeepSpeed(engine, loss_fn=compute_loss, config=sdc.SDCConfig(metrics_port=None, nvml=False))
        refused = ""
    except (TypeError, ValueError) as e:
        refused = str(e)
    engine.destroy()
    return {"refused": refused}


def run(rank: int, world: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    return each_in_turn(train, runs)
