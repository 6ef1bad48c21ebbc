"""One process (torch.distributed not initialised, or a world of one): gradient checks only.

Local gradients are ``.grad`` after backward (there is no reduction to tap and nothing reduced to check); with no
replica there is nothing to vote on or replay, and a non-finite gradient names this process, marked ambiguous
(numerics and hardware look alike from inside one process).
"""

from __future__ import annotations

import torch

from sdc_telemetry.parallel.base import Layout

__all__ = ["SingleProcess"]


class SingleProcess(Layout):
    name = "single"

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, model, None, [0], 0)
