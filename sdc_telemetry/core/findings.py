"""A check's collective verdict (``Finding``) and the names of the checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Finding", "CHECKS"]

CHECKS = ("grad_local", "grad_reduced", "replay", "weights", "update")


@dataclass(frozen=True)
class Finding:
    """A collective verdict: every rank computes the same Finding from the same gathered data."""

    check: str
    suspect_ranks: tuple[int, ...]
    evidence: dict[str, Any] = field(default_factory=dict)
