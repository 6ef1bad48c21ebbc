"""Which schedule of tensor operations the monitor uses on a device.

GPUs pay a launch for every operation, so the monitor's work there is a few large operations (a bucket at once, every
tensor's fingerprint in one kernel). CPUs pay for memory traffic instead: pieces of a bucket small enough to stay in
cache, read twice while they are there. ``SDC_SCHEDULE=gpu`` makes CPU tensors take the GPU schedule (same results:
both compute the same values), so that what a GPU would launch can be counted on a machine without one
(``benchmarks/launches.py``).
"""

from __future__ import annotations

import os

import torch

__all__ = ["gpu_schedule"]

_ENV = "SDC_SCHEDULE"


def gpu_schedule(device: torch.device) -> bool:
    """Few large operations (True: every device but the CPU, unless ``SDC_SCHEDULE=gpu``) or cache-sized pieces."""
    return device.type != "cpu" or os.environ.get(_ENV, "") == "gpu"
