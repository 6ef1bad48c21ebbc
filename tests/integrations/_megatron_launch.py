"""Runs a Megatron-core script on CPU ranks (``python _megatron_launch.py SCRIPT ARGS...``, under torchrun): the CPU
shim of ``_megatron_cpu`` first, then the script as ``__main__``, unchanged."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.integrations import _megatron_cpu

if __name__ == "__main__":
    _megatron_cpu.install()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
