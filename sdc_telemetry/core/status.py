"""The step's status vector: the wire format of the healthy path's one collective.

One int64 per field, agreed by MAX and MIN over the group in one all-reduce (``core.collective.Agreement``): flags
become OR/AND, digests equal or not. Layouts whose tensors are sharded add one digest slot per shard index after
the fixed fields, so that the replicas of each shard agree among themselves (other ranks leave the slot absent).
The vector's size depends on the layout, never on the world size.
"""

from __future__ import annotations

__all__ = ["STEP", "LOCAL_MEASURED", "LOCAL_NONFINITE", "REDUCED_MEASURED", "REDUCED_NONFINITE", "ERROR", "REPEATED",
           "REPLAYABLE", "SCALER", "WEIGHTS_ERROR", "DIGEST", "FIELDS", "GRAD_FIELDS", "digests_agree"]

(STEP, LOCAL_MEASURED, LOCAL_NONFINITE, REDUCED_MEASURED, REDUCED_NONFINITE, ERROR, REPEATED, REPLAYABLE, SCALER,
 WEIGHTS_ERROR, DIGEST) = range(11)
FIELDS = 11
GRAD_FIELDS = (LOCAL_MEASURED, LOCAL_NONFINITE, REDUCED_MEASURED, REDUCED_NONFINITE)


def digests_agree(high: list[int], low: list[int], slots: int) -> bool:
    """Every replica's weight digest is the same (in each shard's slot, for sharded layouts)."""
    return all(high[f] == low[f] for f in (DIGEST, *range(FIELDS, FIELDS + slots)))
