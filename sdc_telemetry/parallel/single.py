"""One process (torch.distributed not initialised, or a world of one): gradient checks only.

Local gradients are ``.grad`` after backward (there is no reduction to tap and nothing reduced to check); with no
replica there is nothing to vote on or replay, and a non-finite gradient names this process, marked ambiguous
(numerics and hardware look alike from inside one process).
"""

from __future__ import annotations

import torch

from sdc_telemetry.parallel.base import GradSink, Layout

__all__ = ["SingleProcess"]


class SingleProcess(Layout):
    name = "single"

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, model, None, [0], 0)
        self._backward = False  # a backward reached the parameters since the last read
        self._hook: torch.utils.hooks.RemovableHandle | None = None

    def install(self, sink: GradSink, *, reduced_checks: bool = True) -> None:
        # One flag per backward (the hook fires once, for the first gradient of any parameter): a step whose block
        # ran no backward measured nothing, and ``.grad`` left from an earlier step must not count as a pass.
        params = [p for p in self.module.parameters() if p.requires_grad]
        self._hook = torch.autograd.graph.register_multi_grad_hook(params, self._ran, mode="any")

    def _ran(self, _: torch.Tensor) -> None:
        self._backward = True

    def after_backward(self, sink: GradSink) -> None:
        if self._backward or self._hook is None:
            sink.measure_local()
        self._backward = False

    def disable(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
