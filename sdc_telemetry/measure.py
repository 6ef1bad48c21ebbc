"""Measuring one step on this rank: thin tensor code, no host synchronisation, then the one agreement.

What the layout's tap recorded during backward (local-gradient norms; fingerprints and sketches on audit steps), the
reduced gradients' norm (this rank's share), the weight digest when due, the quantized loss and gradient norm for
outlier triggers, and host-side flags are packed into the status vector (``core/status.py``) whose all-reduce is
launched here; deciding reads its result, at once or one step later on CUDA.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from sdc_telemetry.checks import grad as grad_check
from sdc_telemetry.checks.at_rest import AtRestCheck, Compared
from sdc_telemetry.checks.outliers import OutlierTrigger, quantize
from sdc_telemetry.checks.replay import ReplayCheck
from sdc_telemetry.checks.weights import WeightsCheck
from sdc_telemetry.core import status as S
from sdc_telemetry.core.collective import Agreement, disagreement
from sdc_telemetry.core.config import SDCConfig
from sdc_telemetry.parallel.base import Layout

__all__ = ["Measured", "StepMeasurer"]


@dataclass
class Measured:
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
    deferred: bool = False       # decided one step later (the step's batch and weights are gone by then)
    at_rest: Compared | None = None  # this rank's at-rest comparison, for the rare path
    update_audit: bool = False   # the previous step's update is audited at this hook point


class StepMeasurer:
    """The parts a step's measurement reads, held once (``on_error(component, what)`` counts a contained failure)."""

    def __init__(self, layout: Layout, config: SDCConfig, params: Sequence[torch.nn.Parameter],
                 device: torch.device, record: grad_check.GradRecord, weights: WeightsCheck | None,
                 replay: ReplayCheck | None, outliers: OutlierTrigger | None,
                 on_error: Callable[[str, str], None], at_rest: AtRestCheck | None = None,
                 digest_group: dist.ProcessGroup | None = None) -> None:
        self.layout, self.config, self._params, self.device = layout, config, list(params), device
        self._record, self._weights, self._replay, self._outliers = record, weights, replay, outliers
        self._on_error = on_error
        self._at_rest = at_rest
        # The replicas of this rank's shard (sharded layouts): their digests are compared there first.
        self._digest_group = digest_group

    def measure(self, step: int, loss: torch.Tensor | None, scaler_used: bool, *, weights: bool,
                audit: bool = False, snapshot: bool = False, grads: bool = True,
                update_ready: bool | None = None) -> Measured:
        """This rank's measurements and the launched agreement (no host synchronisation). ``snapshot`` keeps copies
        of what the next step overwrites, for a verdict read one step later; ``grads=False`` (an on-demand weight
        check) measures the weights only."""
        start = time.perf_counter()
        host = [0] * S.FIELDS
        host[S.STEP] = step
        host[S.SCALER] = int(scaler_used)
        host[S.UPDATE_READY] = int(bool(update_ready))
        nonfinite = torch.zeros(2, dtype=torch.int64, device=self.device)
        digest = torch.zeros(1, dtype=torch.int64, device=self.device)
        # local, reduced, loss, reduction checksum flag
        norms = torch.full((4,), math.nan, dtype=torch.float64, device=self.device)
        on_device: dict[int, torch.Tensor] = {}
        record, layout = self._record, self.layout
        reduced_s = 0.0
        try:
            if grads and self.config.grad_checks:
                layout.after_backward(record)
            if grads and (self.config.grad_checks or audit):
                host[S.LOCAL_MEASURED] = int(record.measured)
                host[S.REPEATED] = int(record.repeated)
                if record.measured:
                    local_norm = record.total_norm()
                    nonfinite[0] = ~torch.isfinite(local_norm)
                    norms[0] = local_norm
                    if self._outliers is not None and loss is not None:
                        loss_q, norm_q = quantize(loss), quantize(local_norm)
                        norms[2] = loss
                        on_device.update({S.LOSS_Q: loss_q, S.NORM_Q: norm_q,
                                          S.JUMP_Q: self._outliers.jump(loss_q, norm_q)})
                if self.config.grad_checks and layout.reduces:
                    t = time.perf_counter()
                    # The reduce-phase checksum (on the device), or None; where its pass read the reduced gradients'
                    # norms bucket by bucket, they land in the record and need no second pass here.
                    mismatch = layout.reduction_mismatch()
                    if mismatch is not None:
                        on_device[S.REDUCED_CHECKSUM] = mismatch
                        norms[3] = mismatch
                    per_param = record.reduced
                    reduced_here = per_param is not None
                    if per_param is None:
                        held = layout.reduced(self._params)
                        per_param = grad_check.reduced_norms(len(self._params), held, self.device)
                        reduced_here = bool(held)
                    reduced_norm = torch.linalg.vector_norm(per_param)
                    reduced_s = time.perf_counter() - t
                    # Reduced this step: the reduction's tap ran (stale .grad from an earlier step is not a pass).
                    host[S.REDUCED_MEASURED] = int(record.measured and reduced_here)
                    nonfinite[1] = ~torch.isfinite(reduced_norm)
                    norms[1] = reduced_norm
            host[S.REPLAYABLE] = int(self._replay is not None and self._replay.ready())
        except Exception:  # noqa: BLE001 - contained; the agreement below must still run on this rank
            self._on_error("grad", "measuring gradients failed")
            host[S.ERROR] = 1
        table = None
        at_rest = None
        weights_s = 0.0
        if weights:
            t = time.perf_counter()
            try:
                if self._weights is None and self._at_rest is None:
                    raise RuntimeError("no replicas to compare")
                if self._weights is not None:
                    digest = self._weights.measure().reshape(1)
                    table = self._weights.table
                if self._at_rest is not None:
                    on_device[S.AT_REST], at_rest = self._at_rest.measure(
                        table, self._weights.labels if self._weights is not None else None)
            except Exception:  # noqa: BLE001
                self._on_error("weights", "fingerprinting the parameters failed")
                host[S.WEIGHTS_ERROR] = 1
                on_device.pop(S.AT_REST, None)
                at_rest = None
            if self._digest_group is not None:  # every rank of the group, whatever happened above
                digest = disagreement(digest, self._digest_group).reshape(1)
            weights_s = time.perf_counter() - t
        on_device.update({S.LOCAL_NONFINITE: nonfinite[0], S.REDUCED_NONFINITE: nonfinite[1]})
        vec = S.pack(host, on_device, digest, self.device)
        agreement = Agreement(vec, layout.group, layout.distributed, local=norms)
        elapsed = time.perf_counter() - start
        # grad_local: the tap's measurements during backward and the local part here; grad_reduced: its pass.
        durations = {"grad_local": record.elapsed + elapsed - reduced_s - weights_s, "grad_reduced": reduced_s,
                     "weights": weights_s}
        return Measured(step=step, mine=host, agreement=agreement, weights_due=weights, audit=audit, table=table,
                         norms=record.norms.clone() if snapshot else record.norms, durations=durations,
                         grads=grads, deferred=snapshot, at_rest=at_rest, update_audit=update_ready is not None)

