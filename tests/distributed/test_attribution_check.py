"""scripts/attribution_check.py, which scripts/gpu_check.sh runs on a lent GPU, passes on CPU ranks: the harness
itself cannot rot unseen where no GPU runs it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "attribution_check.py"


def test_attribution_check_passes_on_cpu_ranks_on_both_verdict_paths(capsys) -> None:  # type: ignore[no-untyped-def]
    """Every scenario gives its expected verdict, decided before the update and read one step later."""
    spec = importlib.util.spec_from_file_location("attribution_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count(" ok ") == 2 * len(module.SCENARIOS) and "FAIL" not in out
