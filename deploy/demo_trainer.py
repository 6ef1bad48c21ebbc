"""The docker-compose demo trainer: run under torchrun, one process per rank, a fault after a few minutes.

    torchrun --standalone --nproc-per-node=4 deploy/demo_trainer.py

Settings come from the environment (defaults in ``plan_from_env``): ``SDC_DEMO_FAULT`` (weight-bitflip, grad-nan,
comm, compute or none), ``SDC_DEMO_FAULT_RANK``, ``SDC_DEMO_FAULT_STEP``, ``SDC_DEMO_STEPS``, ``SDC_DEMO_STEP_DELAY``
(seconds), ``SDC_DEMO_SERVE_AFTER`` (seconds to keep serving after training), ``SDC_METRICS_PORT`` (base; rank r
serves on base + local rank; 0: no endpoint) and ``SDC_METRICS_HOST``. The ranks record
incidents and train on (``on_suspect="record"``), then keep serving metrics, so Prometheus keeps the suspect latched
and the page stays up. GPU counters come from a FakeNVML labelled as simulated: the container has no GPU.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch.distributed as dist

from sdc_telemetry.ops.demo import DemoPlan, run_rank


def plan_from_env(env: Mapping[str, str] = os.environ) -> DemoPlan:
    """The demo plan: by default a weight bit flip on rank 2 at step 600 (about three minutes in)."""
    return DemoPlan(
        fault=env.get("SDC_DEMO_FAULT", "weight-bitflip"),
        fault_rank=int(env.get("SDC_DEMO_FAULT_RANK", "2")),
        fault_step=int(env.get("SDC_DEMO_FAULT_STEP", "600")),
        steps=int(env.get("SDC_DEMO_STEPS", "100000")),
        replay_every=int(env.get("SDC_DEMO_REPLAY_EVERY", "25")),
        on_suspect="record",
        metrics_port=int(env.get("SDC_METRICS_PORT", "9860")) or None,
        metrics_host=env.get("SDC_METRICS_HOST", "0.0.0.0"),  # noqa: S104 - Prometheus scrapes from another container
        step_delay=float(env.get("SDC_DEMO_STEP_DELAY", "0.25")),
        serve_after=float(env.get("SDC_DEMO_SERVE_AFTER", "86400")),
        incident_dir=env.get("SDC_INCIDENT_DIR", "/tmp/sdc-incidents"),  # noqa: S108 - the container's own /tmp
        progress_every=50,
    )


def main() -> None:
    dist.init_process_group("gloo")
    try:
        # run_rank reads GPU counters from a FakeNVML labelled as simulated when there is no CUDA device.
        run_rank(dist.get_rank(), dist.get_world_size(), plan_from_env())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
