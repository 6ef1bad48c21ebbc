"""SDCMonitor: drives the checks from the training loop's own hooks and hands verdicts to response and telemetry."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ._collective import gather_objects, gather_rows, group_ranks
from .checks import Finding
from .checks import grad as grad_check
from .checks import weights as weights_check
from .checks.replay import ReplayCheck
from .config import SDCConfig
from .identity import RankIdentity
from .observer import Observer
from .response import Incident, IncidentLog, SDCDetected
from .step import NO_BATCH, StepContext

__all__ = ["SDCMonitor"]

log = logging.getLogger("sdc_telemetry")

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


class SDCMonitor:
    """Silent-data-corruption checks for a DistributedDataParallel training loop.

    >>> monitor = SDCMonitor(ddp_model, optimizer, loss_fn=compute_loss,            # doctest: +SKIP
    ...                      config=SDCConfig(weights_every=1, replay_every=50, on_suspect="raise"))
    >>> for batch in loader:                                                        # doctest: +SKIP
    ...     with monitor.step(batch) as step:
    ...         step.backward(compute_loss(ddp_model, batch))
    ...     optimizer.step()
    ...     optimizer.zero_grad()
    >>> monitor.close()                                                             # doctest: +SKIP

    Construction is collective (every rank of the replica group must construct it) and so are ``verify_weights()``
    and every optimizer step. ``replica_group`` defaults to the DDP model's process group. If the model already needs
    a comm hook, pass it as ``comm_hook=`` (with ``comm_state=``) instead of registering it: the monitor wraps it.
    ``observer`` replaces the telemetry built from the config (tests, custom sinks).
    """

    def __init__(self, model: DistributedDataParallel, optimizer: torch.optim.Optimizer,
                 loss_fn: LossFn | None = None, config: SDCConfig | None = None, *,
                 replica_group: dist.ProcessGroup | None = None,
                 comm_hook: grad_check.CommHook | None = None, comm_state: Any = None,
                 observer: Observer | None = None, **telemetry_deps: Any) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"SDCMonitor needs a torch.nn.parallel.DistributedDataParallel model, got "
                            f"{type(model).__name__}; wrap it first: DistributedDataParallel(model)")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("SDCMonitor needs an initialised process group: call "
                               "torch.distributed.init_process_group() first (torchrun sets up the environment)")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.config = config if config is not None else SDCConfig.from_env()
        if not isinstance(self.config, SDCConfig):
            raise TypeError(f"config must be an SDCConfig, got {type(self.config).__name__}")
        if self.config.replay_every and any(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules()):
            raise ValueError("SyncBatchNorm computes its statistics across ranks, so a replay of one rank's "
                             "micro-batch cannot reproduce it; set SDCConfig(replay_every=0) for this model")
        if self.config.replay_every and loss_fn is None:
            raise ValueError(f"SDCConfig.replay_every={self.config.replay_every} needs loss_fn= (called as "
                             "loss_fn(module, batch) -> scalar loss to recompute a step); pass it, or set "
                             "replay_every=0")
        self.model = model
        self.optimizer = optimizer
        self._group = replica_group if replica_group is not None else model.process_group
        self._ranks = group_ranks(self._group)
        self._world = len(self._ranks)
        self.rank = dist.get_rank()
        named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no parameters that require gradients: nothing to check")
        self._params = [p for _, p in named]
        self._names = [n for n, _ in named]
        self.device = self._params[0].device
        self.mode = self._resolve_mode()

        self.identity = RankIdentity.local(self.device if self.device.type == "cuda" else None)
        gathered = gather_objects(self.identity, self._group)
        self.identities: dict[int, RankIdentity] = {i.rank: i for i in gathered if isinstance(i, RankIdentity)}
        self._writer = self.rank == self._ranks[0]
        self.incidents: list[Incident] = []
        self._incident_log = IncidentLog(self.config.incident_dir) if self._writer and self.config.incident_dir \
            else None
        self._observer = observer if observer is not None else self._build_telemetry(telemetry_deps)

        self._step = -1
        self._next_step = 0
        self._opened = False
        self._implicit_warned = False
        self._skip_warned: set[str] = set()
        self._closed = False

        checked = self._world > 1
        if not checked and (self.config.weights_every or self.config.replay_every):
            log.warning("sdc_telemetry: the replica group has one rank: weight and replay checks are disabled "
                        "(nothing to compare against); gradient checks stay on")
        # Every parameter, frozen ones included (LoRA-style fine-tuning freezes most weights; they must still agree).
        every = list(model.module.named_parameters())
        self._weights = weights_check.WeightsCheck(every, self._group, self._ranks) \
            if checked and self.config.weights_every else None
        self._replay = ReplayCheck(model.module, loss_fn, named, self._group, self._ranks, self.identities,
                                   self.device, self.mode, self.config.tolerance, self.config.replay_every) \
            if checked and self.config.replay_every and loss_fn is not None else None

        self._record = grad_check.GradRecord(self._params, self.device) \
            if self.config.grad_checks or self._replay is not None else None
        self._hook_state: grad_check.CommHookState | None = None
        if self._record is not None:
            self._install_comm_hook(comm_hook, comm_state)
        self._handles = [optimizer.register_step_pre_hook(self._before_update),
                         optimizer.register_step_post_hook(self._after_update)]
        if self.rank == self._ranks[0]:
            log.info("sdc_telemetry: monitoring %d ranks (%d hosts), mode=%s, weights_every=%d, replay_every=%d, "
                     "grad_checks=%s, on_suspect=%s", self._world, len({i.host_name for i in gathered
                                                                     if isinstance(i, RankIdentity)}),
                     self.mode, self.config.weights_every if self._weights else 0,
                     self.config.replay_every if self._replay else 0, self.config.grad_checks,
                     self.config.on_suspect)

    # -- public --------------------------------------------------------------------------------------------------

    def step(self, batch: Any = NO_BATCH) -> StepContext:
        """Context for one optimizer step; ``batch`` is its (only) micro-batch, kept for replay on audit steps."""
        if self._closed:
            raise RuntimeError("SDCMonitor is closed")
        return StepContext(self, batch)

    @property
    def current_step(self) -> int:
        """Index of the step in progress (or last finished); -1 before the first step."""
        return self._step

    def verify_weights(self) -> Incident | None:
        """Run the weight check now, on every rank (call it before saving a checkpoint). Collective."""
        if self._weights is None:
            return None
        found = self._run_weights(max(self._step, 0))
        incidents = self._respond(found, max(self._step, 0))
        return incidents[0] if incidents else None

    def close(self) -> None:
        """Remove the hooks, flush and stop telemetry. The comm hook stays registered (DDP cannot remove it) but
        only forwards to the wrapped all-reduce. A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        for h in self._handles:
            h.remove()
        if self._replay is not None:
            self._replay.close()
        if self._hook_state is not None:
            self._hook_state.enabled = False
        if self._incident_log is not None:
            self._incident_log.close()
        self._guard("telemetry", self._observer.close)

    def __enter__(self) -> SDCMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- step bookkeeping ----------------------------------------------------------------------------------------

    def _open_step(self) -> int:
        self._step = self._next_step
        self._opened = True
        if self._record is not None:
            self._record.reset(detail=self._replay is not None and self._replay.due(self._step))
        if self._replay is not None:
            self._replay.begin_step(self._step)
        return self._step

    def _micro_batch(self, batch: Any) -> None:
        if self._replay is not None:
            self._replay.capture(batch)

    def _record_loss(self, loss: torch.Tensor, scale: float) -> None:
        if self._replay is not None:
            self._replay.record_loss(loss, scale)

    def _current(self) -> int:
        if not self._opened:
            self._step = self._next_step
            self._opened = True
            if self._replay is not None:
                self._replay.drop()
            if not self._implicit_warned:
                self._implicit_warned = True
                log.warning("sdc_telemetry: optimizer.step() ran without `with monitor.step(batch)`; counting it as "
                            "step %d (replay cannot audit such steps)", self._step)
        return self._step

    # -- hooks ---------------------------------------------------------------------------------------------------

    def _before_update(self, *_: Any) -> None:
        step = self._current()
        findings: list[Finding] = []
        rows = self._run_grads(step, findings) if self._record is not None else None
        if self._replay is not None and rows is not None and not findings and self._replay.due(step) \
                and self._replayable(step, rows):
            findings += self._run_replay(step, rows)
        elif self._replay is not None:
            self._replay.drop()
        if self._record is not None:
            self._record.reset()
        self._respond(findings, step)

    def _replayable(self, step: int, rows: list[grad_check.StatusRow]) -> bool:
        """Same answer on every rank (from the gathered rows): can this audit step be replayed at all?"""
        if all(r.comparable and r.replayable for r in rows):
            return True
        if any(r.repeated for r in rows):
            reason = ("a gradient bucket was all-reduced more than once in the step: with gradient accumulation, "
                      "run all but the last micro-batch under ddp_model.no_sync()")
        elif not all(r.replayable for r in rows):
            reason = "not every rank captured the step (use `with monitor.step(batch)` or step.micro_batch())"
        else:
            reason = "local gradients were not measured on every rank"
        if reason not in self._skip_warned and self._writer:
            log.warning("sdc_telemetry: step %d: replay skipped: %s", step, reason)
        self._skip_warned.add(reason)
        return False

    def _after_update(self, *_: Any) -> None:
        step = self._current()
        self._opened = False
        self._next_step = step + 1
        findings: list[Finding] = []
        if self._weights is not None and step % self.config.weights_every == 0:
            findings = self._run_weights(step)
        self._guard("telemetry", self._observer.step_done, step)
        self._respond(findings, step)

    # -- checks --------------------------------------------------------------------------------------------------

    def _run_grads(self, step: int, findings: list[Finding]) -> list[grad_check.StatusRow] | None:
        """Gather every rank's gradient status (always: the replay uses the local fingerprints too)."""
        start = time.perf_counter()
        reduced, error = None, False
        try:
            if self.config.grad_checks:
                reduced = grad_check.reduced_norms(self._params, self.device)
            replayable = self._replay is not None and self._replay.due(step) and self._replay.ready()
            row = grad_check.StatusRow.build(step, self._record, reduced, error, replayable)
        except Exception:  # noqa: BLE001 - contained; the collective below must still run on this rank
            self._internal_error("grad", "measuring gradients failed")
            row = grad_check.StatusRow.build(step, None, None, True)
        rows = [grad_check.StatusRow.parse(r) for r in gather_rows(row, self._group)]
        mine = rows[self._ranks.index(self.rank)]
        if len({r.step for r in rows}) != 1 and self._writer:
            log.error("sdc_telemetry: ranks disagree on the step index %s: the training loops are out of step",
                      {self._ranks[i]: r.step for i, r in enumerate(rows)})
        failed = [self._ranks[i] for i, r in enumerate(rows) if r.error or (self.config.grad_checks
                                                                             and not r.local_measured)]
        if failed and self._writer:
            log.warning("sdc_telemetry: step %d: gradient checks could not measure ranks %s (no DDP all-reduce "
                        "this step, or a measurement error)", step, failed)
        if not self.config.grad_checks:
            return rows
        finding = self._guard("grad", grad_check.decide, rows, self._ranks, True)
        elapsed = time.perf_counter() - start
        if mine.local_measured:  # an unmeasured rank reports nothing rather than a NaN norm
            self._guard("telemetry", self._observer.grad_measured, "local", mine.local_norm,
                        not math.isfinite(mine.local_norm))
        self._guard("telemetry", self._observer.grad_measured, "reduced", mine.reduced_norm,
                    not math.isfinite(mine.reduced_norm))
        self._guard("telemetry", self._observer.check_done, "grad_local",
                    finding is None or finding.check != "grad_local", elapsed)
        self._guard("telemetry", self._observer.check_done, "grad_reduced",
                    finding is None or finding.check != "grad_reduced", elapsed)
        if finding is not None:
            findings.append(self._with_nonfinite_names(finding))
        return rows

    def _with_nonfinite_names(self, finding: Finding) -> Finding:
        """Rare path, after a non-finite verdict that every rank shares: gather which parameters were affected."""
        mine: list[str] = []
        try:
            # A non-finite local gradient spreads through the all-reduce element by element, so the reduced
            # gradients name the same parameters (the local bucket was overwritten by the all-reduce).
            norms = grad_check.reduced_norms(self._params, self.device).tolist()
            mine = [self._names[i] for i, n in enumerate(norms) if not math.isfinite(n)][:32]
        except Exception:  # noqa: BLE001
            self._internal_error("grad", "listing non-finite parameters failed")
        names = gather_objects(mine, self._group)
        evidence = dict(finding.evidence)
        evidence["nonfinite_parameters"] = {str(self._ranks[i]): n for i, n in enumerate(names)
                                            if self._ranks[i] in finding.suspect_ranks}
        return Finding(finding.check, finding.suspect_ranks, evidence)

    def _run_replay(self, step: int, rows: list[grad_check.StatusRow]) -> list[Finding]:
        assert self._replay is not None and self._record is not None
        start = time.perf_counter()
        finding, measured = self._replay.run(step, [r.local_fp for r in rows], self._record.norms)
        for m in measured:
            self._guard("telemetry", self._observer.replay_measured, m.origin_rank, m.loss_delta, m.grad_delta,
                        m.mismatch)
        if self._replay.errors and self._writer:
            log.warning("sdc_telemetry: step %d: replay failed on ranks %s: %s", step, self._replay.errors,
                        self._replay.error_text)
        if self._replay.errors:
            self._guard("telemetry", self._observer.internal_error, "replay")
        self._guard("telemetry", self._observer.check_done, "replay", finding is None, time.perf_counter() - start)
        return [finding] if finding is not None else []

    def _run_weights(self, step: int) -> list[Finding]:
        assert self._weights is not None
        start = time.perf_counter()
        finding, failed = self._weights.run()
        if failed:
            if self.rank in failed:
                self._guard("telemetry", self._observer.internal_error, "weights")
            if self._writer:
                log.warning("sdc_telemetry: step %d: weight check skipped: ranks %s could not fingerprint their "
                            "parameters", step, failed)
            return []
        agrees = finding is None or self.rank not in finding.suspect_ranks
        self._guard("telemetry", self._observer.weights_measured, agrees)
        self._guard("telemetry", self._observer.check_done, "weights", finding is None,
                    time.perf_counter() - start)
        return [finding] if finding is not None else []

    # -- response ------------------------------------------------------------------------------------------------

    def _respond(self, findings: list[Finding], step: int) -> list[Incident]:
        incidents = []
        gpu = self._gpu_snapshots(findings) if findings else {}
        for f in findings:
            suspects = tuple(self.identities.get(r, RankIdentity(r, -1, "unknown", "unknown"))
                             for r in f.suspect_ranks)
            evidence = dict(f.evidence)
            counters = {str(r): gpu[r] for r in f.suspect_ranks if gpu.get(r)}
            if counters:
                evidence["gpu_counters"] = counters
            incident = Incident(step=step, check=f.check, suspect_ranks=f.suspect_ranks, suspects=suspects,
                                evidence=evidence)
            incidents.append(incident)
            self.incidents.append(incident)
            if self._writer:
                log.error("%s", incident.describe())
            if self._incident_log is not None:
                self._guard("incident_log", self._incident_log.append, incident)
            self._guard("telemetry", self._observer.incident, incident, self.rank in f.suspect_ranks)
        if incidents and self.config.on_suspect == "raise":
            raise SDCDetected(incidents[0])
        return incidents

    def _gpu_snapshots(self, findings: list[Finding]) -> dict[int, Any]:
        """The suspects' GPU counters, gathered so that every rank's incident carries the same evidence.

        Collective, like the findings themselves: every rank reaches here with the same findings."""
        suspected = {r for f in findings for r in f.suspect_ranks}
        mine = self._guard("telemetry", self._observer.gpu_snapshot) if self.rank in suspected else None
        return {self._ranks[i]: s for i, s in enumerate(gather_objects(mine, self._group)) if s}

    # -- plumbing ------------------------------------------------------------------------------------------------

    def _resolve_mode(self) -> str:
        if self.config.mode != "auto":
            return self.config.mode
        exact = self.device.type == "cpu" or torch.are_deterministic_algorithms_enabled()
        return "exact" if exact else "tolerance"

    def _install_comm_hook(self, hook: grad_check.CommHook | None, state: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        assert self._record is not None
        inner = hook if hook is not None else default_hooks.allreduce_hook
        inner_state = state if hook is not None else self._group
        self._hook_state = grad_check.CommHookState(self._record, inner, inner_state)
        try:
            self.model.register_comm_hook(self._hook_state, grad_check.comm_hook)
        except RuntimeError as e:
            raise ValueError("the DDP model already has a communication hook; the monitor must wrap it to see local "
                             "gradients before the all-reduce. Register none, and pass yours as "
                             "SDCMonitor(..., comm_hook=your_hook, comm_state=your_state)") from e

    def _build_telemetry(self, deps: dict[str, Any]) -> Observer:
        try:
            from .telemetry import Telemetry
        except ImportError:
            log.warning("sdc_telemetry: OpenTelemetry is not importable; checks go on without metrics",
                        exc_info=True)
            return Observer()
        try:
            telemetry: Observer = Telemetry(self.config, self.identity, **deps)
            return telemetry
        except Exception:
            log.exception("sdc_telemetry: telemetry could not start; checks go on without metrics")
            return Observer()

    def _internal_error(self, component: str, what: str) -> None:
        log.exception("sdc_telemetry: %s (rank %d); training goes on", what, self.rank)
        self._guard("telemetry", self._observer.internal_error, component)

    def _guard(self, component: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except SDCDetected:
            raise
        except Exception:  # telemetry and bookkeeping never break training
            log.exception("sdc_telemetry: %s failed (rank %d); training goes on", component, self.rank)
            if component != "telemetry":
                with contextlib.suppress(Exception):
                    self._observer.internal_error(component)
            return None

