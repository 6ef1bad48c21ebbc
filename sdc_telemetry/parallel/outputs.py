"""What a rank's stage modules (pipelines) or expert modules (expert parallelism) computed on an audited step,
fingerprinted per forward, so that the replay can name the first stage or rank whose result differs from the
origin's (``StageOutputs``; ``parallel.experts.ExpertOutputs`` extends it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from sdc_telemetry.core.fingerprint import digest, fingerprint
from sdc_telemetry.parallel.fsdp import local_shard

__all__ = ["StageOutputs"]


class StageOutputs:
    """What this rank's stage modules computed in a step: per forward, its local stage, the fingerprint of its output
    and the output's norm, and per backward the same of the gradient it sends back to the previous stage (the
    gradient of each stage input that requires one), recorded while ``recording()`` is in force (the origin's audited
    step, a partner's rerun of it). The replay compares them stage by stage: a fault in one stage's forward changes
    its output and every later stage's, while the gradients of every stage change (backward carries it back), so the
    first stage whose output differs is the one that computed wrongly; a fault in a stage's backward leaves every
    output alike and changes the gradient that stage sends back and every earlier stage's, so the last stage whose
    sent gradient differs is the one. Records carry their channel: ``k`` for local stage k's outputs, ``parts + k``
    for the gradients it sent. ``stages_of``: every position's pipeline stage indices, in local stage order (one per
    position, or several under an interleaved or looped schedule)."""

    def __init__(self, modules: Sequence[torch.nn.Module], stages_of: Sequence[Sequence[int]]) -> None:
        self.stages_of = [list(s) for s in stages_of]
        self.parts = len(modules)
        self._rows: list[torch.Tensor] | None = None
        self._norms: list[torch.Tensor] = []
        self._local: list[int] = []
        self._handles = [m.register_forward_hook(self._hook(k)) for k, m in enumerate(modules)]
        # the recorded forwards' hooks on their inputs, removed when the recording ends (a stage's receive buffers
        # live across steps)
        self._input_hooks: list[Any] = []

    #: the recording spans the whole step, from its opening to its audit (``start``/``finish``, called by the
    #: replay), rather than the schedule step (``recording``)
    whole_step = False

    @contextmanager
    def recording(self, on: bool = True) -> Iterator[list[tuple[list[int], list[float], list[int]] | None]]:
        """Records the forwards and backwards inside the block (when ``on``); afterwards the yielded list holds (each
        record's fingerprint, folded to one word; its norm; its channel: the local stage's output, or ``parts`` + the
        local stage for a gradient sent back), in order, or None when nothing was recorded. One host read at the
        end. Not ``on``: a recording in progress (``start``) is paused inside the block."""
        got: list[tuple[list[int], list[float], list[int]] | None] = []
        paused = (self._rows, self._norms, self._local)
        if on:
            self.start()
        else:
            self._rows = None
        try:
            yield got
        finally:
            if on:
                got.append(self.finish())
            else:
                self._rows, self._norms, self._local = paused

    def encode(self, differs: Sequence[bool]) -> int:
        """A comparison's mark from which channels differed: a bit per channel (-1, not compared, past 62 of
        them: the mark travels as an int64)."""
        if len(differs) > 62:
            return -1
        return sum(1 << k for k, d in enumerate(differs) if d)

    @staticmethod
    def merge(a: int, b: int) -> int:
        """A position's marks of two comparisons, as one: a channel differed if it did in either."""
        return a | b

    def sent_differs(self, mark: int) -> bool:
        """Some local stage sent a differing gradient back."""
        return mark > 0 and bool(mark >> self.parts)

    def start(self) -> None:
        """Start recording (a recording in progress is dropped)."""
        self.finish()
        self._rows, self._norms, self._local = [], [], []

    def finish(self) -> tuple[list[int], list[float], list[int]] | None:
        """Stop recording: what was recorded (as ``recording`` yields it), None when nothing was."""
        for h in self._input_hooks:
            h.remove()
        self._input_hooks.clear()
        rows, norms, local = self._rows, self._norms, self._local
        self._rows, self._norms, self._local = None, [], []
        return (torch.stack(rows).cpu().tolist(), torch.stack(norms).double().cpu().tolist(), local) if rows \
            else None

    def _hook(self, k: int) -> Callable[..., None]:
        def on_output(_module: torch.nn.Module, inputs: Any, output: Any) -> None:
            if self._rows is None:
                return
            if self._record(output, k):
                for t in _tensors(inputs):  # what backward sends to the previous stage: these inputs' gradients
                    if t.requires_grad and t.is_floating_point():
                        self._input_hooks.append(t.register_hook(self._sent(self.parts + k)))  # type: ignore[no-untyped-call]
        return on_output

    def _sent(self, channel: int) -> Callable[[torch.Tensor], None]:
        def on_grad(grad: torch.Tensor) -> None:
            if self._rows is not None:
                self._record(grad, channel)
        return on_grad

    def _record(self, value: Any, channel: int) -> bool:
        """Fingerprint and norm of ``value``'s floating tensors, under ``channel``; False when there were none."""
        assert self._rows is not None
        # a tensor-parallel stage's output may be a DTensor (sequence-parallel activations, loss-parallel
        # logits): this rank's local part, which its partner in the same coordinate computes too
        tensors = [local_shard(t.detach()) for t in _tensors(value) if t.is_floating_point()]
        if not tensors or any(t.is_meta for t in tensors):
            return False
        with torch.no_grad():
            self._rows.append(digest(fingerprint(tensors)))
            self._norms.append(torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors])))
        self._local.append(channel)
        return True

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._rows = None


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []
