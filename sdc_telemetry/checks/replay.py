"""``replay``: recompute a partner rank's micro-batches and compare loss and local-gradient fingerprints.

Before the optimizer step every replica holds the same weights, so rank j recomputing rank i's micro-batches with
rank i's RNG states must reproduce rank i's losses and pre-all-reduce gradients: bit for bit in exact mode, within
``tolerance`` otherwise. Only recomputation catches finite-but-wrong arithmetic, since the all-reduce averages it
into identical (wrong) weights everywhere.

Protocol per audit step (all ranks, same collectives):
1. cross round: replayer p audits origin (p + s) mod W; the shift s rotates between audits and prefers partners on
   another host. Micro-batches, RNG states, losses and the per-parameter gradient-norm sketch travel point-to-point.
2. only after a mismatch: every rank reruns its own micro-batches (is the origin reproducible?) and, with 3 or more
   ranks, a referee round with another shift audits every origin again.
``attribute`` turns the gathered outcomes into one verdict (pure, unit-tested).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sdc_telemetry.checks import calibration, late
from sdc_telemetry.checks.calibration import AUTO_FLOOR, Calibration, histogram, noise_median
from sdc_telemetry.checks.pairing import Outcome, attribute, plan_pairs, plan_replica_pairs
from sdc_telemetry.checks.recompute import Recompute, Recomputer, Result, autocast_state, pipeline_loss, scaled
from sdc_telemetry.checks.shipping import MicroBatch, check_shippable, exchange
from sdc_telemetry.checks.sketch import deltas as sketch_deltas
from sdc_telemetry.checks.sketch import floor as sketch_floor
from sdc_telemetry.core.collective import agree, collective_device, gather_rows, sum_counts
from sdc_telemetry.core.evidence import MAX_ITEMS, bits, json_float, unbits
from sdc_telemetry.core.findings import Finding
from sdc_telemetry.core.identity import RankIdentity

__all__ = ["ReplayCheck", "Measurement", "Outcome", "attribute", "plan_pairs", "scaled", "check_shippable",
           "pipeline_loss", "noise_median"]

_CALIBRATE_EVERY = 10  # audits between noise-floor recalibrations in tolerance="auto"
_CONFIRM = 3.0  # tolerance mode: a persistent finding this far above its thresholds is named at once
_NORM_SHARE = 1.0  # a parameter's norm change is measured against at least its part of the whole gradient's norm


@dataclass(frozen=True)
class Measurement:
    """This rank's comparison against the origin rank it audited."""

    origin_rank: int
    loss_delta: float
    grad_delta: float
    mismatch: bool


