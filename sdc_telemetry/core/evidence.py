"""Small shared helpers of the checks: JSON-safe floats, bounded evidence, float <-> int64 bit casts."""

from __future__ import annotations

import math
import struct
from typing import TypeVar

__all__ = ["MAX_ITEMS", "json_float", "top", "bits", "unbits"]

# Evidence stays small enough for one log line and one JSONL record at any world size: per-rank or per-parameter
# detail is listed for at most this many entries, with the full count beside it.
MAX_ITEMS = 16

V = TypeVar("V")


def json_float(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def top(items: dict[str, V], limit: int = MAX_ITEMS) -> dict[str, V]:
    """The first ``limit`` entries of ``items`` (insertion order)."""
    return dict(list(items.items())[:limit])


def bits(x: float) -> int:
    """The IEEE-754 bits of a float64 as a signed int64 (so a float travels exactly in an int64 tensor)."""
    return int(struct.unpack("<q", struct.pack("<d", x))[0])


def unbits(b: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", b))[0])
