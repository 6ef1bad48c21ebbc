"""nanoGPT's train.py with sdc_telemetry: a module-level loop (not a function), gradient accumulation with the
``require_backward_grad_sync`` toggle, certified checkpoints, and the one-line stop recipe ``sdc.exit_on_sdc``.

    python -m torch.distributed.run --nproc-per-node 2 --standalone examples/nanogpt_train.py --max-iters 20

The model is a tiny GPT (token and position embeddings, causal self-attention blocks, a tied head) trained on a
synthetic token stream, so the script runs on CPU with gloo in seconds; on GPUs the same script runs under
``torchrun --nproc-per-node 8`` (NCCL). ``--flip-bit-at ITER`` is a fire drill: it flips one bit of the token
embedding on the last rank before iteration ITER; every rank then stops with exit code 75 (``sdc.EXIT_SDC``).
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import sdc_telemetry as sdc
from sdc_telemetry.faults import flip_bit

# -- configuration (nanoGPT reads it from configurator.py; flags here) ----------------------------------------------
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--max-iters", type=int, default=20)
parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--block-size", type=int, default=16)
parser.add_argument("--n-layer", type=int, default=2)
parser.add_argument("--n-embd", type=int, default=32)
parser.add_argument("--vocab", type=int, default=64)
parser.add_argument("--checkpoint-every", type=int, default=10, help="0: no checkpoints")
parser.add_argument("--out-dir", default="out-nanogpt")
parser.add_argument("--flip-bit-at", type=int, default=None, metavar="ITER")
args = parser.parse_args()


# -- model (nanoGPT's model.py, cut down) ---------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn, self.c_proj, self.n_head = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd), n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.c_attn(x).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, n_layer: int, n_embd: int, n_head: int = 4) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in nanoGPT

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def compute_loss(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The replay check recomputes a micro-batch's loss with this (on another rank, with the unwrapped model)."""
    _, loss = module(*batch)
    return loss


# -- DDP set-up ------------------------------------------------------------------------------------------------------
cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
master_process = rank == 0
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
torch.manual_seed(1337)  # the same initial weights on every rank

tokens = torch.randint(args.vocab, (20_000,), generator=torch.Generator().manual_seed(0))  # the "train.bin"
gen = torch.Generator().manual_seed(1337 + rank)  # each rank its own batches


def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(tokens) - args.block_size - 1, (args.batch_size,), generator=gen)
    x = torch.stack([tokens[i:i + args.block_size] for i in ix])
    y = torch.stack([tokens[i + 1:i + 1 + args.block_size] for i in ix])
    return x.to(device), y.to(device)


def get_lr(it: int, warmup: int = 5, lr: float = 1e-3, min_lr: float = 1e-4) -> float:
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    ratio = min(1.0, (it - warmup) / max(1, args.max_iters - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


raw_model = GPT(args.vocab, args.block_size, args.n_layer, args.n_embd).to(device)
optimizer = torch.optim.AdamW(raw_model.parameters(), lr=get_lr(0), weight_decay=0.1)
model = DDP(raw_model, device_ids=[device.index] if cuda else None)

# SDC_METRICS_PORT, SDC_INCIDENT_DIR, SDC_ALERTMANAGER_URL... come from the environment.
monitor = sdc.SDCMonitor(model, optimizer, loss_fn=compute_loss,
                         config=sdc.SDCConfig.from_env(weights_every=1, replay_every=5, on_suspect="raise"))

# -- the training loop (nanoGPT's `while True`) ---------------------------------------------------------------------
X, Y = get_batch()
iter_num = 0
with sdc.exit_on_sdc(monitor):  # SDCDetected on any rank: every rank exits 75; the monitor closes when it ends
    while True:
        for group in optimizer.param_groups:
            group["lr"] = get_lr(iter_num)
        if args.checkpoint_every and iter_num > 0 and iter_num % args.checkpoint_every == 0:
            cert = monitor.certificate()  # collective: every rank, never under `if master_process`
            if master_process:
                os.makedirs(args.out_dir, exist_ok=True)
                torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                            "iter_num": iter_num, "sdc_certificate": cert.to_dict()},
                           os.path.join(args.out_dir, "ckpt.pt"))
        if iter_num == args.flip_bit_at and rank == world - 1:
            flip_bit(raw_model.wte.weight.data, index=3, bit=20)  # fire drill: memory corruption between steps
        with monitor.step() as step:
            for micro_step in range(args.grad_accum):
                step.micro_batch((X, Y))  # before the forward pass: the batch and the RNG state, for the replay
                model.require_backward_grad_sync = micro_step == args.grad_accum - 1
                logits, loss = model(X, Y)
                X, Y = get_batch()  # prefetch the next micro-batch, as nanoGPT does
                step.backward(loss, scale=1 / args.grad_accum)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if step.finite:  # the same answer on every rank: a bad sample's NaN never reaches the weights
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        if iter_num >= args.max_iters:
            break

dist.destroy_process_group()
if master_process:
    print(f"trained {iter_num} iterations without incident")