class ReplayCheck:
    """Captures audited steps and runs the replay protocol. Collective: every rank calls ``run`` at the same step."""

    def __init__(self, module: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None,
                 named_params: Sequence[tuple[str, torch.nn.Parameter]], group: dist.ProcessGroup | None,
                 ranks: Sequence[int], identities: dict[int, RankIdentity], device: torch.device, mode: str,
                 tolerance: float | str, every: int, recompute: Recompute | None = None,
                 every_step: bool = False, units: tuple[list[int], list[int]] | None = None,
                 coordinate_of: Callable[[int], dict[str, int] | None] | None = None,
                 rerun: Callable[..., Any] | None = None, classes: Sequence[int] | None = None,
                 outputs: Any = None, grad_fields: bool = True,
                 quiet: Callable[[], AbstractContextManager[None]] | None = None,
                 rng: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
                 into: Sequence[torch.dtype | None] | None = None) -> None:
        if loss_fn is None and rerun is None:
            raise ValueError("replay needs loss_fn(module, batch) -> scalar loss")
        self._params = [p for _, p in named_params]
        # Layouts whose recomputation runs collectives (FSDP2): every rank recomputes at once, through ``recompute``.
        self._lockstep = recompute
        self._recomputer = Recomputer(module, loss_fn, self._params, device, mode, recompute, rerun=rerun,
                                      grad_fields=grad_fields, quiet=quiet, rng=rng, into=into)
        self._group = group
        self._ranks = list(ranks)
        self._pos = self._ranks.index(dist.get_rank())
        self._device = device
        self._wire = collective_device(group, device)
        self.mode = mode
        self._auto = tolerance == "auto"
        # One threshold per compared quantity: the loss and the whole gradient's norms, each parameter's gradient
        # norm (a fault in a module's arithmetic scales its parameters' gradients coherently: their norms move by its
        # size, while kernel noise spread over the elements barely moves them), then each parameter's block sketch
        # (a flipped sign or mantissa bit of one element).
        count = len(self._params)
        self._sizes = torch.tensor([p.numel() for p in self._params], dtype=torch.float64)  # for the norms' floor
        factors = [calibration.CROSS_FACTOR] * (1 + count) + [calibration.SKETCH_FACTOR] * count
        self._threshold = Calibration(1 + 2 * count, factors, kinds=[0] * (1 + count) + [1] * count) \
            if self._auto else None
        self._features: list[float] | None = None  # the last comparison's deltas per quantity (healthy audits)
        self._fixed = float(tolerance) if not self._auto else 0.0
        self._every = every
        # Triggered audits: every step's micro-batches are kept (references to the batches, RNG states, losses),
        # so that an anomalous step can be replayed at once.
        self._every_step = every_step
        hosts = [identities[r].host_name if r in identities else str(r) for r in self._ranks]
        self._hosts = hosts
        # N-D layouts: the ranks of a replica compute one micro-batch together; replicas are paired, and each
        # position replays the same coordinate of the partner replica. ``classes`` (a numerics class per position,
        # where the ranks' stacks differ): partners only within a class.
        self._replica_of = units[0] if units is not None else None
        self._replica_count = max(units[0]) + 1 if units is not None else len(self._ranks)
        self._pairs = plan_replica_pairs(hosts, *units, classes=classes) if units is not None \
            else plan_pairs(hosts, classes)
        self.alone = [self._ranks[p] for p in self._pairs.alone]  # ranks no partner can audit (their own class)
        self._coordinate_of = coordinate_of
        self._last_deltas: dict[str, dict[str, float | str]] = {}
        self._audits = 0
        self._capturing = False
        self._hook = module.register_forward_pre_hook(self._on_forward)
        self._micro: list[MicroBatch] = []
        self._micro_step = -1
        # Deferred verdicts: the previous step's record stays referenced until that step is decided (a late audit).
        self.keep_previous = False
        self._previous: tuple[int, list[MicroBatch]] = (-1, [])
        self.errors: list[int] = []
        self.error_text = ""
        self.unconfirmed = 0  # tolerance mode: mismatches counted as noise (not repeated) or waiting for a repeat
        self.unconfirmed_text = ""
        self._margins: dict[tuple[int, int], float] = {}  # mismatching (replayer, origin) -> delta / threshold
        self._rerun_margins: dict[int, float] = {}  # positions that did not reproduce themselves -> delta / threshold
        self._pending: tuple[frozenset[int], int] | None = None  # a narrow persistent finding waiting for a repeat
        # Pipelines: each stage's forward outputs on scheduled audits (``parallel.outputs.StageOutputs``), compared
        # with the origin's to name the stage that computed wrongly; per mismatching pair and per position that did
        # not reproduce itself, which of its stages' outputs differed (a bit per local stage: 1 differed, 0 all
        # matched) or -1 when they were not compared.
        self._outputs = outputs
        self._step_outputs: tuple[list[int], list[float], list[int]] | None = None  # this step's, when recorded
        self._output_marks: dict[tuple[int, int], int] = {}
        self._rerun_output_marks: dict[int, int] = {}

    @property
    def tolerance(self) -> float:
        """The relative threshold of tolerance mode (calibrated with ``tolerance="auto"``)."""
        return self._threshold.tolerance if self._threshold is not None else self._fixed

    @property
    def thresholds(self) -> list[float]:
        """Per compared quantity (the loss and the gradient's norms, each parameter's norm, then its sketch)."""
        return self._threshold.thresholds if self._threshold is not None else \
            [self._fixed] * (1 + 2 * len(self._params))

    @property
    def noise_floor(self) -> float:
        return self._threshold.noise_floor if self._threshold is not None else 0.0

    # -- capture (training thread, every step) -------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """A scheduled audit step (``replay_every``; 0: none, triggered audits only)."""
        return self._every > 0 and step % self._every == 0

    def begin_step(self, step: int) -> None:
        self._previous = (self._micro_step, self._micro) if self.keep_previous else (-1, [])
        self._micro = []
        self._micro_step = step
        self._capturing = self.due(step) or self._every_step
        self._step_outputs = None
        if self._outputs is not None and self._outputs.whole_step:  # recorded from here to the step's audit
            if self.due(step):
                self._outputs.start()
            else:
                self._outputs.finish()

    @contextmanager
    def stage_outputs(self) -> Iterator[None]:
        """Around a pipeline stage's schedule step: on a scheduled audit step, records the stage's forward outputs
        (and nothing else: not a late audit's rerun, not an evaluation)."""
        if self._outputs is None:
            yield
            return
        with self._outputs.recording(self.due(self._micro_step)) as got:
            yield
        self._step_outputs = got[0] if got else None

    def close(self) -> None:
        self._hook.remove()
        if self._outputs is not None:
            self._outputs.close()
        self._micro = []
        self._previous = (-1, [])

    def ready(self) -> bool:
        """This rank holds a complete record of the step being audited (every micro-batch and its loss)."""
        return self._capturing and bool(self._micro) and all(m.loss is not None for m in self._micro)

    def drop(self) -> None:
        self._micro = []
        self._capturing = False
        if self._outputs is not None and self._outputs.whole_step:
            self._outputs.finish()  # the step will not be audited: stop recording its forwards

    def _paused_outputs(self) -> Any:
        """A context in which forwards are not recorded (a recording in progress resumes after it)."""
        return self._outputs.recording(False) if self._outputs is not None else nullcontext()

    def capture(self, batch: Any) -> None:
        check_shippable(batch)
        if not self._capturing:
            self._micro.append(MicroBatch(None, torch.empty(0), None, None))  # counts micro-batches only
            return
        dev_rng = torch.cuda.get_rng_state(self._device) if self._device.type == "cuda" else None
        self._micro.append(MicroBatch(batch, torch.get_rng_state(), dev_rng, autocast_state(self._device),
                                      framework_rng=self._recomputer.framework_rng()))

    def _on_forward(self, *_: Any) -> None:
        """Forward pre-hook of the module: the autocast state the forward pass really runs under (users enter
        autocast around the forward and leave it before backward, so neither micro_batch() nor backward() sees it)."""
        if self._capturing and not self._recomputer.replaying and self._micro and self._micro[-1].loss is None:
            state = autocast_state(self._device)
            if state is not None:
                self._micro[-1].autocast = state

    def record_loss(self, loss: torch.Tensor, scale: float, grad_scale: torch.Tensor | None = None) -> None:
        pending = [m for m in self._micro if m.loss is None]
        if not pending:
            raise ValueError("step.backward() without a registered micro-batch: the replay check needs the batch. "
                             "Open the step with monitor.step(batch), or call step.micro_batch(batch) before each "
                             "micro-batch's forward pass")
        mb = pending[0]
        mb.scale = float(scale)
        mb.loss = loss.detach().clone() if self._capturing else torch.empty(0)
        if self._capturing:
            mb.grad_scale = grad_scale.detach().clone() if grad_scale is not None else None
            mb.had_grad = [p.grad is not None for p in self._params]
            if mb.autocast is None:
                mb.autocast = autocast_state(self._device)

    def pipeline_batch(self, batch: tuple[Any, ...]) -> None:
        """A pipeline stage's step: ``(inputs, target, kwargs)`` of its ``schedule.step`` is the replay unit (the RNG
        states were captured when the step opened)."""
        check_shippable(batch)
        if not self._micro:
            self.capture(batch)
        elif self._capturing:
            self._micro[-1].batch = batch

    def set_had_grad(self, had_grad: list[bool]) -> None:
        """Which parameters held ``.grad`` before the step's backward (a pipeline stage records its loss after the
        schedule ran the backward)."""
        if self._capturing and self._micro:
            self._micro[-1].had_grad = had_grad

    # -- the audit (end of the step, before the update) ----------------------------------------------------------

    def audit(self, blocked: str | None, local: Callable[[], tuple[int, torch.Tensor, torch.Tensor | None]],
              warn: Callable[[str, str], None], on_error: Callable[[], None]
              ) -> tuple[Finding | None, str, Measurement | None]:
        """The audit of the step: skipped (``blocked`` says why: the same on every rank), else the replay protocol
        on ``local()`` (this rank's recorded gradient digest and per-parameter norms). Returns the finding, this
        rank's result, and its comparison."""
        if blocked is not None:
            self.drop()
            warn(blocked, f"replay skipped: {blocked}")
            return None, "skipped", None
        try:
            local_fp, local_norms, local_sketch = local()
        except Exception:  # noqa: BLE001 - the replay protocol below must still run on this rank
            on_error()
            local_fp, local_norms, local_sketch = 0, torch.zeros(len(self._params)), None
        unconfirmed = self.unconfirmed
        finding, measured = self.run(local_fp, local_norms, local_sketch)
        if self.unconfirmed > unconfirmed:
            warn("replay-unconfirmed", f"replay: {self.unconfirmed_text} ({self.unconfirmed} so far; said once)")
        if self.errors:
            warn("replay-error:" + self.error_text.split(":")[0],
                 f"replay failed on ranks {self.errors[:16]}: {self.error_text} (counted as errors, not passes)")
            mine = self._ranks[self._pos] in self.errors or measured is None
            return None, "error" if mine else "pass", measured
        return finding, "fail" if finding is not None else "pass", measured

    def run(self, local_fp: int | None, local_norms: torch.Tensor, local_sketch: torch.Tensor | None = None
            ) -> tuple[Finding | None, Measurement | None]:
        """Audit this step. ``local_fp``: this rank's recorded local-gradient digest (None on a triggered audit of a
        step that recorded none: then the per-parameter norms and the losses are compared, non-finite values
        alike on both sides counting as agreement); ``local_norms``: its per-parameter local-gradient norms (the
        tolerance sketch). Every rank calls it at the same step."""
        self.errors, self.error_text = [], ""
        self._margins, self._rerun_margins = {}, {}
        self._output_marks, self._rerun_output_marks = {}, {}
        micro = [m for m in self._micro if m.loss is not None and m.batch is not None]
        self._micro, self._capturing = [], False
        world = len(self._ranks)
        shift = self._pairs.shifts[self._audits % len(self._pairs.shifts)]
        triggered = local_fp is None
        auto = not triggered and self._auto and self.mode == "tolerance"
        calibrate = auto and self._audits % _CALIBRATE_EVERY == 0  # the rerun noise floor: one more recompute
        across = auto  # the cross-rank deltas: every scheduled audit, in its agreement (the model's size, not W's)
        self._audits += 0 if triggered else 1
        if not triggered and self._outputs is not None and self._outputs.whole_step:
            self._step_outputs = self._outputs.finish()

        mine = {"micro": micro, "fp": local_fp, "norms": local_norms.detach().float().cpu(),
                "sketch": local_sketch.detach().cpu() if local_sketch is not None and not triggered else None,
                "outputs": self._step_outputs}
        self._step_outputs = None
        outcome = Outcome(world)
        if calibrate:  # before comparing, so the first audit already uses a measured threshold
            self._calibrate(mine)
        edges, measured = self._cross_round(shift, mine, calibrate=across)
        outcome.edges += edges
        if self.errors or not edges:
            return None, measured
        # Rare path: a mismatch. Same-rank reruns, and with 3 or more ranks a referee round with another shift.
        outcome.reproduced = self._self_round(mine)
        replicas = self._replica_count
        others = (s for s in (*self._pairs.shifts, *range(1, replicas)) if s != shift)
        referee = next(others, None) if replicas >= 3 else None
        if referee is not None:
            more, _ = self._cross_round(referee, mine)
            outcome.edges += more
        if self.errors:
            return None, measured
        suspects, why = attribute(outcome, self._replica_of)
        suspects, stage = self._first_wrong_stage(suspects, why)
        if self._unconfirmed(suspects, why, outcome, refereed=referee is not None):
            return None, measured
        if why.get("fault") == "unfaithful":  # most ranks cannot reproduce themselves: replay is wrong, not hardware
            self.errors = list(self._ranks)
            self.error_text = ("replay could not reproduce the recorded step on most ranks (an unsupported pattern: "
                               "state changed between the step and the audit, or nondeterminism in exact mode)")
            return None, measured
        if not suspects:
            return None, measured
        involved = {p for e in outcome.edges[:MAX_ITEMS] for p in e}
        evidence: dict[str, Any] = dict(why)
        evidence.update({
            "mode": self.mode,
            "tolerance": self.tolerance if self.mode == "tolerance" else 0.0,
            "mismatching_pairs": [{"replayer": self._ranks[a], "origin": self._ranks[b]}
                                  for a, b in outcome.edges[:MAX_ITEMS]],
            "mismatching_pair_count": len(outcome.edges),
            "reproduced_own_result": {str(self._ranks[p]): ok for p, ok in outcome.reproduced.items()
                                      if not ok or p in involved},
            "deltas": self._last_deltas,
            "verdict": "transient" if why.get("fault") == "transient" else "persistent",
        })
        if stage is not None:
            keys = getattr(self._outputs, "evidence_keys", ("stage", "stage_found_by"))
            evidence[keys[0]], evidence[keys[1]] = stage
        if len(suspects) > 1 and not evidence.get("ambiguous") and len({self._hosts[p] for p in suspects}) > 1:
            # One replica is wrong, but its coordinates share activations and gradients through tensor, context or
            # pipeline collectives: a fault on one spreads to the others, so which host computed it is not known.
            evidence["ambiguous"] = True
            evidence["reason"] = ("one replica disagrees on several coordinates, on several hosts: the fault spreads "
                                  "through the replica's collectives, so which host computed it wrongly is not known")
        return Finding("replay", tuple(self._ranks[p] for p in suspects), evidence), measured

    # -- the late audit (deferred verdicts: one step later, on today's weights; see checks/late.py) ----------------

    def _take_record(self, step: int) -> list[MicroBatch]:
        """The complete micro-batches captured for ``step`` (the previous step's, or this one's when nothing has
        started since), released from here: a step is audited once."""
        if self._previous[0] == step:
            micro, self._previous = self._previous[1], (-1, [])
        elif self._micro_step == step:
            micro, self._micro, self._capturing = self._micro, [], False
        else:
            micro = []
        return [m for m in micro if m.loss is not None and m.batch is not None]

    def late_run(self, step: int, anomalous: bool, norms: torch.Tensor) -> late.LateResult:
        """Audit ``step`` one step late, on today's weights. Every rank calls it at the same step; ``anomalous``: this
        rank was non-finite, or an outlier, at that step; ``norms``: its recorded per-parameter local norms."""
        self.errors, self.error_text = [], ""
        micro = self._take_record(step)
        scales = [m.scale for m in micro]
        recorded = late.summary(_floats([m.loss for m in micro if m.loss is not None]), scales,
                                norms.detach().double().cpu().tolist())
        now: Result | None = None
        if self._lockstep is None or self._recomputable({"micro": micro}):
            try:
                if not micro:
                    raise RuntimeError(f"this rank holds no complete record of step {step}")
                with self._paused_outputs():  # not this step's audit: a whole-step recording must not see it
                    now = self._recomputer.run(micro)  # its own record, on today's weights
            except Exception as e:  # noqa: BLE001 - told to every rank through the gather below
                self.error_text = f"{type(e).__name__}: {e}"
        current = late.summary(now.losses, scales, now.norms.double().cpu().tolist()) if now is not None \
            else (math.nan, math.nan)
        move = late.distance(recorded, current) if now is not None and not anomalous else math.nan
        unusable = now is not None and not anomalous and not all(math.isfinite(x) for x in current)
        rows = gather_rows(torch.tensor([int(now is None), int(anomalous), int(unusable),
                                         bits(move) if math.isfinite(move) else -1], dtype=torch.int64),
                           self._group, self._wire)  # a triggered audit is the rare path: per-rank rows are fine
        self._collect_errors([[0, 0, 0, r[0]] for r in rows])
        flagged = [p for p, r in enumerate(rows) if r[1]]
        named = tuple(self._ranks[p] for p in flagged)
        if self.errors:
            return late.LateResult("error", anomalous=named, evidence={
                "reason": f"rerunning the step on today's weights failed on ranks {self.errors[:16]}"})
        if any(r[2] for r in rows):
            return late.LateResult("undecided", anomalous=named, evidence={
                "reason": "today's weights give non-finite values on ranks that were healthy at that step (its "
                          "non-finite update was applied), so the step cannot be replayed; skip such updates with "
                          "`if step.finite: optimizer.step()`"})
        band = max((unbits(r[3]) for r in rows if r[3] >= 0), default=0.0)
        if band > late.MAX_BAND or not flagged:
            return late.LateResult("undecided", anomalous=named, evidence={
                "band_doublings": round(band, 4),
                "reason": "no rank holds the anomaly on its own record" if not flagged else
                          f"one update moved the healthy ranks' loss or gradient norm by {band:.2f} doublings: too "
                          "far for a replay one step late to tell data from hardware"})
        assert now is not None
        mine = {"micro": micro, "fp": None, "norms": norms.detach().float().cpu(), "extra": {
            "recorded": list(recorded), "now": [float(x) for x in now.losses], "now_fp": now.fp,
            "now_norms": now.norms.detach().float().cpu()}}
        shift = self._pairs.shifts[self._audits % len(self._pairs.shifts)]
        outcome = self._late_round(shift, mine, band, set(flagged))
        if self.errors:
            return late.LateResult("error", anomalous=named, evidence={
                "reason": f"recomputing a partner's record failed on ranks {self.errors[:16]}"})
        persistent = {o for o, (c, same, _) in outcome.items() if c == late.GONE and not same}
        referee: dict[int, bool] = {}
        others = [s for s in (*self._pairs.shifts, *range(1, self._replica_count)) if s != shift]
        if persistent and self._replica_count >= 3 and others:
            second = self._late_round(others[0], mine, band, persistent)
            referee = {o: not same for o, (_, same, _) in second.items()}
            if self.errors:
                referee = {}
                self.errors = []
        result = late.decide(flagged, outcome, referee, band, self._hosts, self._ranks)
        result.evidence["mismatching_pairs"] = [
            {"replayer": self._ranks[self._pairs.replayer(o, shift)], "origin": self._ranks[o]}
            for o, (c, _, _) in sorted(outcome.items()) if c == late.GONE][:MAX_ITEMS]
        return result

    def _late_round(self, shift: int, mine: dict[str, Any], band: float, origins: set[int]
                    ) -> dict[int, tuple[int, bool, float]]:
        """Each replayer whose origin is in ``origins`` (positions) recomputes the origin's record on today's weights
        (in lockstep layouts every replayer does, so that their collectives line up); gathered outcomes per origin."""
        origin = self._pairs.origin(self._pos, shift)
        theirs = self._exchange(mine, send_to=self._pairs.replayer(self._pos, shift), recv_from=origin)
        row = [late.REPRODUCED, 1, -1, 0]
        if origin in origins or self._lockstep is not None:
            if self._lockstep is not None and not self._recomputable(theirs):
                row = [late.UNCLEAR, 0, -1, 1]
            else:
                row = self._late_compare(theirs, band)
        rows = gather_rows(torch.tensor(row, dtype=torch.int64), self._group, self._wire)
        self._collect_errors(rows)
        out = {}
        for p, r in enumerate(rows):
            o = self._pairs.origin(p, shift)
            if o in origins and not r[3]:
                out[o] = (int(r[0]), bool(r[1]), unbits(r[2]) if r[2] >= 0 else math.inf)
        return out

    def _late_compare(self, record: dict[str, Any] | None, band: float) -> list[int]:
        """[class, the origin's rerun today agrees with this one, distance bits (-1: infinite), error]."""
        try:
            if record is None or not record["micro"]:
                raise RuntimeError("no replay record received from the origin rank")
            micro: list[MicroBatch] = record["micro"]
            with self._paused_outputs():
                result = self._recomputer.run(micro)
            got = late.summary(result.losses, [m.scale for m in micro], result.norms.double().cpu().tolist())
            extra = record["extra"]
            dist = late.distance((extra["recorded"][0], extra["recorded"][1]), got)
            same = self._same_result(result, extra["now"], extra["now_fp"], extra["now_norms"], micro)
            return [late.classify(dist, band), int(same), bits(dist) if math.isfinite(dist) else -1, 0]
        except Exception as e:  # noqa: BLE001 - reported to every rank through the gather
            self.error_text = f"{type(e).__name__}: {e}"
            return [late.UNCLEAR, 0, -1, 1]

    def _same_result(self, result: Result, losses: Sequence[float], fp: int, norms: torch.Tensor,
                     micro: Sequence[MicroBatch]) -> bool:
        """Two recomputations of one record on the same weights agree: bit for bit in exact mode, else within the
        tolerance (non-finite values alike)."""
        if self.mode == "exact":
            return result.fp == fp and all(_same_bits(a, b) for a, b in zip(result.losses, losses, strict=True))
        loss, grad = _alike_deltas(result, losses, norms.double())
        limit = max(self.tolerance, AUTO_FLOOR, self._calibrated_floor(rounding_floor(micro, self._params)))
        return loss <= limit and grad <= limit

    def _calibrated_floor(self, unit: float) -> float:
        """The least threshold a comparison may use, given its step's ``rounding_floor``: that unit for calibrated
        thresholds in tolerance mode; none in exact mode (its reruns are deterministic) or for a tolerance the user
        set (used as set)."""
        return unit if self.mode == "tolerance" and self._auto else 0.0

    def _cross_round(self, shift: int, mine: dict[str, Any], calibrate: bool = False
                     ) -> tuple[list[tuple[int, int]], Measurement | None]:
        origin = self._pairs.origin(self._pos, shift)
        replayer_of_mine = self._pairs.replayer(self._pos, shift)
        theirs = self._exchange(mine, send_to=replayer_of_mine, recv_from=origin)
        if self._lockstep is not None and not self._recomputable(theirs):
            row = torch.tensor([0, bits(math.nan), bits(math.nan), 1, -1, -1], dtype=torch.int64)
        else:
            row = self._compare(theirs, theirs["fp"] if theirs is not None else 0)
        measured = Measurement(self._ranks[origin], unbits(int(row[1])), unbits(int(row[2])), bool(row[0])) \
            if not row[3] else None
        # Healthy audits end here: one fixed-size agreement says nobody mismatched or failed and, on calibrating
        # audits, carries the largest healthy delta of each compared quantity (the bits of a non-negative float order
        # as the float does; -1 where this rank did not pass): a vector of the model's size, never the world's.
        healthy = not row[3] and not row[0]
        vec = [int(row[0]), int(row[3])]
        if calibrate:
            size = 1 + 2 * len(self._params)
            features = self._features if healthy and self._features is not None and len(self._features) == size \
                else [math.nan] * size
            vec += [bits(d) if math.isfinite(d) and d >= 0 else -1 for d in features]
        high, _ = agree(torch.tensor(vec, dtype=torch.int64, device=self._wire), self._group)
        if calibrate:
            self._calibrate_across(high[2:])
        if not (high[0] or high[1]):
            return [], measured
        rows = gather_rows(row, self._group, self._wire)
        self._collect_errors(rows)
        edges = []
        self._last_deltas = {}
        for p, r in enumerate(rows):
            o = self._pairs.origin(p, shift)
            if r[0] == 1:
                edges.append((p, o))
                self._margins[(p, o)] = unbits(r[4]) if r[4] >= 0 else math.inf
                self._output_marks[(p, o)] = r[5]
                if len(self._last_deltas) < MAX_ITEMS:
                    self._last_deltas[f"{self._ranks[p]}->{self._ranks[o]}"] = {
                        "loss": json_float(unbits(r[1])), "grad": json_float(unbits(r[2]))}
        return edges, measured

    def _unconfirmed(self, suspects: Sequence[int], why: dict[str, Any], outcome: Outcome, refereed: bool) -> bool:
        """Tolerance mode, what the numerics' noise can explain: one comparison over its threshold that nothing
        repeats; a persistent finding whose comparisons exceed their thresholds by less than ``_CONFIRM`` times,
        until the same suspects exceed again at one of the next two audits (a persistent fault persists; the tail of
        the noise does not repeat on the same rank); a transient one (a rank not reproducing its own step) by less
        than that. True: not a finding (yet): counted, said, never fed into the calibration. Decided from gathered
        rows: the same on every rank."""
        if self.mode != "tolerance":
            return False
        if refereed and len(outcome.edges) == 1 and all(outcome.reproduced.values()):
            # Neither the referee round nor the origin's own comparison of its partner repeats it: a persistent fault
            # shows in two comparisons at least (the faulty rank's record, and its recomputation of another rank's).
            a, o = outcome.edges[0]
            self.unconfirmed += 1
            self.unconfirmed_text = (f"one comparison (rank {self._ranks[a]} replaying rank {self._ranks[o]}: "
                                     f"{self._last_deltas}) exceeded its threshold and no other comparison repeated "
                                     "it: counted as numerical noise, not a fault")
            return True
        if why.get("ambiguous") or not suspects:
            return False
        named = frozenset(suspects)
        if why.get("fault") == "transient":
            # A rank that does not reproduce its own step by less than _CONFIRM times its thresholds: the tail of
            # run-to-run noise (bf16 rounding flips), which a transient fault cannot be told from; counted, said.
            low = max((self._rerun_margins.get(p, math.inf) for p in named), default=math.inf)
            if low >= _CONFIRM:
                return False
            self.unconfirmed += 1
            self.unconfirmed_text = (f"ranks {[self._ranks[p] for p in sorted(named)]} did not reproduce their own "
                                     f"step by {low:.2f}x their thresholds (under {_CONFIRM:g}x): counted as "
                                     "run-to-run noise")
            return True
        if why.get("fault") != "persistent":
            return False
        margin = max((self._margins.get(e, math.inf) for e in outcome.edges if named & set(e)), default=math.inf)
        pending, self._pending = self._pending, None
        if margin >= _CONFIRM:
            why["confirmed"] = f"above its thresholds by {margin:.2f}x" if math.isfinite(margin) else "not comparable"
            return False
        if pending is not None and pending[0] == named and self._audits - pending[1] <= 2:
            why["confirmed"] = f"repeated at a second audit (by {margin:.2f}x here)"
            return False
        self._pending = (named, self._audits)
        self.unconfirmed += 1
        self.unconfirmed_text = (f"ranks {[self._ranks[p] for p in sorted(named)]} exceeded their thresholds by "
                                 f"{margin:.2f}x (under {_CONFIRM:g}x): named only if repeated at one of the next two "
                                 "audits")
        return True

    def _recomputable(self, record: dict[str, Any] | None) -> bool:
        """FSDP2: every rank recomputes through the sharded model at once, so its all-gathers must line up: agree
        that every rank holds a record with the same number of micro-batches before any rank starts."""
        count = len(record["micro"]) if record is not None else 0
        high, low = agree(torch.tensor([count], dtype=torch.int64, device=self._wire), self._group)
        if low[0] == high[0] and low[0] > 0:
            return True
        self.error_text = ("FSDP replay needs a record with the same number of micro-batches on every rank (got "
                           f"{low[0]}..{high[0]}): skipped on every rank")
        return False

    def _self_round(self, mine: dict[str, Any]) -> dict[int, bool]:
        if self._lockstep is not None and not self._recomputable(mine):
            rows = gather_rows(torch.tensor([0, 0, 0, 1, -1, -1], dtype=torch.int64), self._group, self._wire)
            self._collect_errors(rows)
            return {}
        row = self._compare(mine, mine["fp"])
        rows = gather_rows(row, self._group, self._wire)
        self._collect_errors(rows)
        self._rerun_margins = {p: unbits(r[4]) if r[4] >= 0 else math.inf for p, r in enumerate(rows) if r[0]}
        self._rerun_output_marks = {p: r[5] for p, r in enumerate(rows) if r[0]}
        return {p: r[0] == 0 for p, r in enumerate(rows)}

    def _calibrate_across(self, largest_bits: Sequence[int]) -> None:
        """tolerance="auto": two different ranks computing the same micro-batch differ by more than a rank's reruns
        when their kernels differ (autotuning picked another algorithm): the largest healthy cross-rank delta, over
        a window of calibrations, sets the threshold of the audits that follow. This audit was judged against the
        threshold measured before it, and a rank whose comparison failed contributes nothing: a fault present here
        can neither hide itself nor raise the threshold. ``largest_bits``: the MAX over the ranks of their healthy
        deltas' bits per compared quantity (-1: none passed), from the audit's agreement."""
        assert self._threshold is not None
        self._threshold.across([unbits(b) if b >= 0 else None for b in largest_bits])

    def _calibrate(self, mine: dict[str, Any]) -> None:
        """Same-rank rerun of this rank's own step: the noise floor of non-deterministic kernels. The median over
        ranks comes from a summed histogram (fixed size at any world size), not from gathering every rank's delta."""
        if self._lockstep is not None and not self._recomputable(mine):
            return
        row = self._compare(mine, mine["fp"])
        # One floor per kind of quantity: the loss and the norms, the sketches (heavy-tailed; none in 16 bits). A
        # rerun that failed contributes to neither.
        count = len(self._params)
        features = self._features if not row[3] and self._features is not None \
            and len(self._features) == 1 + 2 * count else []

        def largest(deltas: Sequence[float]) -> float:
            return max((d for d in deltas if not math.isnan(d)), default=math.nan)

        histograms = histogram(largest(features[:1 + count])) + histogram(largest(features[1 + count:]))
        counts = sum_counts(histograms, self._group, self._wire)
        assert self._threshold is not None
        half = len(counts) // 2
        self._threshold.rerun(counts[:half], kind=0)
        self._threshold.rerun(counts[half:], kind=1)

    def _compare(self, record: dict[str, Any] | None, recorded_fp: int | None) -> torch.Tensor:
        """[mismatch, loss_delta_bits, grad_delta_bits, error, margin_bits, outputs] for recomputing ``record``
        (``outputs``: a bit per local pipeline stage whose outputs differed, 0 when all matched, -1 when they were
        not compared; tolerance mode:
        the deltas per compared quantity are left in ``_features``)."""
        self._features = None
        try:
            if record is None:
                raise RuntimeError("no replay record received from the origin rank")
            micro: list[MicroBatch] = record["micro"]
            if not micro:
                raise RuntimeError("the origin rank captured no micro-batch for this audit step")
            recorded_outputs = record.get("outputs") if self._outputs is not None else None
            with self._outputs.recording(recorded_outputs is not None) if self._outputs is not None \
                    else nullcontext([]) as got:
                result = self._recomputer.run(micro)
            # 16-bit arithmetic: a rounding flip of one element moves a quantity that it dominates by up to one
            # unit in the last place (bf16 2**-7 relative), and an fp32-sized difference anywhere grows through the
            # roundings of the layers after it into such flips (measured: a 1e-6 difference moves the per-parameter
            # gradient norms of the campaign's bf16 GPT by 5e-4 to 4e-3 from one rerun to the next). No threshold
            # below that unit can tell a fault from rounding: none is calibrated to.
            unit = rounding_floor(micro, self._params)
            floor = self._calibrated_floor(unit)
            limits = [max(t, floor) for t in self.thresholds]
            outputs = self._outputs_differ(recorded_outputs, got[0] if got else None, limits[0])
            # Exact mode: a stage that sent a different gradient back computed wrongly even where its own gradients
            # match (a fault in the backward of its input gradient): a mismatch, so that it is among the suspects.
            sent_differ = self.mode == "exact" and self._outputs is not None and self._outputs.sent_differs(outputs)
            recorded_losses = _floats([m.loss for m in micro if m.loss is not None])  # one host copy
            loss_delta = max(_rel(a, b) for a, b in zip(result.losses, recorded_losses, strict=True))
            ref = record["norms"].double()
            if recorded_fp is None:  # a triggered audit: norms and losses, with non-finite values compared as such
                loss_delta, grad_delta = _alike_deltas(result, recorded_losses, ref)
                limit = max(self.tolerance, AUTO_FLOOR, floor)
                mismatch = not (loss_delta <= limit and grad_delta <= limit)
                return torch.tensor([int(mismatch), bits(loss_delta), bits(grad_delta), 0, -1, outputs],
                                    dtype=torch.int64)
            got = result.norms.double().cpu()
            norm_delta = float(torch.linalg.vector_norm(got - ref) / max(float(torch.linalg.vector_norm(ref)), 1e-30))
            # Each parameter's norm relative to itself, and at least to its share of the whole gradient's norm (a
            # gradient that cancels to rounding, a bias before a LayerNorm, is noise relative to itself: measured
            # against a tenth of its share, such a parameter still raised a false incident in 120 audits).
            share = sketch_floor(ref, self._sizes, _NORM_SHARE)
            norm_deltas = torch.where(got == ref, torch.zeros_like(ref), (got - ref).abs() / share)
            grad_delta = norm_delta
            recorded_sketch = record.get("sketch")
            per_param = [math.nan] * len(self._params)
            # 16-bit arithmetic (autocast, or 16-bit parameters): one unit in the last place is 0.2-0.8% of an
            # element, so run-to-run rounding flips of single elements move the block sketches far beyond any
            # calibrated threshold, and a flipped mantissa bit of one element cannot be told from rounding: compare
            # the loss and the norms only.
            if self.mode == "tolerance" and recorded_sketch is not None and result.sketch is not None \
                    and not unit:
                # The norms cannot see a sign flip and barely a mantissa change: the block sketches can.
                per_param = sketch_deltas(result.sketch, recorded_sketch)
                if len(per_param) != len(self._params):
                    per_param = [math.inf] * len(self._params)
                grad_delta = max(grad_delta, *per_param)
            if self.mode == "exact":
                same_loss = all(_same_bits(a, b) for a, b in zip(result.losses, recorded_losses, strict=True))
                mismatch = not (same_loss and result.fp == recorded_fp) or sent_differ
                margin = math.inf if mismatch else 0.0
            else:
                # Each quantity against its own threshold: a parameter whose gradient is noisy (its terms cancel)
                # must not set the bar for the others. The margin: the largest delta in units of its threshold.
                features = [max(loss_delta, norm_delta), *norm_deltas.tolist(), *per_param]
                margin = max((d / t if t > 0 else math.inf for d, t in zip(features, limits, strict=True)
                              if not math.isnan(d)), default=0.0)
                mismatch = margin > 1.0
                self._features = features
            return torch.tensor([int(mismatch), bits(loss_delta), bits(grad_delta), 0, bits(margin), outputs],
                                dtype=torch.int64)
        except Exception as e:  # noqa: BLE001 - reported to every rank through the agreement
            self.error_text = f"{type(e).__name__}: {e}"
            return torch.tensor([0, bits(math.nan), bits(math.nan), 1, -1, -1], dtype=torch.int64)

    def _outputs_differ(self, recorded: tuple[list[int], list[float], list[int]] | None,
                        got: tuple[list[int], list[float], list[int]] | None, limit: float) -> int:
        """Which of this rank's stages computed outputs, or sent gradients back, that differ from the origin's
        recorded ones: bit k set for local stage k's outputs (one stage per rank: 1 differs, 0 matches), bit
        ``parts + k`` for the gradients it sent; -1 when a stage's outputs were not recorded on either side (a first
        stage sends no gradient: nothing on both sides is a match). The last records of each channel are compared,
        as many as the shorter side has (a schedule's first step runs one more forward before the micro-batches, to
        infer the stages' shapes). Exact mode compares their fingerprints; tolerance mode each record's norm,
        relative, against the threshold of the loss (the quantity nearest to a stage output)."""
        if recorded is None or got is None or self._outputs is None:
            return -1
        differs: list[bool] = []
        parts = self._outputs.parts
        for k in range(2 * parts):
            mine = [i for i, part in enumerate(recorded[2]) if part == k]
            theirs = [i for i, part in enumerate(got[2]) if part == k]
            n = min(len(mine), len(theirs))
            if not n:
                if k >= parts and not mine and not theirs:
                    continue
                return -1
            pairs = list(zip(mine[-n:], theirs[-n:], strict=True))
            if self.mode == "exact":
                differ = any(recorded[0][i] != got[0][j] for i, j in pairs)
            else:
                differ = not max(_rel(got[1][j], recorded[1][i]) for i, j in pairs) <= limit
            differs += [False] * (k - len(differs)) + [differ]
        return int(self._outputs.encode(differs))

    def _first_wrong_stage(self, suspects: tuple[int, ...], why: dict[str, Any]
                           ) -> tuple[tuple[int, ...], tuple[int, str] | None]:
        """Pipelines: among a replica's suspect positions, those of the stage that computed wrongly, and (stage, how
        it was found). A fault in stage s's forward changes the outputs of stages s and later (and, carried back by
        backward, every stage's gradients): the first stage whose outputs differ. A fault in stage s's backward
        leaves every output alike and changes the gradients s sends back and those every earlier stage sends: the
        last stage whose sent gradients differ (exact mode, where such a stage is a mismatch and so a suspect).
        Outputs not compared, or another pattern, leave the suspects as they are. A position runs one stage, or
        several under an interleaved schedule (its marks are a bit per local stage for its outputs, then a bit per
        local stage for the gradients it sent). A recorder with a rule of its own (``narrow``: expert parallelism)
        decides instead; it also narrows an ambiguous finding, to the same slot of each replica."""
        narrow = getattr(self._outputs, "narrow", None)
        if self._outputs is None or not suspects or (why.get("ambiguous") and narrow is None):
            return suspects, None
        stages_of = self._outputs.stages_of
        if why.get("fault") == "transient":
            marks = {p: self._rerun_output_marks.get(p, -1) for p in suspects}
        else:
            marks = {}
            for pair, mark in self._output_marks.items():  # a position's every comparison: differed if any did
                for p in pair:
                    if p in suspects:
                        prev = marks.get(p, mark)
                        marks[p] = -1 if -1 in (prev, mark) else self._outputs.merge(prev, mark)
        if len(marks) != len(suspects) or any(m < 0 for m in marks.values()):
            return suspects, None
        if narrow is not None:
            return narrow(suspects, marks, self.mode)  # type: ignore[no-any-return]
        differ = {s for p, m in marks.items() for k, s in enumerate(stages_of[p]) if m >> k & 1}
        if not differ:
            if self.mode != "exact":
                # Tolerance mode: a differing sent gradient is no mismatch of its own, so the stage that sent it
                # first may not be among the suspects, and the last suspect stage would be named instead.
                return suspects, None
            parts = self._outputs.parts
            sent = {s for p, m in marks.items() for k, s in enumerate(stages_of[p]) if m >> (parts + k) & 1}
            if not sent:
                return suspects, None
            stage = max(sent)
            # What a backward fault makes: stage s and every earlier stage that sends a gradient (all but the
            # first) differ, the later ones do not.
            if sent != {s for p in suspects for s in stages_of[p] if 0 < s <= stage}:
                return suspects, None
            return tuple(p for p in suspects if stage in stages_of[p]), (stage, "gradient_sent")
        stage = min(differ)
        # What a forward fault makes: stage s and every later stage differ, the stages before it do not. Any other
        # pattern (noise over the threshold on an early stage, in tolerance mode) narrows nothing.
        if differ != {s for p in suspects for s in stages_of[p] if s >= stage}:
            return suspects, None
        return tuple(p for p in suspects if stage in stages_of[p]), (stage, "output")

    def _collect_errors(self, rows: Sequence[Sequence[int]]) -> None:
        self.errors += [self._ranks[p] for p, r in enumerate(rows) if r[3] and self._ranks[p] not in self.errors]

    def _exchange(self, mine: dict[str, Any], send_to: int, recv_from: int) -> dict[str, Any] | None:
        """Send this rank's record to ``send_to`` and receive ``recv_from``'s (group positions), point-to-point. A
        rank alone in its numerics class is its own partner: it keeps its record (a rerun)."""
        if send_to == recv_from == self._pos:
            return mine
        theirs, error = exchange(mine, self._ranks[send_to], self._ranks[recv_from], self._group, self._wire,
                                 self._device)
        if error:
            self.error_text = error
        return theirs


