"""DeepSpeed integration: ``SDCDeepSpeed``, for loops written with ``engine.backward`` and ``engine.step``.

    >>> from sdc_telemetry.deepspeed import SDCDeepSpeed                        # doctest: +SKIP
    >>> engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
    ...                                                config=ds_config)
    >>> run = SDCDeepSpeed(engine, loss_fn=compute_loss, config=sdc.SDCConfig(replay_every=50, on_suspect="raise"))
    >>> with sdc.exit_on_sdc(run):
    ...     for batch in loader:                     # one micro-batch per iteration, as DeepSpeed loops run
    ...         run.micro_batch(batch)               # before the forward pass
    ...         loss = compute_loss(engine, batch)
    ...         engine.backward(loss)                # recorded; the checks run in the boundary micro-batch's backward
    ...         engine.step()
    >>> run.close()

The loop keeps ``engine.backward(loss)``: ``SDCDeepSpeed`` wraps it on the engine (undone by ``close()``), records
the loss with DeepSpeed's ``1 / gradient_accumulation_steps`` and ends the monitor's step right after the backward
of the micro-batch at the accumulation boundary, where DeepSpeed has reduced the gradients and ``engine.step()`` is
about to update: the checks run there on every rank and ``SDCDetected`` is raised before the update.

ZeRO stages 0 to 3 with fp32 or bf16 (``parallel/deepspeed.py`` says what each check reads and what is refused).
From stage 1 on each rank's fp32 master partition and its optimizer state live on that rank alone: the at-rest
check watches them between the update and the next weight check, and the update audit (``update_every``, with the
replay by default) has a partner recompute one rank's optimizer step on its partition. ``loss_fn(module, batch)``
recomputes a micro-batch's loss on ``engine.module`` for the replay.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from sdc_telemetry.core.config import SDCConfig
from sdc_telemetry.integrations._backward import WrappedBackward
from sdc_telemetry.monitor import SDCMonitor
from sdc_telemetry.sinks.observer import Observer

__all__ = ["SDCDeepSpeed"]

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


class SDCDeepSpeed(WrappedBackward):
    """Silent-data-corruption checks for a training loop on a ``deepspeed.DeepSpeedEngine``.

    ``engine``: what ``deepspeed.initialize`` returned first; ``loss_fn(module, batch)``: a micro-batch's loss as the
    loop computes it (the replay calls it on ``engine.module``); ``config``, ``start_step``, ``observer``: as for
    ``SDCMonitor``. ``monitor`` is the ``SDCMonitor`` (its ``incidents`` stay readable after ``close()``);
    ``sdc.exit_on_sdc(run)`` reads it."""

    call = "engine.backward()"
    marker = "__sdc_deepspeed__"

    def __init__(self, engine: Any, *, loss_fn: LossFn, config: SDCConfig | None = None, start_step: int = 0,
                 observer: Observer | None = None) -> None:
        if not callable(getattr(engine, "zero_optimization_stage", None)):
            raise TypeError(f"engine must be a deepspeed.DeepSpeedEngine (deepspeed.initialize()'s first result), got "
                            f"{type(engine).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(module, batch), got {type(loss_fn).__name__}")
        self.free(engine)
        self.engine = engine
        monitor = SDCMonitor(engine, engine.optimizer, loss_fn=loss_fn, config=config, start_step=start_step,
                             observer=observer)
        self._layout = monitor.layout  # parallel.deepspeed.DeepSpeedZeRO: its hooks measure while ``armed``
        super().__init__(engine, monitor)

    def _scale(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[float, Any]:
        """What DeepSpeed's backward does to the loss: divide by the accumulation steps (``scale_wrt_gas``, its
        third parameter after ``retain_graph``)."""
        gas = self.engine.gradient_accumulation_steps()
        by_gas = kwargs.get("scale_wrt_gas", args[1] if len(args) > 1 else True)
        return (1.0 / gas if by_gas else 1.0), None

    def _ends_step(self, before: bool | None) -> bool:
        # Asked before the backward (DeepSpeed counts micro-steps in engine.step()): the boundary micro-batch's, unless
        # it runs inside engine.no_sync() (nothing is reduced then).
        if before is None:
            return bool(self.engine.is_gradient_accumulation_boundary()) \
                and not getattr(self.engine, "inside_no_sync_ctxt", False)
        return before

    @contextmanager
    def _around(self) -> Iterator[None]:
        self._layout.armed = True  # type: ignore[attr-defined]
        try:
            yield
        finally:
            self._layout.armed = False  # type: ignore[attr-defined]

    def __enter__(self) -> SDCDeepSpeed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
