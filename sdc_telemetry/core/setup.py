"""Set-up agreement: the checks run on the same steps, with the same settings, in the same mode, on every rank.

One all-reduce of a small vector at construction: the hash of the detection settings and the start step, whether
the incident log could be opened, and the numerics signature. Disagreement is the same clear error on every rank,
never a hang. Deployment fields (metrics port and host, OTLP endpoint, NVML, the job name, the Alertmanager URL,
the incident directory) may differ per node (a collector per node, say) and are not compared.
"""

from __future__ import annotations

import hashlib
import logging

import torch
import torch.distributed as dist

from sdc_telemetry.core.collective import agree, gather_rows
from sdc_telemetry.core.config import SDCConfig

__all__ = ["DETECTION_FIELDS", "agree_setup", "resolve_mode"]

log = logging.getLogger("sdc_telemetry")

# The SDCConfig fields that decide what is checked, when, and how verdicts are reached.
DETECTION_FIELDS = ("weights_every", "replay_every", "grad_checks", "mode", "tolerance", "on_suspect",
                    "trigger_audits")


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def detection_hash(config: SDCConfig, start_step: int) -> int:
    fields = sorted((f, getattr(config, f)) for f in DETECTION_FIELDS if hasattr(config, f))
    return _hash64(repr(fields) + f"|{start_step}")


def agree_setup(group: dist.ProcessGroup | None, distributed: bool, config: SDCConfig, start_step: int,
                signature: int, device: torch.device, log_error: str | None) -> list[int] | None:
    """Collective set-up checks. Returns per-position numerics-signature classes when the ranks' stacks differ
    (None when they are all alike)."""
    if not distributed:
        if log_error:
            raise ValueError(log_error)
        return None
    vec = torch.tensor([detection_hash(config, start_step), int(log_error is not None), signature],
                       dtype=torch.int64)
    high, low = agree(vec.to(device), group)
    if high[1]:
        msg = log_error or "the first rank of the group could not open SDCConfig.incident_dir"
        raise ValueError(f"{msg} (every rank stops here)")
    if high[0] != low[0]:
        raise ValueError("SDCConfig's detection settings (" + ", ".join(DETECTION_FIELDS[:-1]) + ") or start_step "
                         "differ between ranks: every rank must construct the monitor with the same settings (checks "
                         "run on the same steps everywhere)")
    if high[2] == low[2]:
        return None
    classes = [r[0] for r in gather_rows(torch.tensor([signature], dtype=torch.int64), group, device)]
    if dist.get_rank(group) == 0:
        log.warning("sdc_telemetry: the ranks run on %d different hardware/software stacks: exact comparison only "
                    "between ranks of the same stack; the replay compares with a calibrated tolerance",
                    len(set(classes)))
    return classes


def resolve_mode(config: SDCConfig, classes: list[int] | None, device: torch.device, writer: bool) -> str:
    """``exact`` or ``tolerance``: exact only where every rank's numerics can be bit-identical."""
    if classes is not None:
        if config.mode == "exact" and writer:
            log.warning("sdc_telemetry: mode='exact' with mixed hardware/software stacks: the replay uses a "
                        "calibrated tolerance instead")
        return "tolerance"
    if config.mode != "auto":
        return config.mode
    exact = device.type == "cpu" or torch.are_deterministic_algorithms_enabled()
    return "exact" if exact else "tolerance"
