"""What travels to a replaying rank: a record round-trips through ``pack``/``unpack`` exactly, and tensors that
lived on an accelerator are copied to the host together (one synchronisation per record, not one per tensor)."""

from __future__ import annotations

import warnings
from collections import OrderedDict, namedtuple

import pytest
import torch

from sdc_telemetry.checks import shipping
from sdc_telemetry.checks.shipping import MicroBatch, pack, unpack

Pair = namedtuple("Pair", ["x", "y"])


def _record(micro_batches: int, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(0)
    micro = [MicroBatch(batch=Pair(torch.randint(0, 9, (2, 5), generator=gen).to(device),
                                   {"mask": torch.ones(3, dtype=torch.bool).to(device), "n": i,
                                    "o": OrderedDict(k=[1.5, None])}),
                        cpu_rng=torch.get_rng_state(), dev_rng=None, autocast=(True, torch.bfloat16), scale=0.25,
                        loss=torch.tensor(1.0 + i).to(device), grad_scale=torch.tensor(2.0 ** 16).to(device),
                        had_grad=[True, False]) for i in range(micro_batches)]
    return {"fp": 12345, "norms": torch.rand(4, generator=gen), "sketch": None, "micro": micro}


def test_a_record_round_trips_exactly() -> None:
    """Batches (namedtuples, dicts, OrderedDicts, plain values), RNG and autocast state, loss and scale come back
    as they left."""
    sent = _record(3, torch.device("cpu"))
    got = unpack(pack(sent), torch.device("cpu"))
    assert got["fp"] == 12345 and torch.equal(got["norms"], sent["norms"]) and got["sketch"] is None
    assert len(got["micro"]) == 3
    for a, b in zip(sent["micro"], got["micro"], strict=True):
        assert type(b.batch) is Pair and torch.equal(a.batch.x, b.batch.x)
        assert torch.equal(a.batch.y["mask"], b.batch.y["mask"]) and b.batch.y["n"] == a.batch.y["n"]
        assert b.batch.y["o"] == OrderedDict(k=[1.5, None]) and type(b.batch.y["o"]) is OrderedDict
        assert torch.equal(a.cpu_rng, b.cpu_rng) and b.dev_rng is None
        assert b.autocast == (True, torch.bfloat16) and b.scale == 0.25 and b.had_grad == [True, False]
        assert torch.equal(a.loss, b.loss) and torch.equal(a.grad_scale, b.grad_scale)


def test_tensors_off_the_cpu_travel_as_tagged_host_copies_and_land_on_the_device() -> None:
    """Every tensor not on the CPU (here a meta tensor stands for a GPU one) is collected for one batched host copy
    and replaced by a placeholder; the receiver puts the copies on its own device, CPU tensors stay where they were."""
    dev = torch.empty(3, device="meta")
    cpu = torch.arange(2)
    moved: list = []
    tree = shipping._off_device({"a": [dev, cpu, (dev, 1)], "b": "text"}, moved)
    assert [t for _, t in moved] == [dev, dev] and tree["a"][1] is cpu and tree["b"] == "text"
    for slot, _ in moved:  # what _to_host does with a real device tensor
        slot[shipping._DEV] = torch.zeros(3)
    back = shipping._on_device(tree, torch.device("cpu"))
    assert torch.equal(back["a"][0], torch.zeros(3)) and back["a"][1] is cpu
    assert type(back["a"][2]) is tuple and torch.equal(back["a"][2][0], torch.zeros(3)) and back["a"][2][1] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_packing_cuda_micro_batches_costs_the_same_synchronisations_for_1_and_8() -> None:
    """A record of CUDA batches, losses and scales: the host synchronisations of pack and unpack do not grow with
    the number of micro-batches (torch.save would copy each CUDA storage with a blocking copy)."""
    device = torch.device("cuda", torch.cuda.current_device())

    def syncs(n: int) -> int:
        record = _record(n, device)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                got = unpack(pack(record), device)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        assert got["micro"][0].loss.device == device and torch.equal(got["micro"][-1].loss.cpu(),
                                                                     record["micro"][-1].loss.cpu())
        return sum("synchroniz" in str(w.message) for w in seen)

    assert syncs(1) == syncs(8)
