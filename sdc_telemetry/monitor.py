"""SDCMonitor: runs the checks at the end of each training step and hands one result to response and telemetry.

The per-step path reads straight::

    measure (comm hook + one pass after backward)  ->  one all-reduce of a fixed status vector (MAX/MIN)
      ->  decide (pure; per-rank detail gathered only when a field disagrees)  ->  replay on audit steps
      ->  episodes (incidents)  ->  one StepReport to telemetry  ->  raise on every rank, if configured

Every collective runs at the end of ``with monitor.step()`` (or ``StepContext.end()``), a point every rank reaches
before ``optimizer.step()``: a GradScaler that skips the update on one rank, or a loop that skips a step on a bad
loss, cannot make the ranks' collectives diverge.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sdc_telemetry.checks import grad as grad_check
from sdc_telemetry.checks.replay import ReplayCheck
from sdc_telemetry.checks.weights import WeightsCheck
from sdc_telemetry.core.certificate import WeightCertificate, format_fingerprint
from sdc_telemetry.core.collective import Agreement, agree, gather_objects, gather_rows, group_ranks
from sdc_telemetry.core.config import SDCConfig
from sdc_telemetry.core.episodes import Episodes
from sdc_telemetry.core.evidence import bits, unbits
from sdc_telemetry.core.findings import Finding
from sdc_telemetry.core.identity import RankIdentity, numerics_signature
from sdc_telemetry.core.incident import Incident, SDCDetected
from sdc_telemetry.parallel import fsdp
from sdc_telemetry.sinks.incident_log import IncidentLog
from sdc_telemetry.sinks.observer import Observer, ReplayDeltas, StepReport
from sdc_telemetry.step import NO_BATCH, StepContext

__all__ = ["SDCMonitor"]

log = logging.getLogger("sdc_telemetry")

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]

# The step's status vector: one int64 per field, agreed by MAX and MIN over the group in one all-reduce.
(STEP, LOCAL_MEASURED, LOCAL_NONFINITE, REDUCED_MEASURED, REDUCED_NONFINITE, ERROR, REPEATED, REPLAYABLE, SCALER,
 WEIGHTS_ERROR, DIGEST) = range(11)
FIELDS = 11


@dataclass
class _Measured:
    """One rank's measurements at a hook point and the agreement launched on them: what deciding needs, kept
    until the verdict is read (at once, or one step later on CUDA)."""

    step: int
    mine: list[int]              # this rank's host-side status fields
    agreement: Agreement
    weights_due: bool
    audit: bool
    table: torch.Tensor | None   # this rank's weight fingerprint table, for a vote on disagreement
    norms: torch.Tensor          # this rank's per-parameter local-gradient norms (evidence)
    durations: dict[str, float] = field(default_factory=dict)  # measuring time per check on this rank
    grads: bool = True           # gradient results belong to this hook point


class SDCMonitor:
    """Silent-data-corruption checks for a training loop: DDP across ranks, or a plain module in one process.

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
    ``replica_group`` defaults to the DDP model's process group. If the model already needs a comm hook, pass it as
    ``comm_hook=`` (with ``comm_state=``) instead of registering it: the monitor wraps it. ``observer`` replaces the
    telemetry built from the config; ``registry``, ``meter_provider`` and ``nvml`` are handed to that telemetry.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: LossFn | None = None, config: SDCConfig | None = None, *, start_step: int = 0,
                 replica_group: dist.ProcessGroup | None = None,
                 comm_hook: grad_check.CommHook | None = None, comm_state: Any = None,
                 observer: Observer | None = None, registry: Any = None, meter_provider: Any = None,
                 nvml: Any = None) -> None:
        self._closed = True  # until construction succeeds: close() then does nothing
        initialised = dist.is_available() and dist.is_initialized()
        self._layout: fsdp.FSDPLayout | None = None
        if isinstance(model, torch.nn.Module) and fsdp.is_fully_sharded(model):
            if not initialised:
                raise RuntimeError("SDCMonitor needs the initialised process group of the fully_shard-ed model")
            if comm_hook is not None or replica_group is not None:
                raise ValueError("comm_hook= and replica_group= are for DDP models; a fully_shard-ed model's groups "
                                 "come from its device mesh")
            self._layout = fsdp.layout_of(model)
            covered = self._layout.shard_size * self._layout.replicas
            if covered != dist.get_world_size():
                raise fsdp.LayoutError(f"the model's device mesh covers {covered} of {dist.get_world_size()} ranks: "
                                       "it must span every rank")
            self._distributed = True
        elif isinstance(model, DistributedDataParallel):
            if not initialised:
                raise RuntimeError("SDCMonitor needs an initialised process group for a DDP model: call "
                                   "torch.distributed.init_process_group() first (torchrun sets up the environment)")
            self._distributed = True
        elif isinstance(model, torch.nn.Module):
            if initialised and dist.get_world_size() > 1:
                raise TypeError(f"SDCMonitor needs a torch.nn.parallel.DistributedDataParallel model when "
                                f"torch.distributed runs {dist.get_world_size()} ranks, got {type(model).__name__}; "
                                "wrap it first: DistributedDataParallel(model)")
            self._distributed = False
        else:
            raise TypeError(f"model must be a torch.nn.Module (DistributedDataParallel-wrapped across ranks), got "
                            f"{type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step must be an int >= 0 (the index of the first step), got {start_step!r}")
        self.config = config if config is not None else SDCConfig.from_env()
        if not isinstance(self.config, SDCConfig):
            raise TypeError(f"config must be an SDCConfig, got {type(self.config).__name__}")
        module = model.module if isinstance(model, DistributedDataParallel) else model
        if not self._distributed and comm_hook is not None:
            raise ValueError("comm_hook= wraps a DDP all-reduce; a plain module has none")
        self.model = model
        self.module: torch.nn.Module = module
        self.optimizer = optimizer
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no parameters that require gradients: nothing to check")
        self._params = [p for _, p in named]
        self._names = [n for n, _ in named]
        self.device = self._params[0].device
        if self._layout is not None:
            self._group: dist.ProcessGroup | None = None  # the mesh spans the world
            self._ranks = group_ranks(None)
            self.rank = dist.get_rank()
        elif self._distributed:
            assert isinstance(model, DistributedDataParallel)
            self._group = replica_group if replica_group is not None else model.process_group
            self._ranks = group_ranks(self._group)
            self.rank = dist.get_rank()
        else:
            self._group, self._ranks, self.rank = None, [0], 0
        self._world = len(self._ranks)
        self._pos = self._ranks.index(self.rank)
        self._writer = self._pos == 0
        replicas = self._world > 1
        if replicas and self.config.replay_every and any(isinstance(m, torch.nn.SyncBatchNorm)
                                                         for m in module.modules()):
            raise ValueError("SyncBatchNorm computes its statistics across ranks, so a replay of one rank's "
                             "micro-batch cannot reproduce it; set SDCConfig(replay_every=0) for this model")
        if replicas and self.config.replay_every and loss_fn is None:
            raise ValueError(f"SDCConfig.replay_every={self.config.replay_every} needs loss_fn= (called as "
                             "loss_fn(module, batch) -> scalar loss to recompute a step); pass it, or set "
                             "replay_every=0")

        self.identity = RankIdentity.local(self.device if self.device.type == "cuda" else None)
        self._incident_log, log_error = self._open_incident_log()
        signature = numerics_signature(self.device)
        classes = self._setup(start_step, signature, log_error)
        self.identities: dict[int, RankIdentity] = {self.rank: self.identity}
        if self._distributed:
            gathered = gather_objects(self.identity, self._group)
            self.identities = {i.rank: i for i in gathered if isinstance(i, RankIdentity)}
        self.mode = self._resolve_mode(classes)
        self.incidents: list[Incident] = []
        self._episodes = Episodes(self.incidents)
        self._observer = observer if observer is not None else self._build_telemetry(registry, meter_provider, nvml)
        self._pager = self._build_pager()

        # Every parameter, frozen ones included (LoRA-style fine-tuning freezes most weights; they must still agree).
        # Sharded models compare local shards, among the replicas of the same shard (HSDP); a 1-D FSDP mesh holds
        # no replica of a shard, so there the weight check has nothing to compare.
        layout = self._layout
        # FSDP2: every position's shard index (set-up, once): shards are compared among their replicas only.
        self._shard_of = [r[0] for r in gather_rows(torch.tensor([layout.shard_index], dtype=torch.int64),
                                                    self._group, self.device)] if layout is not None else None
        self._weights = None
        if replicas and (layout is None or layout.hsdp):
            self._weights = WeightsCheck(list(module.named_parameters()), self._group, self._ranks,
                                         self._shard_classes(classes) if layout is not None else classes,
                                         local=_local_shard if layout is not None else None)
        elif layout is not None and self.config.weights_every and self._writer:
            log.warning("sdc_telemetry: a 1-D FSDP mesh holds no replica of any shard: the weight check has "
                        "nothing to compare and is off (HSDP, a (replicate, shard) mesh, has replicas)")
        self._replay = ReplayCheck(module, loss_fn, named, self._group, self._ranks, self.identities,
                                   self.device, self.mode, self.config.tolerance, self.config.replay_every,
                                   layout=layout) \
            if replicas and self.config.replay_every and loss_fn is not None else None
        self._record = grad_check.GradRecord(self._params, self.device)
        self._hook_state: grad_check.CommHookState | None = None
        self._tap: fsdp.GradTap | None = None
        if layout is not None:
            record = self._record
            self._tap = fsdp.GradTap(layout, self._params, record.store, lambda: record.detail, record.note_call,
                                     record.fail)
        elif self._distributed:
            self._install_comm_hook(comm_hook, comm_state)
        self._handles = [optimizer.register_step_post_hook(self._after_update)]

        self._next_step = start_step
        self._step = start_step - 1
        self._pending: _Measured | None = None
        self._absent: torch.Tensor | None = None
        self._minority: tuple[tuple[int, ...], int] = ((), 0)  # ranks non-finite alone, and for how many steps
        # On CUDA, read healthy verdicts one step later rather than wait for the GPU (the same on every rank).
        self._defer_verdicts = self.device.type == "cuda"
        self._open = False
        self._scaler_used = False
        self._ended_since_update = True
        self._warned: set[str] = set()
        self._closed = False
        if self._writer:
            self._announce(replicas)

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

    def verify_weights(self) -> Incident | None:
        """Run the weight check now on every rank, whatever ``weights_every`` is (call it before saving a
        checkpoint). Collective. Returns the weights incident (new, or the open episode it repeats) or None."""
        self._require_open_monitor("verify_weights")
        if self._weights is None:
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

    def certificate(self) -> WeightCertificate:
        """Certify the weights for a checkpoint: collective, call it on every rank (not under ``if rank == 0``).

        Runs the weight check first (an incident when replicas disagree, handled like ``verify_weights()``), then
        returns the step and every parameter's fingerprint, keyed by the unwrapped module's parameter names. When
        the replicas disagree but a majority agrees, the certificate holds the majority's fingerprints, so that the
        checkpoint of a corrupted rank does not verify; with no majority there is nothing to certify and
        ``SDCDetected`` is raised whatever ``on_suspect`` says. A fully_shard-ed model is certified as whole
        tensors (gathered from the shards: plan the memory of one full copy) so that it verifies against a full
        state dict; a disagreement there always raises.

        >>> cert = monitor.certificate()                                             # doctest: +SKIP
        >>> torch.save({"model": model.module.state_dict(), "sdc_certificate": cert.to_dict()}, path)  # doctest: +SKIP
        """
        self._require_open_monitor("certificate")
        incident = self.verify_weights()
        named = list(self.module.named_parameters())
        step = max(self._step, 0)
        if self._layout is not None:  # whole tensors, gathered from the shards on every rank (collective)
            named = [(n, p.full_tensor()) for n, p in named]  # type: ignore[operator,attr-defined]
        if incident is None or self._weights is None:
            return WeightCertificate.from_tensors(step, named, world_size=self._world)
        majority = self._weights.majority
        if majority is None or self._layout is not None:  # no majority of whole tensors to certify
            raise SDCDetected(incident)
        return WeightCertificate(step=step, fingerprints={n: format_fingerprint(row)
                                                          for (n, _), row in zip(named, majority, strict=True)},
                                 shapes={n: tuple(p.shape) for n, p in named},
                                 dtypes={n: str(p.dtype).removeprefix("torch.") for n, p in named},
                                 world_size=self._world)

    def close(self) -> None:
        """Remove the hooks, flush a pending page (bounded), mark telemetry closed. A second call does nothing.

        Collective when a verdict is still in flight (CUDA reads healthy verdicts one step later): it is decided
        first, so with ``on_suspect="raise"`` the last step's incident can raise ``SDCDetected`` from here (the
        monitor is closed either way). The comm hook stays registered (DDP cannot remove it) but only forwards to
        the wrapped all-reduce."""
        if self._closed:
            return
        try:
            self._settle()  # a verdict still in flight (CUDA) is decided, and raised, before the monitor stops
        finally:
            self._closed = True
            self._stop()

    def _stop(self) -> None:
        for h in self._handles:
            h.remove()
        if self._replay is not None:
            self._replay.close()
        if self._hook_state is not None:
            self._hook_state.enabled = False
        if self._tap is not None:
            self._tap.enabled = False
        if self._pager is not None:
            self._guard("alertmanager", self._pager.close)
        if self._incident_log is not None:
            self._incident_log.close()
        self._guard("telemetry", self._observer.close)

    def __enter__(self) -> SDCMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the step (called by StepContext) ------------------------------------------------------------------------

    def _open_step(self) -> int:
        self._require_open_monitor("step")
        if self._open:
            raise RuntimeError(f"monitor.step() opened while step {self._step} is still open: end each step's "
                               "`with monitor.step(...)` block before opening the next (steps do not nest)")
        self._step = self._next_step
        self._open = True
        self._scaler_used = False
        self._record.reset(detail=self._replay is not None and self._replay.due(self._step))
        if self._replay is not None:
            self._replay.begin_step(self._step)
        return self._step

    def _micro_batch(self, batch: Any) -> None:
        if self._replay is not None:
            self._replay.capture(batch)

    def _record_loss(self, loss: torch.Tensor, scale: float, grad_scale: torch.Tensor | None) -> None:
        if grad_scale is not None:
            self._scaler_used = True
        if self._replay is not None:
            self._replay.record_loss(loss, scale, grad_scale)

    def _abandon_step(self) -> None:
        """The step's block raised on this rank: no checks (the other ranks' collectives cannot be matched)."""
        self._open = False
        self._next_step = self._step + 1
        if self._replay is not None:
            self._replay.drop()

    def _end_step(self) -> None:
        """The end of the step on every rank: measure, agree, decide, respond.

        On CUDA a healthy step's verdict is read one step later (the agreement's result lands in pinned memory
        behind an event), so the CPU never waits for the GPU here; an audit step, ``verify_weights()``,
        ``certificate()`` and ``close()`` decide at once. Every rank defers the same way, so collectives match."""
        step = self._step
        self._open = False
        self._next_step = step + 1
        self._ended_since_update = True
        weights_due = self._weights is not None and self.config.weights_every > 0 \
            and step % self.config.weights_every == 0
        audit = self._replay is not None and self._replay.due(step)
        deferred = self._defer_verdicts and not audit
        measured = self._measure(step, weights=weights_due, audit=audit, snapshot=deferred)
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

    def _settle(self) -> None:
        """Decide a deferred step now (before an on-demand check or closing)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._decide(pending)

    def _decide(self, m: _Measured) -> None:
        t0 = time.perf_counter()
        high, low = m.agreement.result()
        durations = dict(m.durations)
        results: dict[str, str] = {}
        findings: list[Finding] = []
        if high[STEP] != low[STEP]:
            self._warn_once("out-of-step", "sdc_telemetry: ranks disagree on the step index (%d..%d): the training "
                            "loops are out of step; checks of this step are counted as errors", low[STEP], high[STEP])
            due = [*(("grad_local", "grad_reduced") if self.config.grad_checks else ()),
                   *(("weights",) if m.weights_due else ()), *(("replay",) if m.audit else ())]
            self._conclude(m, [], dict.fromkeys(due, "error"), {}, errors=("monitor",))
            return
        if self.config.grad_checks:
            finding = self._grad_verdict(m, high, low)
            results.update(self._grad_results(m, finding))
            if finding is not None:
                findings.append(finding)
        weights_agree: bool | None = None
        agreed = time.perf_counter() - t0  # the agreement (and any wait for it) is shared by the checks
        for check in ("grad_local", "grad_reduced"):
            durations[check] = durations.get(check, 0.0) + agreed
        if m.weights_due:
            t = time.perf_counter()
            finding, results["weights"] = self._weights_verdict(m, high, low)
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
        self._conclude(m, findings, results, durations, passed=self._agreed_passes(high, low, findings, results),
                       replay=replay, weights_agree=weights_agree, errors=errors)

    def _agreed_passes(self, high: list[int], low: list[int], findings: list[Finding], results: dict[str, str]
                       ) -> frozenset[str]:
        """The checks that passed on every rank, from data every rank shares (results may differ by rank)."""
        found = {f.check for f in findings}
        clean = not high[ERROR]
        passed = set()
        if self.config.grad_checks and clean and not found & {"grad_local", "grad_reduced"}:
            if low[LOCAL_MEASURED]:
                passed.add("grad_local")
            if self._distributed and low[REDUCED_MEASURED]:
                passed.add("grad_reduced")
        if results.get("weights") == "pass":  # decided from the agreement: the same on every rank
            passed.add("weights")
        if results.get("replay") == "pass" and self._replay is not None and not self._replay.errors:
            passed.add("replay")  # the replay's error list is gathered: the same on every rank
        return frozenset(passed)

    # -- measuring -----------------------------------------------------------------------------------------------

    def _measure(self, step: int, *, weights: bool, audit: bool = False, snapshot: bool = False,
                 grads: bool = True) -> _Measured:
        """This rank's measurements and the launched agreement (no host synchronisation). ``snapshot`` keeps copies
        of what the next step overwrites, for a verdict read one step later; ``grads=False`` (an on-demand weight
        check) measures the weights only."""
        start = time.perf_counter()
        host = [0] * FIELDS
        host[STEP] = step
        host[SCALER] = int(self._scaler_used)
        nonfinite = torch.zeros(2, dtype=torch.int64, device=self.device)
        digest = torch.zeros(1, dtype=torch.int64, device=self.device)
        norms = torch.full((2,), math.nan, dtype=torch.float64, device=self.device)  # local, reduced
        record = self._record
        durations: dict[str, float] = {}
        try:
            if grads and not self._distributed and self.config.grad_checks:
                record.measure_local()
            if grads and (self.config.grad_checks or audit):
                host[LOCAL_MEASURED] = int(record.measured)
                host[REPEATED] = int(record.repeated)
                if record.measured:
                    local_norm = record.total_norm()
                    nonfinite[0] = ~torch.isfinite(local_norm)
                    norms[0] = local_norm
                if self.config.grad_checks and self._distributed:
                    t = time.perf_counter()
                    reduced_norm = torch.linalg.vector_norm(grad_check.reduced_norms(
                        self._params, self.device, local=self._layout is not None))
                    durations["grad_reduced"] = time.perf_counter() - t
                    host[REDUCED_MEASURED] = int(any(p.grad is not None for p in self._params))
                    nonfinite[1] = ~torch.isfinite(reduced_norm)
                    norms[1] = reduced_norm
            host[REPLAYABLE] = int(audit and self._replay is not None and self._replay.ready())
        except Exception:  # noqa: BLE001 - contained; the agreement below must still run on this rank
            self._internal_error("grad", "measuring gradients failed")
            host[ERROR] = 1
        table = None
        weights_s = 0.0
        if weights:
            t = time.perf_counter()
            try:
                if self._weights is None:
                    raise RuntimeError("no replicas to compare")
                digest = self._weights.measure().reshape(1)
                table = self._weights.table
            except Exception:  # noqa: BLE001
                self._internal_error("weights", "fingerprinting the parameters failed")
                host[WEIGHTS_ERROR] = 1
            weights_s = time.perf_counter() - t
        slots = self._slots()
        fixed = torch.tensor(host + [0] * slots, dtype=torch.int64)
        # Pinned and non-blocking on CUDA: building the vector never waits for the GPU.
        vec = fixed.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else fixed
        vec[LOCAL_NONFINITE] = nonfinite[0]
        vec[REDUCED_NONFINITE] = nonfinite[1]
        absent = None
        if slots:  # HSDP: one digest slot per shard index, agreed among the replicas of that shard only
            assert self._layout is not None
            vec[FIELDS + self._layout.shard_index] = digest[0]
            if self._absent is None:  # made once: a constant mask, no host-to-device copy per step
                mask = torch.ones(FIELDS + slots, dtype=torch.bool)
                mask[:FIELDS] = False
                mask[FIELDS + self._layout.shard_index] = False
                self._absent = mask.to(vec.device)
            absent = self._absent
        else:
            vec[DIGEST] = digest[0]
        agreement = Agreement(vec, self._group, self._distributed, local=norms, absent=absent)
        elapsed = time.perf_counter() - start
        # grad_local: the comm-hook measurements during backward and the local part here; grad_reduced: its pass.
        durations = {"grad_local": record.elapsed + elapsed - durations.get("grad_reduced", 0.0) - weights_s,
                     "grad_reduced": durations.get("grad_reduced", 0.0), "weights": weights_s}
        return _Measured(step=step, mine=host, agreement=agreement, weights_due=weights, audit=audit, table=table,
                         norms=record.norms.clone() if snapshot else record.norms, durations=durations,
                         grads=grads)

    # -- deciding ------------------------------------------------------------------------------------------------

    def _grad_verdict(self, m: _Measured, high: list[int], low: list[int]) -> Finding | None:
        if not (high[LOCAL_NONFINITE] or high[REDUCED_NONFINITE]):
            self._minority = ((), 0)
            return None
        fields = (LOCAL_MEASURED, LOCAL_NONFINITE, REDUCED_MEASURED, REDUCED_NONFINITE)
        if all(high[f] == low[f] for f in fields):  # every rank alike: no per-rank detail needed
            rows = [grad_check.GradStatus(r, *(bool(high[f]) for f in fields)) for r in self._ranks]
        else:  # rare path: who?
            local, reduced = m.agreement.local()
            mine = torch.tensor([m.mine[LOCAL_MEASURED], bits(local), bits(reduced)], dtype=torch.int64)
            gathered = gather_rows(mine, self._group, self.device) if self._distributed else [mine.tolist()]
            rows = []
            for r, g in zip(self._ranks, gathered, strict=True):
                loc, red = unbits(g[1]), unbits(g[2])
                rows.append(grad_check.GradStatus(r, bool(g[0]), bool(g[0]) and not math.isfinite(loc),
                                                  self._distributed, self._distributed and not math.isfinite(red),
                                                  loc, red))
        minority = grad_check.nonfinite_minority(rows)
        repeats = self._minority[1] if minority and minority == self._minority[0] else 0
        self._minority = (minority, repeats + 1 if minority else 0)
        finding = self._guard("grad", grad_check.decide, rows, overflow_expected=bool(high[SCALER]),
                              repeats=repeats, shard_of=self._shard_of)
        if finding is not None and finding.suspect_ranks and finding.check == "grad_local":
            finding = self._with_nonfinite_names(m, finding)
        return finding  # type: ignore[no-any-return]

    def _grad_results(self, m: _Measured, finding: Finding | None) -> dict[str, str]:
        """This rank's results: a rank that measured nothing (or failed to) never counts a pass."""
        if m.mine[ERROR]:
            return {"grad_local": "error", **({"grad_reduced": "error"} if self._distributed else {})}
        out = {"grad_local": "skipped" if not m.mine[LOCAL_MEASURED] else
               "fail" if finding is not None and finding.check == "grad_local" else "pass"}
        if self._distributed:
            out["grad_reduced"] = "skipped" if not m.mine[REDUCED_MEASURED] else \
                "fail" if finding is not None else "pass"
        return out

    def _with_nonfinite_names(self, m: _Measured, finding: Finding) -> Finding:
        """Rare path: which parameters the suspects' local gradients (before any clipping) were non-finite in."""
        mine: list[str] = []
        if self.rank in finding.suspect_ranks:
            mine = [self._names[i] for i, n in enumerate(m.norms.tolist()) if not math.isfinite(n)][:16]
        names = gather_objects(mine, self._group) if self._distributed else [mine]
        evidence = dict(finding.evidence)
        evidence["nonfinite_parameters"] = {str(self._ranks[i]): n for i, n in enumerate(names)
                                            if self._ranks[i] in finding.suspect_ranks}
        return Finding(finding.check, finding.suspect_ranks, evidence)

    def _weights_verdict(self, m: _Measured, high: list[int], low: list[int]) -> tuple[Finding | None, str]:
        assert self._weights is not None
        if high[WEIGHTS_ERROR]:
            if self._writer:
                log.warning("sdc_telemetry: step %d: weight check could not run: a rank failed to fingerprint its "
                            "parameters", m.step)
            return None, "error" if m.mine[WEIGHTS_ERROR] else "skipped"
        if all(high[f] == low[f] for f in (DIGEST, *range(FIELDS, FIELDS + self._slots()))):
            return None, "pass"
        assert m.table is not None
        finding = self._weights.gather(m.table)
        return finding, "fail" if finding is not None else "pass"

    def _replay_verdict(self, step: int, high: list[int], low: list[int], findings: list[Finding]
                        ) -> tuple[Finding | None, str, ReplayDeltas | None]:
        assert self._replay is not None
        reason = None
        if findings:
            reason = "another check found a fault this step (replay compares healthy replicas only)"
        elif high[REPEATED]:
            reason = ("a gradient bucket was all-reduced more than once in the step: with gradient accumulation, "
                      "run all but the last micro-batch under ddp_model.no_sync()")
        elif not low[REPLAYABLE]:
            reason = "not every rank captured the step (use `with monitor.step(batch)` or step.micro_batch())"
        elif not low[LOCAL_MEASURED] or high[ERROR]:
            reason = "local gradients were not measured on every rank"
        if reason is not None:
            self._replay.drop()
            self._warn_once(reason, "sdc_telemetry: step %d: replay skipped: %s", step, reason)
            return None, "skipped", None
        try:
            local_fp = int(self._record.total_fp().item())
            local_norms = self._record.norms
        except Exception:  # noqa: BLE001 - the replay protocol below must still run on this rank
            self._internal_error("replay", "reading the recorded gradients failed")
            local_fp, local_norms = 0, torch.zeros(len(self._params))
        finding, measured = self._replay.run(local_fp, local_norms)
        deltas = ReplayDeltas(measured.loss_delta, measured.grad_delta, measured.mismatch) if measured else None
        if self._replay.errors:
            self._warn_once("replay-error:" + self._replay.error_text.split(":")[0],
                            "sdc_telemetry: step %d: replay failed on ranks %s: %s (counted as errors, not passes)",
                            step, self._replay.errors[:16], self._replay.error_text)
            return None, "error" if self.rank in self._replay.errors or measured is None else "pass", deltas
        return finding, "fail" if finding is not None else "pass", deltas

    # -- responding ----------------------------------------------------------------------------------------------

    def _conclude(self, m: _Measured, findings: list[Finding], results: dict[str, str], durations: dict[str, float],
                  *, passed: frozenset[str] = frozenset(), counts_step: bool = True,
                  replay: ReplayDeltas | None = None, weights_agree: bool | None = None,
                  errors: tuple[str, ...] = ()) -> list[Incident]:
        """Episodes, the incident log, the page, telemetry, and ``SDCDetected`` on every rank when configured."""
        step = m.step
        opened, touched = self._episodes.observe(step, findings, passed, self._suspects)
        if opened and any(i.suspect_ranks for i in opened):
            self._attach_gpu_counters(opened)
        for incident in opened:
            if self._writer:
                (log.warning if incident.numerics else log.error)("%s", incident.describe())
            if self._incident_log is not None:
                self._guard("incident_log", self._incident_log.append, incident)
            if self._pager is not None and incident.suspect_ranks:
                self._guard("alertmanager", self._pager.page, incident)
        for incident in touched:
            if self._writer:
                log.warning("sdc_telemetry: incident of step %d (check=%s) still ongoing at step %d: %d findings",
                            incident.step, incident.check, incident.last_step, incident.count)
            if self._incident_log is not None:
                self._guard("incident_log", self._incident_log.update, incident)
            if self._pager is not None and incident.suspect_ranks:
                self._guard("alertmanager", self._pager.page, incident)
        report = StepReport(step=step, counts_step=counts_step, results=results, durations=durations,
                            grad_norms=self._grad_norms(m, results), replay=replay, weights_agree=weights_agree,
                            incidents=tuple(opened),
                            suspect_checks=tuple(i.check for i in opened if self.rank in i.suspect_ranks),
                            errors=errors)
        self._guard("telemetry", self._observer.report, report)
        raising = [i for i in opened if i.suspect_ranks]
        if raising and self.config.on_suspect == "raise":
            raise SDCDetected(raising[0])
        return opened

    def _suspects(self, ranks: tuple[int, ...]) -> tuple[RankIdentity, ...]:
        return tuple(self.identities.get(r, RankIdentity(r, -1, "unknown", "unknown")) for r in ranks)

    def _grad_norms(self, m: _Measured, results: dict[str, str]) -> dict[str, float]:
        if not m.grads:
            return {}
        local, reduced = m.agreement.local()
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
        mine = self._guard("telemetry", self._observer.gpu_snapshot) if self.rank in suspected else None
        snaps = gather_objects(mine, self._group) if self._distributed else [mine]
        by_rank = {self._ranks[i]: s for i, s in enumerate(snaps) if s}
        for incident in incidents:
            counters = {str(r): by_rank[r] for r in incident.suspect_ranks[:16] if r in by_rank}
            if counters:
                incident.evidence["gpu_counters"] = counters

    def _after_update(self, *_: Any) -> None:
        """Optimizer post-step hook: says once if steps run outside ``monitor.step()`` (no checks ran for them)."""
        if not self._ended_since_update:
            self._warn_once("no-step", "sdc_telemetry: optimizer.step() ran without a `with monitor.step(...)` "
                            "block since the last update: no check runs for such steps")
        self._ended_since_update = False

    # -- set-up --------------------------------------------------------------------------------------------------

    def _setup(self, start_step: int, signature: int, log_error: str | None) -> list[int] | None:
        """Collective set-up checks: configurations and start steps agree, the incident log opened, and whether
        every rank has the same numerics signature. Returns per-position signature classes when they differ."""
        config_hash = _hash64(repr(sorted(vars(self.config).items())) + f"|{start_step}")
        vec = torch.tensor([config_hash, int(log_error is not None), signature], dtype=torch.int64)
        if not self._distributed:
            if log_error:
                raise ValueError(log_error)
            return None
        high, low = agree(vec.to(self.device), self._group)
        if high[1]:
            msg = log_error or "the first rank of the group could not open SDCConfig.incident_dir"
            raise ValueError(f"{msg} (every rank stops here)")
        if high[0] != low[0]:
            raise ValueError("SDCConfig or start_step differs between ranks: every rank must construct the monitor "
                             "with the same settings (checks run on the same steps everywhere)")
        if high[2] == low[2]:
            return None
        gathered = gather_rows(torch.tensor([signature], dtype=torch.int64), self._group, self.device)
        classes = [r[0] for r in gathered]
        if self._writer:
            log.warning("sdc_telemetry: the ranks run on %d different hardware/software stacks: exact comparison only "
                        "between ranks of the same stack; the replay compares with a calibrated tolerance",
                        len(set(classes)))
        return classes

    def _slots(self) -> int:
        """Digest slots of the status vector: one per shard index for HSDP, none otherwise (one DIGEST field)."""
        return self._layout.shard_size if self._layout is not None and self._layout.hsdp else 0

    def _shard_classes(self, classes: list[int] | None) -> list[tuple[int, int]]:
        """Per position: (numerics class, shard index): weights are compared among replicas of the same shard."""
        assert self._shard_of is not None
        return [(classes[i] if classes is not None else 0, shard) for i, shard in enumerate(self._shard_of)]

    def _open_incident_log(self) -> tuple[IncidentLog | None, str | None]:
        if not (self._writer and self.config.incident_dir):
            return None, None
        try:
            return IncidentLog(self.config.incident_dir), None
        except OSError as e:
            return None, f"SDCConfig.incident_dir={self.config.incident_dir!r} is not usable: {e}"

    def _resolve_mode(self, classes: list[int] | None) -> str:
        if classes is not None:
            if self.config.mode == "exact" and self._writer:
                log.warning("sdc_telemetry: mode='exact' with mixed hardware/software stacks: the replay uses a "
                            "calibrated tolerance instead")
            return "tolerance"
        if self.config.mode != "auto":
            return self.config.mode
        exact = self.device.type == "cpu" or torch.are_deterministic_algorithms_enabled()
        return "exact" if exact else "tolerance"

    def _install_comm_hook(self, hook: grad_check.CommHook | None, state: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        inner = hook if hook is not None else default_hooks.allreduce_hook
        assert isinstance(self.model, DistributedDataParallel)
        # DDP's own group, whatever replica_group is: the monitor must not change how gradients are averaged.
        inner_state = state if hook is not None else self.model.process_group
        self._hook_state = grad_check.CommHookState(self._record, inner, inner_state)
        assert isinstance(self.model, DistributedDataParallel)
        try:
            self.model.register_comm_hook(self._hook_state, grad_check.comm_hook)
        except RuntimeError as e:
            raise ValueError("the DDP model already has a communication hook; the monitor must wrap it to see local "
                             "gradients before the all-reduce. Register none, and pass yours as "
                             "SDCMonitor(..., comm_hook=your_hook, comm_state=your_state)") from e

    def _build_telemetry(self, registry: Any, meter_provider: Any, nvml: Any) -> Observer:
        try:
            from sdc_telemetry.sinks.telemetry import Telemetry
        except ImportError:
            log.warning("sdc_telemetry: OpenTelemetry is not importable; checks go on without metrics",
                        exc_info=True)
            return Observer()
        try:
            telemetry: Observer = Telemetry(self.config, self.identity, registry=registry,
                                            meter_provider=meter_provider, nvml=nvml)
            return telemetry
        except Exception:
            log.exception("sdc_telemetry: telemetry could not start; checks go on without metrics")
            return Observer()

    def _build_pager(self) -> Any:
        if not (self.config.alertmanager_url and self._writer):
            return None
        try:
            from sdc_telemetry.sinks.pager import AlertmanagerPusher

            return AlertmanagerPusher(self.config.alertmanager_url, self.config.job_name,
                                      on_error=lambda: self._observer.internal_error("alertmanager"))
        except Exception:
            log.exception("sdc_telemetry: the Alertmanager push could not start; pages depend on Prometheus")
            return None

    def _announce(self, replicas: bool) -> None:
        hosts = len({i.host_name for i in self.identities.values()})
        checks = [*(("grad_local", "grad_reduced" if self._distributed else "") if self.config.grad_checks else ()),
                  *((f"weights every {self.config.weights_every}",) if replicas and self.config.weights_every else ()),
                  *((f"replay every {self.config.replay_every} ({self.mode})",) if self._replay else ())]
        text = (f"sdc_telemetry: monitoring {self._world} rank(s) on {hosts} host(s) from step {self._next_step}: "
                f"{', '.join(c for c in checks if c) or 'no checks'}; on_suspect={self.config.on_suspect}")
        if not replicas:
            text += " (one replica: weight and replay checks need several ranks and are off)"
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
        self._guard("telemetry", self._observer.internal_error, component)

    def _guard(self, component: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SDCDetected:
            raise
        except Exception:  # telemetry and bookkeeping never break training
            log.exception("sdc_telemetry: %s failed (rank %d); training goes on", component, self.rank)
            if component != "telemetry":
                try:
                    self._observer.internal_error(component)
                except Exception:
                    log.debug("sdc_telemetry: counting an internal error failed", exc_info=True)
            return None


def _local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor parameter (a view, no copy)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t  # type: ignore[no-any-return]


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)
