"""What travels to a replaying rank: a step's micro-batches with their RNG and autocast state, and the origin's
record. Only plain nests of tensors and values are allowed (lists, tuples, namedtuples, dicts and OrderedDicts), so
the receiver can load them with ``torch.load(weights_only=True)`` and never unpickles arbitrary objects from a peer.
A namedtuple travels as its class path and values and is rebuilt on the receiver only if that path names a
namedtuple class there (both ranks run the same code)."""

from __future__ import annotations

import importlib
import io
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MicroBatch", "check_shippable", "exchange_bytes", "from_bytes", "pack", "to_bytes", "unpack"]

_PLAIN = (int, float, bool, str, bytes, complex, type(None))


def check_shippable(batch: Any, path: str = "batch") -> None:
    """Raise ``TypeError`` naming the first leaf that cannot travel to a replaying rank."""
    if isinstance(batch, torch.Tensor):
        if batch.layout != torch.strided:
            raise TypeError(f"replay cannot ship {path}: a {batch.layout} tensor; use dense tensors")
        return
    if type(batch) in (list, tuple) or _is_namedtuple(batch):
        for i, item in enumerate(batch):
            check_shippable(item, f"{path}[{i}]")
        return
    if type(batch) in (dict, OrderedDict):
        for k, v in batch.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"replay cannot ship {path}: dict key {k!r} of type {type(k).__name__} "
                                "(keys must be str or int)")
            check_shippable(v, f"{path}[{k!r}]")
        return
    if type(batch) in _PLAIN:
        return
    raise TypeError(f"replay cannot ship {path}: leaf of type {type(batch).__module__}.{type(batch).__qualname__}. "
                    "Batches must nest tensors, lists, tuples and dicts of plain values (int, float, bool, str, "
                    "bytes, None); convert it in the loop, or set replay_every=0")


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and type(x) is not tuple and hasattr(type(x), "_fields")


_NT = "__sdc_namedtuple__"
_DESCEND = object()  # what a ``_map`` rule returns for a node it leaves to the walk


def _map(x: Any, rule: Callable[[Any], Any]) -> Any:
    """``x`` rebuilt with ``rule(node)`` in place of every node for which it returns something else than
    ``_DESCEND``; lists, tuples, dicts and OrderedDicts are walked, any other leaf is kept as is."""
    out = rule(x)
    if out is not _DESCEND:
        return out
    if type(x) in (list, tuple):
        return type(x)(_map(v, rule) for v in x)
    if type(x) in (dict, OrderedDict):
        return type(x)((k, _map(v, rule)) for k, v in x.items())
    return x


def _to_plain(x: Any) -> Any:
    """Namedtuples as tagged dicts (weights_only loading refuses unknown classes); everything else as is."""
    def rule(node: Any) -> Any:
        if not _is_namedtuple(node):
            return _DESCEND
        cls = type(node)
        return {_NT: f"{cls.__module__}:{cls.__qualname__}", "values": [_to_plain(v) for v in node]}

    return _map(x, rule)


def _from_plain(x: Any) -> Any:
    def rule(node: Any) -> Any:
        if not (type(node) is dict and _NT in node):
            return _DESCEND
        module, _, qualname = str(node[_NT]).partition(":")
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        if not (isinstance(obj, type) and issubclass(obj, tuple) and hasattr(obj, "_fields")):
            raise TypeError(f"replay record names {node[_NT]!r}, which is not a namedtuple class on this rank")
        return obj(*(_from_plain(v) for v in node["values"]))

    return _map(x, rule)


@dataclass
class MicroBatch:
    batch: Any
    cpu_rng: torch.Tensor
    dev_rng: torch.Tensor | None
    autocast: tuple[bool, torch.dtype] | None
    scale: float = 1.0
    loss: torch.Tensor | None = None
    grad_scale: torch.Tensor | None = None  # a GradScaler's scale when the loss was scaled by it
    # Which parameters already had a .grad when this micro-batch's backward ran: autograd then adds into it
    # (0.0 + g turns -0.0 into +0.0), and the replay must add the same way to reproduce the bits.
    had_grad: list[bool] | None = None
    # A framework's own RNG states, captured with the others (Megatron's RNG tracker: ``Layout.rng_state``).
    framework_rng: Any = None


_DEV = "__sdc_device_tensor__"


def _off_device(x: Any, moved: list[tuple[dict[str, Any], torch.Tensor]]) -> Any:
    """``x`` with every tensor that is not on the CPU replaced by a tagged placeholder ``{_DEV: None}``, collected in
    ``moved`` with its tensor: they are copied to the host all at once (``_to_host``), not one blocking copy each."""
    def rule(node: Any) -> Any:
        if not isinstance(node, torch.Tensor):
            return _DESCEND
        if node.device.type == "cpu":
            return node
        slot: dict[str, Any] = {_DEV: None}
        moved.append((slot, node))
        return slot

    return _map(x, rule)


def _to_host(moved: list[tuple[dict[str, Any], torch.Tensor]]) -> None:
    """Fill the placeholders with host copies: on CUDA every copy is queued without blocking (into pinned memory)
    and the host waits once per device, so a record of M micro-batches costs one synchronisation, not one per
    tensor (``torch.save`` would copy each CUDA storage with its own blocking copy)."""
    for slot, t in moved:  # another accelerator than CUDA: a plain copy
        slot[_DEV] = t.detach().to("cpu", non_blocking=t.is_cuda)
    for device in {t.device for _, t in moved if t.is_cuda}:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(device))
        event.synchronize()


