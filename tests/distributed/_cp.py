"""Rank side of the context-parallel (CP) tests: a tiny causal language model on a ("dp_shard", "cp") or
("dp_replicate", "dp_shard", "cp") world mesh, laid out as torchtitan lays out CP.

- FSDP2 (``fully_shard``) over the flattened ``dp_shard_cp`` mesh (``mesh["dp_shard", "cp"]._flatten("dp_shard_cp")``),
  HSDP over ``mesh["dp_replicate", "dp_shard_cp"]`` when ``dp_replicate`` is present: the parameters' DTensor mesh is
  that flattened mesh, so the cp dim does not show in it (``param.device_mesh._get_root_mesh()`` is the world mesh).
- The sequence is sharded across the cp ranks with torch's own CP pieces in their module-wrapper form (torchtitan's
  form): ``_context_parallel_shard`` (functional: returns new local chunks, never resizes its inputs) and a
  ``_ContextParallel`` SDPA style applied with ``parallelize_module`` to the attention core, whose hooks turn q/k/v
  (and the causal mask) into DTensors sharded on the sequence dim of the cp mesh and the output back to the local
  chunk. The hooks stay on the module, so a replay run outside the training step still does CP attention.
- What torch 2.13 cannot do on CPU: its ring attention (``_templated_ring_attention``) is dispatched only for the
  CUDA ops ``_scaled_dot_product_{flash,efficient,cudnn}_attention``; on CPU SDPA picks
  ``_scaled_dot_product_flash_attention_for_cpu``, which has no DTensor sharding strategy (causal: the forward fails,
  non-causal: the backward fails), and ``is_causal=True`` under the math backend builds a plain-tensor mask that
  DTensor refuses. So the attention core forces the math backend and passes the causal mask explicitly (each cp rank's
  rows of it, sharded like q): DTensor then all-gathers K/V over the cp group in the forward and reduces their
  gradients in the backward (autograd-aware). Exact, but an all-gather of K/V, not a ring.

A batch is each rank's own chunk, ``{"tokens", "labels", "positions"}`` (``make_batch``): ranks with the same data-
parallel index get chunks of the same global batch. Pass that chunk dict to ``monitor.step``; ``loss_fn`` never
changes it. (torch's legacy ``context_parallel(mesh, buffers=...)`` context manager resizes its buffers in place to
the local chunk and back on exit, and patches SDPA only inside the context: a batch captured by reference would be
the full sequence again at replay time, and a replay outside the context would run local-only attention. With it,
pass clones of the sharded buffers taken inside the context, and replay only with the CP dispatcher active.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental._attention import (
    _context_parallel_shard,
    _ContextParallel,
    _enable_context_parallel_dispatcher,
)
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.attention import SDPBackend, sdpa_kernel

VOCAB = 32
DIM = 16
HEADS = 2
SEQ = 16  # global sequence length, split evenly across the cp ranks
BATCH = 4
DIM_NAMES = ("dp_replicate", "dp_shard", "cp")


class Attention(nn.Module):
    """The attention core (no parameters): math SDPA with an explicit boolean mask (True: attend)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.MATH):
            return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.attn = Attention()
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        h = self.attn(q, k, v, mask).transpose(1, 2).reshape(b, s, DIM)
        x = x + self.proj(h)
        return x + cast(torch.Tensor, self.mlp(self.norm2(x)))


class TinyLM(nn.Module):
    """Causal LM over ``SEQ`` tokens. ``cp_size`` > 1: each rank sees its chunk, ``positions`` says which."""

    def __init__(self, cp_size: int = 1) -> None:
        super().__init__()
        self.cp_size = cp_size
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] * self.cp_size != SEQ or positions.shape != (tokens.shape[1],):
            raise ValueError(f"expected a chunk of {SEQ // self.cp_size} tokens with as many positions, got tokens "
                             f"{tuple(tokens.shape)} positions {tuple(positions.shape)}")
        # this chunk's rows of the global causal mask: (1, 1, local, global), sharded on dim 2 like q
        mask = (positions[:, None] >= torch.arange(SEQ)[None, :])[None, None]
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))  # type: ignore[no-any-return]


def loss_fn(module: nn.Module, batch: Any) -> torch.Tensor:
    """Mean cross-entropy over this rank's chunk; reads the batch, never changes it."""
    logits = module(batch["tokens"], batch["positions"])
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())


