"""Who a rank is: rank, local rank, host and the hardware it computes on."""

from __future__ import annotations

import hashlib
import os
import socket
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RankIdentity", "numerics_signature", "numerics_settings", "bitwise_reproducible", "NUMERICS_SIGNATURE_ENV"]

HOST_NAME_ENV = "SDC_HOST_NAME"
NUMERICS_SIGNATURE_ENV = "SDC_NUMERICS_SIGNATURE"


@dataclass(frozen=True)
class RankIdentity:
    """A rank's identity as incidents, logs and metrics name it.

    ``hw_id`` is the GPU UUID (``GPU-...``, the same string NVML and DCGM report) when the rank computes on a CUDA
    device, else ``cpu:<host>:<local_rank>``.

    >>> RankIdentity(rank=2, local_rank=2, host_name="node-a", hw_id="cpu:node-a:2").rank
    2
    """

    rank: int
    local_rank: int
    host_name: str
    hw_id: str

    @classmethod
    def local(cls, device: torch.device | None = None) -> RankIdentity:
        """This process's identity.

        The rank comes from the initialised default process group (else ``RANK``), the local rank from
        ``LOCAL_RANK`` (torchrun sets it; else the rank), the host from ``SDC_HOST_NAME`` when set (containers whose
        hostname is a pod id) else the machine's host name. ``device`` is the rank's compute device; by default the
        current CUDA device when CUDA is available.
        """
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        host = os.environ.get(HOST_NAME_ENV) or socket.gethostname()
        if device is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        hw_id = _gpu_uuid(device) if device is not None and device.type == "cuda" else None
        return cls(rank=rank, local_rank=local_rank, host_name=host, hw_id=hw_id or f"cpu:{host}:{local_rank}")

    def describe(self) -> str:
        """One human line: ``rank 2 (local 2) on node-a, GPU-...``."""
        return f"rank {self.rank} (local {self.local_rank}) on {self.host_name}, {self.hw_id}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _gpu_uuid(device: torch.device) -> str | None:
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    except (AttributeError, RuntimeError):
        pass
    try:  # NVML enumerates all GPUs: map through the PCI bus id, which CUDA_VISIBLE_DEVICES does not renumber
        import pynvml

        pynvml.nvmlInit()
        props: Any = torch.cuda.get_device_properties(index)
        bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    except Exception:  # noqa: BLE001 - identity must never fail; the caller falls back to a CPU-style id
        return None


def numerics_signature(device: torch.device) -> int:
    """A 64-bit id of everything that decides the bits a rank computes: device model and compute capability, torch,
    CUDA, cuDNN and driver versions, the CPU's vector ISA, and the kernel-choosing settings (``numerics_settings``:
    autotuning, TF32, matmul precision, deterministic algorithms). Ranks with equal signatures can be compared exactly;
    others only within a calibrated tolerance. ``SDC_NUMERICS_SIGNATURE`` overrides it (fire drills of a mixed
    cluster on identical machines)."""
    override = os.environ.get(NUMERICS_SIGNATURE_ENV)
    parts = [override] if override else [f"torch={torch.__version__}", f"cpu={_cpu_capability()}",
                                         *(f"{k}={v}" for k, v in numerics_settings().items())]
    if not override and device.type == "cuda":
        props: Any = torch.cuda.get_device_properties(device)
        parts += [f"gpu={props.name}", f"cc={props.major}.{props.minor}", f"cuda={torch.version.cuda}",
                  f"cudnn={_cudnn_version()}", f"driver={_driver_version()}"]
    digest = hashlib.blake2b("|".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def numerics_settings() -> dict[str, object]:
    """The process's settings that change which kernels run, hence the bits: autotuning (cuDNN benchmark mode,
    Inductor's max-autotune when Inductor is loaded), TF32 and matmul precision, deterministic algorithms."""
    inductor = sys.modules.get("torch._inductor.config")
    return {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "cudnn.benchmark": bool(torch.backends.cudnn.benchmark),
        "cudnn.deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn.allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "matmul.allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "inductor.max_autotune": bool(getattr(inductor, "max_autotune", False)) if inductor is not None else False,
    }


def bitwise_reproducible(device: torch.device) -> bool:
    """Whether two ranks with this stack compute the same bits for the same inputs: on the CPU, or on a GPU with
    deterministic algorithms and no autotuning (cuDNN benchmark mode or max-autotune pick kernels per process)."""
    if device.type == "cpu":
        return True
    settings = numerics_settings()
    return bool(settings["deterministic"]) and not settings["cudnn.benchmark"] and \
        not settings["inductor.max_autotune"]


def _cudnn_version() -> str:
    return str(torch.backends.cudnn.version())  # type: ignore[no-untyped-call]


def _cpu_capability() -> str:
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


def _driver_version() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        return str(pynvml.nvmlSystemGetDriverVersion())
    except Exception:  # noqa: BLE001 - the signature then leans on the other parts
        return "unknown"