def _on_device(x: Any, device: torch.device) -> Any:
    """The inverse of ``_off_device`` on the receiver: tagged tensors land on ``device`` (CUDA: from pinned memory,
    without blocking), everything else as loaded."""
    def rule(node: Any) -> Any:
        if not (type(node) is dict and _DEV in node and len(node) == 1 and isinstance(node[_DEV], torch.Tensor)):
            return _DESCEND
        t = node[_DEV]
        return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)

    return _map(x, rule)


def pack(record: dict[str, Any]) -> torch.Tensor:
    """The record as bytes. Tensors on an accelerator (a batch on the GPU, the loss, a GradScaler's scale) travel
    as tagged host copies, made together; they land on the receiver's device."""
    moved: list[tuple[dict[str, Any], torch.Tensor]] = []
    micro = _off_device([{"batch": _to_plain(m.batch), "cpu_rng": m.cpu_rng, "dev_rng": m.dev_rng, "scale": m.scale,
                          "framework_rng": m.framework_rng, "loss": m.loss, "grad_scale": m.grad_scale,
                          "had_grad": m.had_grad,
                          "autocast": None if m.autocast is None else
                          (m.autocast[0], str(m.autocast[1]).removeprefix("torch."))} for m in record["micro"]],
                        moved)
    _to_host(moved)
    plain = {
        "fp": record.get("fp"),
        "norms": _cpu(record["norms"]),
        "sketch": _cpu(record.get("sketch")),
        "micro": micro,
        "outputs": record.get("outputs"),  # a pipeline stage's (output digest, per-micro-batch output norms)
        "extra": record.get("extra"),  # plain values (numbers, lists, CPU tensors) a protocol adds: a late audit's
    }
    return to_bytes(plain)


def to_bytes(plain: Any) -> torch.Tensor:
    """A plain nest (tensors, lists, tuples, dicts, numbers, strings) as a uint8 tensor, for ``from_bytes``."""
    buf = io.BytesIO()
    torch.save(plain, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def from_bytes(data: torch.Tensor) -> Any:
    """What ``to_bytes`` made, loaded with ``weights_only=True`` (a peer's bytes never unpickle arbitrary objects);
    tensors land on the CPU."""
    return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), map_location="cpu", weights_only=True)


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.device.type == "cpu" else t.cpu()


def unpack(data: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """Load a packed record: tensors that lived on an accelerator land on ``device``, CPU tensors (the batch as the
    origin held it, RNG states, which ``set_rng_state`` wants on the CPU) stay on the CPU."""
    plain = from_bytes(data)
    plain["micro"] = _on_device(plain["micro"], device)
    micro = [MicroBatch(batch=_from_plain(m["batch"]), cpu_rng=m["cpu_rng"], dev_rng=m["dev_rng"],
                         had_grad=m["had_grad"], grad_scale=m["grad_scale"],
                         autocast=None if m["autocast"] is None else (m["autocast"][0],
                                                                      getattr(torch, m["autocast"][1])),
                         scale=m["scale"], loss=m["loss"], framework_rng=m["framework_rng"])
             for m in plain["micro"]]
    sk = plain.get("sketch")
    return {"fp": plain["fp"], "norms": plain["norms"], "sketch": sk, "micro": micro, "outputs": plain.get("outputs"),
            "extra": plain.get("extra")}


def exchange(mine: dict[str, Any], send_to: int, recv_from: int, group: Any, wire: torch.device,
             device: torch.device) -> tuple[dict[str, Any] | None, str]:
    """Send ``mine`` to global rank ``send_to`` and receive ``recv_from``'s record, point-to-point (size, then
    payload). Returns (their record or None, an error text or ""); a record that cannot be packed goes out empty so
    that the peer never waits forever."""
    error = ""
    try:
        payload = pack(mine)
    except Exception as e:  # noqa: BLE001
        error = f"packing the replay record failed: {type(e).__name__}: {e}"
        payload = torch.zeros(0, dtype=torch.uint8)
    data_in = exchange_bytes(payload, send_to, recv_from, group, wire)
    if data_in.numel() == 0:
        return None, error
    try:
        return unpack(data_in, device), error
    except Exception as e:  # noqa: BLE001
        return None, f"unpacking the replay record failed: {type(e).__name__}: {e}"


def exchange_bytes(payload: torch.Tensor, send_to: int, recv_from: int, group: Any, wire: torch.device
                   ) -> torch.Tensor:
    """Send ``payload`` (uint8) to global rank ``send_to`` and receive ``recv_from``'s, point-to-point: the sizes,
    then the payloads, each pair in one ``batch_isend_irecv``."""
    import torch.distributed as dist

    def p2p(out: torch.Tensor, into: torch.Tensor) -> None:
        ops = [dist.P2POp(dist.isend, out, send_to, group), dist.P2POp(dist.irecv, into, recv_from, group)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    size_out = torch.tensor([payload.numel()], dtype=torch.int64, device=wire)
    size_in = torch.zeros(1, dtype=torch.int64, device=wire)
    p2p(size_out, size_in)
    data_in = torch.empty(int(size_in.item()), dtype=torch.uint8, device=wire)
    p2p(payload.to(wire), data_in)
    return data_in
