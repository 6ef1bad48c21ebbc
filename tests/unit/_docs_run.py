"""Runs one Python snippet of docs/ in a fresh process: ``python _docs_run.py HARNESS SNIPPET WORKDIR``.

A snippet is a fragment of a training script: its text says what the names it uses are (``model`` is the DDP
model, ``compute_loss`` the loss of a batch, ...). Each harness below builds those names for real, on CPU in one
process (a gloo group of one rank), runs the snippet with ``exec`` in WORKDIR, then checks what the snippet is
documented to do. Where a snippet names what cannot exist here (a GPU, a database host, /checkpoints), the harness
lists the substitution in ``SUBSTITUTIONS``; each must match the snippet's text, so that a changed snippet fails
instead of running something else. Prints ``SNIPPET OK`` at the end."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sdc_telemetry as sdc

# harness -> [(text in the snippet, what runs here instead)]
SUBSTITUTIONS: dict[str, list[tuple[str, str]]] = {
    "ledger": [("postgresql://sdc@db:5432/sdc", "sqlite:///{work}/ledger.sqlite3")],
    "checkpoints": [('"/checkpoints/ckpt-*.pt"', '"{work}/ckpt-*.pt"')],
    "lightning": [('accelerator="gpu", devices=8', 'accelerator="cpu", devices=1'),
                  ("callbacks=[callback])", "callbacks=[callback], max_steps=8, logger=False, enable_checkpointing="
                   "False, enable_progress_bar=False, enable_model_summary=False)")],
    "transformers": [("TrainingArguments(...,", "TrainingArguments(output_dir='{work}/hf', use_cpu=True, "
                      "per_device_train_batch_size=2, max_steps=8, report_to='none', logging_strategy='no', "
                      "save_strategy='no', disable_tqdm=True,")],
}
CONFIG = {"metrics_port": None, "nvml": False}


def compute_loss(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(module(x), y)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)) for _ in range(n)]


def _group(work: Path) -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{work}/pg", rank=0, world_size=1)


def _ddp(work: Path, *, monitor: bool) -> dict[str, Any]:
    """``model`` (DDP), ``net`` (its module), ``optimizer``, ``compute_loss``, ``loader``, ``config``; with
    ``monitor``: a monitor that ran 3 steps, and ``cert``, ``step``, ``path`` (a certified checkpoint)."""
    _group(work)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    model = DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    ns: dict[str, Any] = {"torch": torch, "sdc": sdc, "nn": nn, "net": net, "model": model, "optimizer": optimizer,
                          "compute_loss": compute_loss, "loader": _batches(3), "config": sdc.SDCConfig(**CONFIG),
                          "device": torch.device("cpu")}
    if monitor:
        mon = sdc.SDCMonitor(model, optimizer, loss_fn=compute_loss, config=sdc.SDCConfig(**CONFIG))
        for batch in _batches(3):
            with mon.step(batch) as s:
                s.backward(compute_loss(model, batch))
            optimizer.step()
            optimizer.zero_grad()
        cert = mon.certificate()
        path = work / "given.pt"
        torch.save({"model": net.state_dict(), "sdc_certificate": cert.to_dict()}, path)
        ns.update(monitor=mon, cert=cert, step=mon.current_step, path=str(path))
    return ns


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def run(harness: str, code: str, work: Path) -> None:
    for old, new in SUBSTITUTIONS.get(harness, []):
        assert old in code, f"harness {harness}: the snippet no longer contains {old!r}"
        code = code.replace(old, new.format(work=work))
    os.chdir(work)
    setup, check = HARNESSES[harness]
    ns = setup(work)
    exec(compile(code, f"<docs snippet, harness {harness}>", "exec"), ns)
    check(ns, work)
    if dist.is_initialized():
        dist.destroy_process_group()
    print("SNIPPET OK", flush=True)


# -- the harnesses: (set-up, check) ----------------------------------------------------------------------------------

def _check_telemetry(ns: dict[str, Any], work: Path) -> None:
    monitor = ns["monitor"]
    for batch in ns["loader"]:
        with monitor.step(batch) as s:
            s.backward(compute_loss(ns["model"], batch))
        ns["optimizer"].step()
        ns["optimizer"].zero_grad()
    monitor.close()
    assert monitor.incidents == [] and monitor.current_step == len(ns["loader"]) - 1


def _check_safetensors(ns: dict[str, Any], work: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(work / "model.safetensors"), "pt") as f:
        cert = sdc.WeightCertificate.from_dict(json.loads(f.metadata()["sdc_certificate"]))
    assert cert.verify(load_file(str(work / "model.safetensors"))) == []
    ns["monitor"].close()


def _check_certificate_saved(ns: dict[str, Any], work: Path) -> None:
    [saved] = list(work.glob("ckpt-*.pt"))
    ckpt = torch.load(saved, weights_only=True)
    assert sdc.WeightCertificate.from_dict(ckpt["sdc_certificate"]).verify(ckpt["model"]) == []
    assert set(ckpt) == {"model", "optimizer", "sdc_certificate"}
    ns["monitor"].close()


def _check_loaded(ns: dict[str, Any], work: Path) -> None:
    assert ns["bad"] == [] and ns["cert"].step == ns["step"]
    ns["monitor"].close()


def _setup_ledger(work: Path) -> dict[str, Any]:
    from sdc_telemetry.ops.ledger import Ledger

    with Ledger(f"sqlite:///{work}/ledger.sqlite3") as led:
        led.add_strike("GPU-docs", host_name="node-docs", alertname="SDCReplayMismatch")
    return {}


def _check_ledger(ns: dict[str, Any], work: Path) -> None:
    gpu = ns["gpu"]  # the loop ran over the one GPU recorded
    assert (gpu.hw_id, gpu.host_name, gpu.strikes_in_window) == ("GPU-docs", "node-docs", 1)


def _setup_checkpoints(work: Path) -> dict[str, Any]:
    weights = {"w": torch.ones(3)}
    for step, audit in ((1100, 1000), (1200, 1200), (1300, 1300)):
        cert = sdc.WeightCertificate.from_tensors(step, weights, last_passing_audit=audit)
        torch.save({"model": weights, "sdc_certificate": cert.to_dict()}, work / f"ckpt-{step:08d}.pt")
    return {}


def _check_checkpoints(ns: dict[str, Any], work: Path) -> None:
    # the newest checkpoint at or before the last audit that passed before the incident (1200 < 1234 < 1300)
    assert ns["choice"].path == str(work / "ckpt-00001200.pt") and ns["choice"].certificate.step == 1200


def _setup_lightning(work: Path) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(64, 8, generator=gen), torch.randint(0, 3, (64,), generator=gen)),
                        batch_size=2)
    os.environ.update(SDC_METRICS_PORT="none", SDC_NVML="0")
    return {"sdc": sdc, "model": Tiny(), "loader": loader}


def _check_lightning(ns: dict[str, Any], work: Path) -> None:
    monitor = ns["callback"].monitor
    # 8 optimizer steps of 4 micro-batches each, every one checked
    assert monitor is not None and monitor.closed and monitor.incidents == [] and monitor.current_step == 7


def _setup_transformers(work: Path) -> dict[str, Any]:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (64, 12), generator=torch.Generator().manual_seed(0))
    os.environ.update(SDC_METRICS_PORT="none", SDC_NVML="0")
    return {"sdc": sdc, "TrainingArguments": TrainingArguments,
            "model": GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=64)),
            "data": [{"input_ids": r, "labels": r} for r in ids]}


def _check_transformers(ns: dict[str, Any], work: Path) -> None:
    trainer = ns["trainer"]
    monitor = trainer.sdc_monitor
    assert trainer.state.global_step == 8, trainer.state.global_step
    assert monitor is not None and monitor.closed and monitor.incidents == [] and monitor.current_step == 7


HARNESSES: dict[str, tuple[Callable[[Path], dict[str, Any]], Callable[[dict[str, Any], Path], None]]] = {
    "telemetry": (lambda w: _ddp(w, monitor=False), _check_telemetry),
    "safetensors": (lambda w: _ddp(w, monitor=True), _check_safetensors),
    "certificate-save": (lambda w: _ddp(w, monitor=True), _check_certificate_saved),
    "certificate-load": (lambda w: _ddp(w, monitor=True), _check_loaded),
    "ledger": (_setup_ledger, _check_ledger),
    "checkpoints": (_setup_checkpoints, _check_checkpoints),
    "lightning": (_setup_lightning, _check_lightning),
    "transformers": (_setup_transformers, _check_transformers),
}


if __name__ == "__main__":
    run(sys.argv[1], Path(sys.argv[2]).read_text(), Path(sys.argv[3]))
