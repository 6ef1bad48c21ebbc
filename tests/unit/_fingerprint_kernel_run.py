"""Run in its own process (``TRITON_INTERPRET=1`` must be set before triton is first imported): the one-launch
fingerprint kernel against the torch operations, on CPU tensors through Triton's interpreter."""

from __future__ import annotations

import json
import os
import sys

import torch

from sdc_telemetry.core import fingerprint as fp
from sdc_telemetry.core import fingerprint_kernel


def main() -> None:
    g = torch.Generator().manual_seed(0)
    # Shapes around the definition's edges: fewer words than a row (tail only), exactly one row, a row and a word,
    # several blocks of 128 rows plus a partial block plus a tail; odd byte counts (a padded copy), a transposed view.
    shapes = [(), (1,), (3,), (4093,), (2 * 4094,), (129 * 4093 + 7,), (300, 29)]
    blocks = (129 * 4093 + 7,)  # 129 blocks of rows in float64 (8-byte words); the interpreter is slow: that dtype only
    every = (torch.float32, torch.bfloat16, torch.float64, torch.int8)
    tensors = []
    for shape in shapes:
        for dtype in (torch.float64,) if shape == blocks else every:
            x = torch.randn(shape, generator=g).mul(100)
            tensors.append(x.to(dtype))
    tensors += [torch.randn(40, 50, generator=g).t(), torch.empty(0), torch.tensor([True, False, True])]
    os.environ["SDC_FINGERPRINT_KERNEL"] = "torch"
    reference = fp.fingerprint(tensors)
    os.environ["SDC_FINGERPRINT_KERNEL"] = "triton"
    assert fingerprint_kernel.available(torch.device("cpu"))
    before = fingerprint_kernel.launches[0]
    first = fp.fingerprint(tensors)
    second = fp.fingerprint(tensors)
    # Tensors the kernel reads in place (every one here but the transposed view, which goes through a copy at a new
    # address each call): the tile table is built once for them and reused.
    own = [t for t in tensors if fingerprint_kernel.direct(t)]
    tables = len(fingerprint_kernel._tables)
    fp.fingerprint(own)
    fp.fingerprint(own)
    reused = len(fingerprint_kernel._tables) == tables + 1
    launched = fingerprint_kernel.launches[0] - before
    flipped = [t.clone() for t in tensors]
    word = flipped[-5].view(-1)  # the (300, 29) float64 tensor's last word
    word.view(torch.int64)[-1] ^= 1 << 40
    changed = fp.fingerprint(flipped)
    json.dump({
        "equal": bool(torch.equal(first, reference)), "mismatches": int((first != reference).sum()),
        "repeat_equal": bool(torch.equal(second, reference)), "table_reused": reused,
        "direct": len(own), "launches": launched, "rows": int(reference.shape[0]),
        "flip_changes_one_row": int((changed != reference).sum()),
        "flip_row": int((changed != reference).nonzero()[0, 0]) if bool((changed != reference).any()) else -1,
        "flipped_index": len(tensors) - 5,
    }, sys.stdout)


if __name__ == "__main__":
    main()
