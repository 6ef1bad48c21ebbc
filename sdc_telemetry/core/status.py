"""The step's status vector: the wire format of the healthy path's one collective.

One int64 per field, agreed by MAX and MIN over the group in one all-reduce (``core.collective.Agreement``): flags
become OR/AND, digests equal or not. Where tensors are sharded, the replicas of each shard compare their weight
digests among themselves first (``core.collective.disagreement``: one all-reduce of two int64 in the shard's replica
group, on the device) and ``DIGEST`` carries whether any of them differ. The vector has ``FIELDS`` fields at any
layout, mesh shape and world size.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["STEP", "LOCAL_MEASURED", "LOCAL_NONFINITE", "REDUCED_MEASURED", "REDUCED_NONFINITE", "ERROR", "REPEATED",
           "REPLAYABLE", "SCALER", "WEIGHTS_ERROR", "DIGEST", "REDUCED_CHECKSUM", "LOSS_Q", "NORM_Q", "JUMP_Q",
           "AT_REST", "UPDATE_READY", "FIELDS", "GRAD_FIELDS", "OUTLIER_FIELDS", "digests_agree", "pack"]

(STEP, LOCAL_MEASURED, LOCAL_NONFINITE, REDUCED_MEASURED, REDUCED_NONFINITE, ERROR, REPEATED, REPLAYABLE, SCALER,
 WEIGHTS_ERROR, DIGEST, REDUCED_CHECKSUM, LOSS_Q, NORM_Q, JUMP_Q, AT_REST, UPDATE_READY) = range(17)
FIELDS = 17
# REDUCED_CHECKSUM: the layout's reduce-phase checksum disagreed on this rank (1), or was not measured (0).
# LOSS_Q, NORM_Q, JUMP_Q: this rank's loss and local gradient norm, quantized (checks/outliers.py), and its jump
# against its own recent history: the spread between ranks comes from their MAX and MIN.
# AT_REST: 0 nothing compared, 1 unchanged, 2 this rank's parameters or optimizer state changed between the update
# and the weight check (checks/at_rest): MAX says whether any rank changed, MIN whether every rank compared.
# UPDATE_READY: this rank holds its slice of the audited update (checks/update): MIN says whether the audit can run.
GRAD_FIELDS = (LOCAL_MEASURED, LOCAL_NONFINITE, REDUCED_MEASURED, REDUCED_NONFINITE)
OUTLIER_FIELDS = (LOSS_Q, NORM_Q, JUMP_Q)


def digests_agree(high: list[int], low: list[int], grouped: bool) -> bool:
    """Every replica's weight digest is the same: one digest for the group (``grouped`` False: its MAX is its MIN),
    or, agreed first within each shard's replicas (``grouped``), no rank's replica group differed."""
    return high[DIGEST] == 0 if grouped else high[DIGEST] == low[DIGEST]


def pack(host: list[int], on_device: Mapping[int, torch.Tensor], digest: torch.Tensor, device: torch.device
         ) -> torch.Tensor:
    """The status vector on ``device`` from the host fields and the device-side values (``on_device``: field ->
    0-d tensor; no host synchronisation); ``digest``: the weight digest, or the replica group's disagreement flag."""
    fixed = torch.tensor(host, dtype=torch.int64)
    # Pinned and non-blocking on CUDA: building the vector never waits for the GPU.
    vec = fixed.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else fixed
    for f, value in on_device.items():
        vec[f] = value
    vec[DIGEST] = digest.reshape(-1)[0]
    return vec
