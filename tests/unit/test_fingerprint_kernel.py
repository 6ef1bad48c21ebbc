"""The one-launch fingerprint kernel (Triton, what GPUs run) gives the same integers as the torch operations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is installed with the torchtitan extra (make setup)")


def test_kernel_rows_equal_the_torch_definition_in_one_launch_per_call() -> None:
    """Through Triton's interpreter on CPU tensors: every row equals the torch operations' (shapes at the
    definition's edges, four dtypes, a transposed view, an empty and a bool tensor), each call is one launch, the
    tile table is built once per set of tensors read in place and reused, and one flipped bit changes exactly that
    tensor's row."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("_fingerprint_kernel_run.py"))], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout)
    assert got["equal"] and got["mismatches"] == 0 and got["repeat_equal"], got
    assert got["launches"] == 4 and got["table_reused"] and got["direct"] == got["rows"] - 1, got
    assert got["flip_changes_one_row"] == 1 and got["flip_row"] == got["flipped_index"], got


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_on_cuda_equals_the_torch_operations(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU (scripts/gpu_check.sh): the compiled kernel gives the torch operations' rows on CUDA tensors of
    several shapes and dtypes, a model-sized list included, in one launch per call."""
    import torch

    from sdc_telemetry.core import fingerprint as fp
    from sdc_telemetry.core import fingerprint_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(), (3,), (4093,), (129 * 4093 + 7,), (1024, 1024), (50257, 7)]
    tensors = [torch.randn(s, device="cuda", generator=g).to(d) for s in shapes
               for d in (torch.float32, torch.bfloat16, torch.float16)]
    tensors += [torch.randn(4096, 4096, device="cuda", generator=g) for _ in range(4)]
    monkeypatch.setenv("SDC_FINGERPRINT_KERNEL", "torch")
    reference = fp.fingerprint(tensors)
    monkeypatch.setenv("SDC_FINGERPRINT_KERNEL", "")
    assert fingerprint_kernel.available(torch.device("cuda"))
    before = fingerprint_kernel.launches[0]
    got = fp.fingerprint(tensors)
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), reference.cpu())
    assert fingerprint_kernel.launches[0] - before == 1
