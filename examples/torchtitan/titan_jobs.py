"""torchtitan job configs (its ``config_registry`` convention) for CPU gloo ranks: the llama3 debug model, small.

Select one with ``--module titan_jobs --config llama3_cpu_debugmodel`` (``train.py`` passes these); every field can
be overridden on the command line the torchtitan way, e.g. ``--parallelism.tensor_parallel_degree 2``.
"""

from __future__ import annotations

import os
from dataclasses import fields

import cpu_workarounds
from sdc_trainer import SDCSettings, SDCTrainer
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer


def llama3_cpu_debugmodel() -> Trainer.Config:
    """llama3's debug model (6 layers, dim 256, vocab 2048) at sequence length 128, 4 samples a rank, float32, SDPA
    attention, no activation checkpointing, checkpointing, validation or CUDA graphs; offline tokenizer and data."""
    config = _on_cpu(cpu_workarounds.use_sdpa(llama3_debugmodel()))
    config.training.steps = 8
    config.parallelism.pipeline_parallel_schedule = "1F1B"
    config.parallelism.pipeline_parallel_microbatch_size = 2
    return config


def _on_cpu(config: Trainer.Config) -> Trainer.Config:
    """The settings every CPU job shares: offline tokenizer and data, 4 samples of 128 tokens a rank, float32, no
    activation checkpointing, checkpointing, validation or CUDA graphs, seed 0."""
    config.hf_assets_path = os.environ.get("SDC_TITAN_ASSETS") or cpu_workarounds.apply()
    config.dump_folder = os.environ.get("SDC_TITAN_DUMP", "./outputs")
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="sdc_synthetic")
    config.training.local_batch_size = 4
    config.training.seq_len = 128
    config.training.disable_cuda_graphs = True
    config.training.mixed_precision_param = "float32"
    config.parallelism.spmd_backend = "partial_dtensor"  # the spmd_types default fails in fully_shard on torch 2.13
    config.activation_checkpoint = None  # type: ignore[assignment]
    config.checkpoint.enable = False
    config.validator.enable = False
    config.debug.seed = 0
    config.debug.enable_structured_logging = False
    return config


def llama3_cpu_debugmodel_sdc() -> SDCTrainer.Config:
    """The same job with an SDCMonitor in the training step (``sdc_trainer.SDCTrainer``): weights checked every
    step, a replay audit every second step; ``--sdc.*`` flags change that.

    The loss is torchtitan's plain ``CrossEntropyLoss`` instead of the debug model's ``ChunkedLossWrapper``: the
    wrapper applies ``lm_head`` inside the loss, in 8 chunks, outside the stage module's forward, and the last
    pipeline stage then reduce-scatters lm_head's and norm's gradients again outside their FSDP group's one
    reduction; the monitor reads that as a repeated reduction (grad_local skipped on the last stage, replay skipped
    everywhere). Same model, same numbers per token."""
    return _monitored(llama3_cpu_debugmodel())


def _monitored(base: Trainer.Config) -> SDCTrainer.Config:
    """``base`` as an SDCTrainer job, torchtitan's plain ``CrossEntropyLoss`` (``llama3_cpu_debugmodel_sdc``)."""
    base.loss = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(base.model_spec))
    return SDCTrainer.Config(**{f.name: getattr(base, f.name) for f in fields(base) if f.init},
                             sdc=SDCSettings())


def deepseek_v3_cpu_moe_debugmodel() -> Trainer.Config:
    """deepseek_v3's debug model (MoE: 6 layers, 1 dense, 8 routed experts top-3 + 2 shared, dim 256, expert hidden
    256, vocab 2048) with the CPU settings of ``llama3_cpu_debugmodel``, 4 steps. Expert parallelism from the command
    line (``--parallelism.expert_parallel_degree 2``)."""
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    config = _on_cpu(cpu_workarounds.use_sdpa(deepseek_v3_debugmodel()))
    config.training.steps = 4
    return config


def deepseek_v3_cpu_moe_debugmodel_sdc() -> SDCTrainer.Config:
    """The MoE job with an SDCMonitor in the training step (plain ``CrossEntropyLoss``, as
    ``llama3_cpu_debugmodel_sdc`` explains)."""
    return _monitored(deepseek_v3_cpu_moe_debugmodel())

