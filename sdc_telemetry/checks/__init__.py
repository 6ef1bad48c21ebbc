"""The checks: measuring (thin tensor code) and deciding (pure functions over gathered plain data).

Checks never import telemetry, response or the CLI: they return ``Finding``s and measurements, and the monitor
hands those on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Finding", "CHECKS"]

CHECKS = ("grad_local", "grad_reduced", "replay", "weights")


@dataclass(frozen=True)
class Finding:
    """A collective verdict: every rank computes the same Finding from the same gathered data."""

    check: str
    suspect_ranks: tuple[int, ...]
    evidence: dict[str, Any] = field(default_factory=dict)
