"""torchtitan 0.3.0's trainer on CPU gloo ranks, optionally with an SDCMonitor in its training step.

    torchrun --nproc-per-node 4 --standalone examples/torchtitan/train.py \\
        --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2

Arguments are torchtitan's own (``--training.steps 4``, ``--parallelism.pipeline_parallel_degree 2``, ...);
``--config`` picks a job from ``titan_jobs.py`` (default ``llama3_cpu_debugmodel``). The CPU workarounds of
``cpu_workarounds.py`` are applied before torchtitan's trainer is imported; nothing in torchtitan is edited.
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> None:
    import cpu_workarounds

    cpu_workarounds.apply()

    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    if "--config" not in " ".join(argv):
        argv = ["--config", "llama3_cpu_debugmodel", *argv]
    config = ConfigManager().parse_args(["--module", "titan_jobs", *argv])
    trainer = config.build()
    start = time.perf_counter()
    try:
        trainer.train()
    finally:
        trainer.close()
    elapsed = time.perf_counter() - start
    if hasattr(trainer, "summary"):
        print(f"SDC_SUMMARY {json.dumps(trainer.summary(), default=str)}", flush=True)
    if torch.distributed.get_rank() == 0:
        logger.info(f"titan run: {trainer.step} steps in {elapsed:.1f}s")
        print(f"TITAN_DONE steps={trainer.step} seconds={elapsed:.2f}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
