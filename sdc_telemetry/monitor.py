"""SDCMonitor: drives one training step through the checks and hands one result to the sinks.

The per-step path, in this file, reads straight::

    open_step -> (backward: the layout's tap measures local gradients) -> end_step:
      measure (thin tensor code)  ->  one agreement (all-reduce of the fixed-size status vector, MAX/MIN)
      ->  decide (pure; per-rank detail gathered only when a field disagrees)  ->  replay on audit steps
      ->  episodes (incidents)  ->  one StepReport  ->  sinks (telemetry, incident log, pager)
      ->  SDCDetected on every rank, if configured

The monitor never asks what kind of model it has: its Layout (``sdc_telemetry.parallel``) says where gradients are
read, which ranks hold replicas of which tensor, and how a replica recomputes a micro-batch.

Every collective runs at the end of ``with monitor.step()`` (or ``StepContext.end()``), a point every rank reaches
before ``optimizer.step()``: a GradScaler that skips the update on one rank, or a loop that skips a step on a bad
loss, cannot make the ranks' collectives diverge.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from sdc_telemetry.checks import at_rest
from sdc_telemetry.checks import grad as grad_check
from sdc_telemetry.checks import update as update_check
from sdc_telemetry.checks.at_rest import AtRestCheck
from sdc_telemetry.checks.outliers import OutlierTrigger
from sdc_telemetry.checks.pairing import plan_pairs
from sdc_telemetry.checks.replay import ReplayCheck, pipeline_loss
from sdc_telemetry.checks.triggers import TriggeredAudits
from sdc_telemetry.checks.update import UpdateAudit
from sdc_telemetry.checks.weights import WeightsCheck
from sdc_telemetry.core import status as S
from sdc_telemetry.core.certificate import WeightCertificate, format_fingerprint
from sdc_telemetry.core.collective import collective_device
from sdc_telemetry.core.config import SDCConfig
from sdc_telemetry.core.episodes import Episodes
from sdc_telemetry.core.findings import Finding
from sdc_telemetry.core.fingerprint import fingerprint
from sdc_telemetry.core.identity import RankIdentity, numerics_signature
from sdc_telemetry.core.incident import Incident, SDCDetected, root_cause
from sdc_telemetry.core.setup import agree_setup
from sdc_telemetry.measure import Measured, StepMeasurer
from sdc_telemetry.parallel import LayoutError, layout_for
from sdc_telemetry.sinks import Sinks
from sdc_telemetry.sinks.observer import Observer, ReplayDeltas, StepReport
from sdc_telemetry.step import NO_BATCH, StepContext

__all__ = ["SDCMonitor"]

log = logging.getLogger("sdc_telemetry")

#: the most host bytes one update audit copies on a rank (its slice: parameters, gradients and optimizer state)
UPDATE_SLICE_BYTES = 256 * 2**20

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


class SDCMonitor:
    """Silent-data-corruption checks for a training loop: DDP or FSDP2/HSDP across ranks, or a plain module in one
    process.

    >>> monitor = SDCMonitor(ddp_model, optimizer, loss_fn=compute_loss,            # doctest: +SKIP
    ...                      config=SDCConfig(weights_every=1, replay_every=50, on_suspect="raise"))
    >>> for batch in loader:                                                        # doctest: +SKIP
    ...     with monitor.step(batch) as step:
    ...         step.backward(compute_loss(ddp_model, batch))
    ...     optimizer.step()
    ...     optimizer.zero_grad()
    >>> monitor.close()                                                             # doctest: +SKIP

    Construction, the end of every step, ``verify_weights()`` and ``certificate()`` are collective: every rank of
    the replica group calls them in the same order. ``start_step`` is the index of the first step (resume).
    ``replica_group`` defaults to the DDP model's process group. ``pipeline`` is a ``torch.distributed.pipelining``
    schedule; ``model`` is then the rank's stage module, or its stage modules in local stage order (a list or
    ``nn.ModuleList``) under an interleaved or looped schedule. ``mesh`` is the world DeviceMesh of an N-D model
    (tensor/context parallelism with FSDP2/HSDP, torchtitan's dim names); by default it comes from the parameters.
    If the model already needs a comm hook, pass it as
    ``comm_hook=`` (with ``comm_state=``) instead of registering it: the monitor wraps it. ``sinks`` replaces what
    the config would build (``sdc_telemetry.sinks.Sinks``); ``observer`` replaces only the telemetry, and
    ``registry``, ``meter_provider`` and ``nvml`` are handed to the telemetry the config builds.
    """

    def __init__(self, model: torch.nn.Module | Sequence[torch.nn.Module], optimizer: torch.optim.Optimizer,
                 loss_fn: LossFn | None = None, config: SDCConfig | None = None, *, start_step: int = 0,
                 replica_group: dist.ProcessGroup | None = None, comm_hook: Any = None, comm_state: Any = None,
                 mesh: Any = None, pipeline: Any = None, sinks: Sinks | None = None,
                 observer: Observer | None = None, registry: Any = None,
                 meter_provider: Any = None, nvml: Any = None) -> None:
        self._closed = True  # until construction succeeds: close() then does nothing
        self.layout = layout = layout_for(model, replica_group=replica_group, comm_hook=comm_hook,
                                          comm_state=comm_state, mesh=mesh, pipeline=pipeline)
        optimizer = layout.torch_optimizer(optimizer)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step must be an int >= 0 (the index of the first step), got {start_step!r}")
        self.config = config if config is not None else SDCConfig.from_env()
        if not isinstance(self.config, SDCConfig):
            raise TypeError(f"config must be an SDCConfig, got {type(self.config).__name__}")
        if sinks is not None and observer is not None:
            raise ValueError("pass sinks= or observer=, not both (sinks= carries its own observer)")
        self.model, self.module, self.optimizer = model, layout.module, optimizer
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no parameters that require gradients: nothing to check")
        meta = [n for n, p in named if getattr(p, "_local_tensor", p).is_meta]
        if meta:
            raise ValueError(f"the model's parameters are on the meta device ({meta[0]!r} and {len(meta) - 1} more): "
                             "materialize them (model.to_empty(device=...) and initialize) before building the "
                             "monitor")
        embeddings = (torch.nn.Embedding, torch.nn.EmbeddingBag)
        sparse = [n for n, m in layout.module.named_modules() if isinstance(m, embeddings) and m.sparse
                  and any(p.requires_grad for p in m.parameters(recurse=False))]
        if sparse:
            raise ValueError(f"module {sparse[0]!r} makes sparse gradients (sparse=True), which the gradient checks "
                             "and fingerprints do not read: build it with sparse=False")
        self._params = [p for _, p in named]
        self._names = [n for n, _ in named]
        self.device = self._params[0].device
        self.rank, self._ranks, self._world = layout.rank, layout.ranks, layout.world
        self._writer = layout.position == 0
        replicas = layout.replicas
        if replicas and self.config.replay_every and any(isinstance(m, torch.nn.SyncBatchNorm)
                                                         for m in self.module.modules()):
            raise ValueError("SyncBatchNorm computes its statistics across ranks, so a replay of one rank's "
                             "micro-batch cannot reproduce it; set SDCConfig(replay_every=0) for this model")
        if replicas and self.config.replay_every and loss_fn is None and not layout.pipelined:
            raise ValueError(f"SDCConfig.replay_every={self.config.replay_every} needs loss_fn= (called as "
                             "loss_fn(module, batch) -> scalar loss to recompute a step); pass it, or set "
                             "replay_every=0")

        self.identity = RankIdentity.local(self.device if self.device.type == "cuda" else None)
        self.sinks = sinks if sinks is not None else Sinks.from_config(
            self.config, self.identity, writer=self._writer, observer=observer, registry=registry,
            meter_provider=meter_provider, nvml=nvml)
        self.sinks.rank = self.rank
        try:
            classes, self.mode = agree_setup(layout.group, layout.distributed, self.config, start_step,
                                             numerics_signature(self.device), self.device, self.sinks.log_error)
            gathered = layout.gather_objects(self.identity)
        except BaseException:
            self.sinks.close()  # nothing keeps a port or a file open after a failed construction
            raise
        self.identities: dict[int, RankIdentity] = {i.rank: i for i in gathered if isinstance(i, RankIdentity)}
        self.incidents: list[Incident] = []
        self._episodes = Episodes(self.incidents)

        # Every parameter, frozen ones included (LoRA-style fine-tuning freezes most weights; they must still agree),
        # each read as this rank holds it, among the ranks that hold the same tensor.
        every = list(self.module.named_parameters())
        voted_state = optimizer if update_check.unsupported(optimizer) is None and layout.optimizer_replicas else None
        self._weights = WeightsCheck(every, layout.group, self._ranks, layout.weight_classes(classes),
                                     local=layout.local, optimizer=voted_state) if layout.weight_replicas else None
        # Sharded replicas compare their digests within each shard's replica group first, so that the step's
        # agreement has the same size at any mesh (core/status.py).
        self._digest_group = layout.digest_group if self._weights is not None and layout.digest_keys else None
        if self._weights is not None and layout.digest_keys and self._digest_group is None:
            raise LayoutError(f"the {layout.name} layout holds replicas of sharded tensors but names no process group "
                              "of a shard's replicas (Layout.digest_group) to compare their weights in")
        # Each rank's own tensors between the update and the weight check: where no replica holds them, and to
        # referee two replicas (checks/at_rest.py).
        updated, of_module = layout.updated(every, optimizer)
        read = layout.local if of_module else _as_held
        self._at_rest = AtRestCheck([n for n, _ in updated], [p for _, p in updated], optimizer, read,
                                    table_rows=of_module) if self.config.weights_every else None
        self._update = self._plan_update_audit(optimizer, updated, classes, read, own=not of_module)
        reason = layout.weights_off_reason()
        if replicas and reason and self.config.weights_every and self._writer:
            log.warning("sdc_telemetry: %s; the at-rest check still compares each rank's own shards between the "
                        "update and the weight check", reason)
        triggers = self.config.trigger_audits and self.config.grad_checks
        self._replay = ReplayCheck(self.module, loss_fn, named, layout.group, self._ranks, self.identities,
                                   self.device, self.mode, self.config.tolerance, self.config.replay_every,
                                   recompute=layout.recompute if layout.lockstep else None, every_step=triggers,
                                   units=layout.replay_units(), rerun=getattr(layout, "rerun", None),
                                   classes=classes, outputs=layout.stage_outputs(),
                                   grad_fields=layout.grad_fields, quiet=layout.recomputing,
                                   rng=(layout.rng_state, layout.set_rng_state),
                                   into=layout.accumulates_in(self._params)) \
            if replicas and (self.config.replay_every or triggers) and (loss_fn is not None or layout.pipelined) \
            else None
        if self._replay is not None and self._replay.alone and self._writer:
            log.warning("sdc_telemetry: rank(s) %s alone in their numerics class (device model, software stack or "
                        "kernel settings): no other rank computes the same bits, so replay cannot audit them (each "
                        "reruns its own micro-batches: a transient fault shows, a persistent one does not); their "
                        "gradients and weights are still checked", self._replay.alone[:16])
        self._record = grad_check.GradRecord(self._params, self.device)
        self._record.sketching = self.mode == "tolerance"
        self._outliers = OutlierTrigger() if triggers and self._replay is not None else None
        self._triggered = TriggeredAudits(self._replay, self.rank, lambda key, text: self._warn_once(
            key, "sdc_telemetry: %s", text)) if triggers and self._replay is not None else None
        self._loss: torch.Tensor | None = None  # the step's loss (sum over micro-batches of loss * scale), on device
        self._grad = grad_check.GradCheck(self._ranks, self.rank, self._names, layout.reduces, layout.reduced_shards,
                                          gather=lambda row: layout.gather_rows(row, self.device),
                                          gather_objects=layout.gather_objects)
        self._measurer = StepMeasurer(layout, self.config, self._params, self.device, self._record, self._weights,
                                      self._replay, self._outliers, self._internal_error, at_rest=self._at_rest,
                                      digest_group=self._digest_group)
        layout.install(self._record, reduced_checks=self.config.grad_checks)
        self._handles = [optimizer.register_step_post_hook(self._after_update)]
        if self._update is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._before_update))

        self._next_step = start_step
        self._first_step = start_step
        self._step = start_step - 1
        self._pending: Measured | None = None
        # verdicts="deferred": healthy verdicts are read one step later, with no host wait (the same on every rank);
        # the previous step's record stays referenced until then, for a late triggered audit.
        self._defer_verdicts = self.config.verdicts == "deferred"
        if self._replay is not None:
            self._replay.keep_previous = self._defer_verdicts
        self._ended: Measured | None = None  # the last ended step's measurement (``step.finite`` reads it)
        self._unguard: Callable[[], None] | None = None  # undoes skip_nonfinite_updates()
        self._open = False
        self._abandoned = False  # a step's block raised: the ranks' collectives can no longer be matched
        self._scaler_used = False
        self._pipelined_step: int | None = None
        self._ended_since_update = True
        self._updated_at: int | None = None
        self._last_passing_audit: int | None = None
        self._warned: set[str] = set()
        self._closed = False
        if self._writer:
            self._announce()

    # -- public --------------------------------------------------------------------------------------------------

    def step(self, batch: Any = NO_BATCH) -> StepContext:
        """Context for one optimizer step; ``batch`` is its (only) micro-batch, kept for replay on audit steps.

        The checks run when the block ends (every rank must reach it); ``SDCDetected`` is raised there."""
        if self._closed:
            raise RuntimeError("SDCMonitor is closed")
        return StepContext(self, batch)

    @property
    def closed(self) -> bool:
        """``close()`` ran (or construction failed)."""
        return self._closed

    @property
    def current_step(self) -> int:
        """Index of the step in progress (or last finished); ``start_step - 1`` before the first step."""
        return self._step

    @property
    def last_passing_audit(self) -> int | None:
        """The step of the last replay audit that passed on every rank (None before the first)."""
        return self._last_passing_audit

    def verify_weights(self) -> Incident | None:
        """Run the weight check now on every rank, whatever ``weights_every`` is (call it before saving a
        checkpoint). Collective. Returns the weights incident (new, or the open episode it repeats) or None."""
        self._require_open_monitor("verify_weights")
        if self._weights is None and self._at_rest is None:
            return None
        self._settle()
        start = time.perf_counter()
        m = self._measure(max(self._step, 0), weights=True, grads=False)
        high, low = m.agreement.result()
        finding, result = self._weights_verdict(m, high, low)
        self._conclude(m, [finding] if finding else [], {"weights": result},
                       {"weights": time.perf_counter() - start}, counts_step=False,
                       passed=frozenset({"weights"}) if result == "pass" else frozenset(),
                       weights_agree=None if result in ("error", "skipped")
                       else not (finding and self.rank in finding.suspect_ranks))
        return self._episodes.current("weights") if finding else None

    def skip_nonfinite_updates(self) -> None:
        """Make ``optimizer.step()`` skip the update of a step whose gradients were not finite on every rank, as
        ``GradScaler.step`` skips an overflow: the same decision on every rank, from the step's agreement. For loops
        that do not call ``optimizer.step()`` themselves (Lightning's ``SDCCallback(skip_nonfinite=True)``, the HF
        ``SDCTrainer(sdc_skip_nonfinite=True)``); a loop of your own writes ``if step.finite: optimizer.step()``.

        A closure passed to the step (Lightning's forward and backward) runs first, then the update is applied or
        skipped; optimizers that re-evaluate their closure (LBFGS) are refused. Undone by ``close()``.

        >>> monitor.skip_nonfinite_updates()                                     # doctest: +SKIP
        """
        self._require_open_monitor("skip_nonfinite_updates")
        if not self.config.grad_checks:
            raise ValueError("skip_nonfinite_updates() needs the gradient checks: SDCConfig(grad_checks=True)")
        if isinstance(self.optimizer, torch.optim.LBFGS):
            raise ValueError("skip_nonfinite_updates() cannot guard LBFGS: it re-evaluates its closure inside step()")
        if self._unguard is not None:
            return
        optimizer = self.optimizer
        update = optimizer.step

        def step(closure: Callable[[], Any] | None = None, *args: Any, **kwargs: Any) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if self._ended is not None and not self._open and self._ended.step == self._step \
                    and not self.step_finite(self._step):
                if self._writer:  # one line per skipped step, as each is its own decision
                    log.warning("sdc_telemetry: step %d: the update is skipped on every rank: its gradients were not "
                                "finite on every rank", self._step)
                return loss
            out = update(*args, **kwargs)
            return loss if closure is not None else out

        own = "step" in vars(optimizer)  # an LR scheduler may already have wrapped it on the instance
        optimizer.step = step  # type: ignore[method-assign]

        def unguard() -> None:
            if vars(optimizer).get("step") is step:
                if own:
                    optimizer.step = update  # type: ignore[method-assign]
                else:
                    del optimizer.step  # the class's step again

        self._unguard = unguard

    def certificate(self) -> WeightCertificate:
        """Certify the weights for a checkpoint: collective, call it on every rank (not under ``if rank == 0``).

        Runs the weight check first (an incident when replicas disagree, handled like ``verify_weights()``), then
        returns the step and every parameter's fingerprint, keyed by the unwrapped module's parameter names, with
        ``last_passing_audit`` (the step of the last replay audit that passed on every rank). While a hardware
        episode is open (a suspect named and not cleared by a later pass), nothing is certified: ``SDCDetected``
        is raised whatever ``on_suspect`` says. When the replicas disagree but a majority agrees, the certificate
        holds the majority's fingerprints of its current weights (gathered again), so that the checkpoint of a
        corrupted rank does not verify and the healthy ranks' do. A sharded model is certified as whole tensors
        (gathered one at a time) so that it verifies against a full state dict.

        >>> cert = monitor.certificate()                                             # doctest: +SKIP
        >>> torch.save({"model": model.module.state_dict(), "sdc_certificate": cert.to_dict()}, path)  # doctest: +SKIP
        """
        self._require_open_monitor("certificate")
        incident = self.verify_weights()
        step = max(self._step, 0)
        others = [i for i in self._episodes.open_hardware() if i.check != "weights"]
        if others:  # the same on every rank: episodes are decided from agreed data
            raise SDCDetected(others[0])
        named = list(self.module.named_parameters())
        if incident is None:
            rows = self._whole_fingerprints(named)
        elif self._weights is None:  # no replica: a rank's memory changed at rest, nothing else holds the weights
            raise SDCDetected(incident)
        else:  # the replicas disagree (agreed, so every rank is here): the majority's weights as they are now
            majority = self._weights.current_majority() if self.layout.shard_of is None else None
            if majority is None:  # no majority of whole tensors to certify
                raise SDCDetected(incident)
            rows = [format_fingerprint(row) for row in majority[:len(named)]]  # parameters first, then state
        # The buffers are named, not fingerprinted, so that a full state_dict() verifies.
        return WeightCertificate(
            step=step, fingerprints={n: row for (n, _), row in zip(named, rows, strict=True)},
            shapes={n: self.layout.whole_shape(p) for n, p in named},
            dtypes={n: str(p.dtype).removeprefix("torch.") for n, p in named}, world_size=self._world,
            last_passing_audit=self._last_passing_audit, buffers=tuple(n for n, _ in self.module.named_buffers()))

    def _whole_fingerprints(self, named: list[tuple[str, torch.nn.Parameter]]) -> list[str]:
        """Each parameter's fingerprint as a whole tensor, streamed: a sharded layout gathers one tensor at a time
        (collective) and drops it once fingerprinted, so at most one unsharded parameter is held; one host copy."""
        rows = []
        for _, whole in self.layout.whole(named):
            rows.append(fingerprint([whole]))
            del whole  # dropped before the next one is gathered: one unsharded parameter at a time
        host = torch.cat([r.to(self.device) for r in rows]).cpu().tolist() if rows else []
        return [format_fingerprint(row) for row in host]

    def close(self) -> None:
        """Remove the hooks, flush a pending page (bounded), mark telemetry closed. A second call does nothing.

        Collective when a verdict is still in flight (CUDA reads healthy verdicts one step later) and the loop ended
        normally: it is decided first, so with ``on_suspect="raise"`` the last step's incident can raise
        ``SDCDetected`` from here (the monitor is closed either way). On an exception path (called while an
        exception propagates, after ``SDCDetected``, or after a step's block raised) it runs no collective and never
        raises. The comm hook stays registered (DDP cannot remove it) but only forwards to the wrapped all-reduce."""
        if self._closed:
            return
        unwinding = sys.exc_info()[0] is not None or self._abandoned
        try:
            if not unwinding:
                self._settle()  # a verdict still in flight (CUDA) is decided, and raised, before the monitor stops
        finally:
            self._closed = True
            self._pending = None
            self._stop()

    def _stop(self) -> None:
        for h in self._handles:
            h.remove()
        if self._unguard is not None:
            self._unguard()
            self._unguard = None
        if self._replay is not None:
            self._replay.close()
        self.layout.disable()
        self.sinks.close()

    def __enter__(self) -> SDCMonitor:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self._abandoned = True  # an exception path: no collective, nothing raised over it
        self.close()

    # -- the step: the surface StepContext uses ------------------------------------------------------------------

    def open_step(self) -> int:
        """Open the next step (``StepContext.begin``); returns its index."""
        self._require_open_monitor("step")
        if self._open:
            raise RuntimeError(f"monitor.step() opened while step {self._step} is still open: end each step's "
                               "`with monitor.step(...)` block before opening the next (steps do not nest)")
        self._step = self._next_step
        self._open = True
        self._scaler_used = False
        self._loss = None
        self._record.reset(detail=self._replay is not None and self._replay.due(self._step))
        if self._replay is not None:
            self._replay.begin_step(self._step)
        return self._step

    def capture(self, batch: Any) -> None:
        """Register the step's next micro-batch (``StepContext.micro_batch``)."""
        if self._replay is not None:
            self._replay.capture(batch)

    def record_loss(self, loss: torch.Tensor, scale: float, grad_scale: torch.Tensor | None) -> None:
        """A micro-batch's loss as it is backpropagated (``StepContext.backward``/``record_loss``)."""
        if grad_scale is not None:
            self._scaler_used = True
        if self._replay is not None:
            self._replay.record_loss(loss, scale, grad_scale)
        if self._outliers is not None:
            part = loss.detach().double() * scale
            self._loss = part if self._loss is None else self._loss + part

    def pipeline_step(self, inputs: tuple[Any, ...], target: Any, kwargs: dict[str, Any]) -> list[torch.Tensor] | None:
        """One ``schedule.step`` of a pipeline stage (``StepContext.pipeline_step``): the step's whole batch is its
        one replay unit (the replay reruns the schedule), and the loss recorded is the sum of the last stage's
        per-micro-batch losses (0 on the other stages)."""
        layout = self.layout
        if not layout.pipelined:
            raise RuntimeError("step.pipeline_step() runs a pipeline schedule: create the monitor with "
                               "SDCMonitor(stage_module, optimizer, pipeline=schedule)")
        if self._pipelined_step == self._step:
            raise RuntimeError("step.pipeline_step() runs once per `with monitor.step(...)` block (one schedule step "
                               "per optimizer step)")
        self._pipelined_step = self._step
        had_grad = [p.grad is not None for p in self._params]
        if self._replay is not None:
            self._replay.pipeline_batch((inputs, target, kwargs))
        with self._replay.stage_outputs() if self._replay is not None else nullcontext():
            losses: list[torch.Tensor] | None = layout.step(*inputs, target=target,  # type: ignore[attr-defined]
                                                            **kwargs)
        loss = pipeline_loss(losses, self.device)
        self.record_loss(loss, 1.0, None)
        if self._replay is not None:
            self._replay.set_had_grad(had_grad)
        return losses

    def step_finite(self, index: int) -> bool:
        """Whether step ``index`` (the last ended one) had finite gradients on every rank, local and reduced
        (``StepContext.finite``): the same answer on every rank, from the step's agreement. With deferred verdicts
        on a GPU, reading it waits for that agreement (one host wait)."""
        if self._open or self._ended is None or self._ended.step != index or index != self._step:
            raise RuntimeError("step.finite is read after the step's `with monitor.step(...)` block ends and before "
                               "the next step opens (it decides whether to apply this step's update)")
        if not self.config.grad_checks:
            raise RuntimeError("step.finite needs the gradient checks: SDCConfig(grad_checks=True)")
        high, _ = self._ended.agreement.result()
        return not (high[S.LOCAL_NONFINITE] or high[S.REDUCED_NONFINITE])

    def discard_step(self, give_back: bool = False) -> None:
        """Close the open step unchecked, on every rank alike (a loop that ended inside an accumulation window):
        unlike ``abandon_step``, the monitor's later collectives (``close()`` settling a deferred verdict) run.
        ``give_back``: the next step reuses its index (nothing of it was measured: an evaluation pass registered
        micro-batches and ran no backward)."""
        self._open = False
        self._next_step = self._step if give_back else self._step + 1
        if self._replay is not None:
            self._replay.drop()

    def abandon_step(self) -> None:
        """The step's block raised on this rank: no checks (the other ranks' collectives cannot be matched)."""
        self._open = False
        self._abandoned = True
        self._next_step = self._step + 1
        if self._replay is not None:
            self._replay.drop()

    def end_step(self) -> None:
        """The end of the step on every rank (``StepContext.end``): measure, agree, decide, respond.

        With ``verdicts="deferred"`` a healthy step's verdict is read one step later (on CUDA the agreement's result
        lands in pinned memory behind an event, so the CPU never waits for the GPU here); an audit step,
        ``verify_weights()``, ``certificate()`` and ``close()`` decide at once. Every rank defers the same way, so
        collectives match."""
        step = self._step
        self._open = False
        self._next_step = step + 1
        self._ended_since_update = True
        weights_due = (self._weights is not None or self._at_rest is not None) and self.config.weights_every > 0 \
            and step % self.config.weights_every == 0
        audit = self._replay is not None and self._replay.due(step)
        # the update of the step before is audited here (decided at once, like a replay audit)
        update_ready = self._update.ready_for(step - 1) if self._update is not None and self._update.due(step - 1) \
            and step > self._first_step else None
        deferred = self._defer_verdicts and not audit and update_ready is None
        measured = self._measure(step, weights=weights_due, audit=audit, snapshot=deferred, update_ready=update_ready)
        self._ended = measured
        previous, self._pending = self._pending, (measured if deferred else None)
        raised: SDCDetected | None = None
        if previous is not None:
            try:
                self._decide(previous)
            except SDCDetected as e:  # this step's own verdict must still be reached (every rank does the same)
                raised = e
        if not deferred:
            try:
                self._decide(measured)
            except SDCDetected as e:
                raised = raised or e
        if raised is not None:
            raise raised

    # -- measuring -----------------------------------------------------------------------------------------------

    def _measure(self, step: int, *, weights: bool, audit: bool = False, snapshot: bool = False,
                 grads: bool = True, update_ready: bool | None = None) -> Measured:
        """This rank's measurements and the launched agreement (``measure.StepMeasurer``)."""
        return self._measurer.measure(step, self._loss, self._scaler_used, weights=weights, audit=audit,
                                      snapshot=snapshot, grads=grads, update_ready=update_ready)

    # -- deciding ------------------------------------------------------------------------------------------------

    def _settle(self) -> None:
        """Decide a deferred step now (before an on-demand check or closing)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._decide(pending)

    def _decide(self, m: Measured) -> None:
        t0 = time.perf_counter()
        high, low = m.agreement.result()
        durations = dict(m.durations)
        results: dict[str, str] = {}
        findings: list[Finding] = []
        if high[S.STEP] != low[S.STEP]:
            self._warn_once("out-of-step", "sdc_telemetry: ranks disagree on the step index (%d..%d): the training "
                            "loops are out of step; checks of this step are counted as errors",
                            low[S.STEP], high[S.STEP])
            due = [*(("grad_local", "grad_reduced") if self.config.grad_checks else ()),
                   *(("weights",) if m.weights_due else ()), *(("replay",) if m.audit else ())]
            self._conclude(m, [], dict.fromkeys(due, "error"), {}, errors=("monitor",))
            return
        if self.config.grad_checks:
            local = m.agreement.local()
            finding = self.sinks.guard("grad", self._grad.verdict, high, low, m.mine, (local[0], local[1], local[3]),
                                       m.norms, S.GRAD_FIELDS, bool(high[S.SCALER]))
            # Triggered audits: at once, or one step late on today's weights (deferred verdicts); the step's batch and
            # RNG state are still referenced either way.
            triggered = self._triggered if m.grads else None
            if triggered is not None and triggered.nonfinite_minority(high, low):
                finding = triggered.late_nonfinite(m.step, not math.isfinite(local[0]), m.norms, finding) \
                    if m.deferred else triggered.nonfinite_audit(m.step, m.norms, finding)
            elif triggered is not None and self._outliers is not None \
                    and self._outliers.observe(high, low, S.OUTLIER_FIELDS, (local[2], local[0])) \
                    and finding is None and not m.audit and triggered.replayable(high, low):
                outlier, results["replay"] = triggered.late_outlier(
                    m.step, self._outliers.jumped((local[2], local[0])), m.norms) if m.deferred \
                    else triggered.outlier_audit(m.step, m.norms)
                if outlier is not None:
                    findings.append(outlier)
            results.update(self._grad.results(bool(m.mine[S.ERROR]), bool(m.mine[S.LOCAL_MEASURED]),
                                              bool(m.mine[S.REDUCED_MEASURED]), finding))
            if finding is not None:
                findings.append(finding)
        weights_agree: bool | None = None
        agreed = time.perf_counter() - t0  # the agreement (and any wait for it) is shared by the checks
        for check in ("grad_local", "grad_reduced"):
            durations[check] = durations.get(check, 0.0) + agreed
        update: Finding | None = None  # the update audit runs first: it referees a split of two replicas
        if m.update_audit:
            t = time.perf_counter()
            update, results["update"] = self._update_verdict(m, low)
            durations["update"] = time.perf_counter() - t
            if update is not None:
                findings.append(update)
        if m.weights_due:
            t = time.perf_counter()
            finding, results["weights"] = self._weights_verdict(m, high, low, update)
            durations["weights"] = durations.get("weights", 0.0) + agreed + time.perf_counter() - t
            if results["weights"] in ("pass", "fail"):
                weights_agree = not (finding and self.rank in finding.suspect_ranks)
            if finding is not None:
                findings.append(finding)
        replay: ReplayDeltas | None = None
        if m.audit:
            t = time.perf_counter()
            finding, results["replay"], replay = self._replay_verdict(m.step, high, low, findings)
            durations["replay"] = time.perf_counter() - t
            if finding is not None:
                findings.append(finding)
        durations = {c: durations.get(c, 0.0) for c in results}
        errors = ("replay",) if results.get("replay") == "error" else ()
        passed = self._agreed_passes(high, low, findings, results if m.audit else
                                     {k: v for k, v in results.items() if k != "replay"})
        if "replay" in passed:
            self._last_passing_audit = m.step
        self._conclude(m, findings, results, durations, passed=passed, replay=replay, weights_agree=weights_agree,
                       errors=errors)

    def _agreed_passes(self, high: list[int], low: list[int], findings: list[Finding], results: dict[str, str]
                       ) -> frozenset[str]:
        """The checks that passed on every rank, from data every rank shares (results may differ by rank)."""
        found = {f.check for f in findings}
        passed = set()
        if self.config.grad_checks and not high[S.ERROR] and not found & {"grad_local", "grad_reduced"}:
            if low[S.LOCAL_MEASURED]:
                passed.add("grad_local")
            if self.layout.reduces and low[S.REDUCED_MEASURED]:
                passed.add("grad_reduced")
        if results.get("weights") == "pass":  # decided from the agreement: the same on every rank
            passed.add("weights")
        if results.get("replay") == "pass" and self._replay is not None and not self._replay.errors:
            passed.add("replay")  # the replay's error list is gathered: the same on every rank
        return frozenset(passed)

    def _weights_verdict(self, m: Measured, high: list[int], low: list[int], update: Finding | None = None
                         ) -> tuple[Finding | None, str]:
        """The vote among replicas (where there are any) and the at-rest comparison, from the agreement; an
        unambiguous update audit of the same step referees a vote that cannot name a rank."""
        error = bool(high[S.WEIGHTS_ERROR])
        if self._weights is not None:
            finding, result = self._weights.verdict(m.step, error, bool(m.mine[S.WEIGHTS_ERROR]),
                                                    S.digests_agree(high, low, self._digest_group is not None), m.table,
                                                    self._writer)
        elif error:
            finding, result = None, "error" if m.mine[S.WEIGHTS_ERROR] else "skipped"
        else:  # no replica: the at-rest comparison is the check; nothing to compare before the first update
            finding, result = None, "pass" if low[S.AT_REST] >= 1 else "skipped"
        if not error and high[S.AT_REST] >= 2 and self._at_rest is not None:
            changed = at_rest.decide(m.at_rest, self.layout.gather_objects, self._ranks)
            if changed is not None:
                finding, result = at_rest.merge(changed, finding), "fail"
                if self._weights is not None:
                    self._weights.refereed(finding)
        if finding is not None and finding.evidence.get("ambiguous") and update is not None \
                and not update.evidence.get("ambiguous") and set(update.suspect_ranks) < set(finding.suspect_ranks):
            finding = at_rest.refereed_by_update(finding, update)
            if self._weights is not None:
                self._weights.refereed(finding)
        return finding, result

    def _update_verdict(self, m: Measured, low: list[int]) -> tuple[Finding | None, str]:
        """The audit of the previous step's update, where every rank holds its slice (agreed: the same on every
        rank); skipped where some rank does not (an update skipped, a failed copy)."""
        assert self._update is not None
        if not low[S.UPDATE_READY]:
            self._update.pending = None
            return None, "skipped"
        finding, result = self._update.audit(m.step - 1, self.layout.position, self._update_origin_of, self._ranks,
                                             self.layout.group, self._update_wire, self.device,
                                             self.layout.gather_objects)
        if finding is not None:
            finding.evidence["update_step"] = m.step - 1
        if self._update.errors:
            self._warn_once("update-error", "sdc_telemetry: step %d: the update audit could not run everywhere "
                            "(counted as errors): %s", m.step, "; ".join(self._update.errors[:3]))
        return finding, result

    def _replay_verdict(self, step: int, high: list[int], low: list[int], findings: list[Finding]
                        ) -> tuple[Finding | None, str, ReplayDeltas | None]:
        assert self._replay is not None
        reason = None
        if findings:
            reason = "another check found a fault this step (replay compares healthy replicas only)"
        elif high[S.REPEATED]:
            reason = self.layout.repeats_why
        elif not low[S.REPLAYABLE]:
            reason = "not every rank captured the step (use `with monitor.step(batch)` or step.micro_batch())"
        elif not low[S.LOCAL_MEASURED] or high[S.ERROR]:
            reason = "local gradients were not measured on every rank"
        finding, result, measured = self._replay.audit(
            reason, lambda: (int(self._record.total_fp().item()), self._record.norms, self._record.sketch),
            lambda key, text: self._warn_once(key, "sdc_telemetry: step %d: %s", step, text),
            lambda: self._internal_error("replay", "reading the recorded gradients failed"))
        deltas = ReplayDeltas(measured.loss_delta, measured.grad_delta, measured.mismatch, measured.origin_rank) \
            if measured else None
        return finding, result, deltas

    # -- responding ----------------------------------------------------------------------------------------------

    def _conclude(self, m: Measured, findings: list[Finding], results: dict[str, str], durations: dict[str, float],
                  *, passed: frozenset[str] = frozenset(), counts_step: bool = True,
                  replay: ReplayDeltas | None = None, weights_agree: bool | None = None,
                  errors: tuple[str, ...] = ()) -> list[Incident]:
        """Episodes, then the sinks (log line, incident log, page, telemetry), then ``SDCDetected`` on every rank
        when configured."""
        for f in findings:
            self._add_coordinates(f)
        opened, touched = self._episodes.observe(m.step, findings, passed, self._suspects)
        if opened and any(i.suspect_ranks for i in opened):
            self._attach_gpu_counters(opened)
        for incident in opened:
            self.sinks.opened(incident)
        for incident in touched:
            self.sinks.touched(incident)
        for incident in self._episodes.closed:
            self.sinks.closed(incident)
        mine = [i for i in opened if self.rank in i.suspect_ranks]
        self.sinks.report(StepReport(
            step=m.step, counts_step=counts_step, results=results, durations=durations,
            grad_norms=self._grad_norms(m, results), replay=replay, weights_agree=weights_agree,
            incidents=tuple(opened), suspect_checks=tuple(i.check for i in mine),
            ambiguous_checks=tuple(i.check for i in mine if i.evidence.get("ambiguous") is True), errors=errors))
        raising = root_cause([i for i in opened if i.suspect_ranks])
        if raising and self.config.on_suspect == "raise":
            self.sinks.flush()  # the page is out before any rank stops (close() on the stop path is then prompt)
            self._abandoned = True  # the loop stops: close() must not run collectives the others never join
            raise SDCDetected(raising[0], raising)
        return opened

    def _add_coordinates(self, finding: Finding) -> None:
        """N-D layouts: the suspects' mesh coordinates (``{"pp": 1, "dp_replicate": 0, "tp": 1}``) in the evidence."""
        coords = {r: c for r in finding.suspect_ranks[:16] if (c := self.layout.coordinate_of(r)) is not None}
        if coords:
            finding.evidence["coordinate"] = coords[finding.suspect_ranks[0]] if finding.suspect_ranks[0] in coords \
                else next(iter(coords.values()))
            finding.evidence["coordinates"] = {str(r): c for r, c in coords.items()}

    def _suspects(self, ranks: tuple[int, ...]) -> tuple[RankIdentity, ...]:
        return tuple(self.identities.get(r, RankIdentity(r, -1, "unknown", "unknown")) for r in ranks)

    def _grad_norms(self, m: Measured, results: dict[str, str]) -> dict[str, float]:
        if not m.grads:
            return {}
        local, reduced = m.agreement.local()[:2]
        out: dict[str, float] = {}
        if results.get("grad_local") in ("pass", "fail"):
            out["local"] = local
        if results.get("grad_reduced") in ("pass", "fail"):
            out["reduced"] = reduced
        return out

    def _attach_gpu_counters(self, incidents: list[Incident]) -> None:
        """The suspects' GPU counters, gathered so that every rank's incident carries the same evidence.

        Collective, like the findings themselves: every rank reaches here with the same new incidents."""
        suspected = {r for i in incidents for r in i.suspect_ranks}
        mine = self.sinks.gpu_snapshot() if self.rank in suspected else None
        snaps = self.layout.gather_objects(mine)
        by_rank = {self._ranks[i]: s for i, s in enumerate(snaps) if s}
        for incident in incidents:
            counters = {str(r): by_rank[r] for r in incident.suspect_ranks[:16] if r in by_rank}
            if counters:
                incident.evidence["gpu_counters"] = counters

    def _after_update(self, *_: Any) -> None:
        """Optimizer post-step hook: the at-rest reference when the next step checks the weights; says once if
        steps run outside ``monitor.step()`` (no checks ran for them)."""
        # A ZeRO optimizer steps its torch optimizer one parameter group at a time (the others hidden from it): the
        # calls of one update after the first are not steps run outside a block.
        partial = self.layout.steps_in_parts and self._updated_at == self._step
        self._updated_at = self._step
        if not self._ended_since_update and not partial:
            self._warn_once("no-step", "sdc_telemetry: optimizer.step() ran without a `with monitor.step(...)` "
                            "block since the last update: no check runs for such steps")
        self._ended_since_update = False
        if self._update is not None:
            try:
                self._update.after_update(self._step)
            except Exception:  # noqa: BLE001
                self._update.pending = None
                self._internal_error("update", "fingerprinting the audited slice after the update failed")
        if self._at_rest is not None:
            nxt = self._step + 1
            try:
                if nxt % self.config.weights_every == 0:
                    self._at_rest.after_update(self._step)
                else:
                    self._at_rest.forget()
            except Exception:  # noqa: BLE001 - telemetry never breaks training; counted, the check skips
                self._at_rest.forget()
                self._internal_error("weights", "fingerprinting the parameters after the update failed")

    def _before_update(self, *_: Any) -> None:
        """Optimizer pre-step hook: the update audit's copy of its slice (local; never a collective)."""
        assert self._update is not None
        try:
            self._update.before_update(self._step)
        except Exception:  # noqa: BLE001 - telemetry never breaks training; counted, that audit skips
            self._update.pending = None
            self._internal_error("update", "copying the audited slice before the update failed")

    def _plan_update_audit(self, optimizer: torch.optim.Optimizer, every: list[tuple[str, torch.Tensor]],
                           classes: list[int] | None, read: Callable[[torch.Tensor], torch.Tensor], *,
                           own: bool = False) -> UpdateAudit | None:
        """The update audit, where it is asked for (``update_every``) or useful (``"auto"``: the vote cannot name
        a rank) and the optimizer's step can be recomputed."""
        n = self.config.update_every
        reason = update_check.unsupported(optimizer)
        layout = self.layout
        holders = self._world // max(layout.digest_keys, 1) \
            if layout.weight_replicas and layout.optimizer_replicas else 1
        if n == "auto":
            n = self.config.replay_every if reason is None and self._world > 1 and holders <= 2 else 0
            if reason is not None and self._world > 1 and not layout.optimizer_replicas and self._writer:
                log.warning("sdc_telemetry: %s, and no other rank holds this rank's optimizer state: a wrong update "
                            "goes unseen (the update audit is off)", reason)
        elif n and reason is not None:
            raise ValueError(f"SDCConfig.update_every={n}: {reason}")
        elif n and self._world < 2:
            if self._writer:
                log.warning("sdc_telemetry: SDCConfig.update_every=%d: the update audit needs a partner rank and is "
                            "off in a single process", n)
            n = 0
        if not n:
            return None
        hosts = [self.identities[r].host_name if r in self.identities else str(r) for r in self._ranks]
        # Partners within a numerics class where every class has two ranks or more (an update recomputed on
        # another GPU model may round differently); else across classes.
        pairing = plan_pairs(hosts, classes)
        if pairing.alone:
            pairing = plan_pairs(hosts)
        self._update_origin_of = [pairing.origin(q, pairing.shifts[0]) for q in range(len(self._ranks))]
        self._update_wire = collective_device(layout.group, self.device)
        # One audit's host copy: about two of the largest parameters, and never more than UPDATE_SLICE_BYTES (a
        # larger share, such as a ZeRO optimizer's flat partition, is audited a range at a time).
        largest = max(p.numel() * p.element_size() for _, p in every)
        return UpdateAudit([name for name, _ in every], [p for _, p in every], optimizer, read, n,
                           slice_bytes=2 * largest, own=own, max_bytes=UPDATE_SLICE_BYTES)

    def weights_changed(self) -> None:
        """Say that the weights (or the optimizer's state) were changed on purpose outside ``optimizer.step()``
        (an EMA written into them, a manual clamp, a reload): the at-rest check compares again from the next update.
        Local, not a collective."""
        if self._at_rest is not None:
            self._at_rest.forget()

    def _announce(self) -> None:
        hosts = len({i.host_name for i in self.identities.values()})
        replicas = self.layout.replicas
        checks = [*(("grad_local", "grad_reduced" if self.layout.reduces else "") if self.config.grad_checks else ()),
                  *((f"weights every {self.config.weights_every}" + ("" if self._weights else " (at rest)"),)
                    if self._at_rest is not None else ()),
                  *((f"replay every {self.config.replay_every} ({self.mode})",)
                    if self._replay is not None and self.config.replay_every else ()),
                  *(("triggered audits",) if self._outliers is not None else ())]
        text = (f"sdc_telemetry: monitoring {self._world} rank(s) on {hosts} host(s) from step {self._next_step} "
                f"({self.layout.name}): {', '.join(c for c in checks if c) or 'no checks'}; "
                f"on_suspect={self.config.on_suspect}")
        if not replicas:
            text += (" (one replica: the replay and the weight vote need several ranks and are off; the at-rest "
                     "check compares this rank's own weights)")
        # Said at WARNING when logging is not configured, so that it reaches stderr once: monitoring is on.
        log.log(logging.INFO if logging.getLogger().handlers else logging.WARNING, "%s", text)

    # -- plumbing ------------------------------------------------------------------------------------------------

    def _require_open_monitor(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"SDCMonitor is closed: {what}() is not available")

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned and self._writer:
            log.warning(msg, *args)
        self._warned.add(key)

    def _internal_error(self, component: str, what: str) -> None:
        log.exception("sdc_telemetry: %s (rank %d); training goes on", what, self.rank)
        self.sinks.internal_error(component)


def _as_held(t: torch.Tensor) -> torch.Tensor:
    """A tensor the optimizer updates as this rank holds it (a ZeRO optimizer's own partition)."""
    return t
