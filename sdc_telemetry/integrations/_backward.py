"""What the Accelerate and DeepSpeed integrations share: the loop keeps the framework's own ``backward(loss)``, which is
wrapped on the object that owns it (undone by ``close()``).

Each call records the micro-batch's loss with the factor the framework applies before its backward (so that the
replay recomputes the same gradients), then runs the framework's backward. The monitor's step opens at the first
micro-batch ``micro_batch(batch)`` registers (capturing its RNG state for the replay) and ends right after the
backward of the micro-batch on which the framework reduces gradients (the last one of an accumulation window): every
rank runs the checks there, after the reduction and before the update, and ``SDCDetected`` is raised on every rank
at the same step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from sdc_telemetry.core.incident import Incident
from sdc_telemetry.monitor import SDCMonitor
from sdc_telemetry.step import StepContext

__all__ = ["WrappedBackward", "close_open"]


def close_open(step: StepContext | None, monitor: SDCMonitor) -> None:
    """Close the monitor, and before it a step still open: discarded unchecked after a normal end (the loop ended
    inside an accumulation window, the same on every rank), abandoned on an exception path (no collective)."""
    if step is not None and not monitor.closed:
        if sys.exc_info()[0] is None:
            step.discard()
        else:
            step.__exit__(RuntimeError, None, None)
    monitor.close()


class WrappedBackward:
    """Base: ``owner.backward`` wrapped for ``monitor``. Subclasses say how the framework scales a loss
    (``_scale``: (factor, GradScaler or None)) and whether a backward ends the optimizer step (``_ends_step``,
    asked before and after the call: ``before`` is what it answered before)."""

    #: how the loop names the wrapped call, for errors
    call = "backward()"
    #: the attribute that marks the wrapper this object installed
    marker = "__sdc_backward__"

    def __init__(self, owner: Any, monitor: SDCMonitor) -> None:
        backward = getattr(owner, "backward", None)
        marker = self.marker
        if not callable(backward):
            monitor.close()
            raise TypeError(f"{type(owner).__name__} has no backward() to wrap")
        if getattr(backward, marker, None) is not None:
            monitor.close()
            raise ValueError(f"this {type(owner).__name__} already has an {type(self).__name__} attached: close() it "
                             "first")
        self.monitor = monitor
        self._owner = owner
        self._marker = marker
        self._step: StepContext | None = None   # the open step, from its first micro-batch to the reducing one
        self._last: StepContext | None = None   # the last step that ended
        self._backward = backward
        self._own_backward = "backward" in vars(owner)
        owner.backward = self._wrap(backward)

    @classmethod
    def free(cls, owner: Any) -> None:
        """Refuse an owner that already has this kind of wrapper attached (before any monitor is built for it)."""
        if getattr(getattr(owner, "backward", None), cls.marker, None) is not None:
            raise ValueError(f"this {type(owner).__name__} already has an {cls.__name__} attached: close() it first")

    def _scale(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[float, Any]:
        raise NotImplementedError

    def _ends_step(self, before: bool | None) -> bool:
        raise NotImplementedError

    def _around(self) -> Any:
        """A context the framework's backward runs in (the layout's measuring window); none by default."""
        from contextlib import nullcontext

        return nullcontext()

    def _wrap(self, backward: Callable[..., Any]) -> Callable[..., Any]:
        def sdc_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.monitor.closed:
                return backward(loss, *args, **kwargs)
            step = self._step
            if step is None:
                raise RuntimeError(f"{self.call} ran with no micro-batch registered: call run.micro_batch(batch) "
                                   f"({type(self).__name__}) before each micro-batch's forward pass")
            scale, scaler = self._scale(args, kwargs)
            step.record_loss(loss, scale=scale, scaler=scaler)
            before = self._ends_step(None)
            try:
                with self._around():
                    out = backward(loss, *args, **kwargs)
            except BaseException as e:
                self._step = None
                step.__exit__(type(e), e, e.__traceback__)  # abandoned on this rank; the next micro-batch reopens
                raise
            if self._ends_step(before):  # the gradients are reduced: the step's checks, before the update
                self._step = None
                self._last = step
                step.end()
            return out

        setattr(sdc_backward, self._marker, self)
        return sdc_backward

    def micro_batch(self, batch: Any) -> None:
        """Register the next micro-batch (call before its forward pass): opens the monitor's step on the first
        micro-batch of an optimizer step. Does nothing once the monitor is closed."""
        if self.monitor.closed:
            return
        if self._step is None:
            self._step = self.monitor.step().begin()
        self._step.micro_batch(batch)

    @property
    def finite(self) -> bool:
        """The last completed step's gradients were finite on every rank (the same answer everywhere)."""
        if self._last is None:
            raise RuntimeError(f"no step has ended yet: read run.finite after the reducing {self.call}")
        return self._last.finite

    @property
    def incidents(self) -> list[Incident]:
        return self.monitor.incidents

    def close(self) -> None:
        """Give ``backward`` back and close the monitor. Idempotent. A step still open (the loop ended inside an
        accumulation window, the same on every rank) is discarded unchecked; on an exception path it is abandoned
        (no collective)."""
        current = vars(self._owner).get("backward")
        if getattr(current, self._marker, None) is self:
            if self._own_backward:
                self._owner.backward = self._backward
            else:
                del self._owner.backward  # the class's method again
        step, self._step = self._step, None
        close_open(step, self.monitor)

    @property
    def backward_restored(self) -> bool:
        """``backward`` is the framework's own again (after ``close()``)."""
        return getattr(getattr(self._owner, "backward", None), self._marker, None) is None
