"""Set-up agreement: the checks run on the same steps, with the same settings, in the same mode, on every rank.

One all-reduce of a small vector at construction: the hash of the detection settings and the start step, whether
the incident log could be opened, the numerics signature (which includes the kernel-choosing settings), and the
comparison mode each rank resolved. Disagreement is the same clear error on every rank,
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
from sdc_telemetry.core.identity import bitwise_reproducible

__all__ = ["DETECTION_FIELDS", "agree_setup", "resolve_mode"]

log = logging.getLogger("sdc_telemetry")

# The SDCConfig fields that decide what is checked, when, and how verdicts are reached.
DETECTION_FIELDS = ("weights_every", "replay_every", "update_every", "grad_checks", "mode", "tolerance",
                    "on_suspect", "trigger_audits", "verdicts")


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def detection_hash(config: SDCConfig, start_step: int) -> int:
    fields = sorted((f, getattr(config, f)) for f in DETECTION_FIELDS if hasattr(config, f))
    return _hash64(repr(fields) + f"|{start_step}")


def agree_setup(group: dist.ProcessGroup | None, distributed: bool, config: SDCConfig, start_step: int,
                signature: int, device: torch.device, log_error: str | None
                ) -> tuple[list[int] | None, str]:
    """Collective set-up checks. Returns per-position numerics-signature classes when the ranks' stacks differ
    (None when they are all alike) and the comparison mode every rank uses (``resolve_mode``, agreed)."""
    if not distributed:
        if log_error:
            raise ValueError(log_error)
        return None, resolve_mode(config, None, device, True)
    local_mode = resolve_mode(config, None, device, False)
    vec = torch.tensor([detection_hash(config, start_step), int(log_error is not None), signature,
                        int(local_mode == "exact")], dtype=torch.int64)
    high, low = agree(vec.to(device), group)
    writer = dist.get_rank(group) == 0
    if high[1]:
        msg = log_error or ("another rank could not set up its sinks (SDCConfig.incident_dir on the first rank of the "
                            "group, or SDCConfig.metrics_host); its log names which")
        raise ValueError(f"{msg} (every rank stops here)")
    if high[0] != low[0]:
        raise ValueError("SDCConfig's detection settings (" + ", ".join(DETECTION_FIELDS[:-1]) + ") or start_step "
                         "differ between ranks: every rank must construct the monitor with the same settings (checks "
                         "run on the same steps everywhere)")
    if high[2] == low[2]:
        if high[3] != low[3]:  # equal stacks resolve alike; anything else is a bug to stop on, not to hang on
            raise ValueError("the ranks resolved SDCConfig.mode differently (exact on some, tolerance on others) with "
                             "equal numerics signatures: set SDCConfig(mode='exact' or 'tolerance') explicitly "
                             "(every rank stops here)")
        return None, resolve_mode(config, None, device, writer)
    classes = [r[0] for r in gather_rows(torch.tensor([signature], dtype=torch.int64), group, device)]
    if writer:
        log.warning("sdc_telemetry: the ranks run on %d different hardware/software stacks (or kernel settings: "
                    "autotuning, TF32, deterministic algorithms): exact comparison only between ranks of the same "
                    "stack; the replay compares with a calibrated tolerance", len(set(classes)))
    return classes, resolve_mode(config, classes, device, writer)


def resolve_mode(config: SDCConfig, classes: list[int] | None, device: torch.device, writer: bool) -> str:
    """``exact`` or ``tolerance``: exact only where every rank's numerics can be bit-identical."""
    if classes is not None:
        if config.mode == "exact" and writer:
            log.warning("sdc_telemetry: mode='exact' with mixed hardware/software stacks: the replay uses a "
                        "calibrated tolerance instead")
        return "tolerance"
    if config.mode != "auto":
        return config.mode
    return "exact" if bitwise_reproducible(device) else "tolerance"
