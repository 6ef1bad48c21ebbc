"""HSDP: fully_shard on a 2-D ``(replicate, shard)`` mesh. Ranks with the same shard index hold the same shard.

Everything of FSDP2 (``parallel.fsdp``) holds, and the replicate dimension adds the weight vote: the replicas of
each shard index compare their weight digests among themselves (one small all-reduce in their replica group; the
status vector carries whether any group differed), and a disagreement is voted on within the replicas of the shard.
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
    def digest_keys(self) -> int:
        return self.mesh.shard_size

    @property
    def digest_key(self) -> int:
        return self.mesh.shard_index
