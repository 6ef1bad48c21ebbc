"""An SDCMonitor in torchtitan's training step: a ``Trainer`` subclass, the way torchtitan is extended.

torchtitan builds the trainer from its config (``config.build()`` constructs the class that owns the ``Config``), so
the integration is a subclass with its own ``Config`` (the trainer's fields plus ``sdc``), overriding the two steps
torchtitan documents as the place where the forward and backward run:

- ``forward_backward_step`` (no pipeline): ``with monitor.step(batch) as step: step.backward(loss)``, where
  ``batch`` holds what one rank's step needs to be recomputed (inputs, labels, positions, the global token count);
- ``pp_forward_backward_step`` (pipeline): the micro-batches torchtitan split are joined into the rank's batch and
  ``step.pipeline_step(inputs, target=labels, ...)`` runs the schedule with it (the schedule splits it again into
  the same micro-batches).

``optimizer.step()`` stays where torchtitan has it (after gradient clipping), outside the ``with`` block; the
monitor hooks the optimizer to count updates. Gradient accumulation (``global_batch_size`` above
``local_batch_size x dp``) is refused: each ``forward_backward_step`` would be a step of its own.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torchtitan.trainer import Trainer

import sdc_telemetry as sdc
from sdc_telemetry.parallel import LayoutError


class CheckCounter(sdc.Observer):
    """Counts each check's results on this rank (what ``sdc_checks_total`` exports)."""

    def __init__(self) -> None:
        self.results: dict[str, dict[str, int]] = {}

    def report(self, report: sdc.StepReport) -> None:
        for check, result in report.results.items():
            per = self.results.setdefault(check, {})
            per[result] = per.get(result, 0) + 1


@dataclass(kw_only=True, slots=True)
class SDCSettings:
    """The monitor's settings in the job config (``--sdc.replay_every 2`` on the command line)."""

    enable: bool = True
    weights_every: int = 1
    replay_every: int = 2
    on_suspect: Literal["record", "raise"] = "record"
    mode: Literal["auto", "exact", "tolerance"] = "auto"
    mesh: Literal["parameters", "dense"] = "parameters"
    """Where the monitor takes the DeviceMesh from: the parameters' DTensors, or torchtitan's dense mesh
    (``parallel_dims``' pp/dp_replicate/fsdp/tp mesh) passed as ``mesh=``."""
    flip_weight_bit_at: int = -1
    """Fire drill: flip one weight bit on ``fault_rank`` just before this step (0-based; -1: never)."""
    perturb_output_at: int = -1
    """Fire drill: a transient compute fault on ``fault_rank`` at this step (``fault_module``'s output x (1 + 1e-3)
    in the step's first forward call)."""
    fault_rank: int = -1
    """The rank the fault hits (-1: the last rank)."""
    fault_param: str = "norm.weight"
    fault_module: str = "norm"
    report: str = ""
    """A folder: each rank writes rank<N>.json there when training ends (checks run, incidents, refusal)."""


class SDCTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        sdc: SDCSettings = field(default_factory=SDCSettings)

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.sdc_settings = s = config.sdc
        self.monitor: sdc.SDCMonitor | None = None
        self.faults: Any = None
        self.refusal: str | None = None
        self.sdc_steps = 0
        if not s.enable:
            return
        if self.gradient_accumulation_steps != 1:
            raise ValueError("SDCTrainer: gradient accumulation is not integrated (global_batch_size must be "
                             "local_batch_size x the data-parallel degree)")
        sdc_config = sdc.SDCConfig(weights_every=s.weights_every, replay_every=s.replay_every,
                                   on_suspect=s.on_suspect, mode=s.mode, metrics_port=None, nvml=False)
        # the rank's stage modules in local stage order under an interleaved or looped schedule, else its one module
        module: Any = self.model_parts[0] if len(self.model_parts) == 1 else torch.nn.ModuleList(self.model_parts)
        self.counter = CheckCounter()
        kwargs: dict[str, Any] = {"config": sdc_config, "observer": self.counter}
        if self.parallel_dims.cp > 1 and (s.mesh == "dense" or self.parallel_dims.pp_enabled):
            # torchtitan's dense mesh folds cp into its fsdp dim: read as data-parallel replicas, the cp ranks would
            # be paired for reruns that do not line up. The monitor needs a mesh that names cp.
            raise ValueError("SDCTrainer: context parallelism with a pipeline (or mesh='dense') is not integrated: "
                             "torchtitan's dense mesh folds cp into fsdp; pass SDCMonitor a world mesh with a 'cp' "
                             "dim (docs/checks.md, context parallelism inside stages)")
        if s.mesh == "dense" or self.parallel_dims.pp_enabled:  # a pipeline's stages take the world mesh
            kwargs["mesh"] = self.parallel_dims._global_meshes["dense"]
        if self.parallel_dims.pp_enabled:
            kwargs["pipeline"] = self.pp_schedule
        else:
            kwargs["loss_fn"] = self._replay_loss
        self._plan_faults(module)
        try:
            self.monitor = sdc.SDCMonitor(module, self.optimizers, **kwargs)
        except (LayoutError, TypeError, ValueError) as e:
            self.refusal = f"{type(e).__name__}: {e}"
            self._write_report()
            raise

    # -- faults (fire drills) ------------------------------------------------------------------------------------

    def _plan_faults(self, module: torch.nn.Module) -> None:
        """The fire drills asked for, planned on ``fault_rank`` only (its module must hold the named parameter or
        submodule: a pipeline stage holds its own layers only, ``norm`` is on the last stage)."""
        s = self.sdc_settings
        if s.flip_weight_bit_at < 0 and s.perturb_output_at < 0:
            return
        from sdc_telemetry.faults import FaultInjector

        rank = s.fault_rank if s.fault_rank >= 0 else torch.distributed.get_world_size() - 1
        self.faults = FaultInjector(module, self.optimizers)
        if torch.distributed.get_rank() != rank:
            return
        if s.flip_weight_bit_at >= 0:
            self.faults.flip_weight_bit(rank=rank, step=s.flip_weight_bit_at, param=s.fault_param, index=3, bit=22)
        if s.perturb_output_at >= 0:  # transient: the first forward of that step only, so a rerun is clean
            self.faults.perturb_output(rank=rank, step=s.perturb_output_at, module=s.fault_module, relative=1e-3,
                                       transient=True)

    # -- the monitored steps --------------------------------------------------------------------------------------

    def _replay_loss(self, module: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss of one rank's step, exactly as ``_forward_backward_body`` computes it (no backward)."""
        with self.train_context():
            pred = module(batch["input"], positions=batch["positions"])
            loss, _ = self.loss_fn(pred, batch["labels"], batch["global_valid_tokens"],
                                   positions=batch["positions"])
        return loss

    def forward_backward_step(self, *, input_dict: Any, labels: Any, global_valid_tokens: torch.Tensor
                              ) -> torch.Tensor:
        if self.monitor is None:
            return super().forward_backward_step(input_dict=input_dict, labels=labels,
                                                 global_valid_tokens=global_valid_tokens)
        if self.parallel_dims.pp_enabled:
            return self.pp_forward_backward_step(input_dict_mbs=input_dict, label_mbs=labels,
                                                 global_valid_tokens=global_valid_tokens)
        inputs, labels, extra = self.post_dataloading_process(input_dict, labels)
        if set(extra) != {"positions"}:
            raise ValueError(f"SDCTrainer: model inputs {sorted(extra)} are not integrated (positions only)")
        batch = {"input": inputs, "labels": labels, "positions": extra["positions"],
                 "global_valid_tokens": global_valid_tokens}
        with self.monitor.step(batch) as step:
            loss = self._replay_loss(self.model_parts[0], batch)
            with self.train_context():
                step.backward(loss)
        self.sdc_steps += 1
        return loss.detach()

    def pp_forward_backward_step(self, *, input_dict_mbs: list[dict[str, torch.Tensor]],
                                 label_mbs: list[torch.Tensor], global_valid_tokens: torch.Tensor) -> torch.Tensor:
        if self.monitor is None:
            return super().pp_forward_backward_step(input_dict_mbs=input_dict_mbs, label_mbs=label_mbs,
                                                    global_valid_tokens=global_valid_tokens)
        parts = [self.post_dataloading_process(d, lab) for d, lab in zip(input_dict_mbs, label_mbs, strict=True)]
        if any(set(extra) != {"positions"} for _, _, extra in parts):
            raise ValueError("SDCTrainer: model inputs other than positions are not integrated")
        inputs = torch.cat([p[0] for p in parts])
        labels = torch.cat([p[1] for p in parts])
        positions = torch.cat([p[2]["positions"] for p in parts])
        batch = {"input": inputs, "labels": labels, "positions": positions,
                 "global_valid_tokens": global_valid_tokens}
        # torchtitan's train context (loss parallelism under tp) around the whole block: the step's end reruns the
        # schedule for the replay, and that rerun must compute the loss as the step did
        with self.train_context(), self.monitor.step(batch) as step:
            losses = step.pipeline_step(inputs, target=labels, positions=positions,
                                        loss_kwargs={"global_valid_tokens": global_valid_tokens})
        self.sdc_steps += 1
        if self.pp_has_last_stage:
            assert losses is not None
            return torch.sum(torch.stack(losses)).to(self.device)
        return torch.tensor([-1.0], device=self.device)

    # -- the end ---------------------------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """What the monitor did on this rank, JSON-serialisable."""
        out: dict[str, Any] = {"rank": torch.distributed.get_rank(), "steps": self.step,
                               "monitored_steps": self.sdc_steps, "refusal": self.refusal,
                               "faults_fired": list(self.faults.fired) if self.faults is not None else []}
        m = self.monitor
        if m is not None:
            out["layout"] = getattr(m.layout, "name", type(m.layout).__name__)
            out["checks"] = self.counter.results
            out["incidents"] = [{"step": i.step, "check": i.check, "suspect_ranks": list(i.suspect_ranks),
                                 "coordinate": i.evidence.get("coordinate"),
                                 "coordinates": i.evidence.get("coordinates"),
                                 "verdict": i.evidence.get("verdict"), "stage": i.evidence.get("stage")}
                                for i in m.incidents]
            out["describe"] = m.layout.describe()
        return out

    def _write_report(self) -> None:
        if self.sdc_settings.report:
            os.makedirs(self.sdc_settings.report, exist_ok=True)
            path = os.path.join(self.sdc_settings.report, f"rank{torch.distributed.get_rank()}.json")
            with open(path, "w") as f:
                json.dump(self.summary(), f, indent=1, default=str)

    def close(self) -> None:
        try:
            if self.monitor is not None and not self.monitor.closed:
                self._write_report()
                self.monitor.close()
            if self.faults is not None:
                self.faults.close()
        finally:
            super().close()

