"""Megatron-core on CPU gloo ranks, for the tests only: Megatron-core 0.16.1 assumes CUDA in a few places (its RNG
tracker, its grad buffers' device, ``device='cuda'`` tensors and ``torch.cuda.FloatTensor`` type checks in its
optimizer and gradient clipping). ``install()`` points them at the CPU at run time; no file of Megatron-core is
edited and the package under test never imports this."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["install", "tiny_gpt"]


#: torch's factories that Megatron-core calls with ``device="cuda"``
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "zeros_like",
              "ones_like", "empty_like", "full_like")
_installed = [False]


def _on_cpu(factory: Any) -> Any:
    def make(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)
    return make


def install() -> None:
    """Once per process, before Megatron-core builds anything: ``device='cuda'`` becomes the CPU, ``.cuda()`` a
    no-op, ``.type()`` names CPU tensors as CUDA ones (what Megatron's optimizer asserts), and the RNG tracker forks
    the CPU generator."""
    if _installed[0]:
        return
    import megatron.core.tensor_parallel.random as rng

    for name in _FACTORIES:
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    as_type = torch.Tensor.type

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = as_type(self, *args, **kwargs)
        if not args and not kwargs and out.startswith("torch.") and not out.startswith("torch.cuda."):
            return "torch.cuda." + out[len("torch."):]
        return out

    torch.Tensor.type = type_  # type: ignore[assignment,method-assign]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[assignment,method-assign]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.manual_seed = torch.manual_seed  # type: ignore[assignment]
    rng._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    rng._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    _installed[0] = True


def tiny_gpt(*, tp: int = 1, layers: int = 2, hidden: int = 32, vocab: int = 64, seq: int = 16,
             dropout: float = 0.0, recompute: str | None = None, bf16: bool = False) -> Any:
    """A small ``GPTModel`` with Megatron-core's local layer spec (no Transformer Engine)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=4, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, hidden_dropout=dropout, attention_dropout=dropout,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else
        torch.float32, pipeline_dtype=torch.float32,
        recompute_granularity=recompute, recompute_method="uniform" if recompute == "full" else None,
        recompute_num_layers=1 if recompute == "full" else None)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                    max_sequence_length=seq, position_embedding_type="learned_absolute")
