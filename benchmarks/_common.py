"""Shared pieces of the benchmarks: a small GPT-style model, seeded token batches, tables and JSON results.

Every benchmark is a script (``python benchmarks/<name>.py`` from the repository root) and a module whose ``run()``
takes the sizes as arguments, so that the smoke test can call it in a tiny configuration.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

if str(ROOT) not in sys.path:  # run as a script from a checkout without the editable install
    # Appended, not prepended: an sdc_telemetry on PYTHONPATH (an older checkout, for before/after comparisons) or
    # installed comes first.
    sys.path.append(str(ROOT))


# -- model ----------------------------------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(nn.functional.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """A small GPT: token + position embeddings, ``layers`` blocks, final LayerNorm, head tied to the embedding."""

    def __init__(self, vocab: int = 8192, dim: int = 320, layers: int = 6, heads: int = 5, seq: int = 64,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))  # type: ignore[no-any-return]


def lm_loss(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy; the ``loss_fn(module, batch)`` the monitor's replay calls."""
    x, y = batch
    logits = module(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def token_batches(n: int, batch: int, seq: int, vocab: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` seeded (input, target) batches of shape (batch, seq), made before timing starts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# -- statistics -----------------------------------------------------------------------------------------------------


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default), without numpy."""
    s = sorted(xs)
    if not s:
        return math.nan
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median(xs: Sequence[float]) -> float:
    return quantile(xs, 0.5)


def iqr(xs: Sequence[float]) -> tuple[float, float]:
    return quantile(xs, 0.25), quantile(xs, 0.75)


# -- output ---------------------------------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """A GitHub-flavoured Markdown table (pastes into the README as is)."""
    cells = [[str(h) for h in headers]] + [[_cell(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [] if title is None else [f"### {title}", ""]
    lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells[1:]:
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |")
    return "\n".join(lines)


def _cell(c: Any) -> str:
    if isinstance(c, float):
        if math.isnan(c):
            return "-"
        return f"{c:.3g}" if abs(c) < 1000 else f"{c:.0f}"
    return str(c)


def environment() -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "busy_cpus_before": busy_cpus(0.2),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def busy_cpus(window_s: float = 0.5) -> float | None:
    """How many CPUs other work keeps busy right now (from /proc/stat over ``window_s``); None where unknown."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
        return sum(v[:8]) - idle, sum(v[:8])

    try:
        busy0, total0 = sample()
        time.sleep(window_s)
        busy1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    cpus = os.cpu_count() or 1
    return cpus * (busy1 - busy0) / max(total1 - total0, 1)


def wait_until_quiet(max_wait_s: float, busy_fraction: float = 0.25, poll_s: float = 2.0) -> float | None:
    """Wait (up to ``max_wait_s``) until other work keeps under ``busy_fraction`` of the CPUs busy.

    On a shared machine a few seconds of waiting buys figures that mean something. Returns the last busy-CPU
    reading (None where unknown).
    """
    deadline = time.monotonic() + max_wait_s
    while True:
        busy = busy_cpus(poll_s)
        if busy is None or busy < busy_fraction * (os.cpu_count() or 1) or time.monotonic() >= deadline:
            return busy


def load_warning() -> str | None:
    """A line to print when other work is running on the machine (its timings would be unreliable)."""
    busy = busy_cpus()
    if busy is None or busy < 0.25 * (os.cpu_count() or 1):
        return None
    return (f"warning: other work keeps {busy:.1f} of {os.cpu_count()} CPUs busy before the run: timings are "
            "unreliable (see the spread)")


def write_json(name: str, payload: dict[str, Any], out_dir: Path | str | None = None) -> Path:
    """Write ``payload`` (plus the environment) to ``benchmarks/results/<name>.json``; return the path."""
    directory = Path(out_dir) if out_dir is not None else RESULTS
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    body = _plain({"benchmark": name, "environment": environment(), **payload})
    path.write_text(json.dumps(body, indent=2, allow_nan=False) + "\n")
    return path


def _plain(o: Any) -> Any:
    """Strict JSON: non-finite floats become null, tuples lists, dtypes/devices/paths strings."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {str(k): _plain(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_plain(v) for v in o]
    if isinstance(o, (torch.dtype, torch.device, Path)):
        return str(o)
    return o