def rounding_floor(micro: Sequence[MicroBatch], params: Sequence[torch.Tensor]) -> float:
    """The least tolerance a comparison of the recorded step can use: one unit in the last place at 1.0
    (``torch.finfo(dtype).eps``: bf16 2**-7, fp16 2**-10) of the coarsest 16-bit type it computed in (under a
    16-bit autocast, or with 16-bit parameters); 0.0 for a step computed in 32 or 64 bits."""
    half = {torch.float16, torch.bfloat16}
    used = {m.autocast[1] for m in micro if m.autocast is not None and m.autocast[0] and m.autocast[1] in half}
    used |= {p.dtype for p in params if p.dtype in half}
    return max((torch.finfo(d).eps for d in used), default=0.0)


def _floats(values: Sequence[torch.Tensor]) -> list[float]:
    """Scalars (on any device) as Python floats, with one host copy."""
    if not values:
        return []
    device = values[0].device
    return [float(x) for x in torch.stack([v.detach().double().reshape(()).to(device) for v in values]).tolist()]


def _alike_deltas(result: Result, losses: Sequence[float], norms: torch.Tensor) -> tuple[float, float]:
    """(loss, gradient) relative deltas of a recomputation against recorded losses and per-parameter norms, with
    non-finite values compared as such: infinite when one side is non-finite where the other is not, else taken over
    the finite values (a NaN batch is NaN alike on both sides)."""
    got = result.norms.double().cpu()
    if not torch.equal(torch.isfinite(got), torch.isfinite(norms)) or \
            any(math.isfinite(a) != math.isfinite(b) for a, b in zip(result.losses, losses, strict=True)):
        return math.inf, math.inf
    finite = torch.isfinite(norms)
    grad = float(torch.linalg.vector_norm(got[finite] - norms[finite])
                 / max(float(torch.linalg.vector_norm(norms[finite])), 1e-30))
    loss = max((_rel(a, b) for a, b in zip(result.losses, losses, strict=True) if math.isfinite(a)), default=0.0)
    return loss, grad


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-30)


def _same_bits(a: float, b: float) -> bool:
    return struct.pack("<d", a) == struct.pack("<d", b)