def _check_names(shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    if len(shape) != len(names):
        raise ValueError(f"shape {shape} and names {names} differ in length")
    if names not in (("dp_shard", "cp"), DIM_NAMES):
        raise ValueError(f"names must be ('dp_shard', 'cp') or {DIM_NAMES}, got {names}")


def build_cp_model(shape: tuple[int, ...], names: tuple[str, ...] = ("dp_shard", "cp")) -> tuple[nn.Module, DeviceMesh]:
    """The world mesh and a TinyLM (seed 0) with CP attention on ``mesh["cp"]``, every block and the root
    fully_shard-ed over ``dp_shard_cp`` (HSDP over ``("dp_replicate", "dp_shard_cp")`` when replicated)."""
    _check_names(shape, names)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    fsdp_mesh = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")  # torch 2.13: keep the flattened mesh it returns
    if "dp_replicate" in names:  # slicing a flattened dim from the root mesh still works in 2.13 (with a warning)
        fsdp_mesh = mesh["dp_replicate", "dp_shard_cp"]
    cp_mesh = mesh["cp"]
    torch.manual_seed(0)
    model = TinyLM(cp_mesh.size())
    _enable_context_parallel_dispatcher()  # the ring attention's op handlers (CUDA ops only; inert on CPU)
    style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA)
    for block in cast(list[Block], model.blocks):
        parallelize_module(block.attn, cp_mesh, style)
        fully_shard(block, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    return model, mesh


def build_reference_model() -> nn.Module:
    """The same model (same seed 0 initial weights) without CP or sharding, on the full sequence."""
    torch.manual_seed(0)
    return TinyLM(1)


def dp_index(mesh: DeviceMesh) -> int:
    """This rank's data-parallel index (replica-major over dp_replicate, dp_shard)."""
    names = mesh.mesh_dim_names or ()
    shard = mesh.get_local_rank("dp_shard")
    if "dp_replicate" in names:
        return mesh.get_local_rank("dp_replicate") * mesh["dp_shard"].size() + shard
    return shard


def dp_size(mesh: DeviceMesh) -> int:
    names = mesh.mesh_dim_names or ()
    return mesh["dp_shard"].size() * (mesh["dp_replicate"].size() if "dp_replicate" in names else 1)


def global_batch(step: int, index: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The full-sequence batch of data-parallel index ``index`` at ``step`` (next-token labels)."""
    gen = torch.Generator().manual_seed(100_003 * seed + 1009 * step + index)
    seq = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return {"tokens": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous(), "positions": torch.arange(SEQ)}


def make_batch(mesh: DeviceMesh, step: int, index: int | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """This cp rank's chunk of the global batch of data-parallel index ``index`` (default: this rank's) at ``step``:
    contiguous chunks, cut by torch's ``_context_parallel_shard`` (no load balancer: no communication)."""
    full = global_batch(step, dp_index(mesh) if index is None else index, seed)
    chunks = _context_parallel_shard(mesh["cp"], [full["tokens"], full["labels"], full["positions"]], [1, 1, 0])
    return dict(zip(("tokens", "labels", "positions"), cast(list[torch.Tensor], chunks), strict=True))


def reference_train(steps: int, n_dp: int, lr: float = 1e-2) -> dict[str, Any]:
    """One process, no CP, no sharding: the loss per step and data-parallel index on the full sequence, trained on
    the mean of the data-parallel losses (what FSDP's averaged reduce-scatter over dp_shard_cp computes)."""
    model = build_reference_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        per_dp = [loss_fn(model, global_batch(step, d)) for d in range(n_dp)]
        losses.append([float(x.detach()) for x in per_dp])
        torch.stack(per_dp).mean().backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def train(rank: int, steps: int, monitor_factory: Callable[..., Any] | None = None, *,
          shape: tuple[int, ...] = (2, 2), names: tuple[str, ...] = ("dp_shard", "cp"), lr: float = 1e-2,
          rerun: bool = False, report: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """Train ``steps`` steps of AdamW. ``monitor_factory(model, optimizer, loss_fn, mesh)`` makes an SDCMonitor used
    as ``with monitor.step(batch) as st: st.backward(loss_fn(model, batch))``. ``rerun``: after each backward every
    rank recomputes, under no_grad and all at once, the chunk of the same cp coordinate of the next data-parallel
    index's batch (the lockstep a replay does). ``report(monitor)``, called after ``monitor.close()``, adds any
    picklable value as ``"report"`` (e.g. an observer's counts). Returns the losses, the reruns, this rank's shards,
    the full weights and the monitor's incidents."""
    model, mesh = build_cp_model(shape, names)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    monitor = monitor_factory(model, opt, loss_fn, mesh) if monitor_factory is not None else None
    losses: list[float] = []
    reruns: list[float] = []
    partner = (dp_index(mesh) + 1) % dp_size(mesh)
    for step in range(steps):
        batch = make_batch(mesh, step)
        if monitor is not None:
            with monitor.step(batch) as st:
                loss = loss_fn(model, batch)
                st.backward(loss)
        else:
            loss = loss_fn(model, batch)
            loss.backward()  # type: ignore[no-untyped-call]
        losses.append(float(loss.detach()))
        if rerun:
            with torch.no_grad():
                reruns.append(float(loss_fn(model, make_batch(mesh, step, partner))))
            # the root keeps its parameters unsharded after a forward (reshard_after_forward=None -> False for the
            # root); with no backward to follow, reshard it by hand, else named_parameters() shows plain tensors
            cast(FSDPModule, model).reshard()
        opt.step()
        opt.zero_grad()
    if monitor is not None:
        monitor.close()
    params = {n: cast(DTensor, p) for n, p in model.named_parameters()}
    full = {n: p.full_tensor().detach().clone() for n, p in params.items()}
    return {"rank": rank, "coordinate": {n: mesh.get_local_rank(n) for n in names}, "dp_index": dp_index(mesh),
            "losses": losses, "reruns": reruns, "full_weights": full,
            "weights": {n: p.to_local().detach().clone() for n, p in params.items()},
            "param_mesh": [tuple(p.device_mesh.mesh_dim_names or ()) for p in params.values()],
            "root_mesh": tuple(params["head.weight"].device_mesh._get_root_mesh().mesh_dim_names or ()),
            "incidents": list(monitor.incidents) if monitor is not None else [],
            "report": report(monitor) if report is not None and monitor is not None else None}


def run_train(rank: int, world: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``spawn_ranks`` entry: ``train(rank, **kwargs)``, then a barrier."""
    out = train(rank, **kwargs)
    dist.barrier()
    return out
