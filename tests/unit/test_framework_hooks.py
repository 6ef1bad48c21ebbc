"""The layout hooks frameworks need in the replay and the step (Megatron-core's, tested end to end on gloo ranks in
tests/integrations/test_megatron.py): gradients added into a framework's zeroed buffer of its own dtype, and a step
withdrawn with its index given back."""

from __future__ import annotations

import torch
from torch import nn

import sdc_telemetry as sdc
from sdc_telemetry.checks.recompute import _Stream
from sdc_telemetry.core.fingerprint import fingerprint

OFF = {"metrics_port": None, "nvml": False}


def _rows(stream: _Stream) -> list[list[int]]:
    assert stream.fps is not None
    return stream.fps.tolist()


def test_pieces_are_added_into_zeros_of_the_frameworks_dtype() -> None:
    """A framework that adds each local gradient into a zeroed fp32 buffer (Megatron's main_grad) gets back
    0.0 + g: -0.0 becomes +0.0, and bf16 pieces of two micro-batches sum in fp32. The replay's fingerprint equals
    that buffer's, bit for bit, where summing the pieces as autograd does would not."""
    p = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    g1 = torch.tensor([-0.0, 1.0, 3.0, 1e-3], dtype=torch.bfloat16)
    g2 = torch.tensor([-0.0, 2.0 ** -9, 1.0, 1e-3], dtype=torch.bfloat16)
    buffer = torch.zeros(4, dtype=torch.float32)
    buffer.add_(g1)
    buffer.add_(g2)  # what the framework holds after two micro-batches
    stream = _Stream([p], torch.device("cpu"), False, 2, set(), into=[torch.float32])
    for k, g in enumerate((g1, g2)):
        stream.begin(k)
        stream.piece(0, g, owned=False)
    stream.settle(zeros=True)
    assert _rows(stream) == fingerprint([buffer]).tolist()
    plain = _Stream([p], torch.device("cpu"), False, 2, set())  # as autograd sums: bf16, -0.0 kept
    for k, g in enumerate((g1, g2)):
        plain.begin(k)
        plain.piece(0, g, owned=False)
    plain.settle(zeros=True)
    assert _rows(plain) != _rows(stream)


def test_a_withdrawn_step_gives_its_index_back() -> None:
    """A step that registered a micro-batch and ran no backward (an evaluation pass through the training's forward
    function) is withdrawn: nothing is checked and the next step opens at the same index."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sdc.SDCMonitor(model, opt, config=sdc.SDCConfig(**OFF), start_step=5)
    x = torch.ones(3, 4)
    withdrawn = mon.step().begin()
    withdrawn.micro_batch(x)
    assert withdrawn.index == 5
    withdrawn.discard(give_back=True)
    with mon.step(x) as step:
        step.backward(model(x).sum())
    assert step.index == 5 and step.finite
    discarded = mon.step().begin()
    discarded.discard()  # without give_back, a discarded step keeps its index
    with mon.step(x) as step:
        step.backward(model(x).sum())
    assert discarded.index == 6 and step.index == 7
    mon.close()
