"""Run torchtitan 0.3.0's trainer on CPU gloo ranks without editing any of its files.

``apply()`` must run before anything from torchtitan but ``torchtitan.tools.utils`` is imported. It patches, at run
time only:

1. the device, where no CUDA device is available: torchtitan picks ``_get_available_device_type() or "cuda"`` at
   import, so on a CPU-only machine it silently targets CUDA; here its ``device_type`` becomes ``"cpu"`` and
   ``device_module`` a small CPU stand-in for the ``torch.cuda`` calls it makes (memory stats, device name,
   set_device);
2. the FSDP2 gradient reduction: torchtitan sets ``gradient_divide_factor=1.0``, which FSDP2 turns into a
   ``PREMUL_SUM`` reduce-scatter that gloo does not implement; forcing sum reductions (what torchtitan itself does
   for symmetric memory) keeps the same gradients with an op gloo has;
3. the process groups' timeouts after step 1: torchtitan calls ``torch.distributed.set_timeout``, absent from torch
   2.13; the same barrier and the private ``_set_pg_timeout`` instead;
4. the pipeline schedule's ``step``: torchtitan passes micro-batches already split (``arg_mbs=``, ``kwarg_mbs=``,
   ``target_mbs=``), a newer torch's signature; torch 2.13's ``step`` splits a whole batch itself. A pre-split call
   runs the schedule's own ``_step_microbatches`` on the given micro-batches;
5. data and tokenizer, offline: a byte-level tokenizer written to a temp folder and a synthetic text dataset
   registered under the name ``sdc_synthetic`` in torchtitan's dataset table.

``use_sdpa(config)`` swaps FlexAttention (no CPU backward) for causal scaled-dot-product attention in a job config.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from typing import Any

import torch

_APPLIED = False


class _CpuDeviceModule:
    """The subset of ``torch.cuda`` that torchtitan's trainer and metrics call, answered for the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        class _Props:
            total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

        return _Props()

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None


def _patch_device() -> None:
    late = [m for m in ("torchtitan.trainer", "torchtitan.components.metrics", "torchtitan.distributed.utils",
                        "torchtitan.distributed.parallel_dims") if m in sys.modules]
    if late:
        raise RuntimeError(f"cpu_workarounds.apply() must run before {late[0]} is imported: it binds the device "
                           "type at import")
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type = "cpu"
    tt_utils.device_module = _CpuDeviceModule()  # type: ignore[assignment]


def _patch_fsdp_reduce_op() -> None:
    import torchtitan.distributed.fsdp as tt_fsdp
    from torch.distributed.fsdp import FSDPModule

    original = tt_fsdp.disable_fsdp_gradient_division

    def disable_division_with_sum(model: torch.nn.Module) -> None:
        original(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    tt_fsdp.disable_fsdp_gradient_division = disable_division_with_sum
    for name, mod in list(sys.modules.items()):  # modules that imported the function by name
        if name.startswith("torchtitan.") and getattr(mod, "disable_fsdp_gradient_division", None) is original:
            mod.disable_fsdp_gradient_division = disable_division_with_sum  # type: ignore[attr-defined]


def _patch_pg_timeouts() -> None:
    """torchtitan shortens the process groups' timeouts after step 1 with ``torch.distributed.set_timeout``, which
    torch 2.13 does not have (it has the private ``_set_pg_timeout``); the same barrier, then that call."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    import torchtitan.distributed.utils as tt_dist_utils

    if hasattr(dist, "set_timeout"):
        return

    def set_pg_timeouts(timeout: Any, parallel_dims: Any) -> None:
        dist.barrier()
        groups = [mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]
        for group in groups:
            c10d._set_pg_timeout(timeout, group)

    tt_dist_utils.set_pg_timeouts = set_pg_timeouts


def _patch_pipeline_step() -> None:
    """torchtitan calls ``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=..., losses=..., loss_kwargs=...)``
    with inputs already split into micro-batches; torch 2.13's ``step`` takes the whole batch and splits it itself
    (the keywords reach the model as inputs). A pre-split call runs torch's own ``_step_microbatches`` directly,
    with the same preamble ``step`` has; any other call is torch's ``step`` unchanged."""
    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        if getattr(cls.step, "_sdc_presplit", False):
            continue
        original = cls.step

        def step(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            if not {"arg_mbs", "kwarg_mbs", "target_mbs"} & kwargs.keys():
                return _original(self, *args, **kwargs)
            if args:
                raise TypeError("pre-split schedule.step() takes no positional inputs")
            stages = list(getattr(self, "_stages", None) or [self._stage])
            for stage in stages:
                stage.has_backward = self._has_backward
                stage.clear_runtime_states()
            arg_mbs, kwarg_mbs = self._check_inputs(kwargs.pop("arg_mbs", None), kwargs.pop("kwarg_mbs", None))
            return_outputs = kwargs.pop("return_outputs", True)
            self._step_microbatches(arg_mbs, kwarg_mbs, kwargs.pop("target_mbs", None), kwargs.pop("losses", None),
                                    return_outputs, loss_kwargs=kwargs.pop("loss_kwargs", None))
            if kwargs:
                raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
            for stage in stages:
                if stage.is_last and return_outputs:
                    return self._merge_outputs(stage.output_chunks)
            return None

        step._sdc_presplit = True  # type: ignore[attr-defined]
        cls.step = step  # type: ignore[method-assign]


def write_tokenizer(folder: str) -> str:
    """A byte-level BPE tokenizer with no merges (256 byte tokens plus BOS/EOS), saved as torchtitan's
    ``hf_assets_path`` expects (tokenizer.json and tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": bos, "eos_token": eos}, f)
    return folder


WORDS = ("silent data corruption flips a bit in a weight or an activation and the loss goes on looking fine "
         "while replicas drift apart until a checksum or a replay names the rank the host and the unit").split()


def synthetic_texts(n: int = 2000, seed: int = 0) -> list[str]:
    """Deterministic pseudo-sentences: the same list on every rank and every run."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120))) + "." for _ in range(n)]


def _register_dataset() -> None:
    from datasets import Dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS["sdc_synthetic"] = DatasetConfig(
        path="(in memory)",
        loader=lambda path: Dataset.from_dict({"text": synthetic_texts()}),
        sample_processor=lambda sample: sample["text"],
    )


def apply() -> str:
    """Apply the runtime workarounds; return the folder of the offline tokenizer (the job's ``hf_assets_path``)."""
    global _APPLIED
    folder = os.environ.get("SDC_TITAN_ASSETS") or os.path.join(tempfile.gettempdir(),
                                                                 f"sdc-titan-tokenizer-{os.getuid()}")
    if _APPLIED:
        return folder
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not torch.cuda.is_available():
        _patch_device()
    _patch_fsdp_reduce_op()
    _patch_pg_timeouts()
    _patch_pipeline_step()
    _register_dataset()
    # Every rank writes the same bytes; write to a per-process name and rename, so readers never see half a file.
    tmp = f"{folder}.{os.getpid()}"
    write_tokenizer(tmp)
    os.makedirs(folder, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.replace(os.path.join(tmp, name), os.path.join(folder, name))
    os.rmdir(tmp)
    _APPLIED = True
    return folder


def use_sdpa(config: Any) -> Any:
    """Replace every FlexAttention in the job config's model by causal ScaledDotProductAttention."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    model = config.model_spec.model
    replaced = 0
    for _fqn, _cfg, parent, attr in list(model.traverse(FlexAttention.Config)):
        if parent is None:
            raise ValueError("the model config itself is an attention config")
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
        replaced += 1
    if not replaced:
        raise ValueError("no FlexAttention found in the model config")
    return config
