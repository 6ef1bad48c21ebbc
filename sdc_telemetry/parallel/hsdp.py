"""HSDP: fully_shard on a 2-D ``(replicate, shard)`` mesh. Ranks with the same shard index hold the same shard.

Everything of FSDP2 (``parallel.fsdp``) holds, and the replicate dimension adds the weight vote: each shard index
has its own digest slot in the status vector, agreed among the replicas of that shard only, and a disagreement is
voted on within the replicas of the shard.
"""

from __future__ import annotations

from sdc_telemetry.parallel.fsdp import FSDP

__all__ = ["HSDP"]


class HSDP(FSDP):
    name = "hsdp"

    @property
    def weight_replicas(self) -> bool:
        return True

    def weights_off_reason(self) -> str | None:
        return None

    @property
    def digest_slots(self) -> int:
        return self.mesh.shard_size

    @property
    def digest_slot(self) -> int:
        return self.mesh.shard_index
