"""Weight certificates: made from tensors, saved with a checkpoint, and naming every tensor that changed."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from sdc_telemetry.core.certificate import (
    EMPTY_CERTIFICATE,
    WeightCertificate,
    fingerprint_algorithm,
    format_fingerprint,
)
from sdc_telemetry.core.fingerprint import fingerprint
from sdc_telemetry.ops.checkpoints import choose_checkpoint
from sdc_telemetry.ops.cli import main


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _flip_bit(t: torch.Tensor, index: int = 0, bit: int = 3) -> None:
    t.view(-1).view(torch.int32)[index] ^= 1 << bit


def test_fingerprint_text_is_the_row_as_16_hex_digits_per_column() -> None:
    """Each int64 column becomes 16 lower-case hex digits of its value mod 2**64, joined with '-'."""
    t = torch.randn(5, 7)
    row = fingerprint([t])[0].tolist()
    text = format_fingerprint(row)
    assert text.split("-") == [f"{v % 2**64:016x}" for v in row]
    assert format_fingerprint([-1, 255]) == "ffffffffffffffff-00000000000000ff"


def test_intact_checkpoint_verifies_after_save_and_load(tmp_path: Path) -> None:
    """A certificate made from the parameters verifies the state dict after torch.save/torch.load and JSON."""
    model = _model()
    cert = WeightCertificate.from_tensors(12, model.named_parameters(), world_size=4)
    torch.save({"model": model.state_dict(), "sdc_certificate": cert.to_dict()}, tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    back = WeightCertificate.from_dict(json.loads(json.dumps(ckpt["sdc_certificate"])))
    assert back == cert
    assert back.verify(ckpt["model"]) == []
    assert back.verify(model) == []
    assert (back.step, back.world_size, back.algorithm) == (12, 4, fingerprint_algorithm())
    assert back.shapes["0.weight"] == (6, 8) and back.dtypes["0.weight"] == "float32"


def test_one_flipped_bit_is_named() -> None:
    """One bit flipped in one element of one tensor names that tensor and no other."""
    model = _model()
    cert = WeightCertificate.from_tensors(1, model.state_dict())
    state = _state(model)
    _flip_bit(state["2.weight"], index=5, bit=0)
    assert cert.verify(state) == ["2.weight"]


def test_two_swapped_rows_are_named() -> None:
    """Two rows of a weight matrix swapped (same values, wrong places) name that tensor."""
    model = _model()
    cert = WeightCertificate.from_tensors(1, model.state_dict())
    state = _state(model)
    w = state["0.weight"]
    w[[1, 4]] = w[[4, 1]]
    assert cert.verify(state) == ["0.weight"]


def test_missing_reshaped_and_recast_tensors_are_named() -> None:
    """A missing tensor, one of another shape and one of another dtype are each named, in certificate order."""
    model = _model()
    cert = WeightCertificate.from_tensors(1, model.state_dict())
    state = _state(model)
    del state["0.bias"]
    state["2.weight"] = state["2.weight"].reshape(-1)
    state["2.bias"] = state["2.bias"].double()
    assert cert.verify(state) == ["0.bias", "2.weight", "2.bias"]


def test_ddp_module_prefix_is_tolerated_either_way() -> None:
    """A certificate of the unwrapped model verifies a DDP-style 'module.'-prefixed state dict, and the reverse."""
    model = _model()
    cert = WeightCertificate.from_tensors(1, model.state_dict())
    prefixed = {f"module.{k}": v for k, v in _state(model).items()}
    assert cert.verify(prefixed) == []
    prefixed_cert = WeightCertificate.from_tensors(1, prefixed)
    assert prefixed_cert.verify(model) == []
    _flip_bit(prefixed["module.0.weight"])
    assert cert.verify(prefixed) == ["0.weight"]


def test_buffers_listed_in_the_certificate_are_not_uncovered() -> None:
    """A module's buffers (listed by from_tensors(step, module), not fingerprinted) do not make its state dict fail;
    a certificate of the parameters alone names them as uncovered instead."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    cert = WeightCertificate.from_tensors(3, model)
    assert cert.buffers == ("1.running_mean", "1.running_var", "1.num_batches_tracked")
    assert set(cert.fingerprints) == {n for n, _ in model.named_parameters()}
    assert cert.verify(model.state_dict()) == [] and cert.verify(model) == []
    bare = WeightCertificate.from_tensors(3, model.named_parameters())
    assert bare.verify(model.state_dict()) == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]


def test_other_fingerprint_algorithm_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A certificate made with another fingerprint algorithm is not verified: ValueError naming both."""
    cert = WeightCertificate.from_tensors(1, {"w": torch.ones(3)})
    monkeypatch.setattr(importlib.import_module("sdc_telemetry.core.fingerprint"), "FINGERPRINT_ALGORITHM", "sdc-fp99",
                        raising=False)
    with pytest.raises(ValueError, match=r"sdc-fp99"):
        cert.verify({"w": torch.ones(3)})


def _good() -> dict[str, Any]:
    return WeightCertificate.from_tensors(2, {"a": torch.ones(2, 2), "b": torch.zeros(3)}).to_dict()


@pytest.mark.parametrize(("change", "field"), [
    (lambda d: d.pop("fingerprints"), "fingerprints"),
    (lambda d: d.update(step=-1), "step"),
    (lambda d: d.update(step="7"), "step"),
    (lambda d: d.update(world_size=0), "world_size"),
    (lambda d: d.update(algorithm=""), "algorithm"),
    (lambda d: d.update(created_unix=float("nan")), "created_unix"),
    (lambda d: d["fingerprints"].update(a="XYZ"), "fingerprints"),
    (lambda d: d["fingerprints"].update(a=12), "fingerprints"),
    (lambda d: d["shapes"].update(a="2x2"), "shapes"),
    (lambda d: d["shapes"].pop("b"), "shapes"),
    (lambda d: d["dtypes"].update(a="float99"), "dtypes"),
    (lambda d: d.update(dtypes=[]), "dtypes"),
])
def test_from_dict_rejects_malformed_input_naming_the_field(change: Any, field: str) -> None:
    """Missing fields, wrong types and inconsistent parameter sets raise ValueError naming the field."""
    d = _good()
    change(d)
    with pytest.raises(ValueError, match=field):
        WeightCertificate.from_dict(d)


def test_from_dict_rejects_a_non_dict() -> None:
    """A list where the certificate dict should be is a ValueError."""
    with pytest.raises(ValueError, match="dict"):
        WeightCertificate.from_dict([])  # type: ignore[arg-type]


def test_from_tensors_rejects_duplicate_names() -> None:
    """Two tensors under one name are refused rather than one silently dropped."""
    with pytest.raises(ValueError, match="'w' twice"):
        WeightCertificate.from_tensors(0, [("w", torch.ones(1)), ("w", torch.zeros(1))])


def _save(tmp_path: Path, ckpt: Any) -> str:
    path = tmp_path / "ckpt.pt"
    torch.save(ckpt, path)
    return str(path)


def test_cli_verify_checkpoint_intact_and_corrupt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """verify-checkpoint prints 'intact' and exits 0, or lists the differing tensors and exits 1."""
    model = _model()
    cert = WeightCertificate.from_tensors(40, model.named_parameters()).to_dict()
    assert main(["verify-checkpoint", _save(tmp_path, {"model": model.state_dict(), "sdc_certificate": cert})]) == 0
    assert capsys.readouterr().out.strip() == "intact: 4 tensors verified (step 40)"
    state = _state(model)
    _flip_bit(state["2.bias"])
    assert main(["verify-checkpoint", _save(tmp_path, {"model": state, "sdc_certificate": cert})]) == 1
    out = capsys.readouterr().out
    assert "2.bias" in out and "0.weight" not in out


def test_cli_verify_checkpoint_key_and_top_level_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--key selects the state dict entry; without 'model' the top level is the state dict."""
    model = _model()
    cert = WeightCertificate.from_tensors(3, model.state_dict()).to_dict()
    assert main(["verify-checkpoint", _save(tmp_path, {"weights": model.state_dict(), "sdc_certificate": cert}),
                 "--key", "weights"]) == 0
    assert main(["verify-checkpoint", _save(tmp_path, {**model.state_dict(), "sdc_certificate": cert})]) == 0
    assert capsys.readouterr().out.count("intact: 4 tensors verified (step 3)") == 2


@pytest.mark.parametrize(("ckpt", "message"), [
    (None, "cannot load"),
    ({"model": {}}, "no 'sdc_certificate'"),
    ({"model": {}, "sdc_certificate": {"step": 1}}, "malformed certificate"),
    ([1, 2], "not a dict"),
])
def test_cli_verify_checkpoint_errors_exit_2(ckpt: Any, message: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """An unreadable file, no certificate or a malformed one exits 2 with a message saying which."""
    if ckpt is None:
        path = tmp_path / "garbage.pt"
        path.write_bytes(b"not a checkpoint")
    else:
        path = Path(_save(tmp_path, ckpt))
    assert main(["verify-checkpoint", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_cli_verify_checkpoint_missing_key_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--key naming an absent entry exits 2 and lists the entries there are."""
    cert = WeightCertificate.from_tensors(3, {"w": torch.ones(2)}).to_dict()
    assert main(["verify-checkpoint", _save(tmp_path, {"model": {"w": torch.ones(2)}, "sdc_certificate": cert}),
                 "--key", "ema"]) == 2
    assert "'ema'" in capsys.readouterr().err


# ---- last_passing_audit, coverage ----


def test_last_passing_audit_round_trips_and_old_dicts_read_as_none() -> None:
    """last_passing_audit and buffers survive to_dict/JSON/from_dict; a dict written before they existed reads as
    None and no buffers."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    cert = WeightCertificate.from_tensors(30, model, world_size=2, last_passing_audit=25)
    d = json.loads(json.dumps(cert.to_dict()))
    assert d["last_passing_audit"] == 25
    back = WeightCertificate.from_dict(d)
    assert back == cert and back.last_passing_audit == 25 and back.buffers == cert.buffers
    del d["last_passing_audit"], d["buffers"]
    old = WeightCertificate.from_dict(d)
    assert old.last_passing_audit is None and old.buffers == ()
    assert WeightCertificate.from_tensors(0, model).last_passing_audit is None


@pytest.mark.parametrize("value", [-1, 31, True, "20", 2.0])
def test_last_passing_audit_must_be_a_step_at_most_the_certificate_step(value: Any) -> None:
    """A last_passing_audit that is negative, after the certificate's step or not an integer is refused, naming it."""
    d = WeightCertificate.from_tensors(30, {"w": torch.ones(2)}).to_dict()
    d["last_passing_audit"] = value
    with pytest.raises(ValueError, match="last_passing_audit"):
        WeightCertificate.from_dict(d)


def test_empty_certificate_never_verifies() -> None:
    """A certificate emptied to zero tensors verifies nothing: EMPTY_CERTIFICATE first, then every tensor given."""
    model = _model()
    d = WeightCertificate.from_tensors(5, model).to_dict()
    d["fingerprints"], d["shapes"], d["dtypes"] = {}, {}, {}
    empty = WeightCertificate.from_dict(d)
    assert empty.verify(model.state_dict()) == [EMPTY_CERTIFICATE, "0.weight", "0.bias", "2.weight", "2.bias"]
    assert empty.verify(model)[0] == EMPTY_CERTIFICATE
    assert empty.verify({}) == [EMPTY_CERTIFICATE]


def test_partial_certificate_names_the_uncovered_tensors() -> None:
    """A certificate missing one parameter names it, for a state dict and for a module."""
    model = _model()
    d = WeightCertificate.from_tensors(5, model).to_dict()
    for part in ("fingerprints", "shapes", "dtypes"):
        del d[part]["2.bias"]
    partial = WeightCertificate.from_dict(d)
    assert partial.verify(model.state_dict()) == ["2.bias"]
    assert partial.verify(model) == ["2.bias"]
    assert partial.verify({f"module.{k}": v for k, v in model.state_dict().items()}) == ["module.2.bias"]


def test_tied_weights_are_covered_but_an_equal_copy_is_not() -> None:
    """A second name of a certified tensor (tied weights, shared storage) is covered; an uncertified tensor that
    merely holds equal values is not."""
    emb = torch.nn.Embedding(6, 4)
    head = torch.nn.Linear(4, 6, bias=False)
    head.weight = emb.weight  # tied, as language models tie the embedding and the output projection
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    cert = WeightCertificate.from_tensors(1, model)
    assert list(cert.fingerprints) == ["emb.weight"]
    state = model.state_dict()
    assert set(state) == {"emb.weight", "head.weight"} and cert.verify(state) == []
    copied = {"emb.weight": state["emb.weight"], "head.weight": state["head.weight"].clone()}
    assert cert.verify(copied) == ["head.weight"]


# ---- verify-checkpoint on the formats frameworks save, through the installed command ----

CLI = str(Path(sys.executable).parent / "sdc-telemetry")


def _cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, "verify-checkpoint", *map(str, args)], capture_output=True, text=True, timeout=120,
                          check=False)


def _flip_one(state: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    out = {k: v.detach().clone() for k, v in state.items()}
    _flip_bit(out[name], index=1, bit=7)
    return out


def _gpt_like() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))


def test_cli_torch_dict_and_plain_state_dict(tmp_path: Path) -> None:
    """A torch.save'd dict with its certificate, and a plain state dict with --certificate, exit 0; one flipped
    element exits 1 naming that tensor; a plain state dict without --certificate exits 2 saying so."""
    model = _gpt_like()
    cert = WeightCertificate.from_tensors(40, model, last_passing_audit=30)
    torch.save({"model": model.state_dict(), "step": 40, "sdc_certificate": cert.to_dict()}, tmp_path / "a.pt")
    r = _cli(tmp_path / "a.pt")
    assert (r.returncode, r.stdout.strip()) == (0, "intact: 6 tensors verified (step 40, last passing audit 30)")
    torch.save({"model": _flip_one(model.state_dict(), "1.weight"), "sdc_certificate": cert.to_dict()},
               tmp_path / "b.pt")
    r = _cli(tmp_path / "b.pt")
    assert r.returncode == 1 and "CORRUPT: 1 of 6" in r.stdout and "  1.weight" in r.stdout
    torch.save(model.state_dict(), tmp_path / "plain.bin")
    (tmp_path / "cert.json").write_text(json.dumps(cert.to_dict()))
    assert _cli(tmp_path / "plain.bin", "--certificate", tmp_path / "cert.json").returncode == 0
    r = _cli(tmp_path / "plain.bin")
    assert r.returncode == 2 and "no 'sdc_certificate' entry" in r.stderr and "--certificate" in r.stderr


def test_cli_single_safetensors_with_metadata(tmp_path: Path) -> None:
    """A .safetensors file with the certificate as JSON in its metadata exits 0; a flipped element exits 1; without
    the metadata (and no certificate beside it) exits 2."""
    save_file = pytest.importorskip("safetensors.torch").save_file
    model = _gpt_like()
    meta = {"sdc_certificate": json.dumps(WeightCertificate.from_tensors(7, model).to_dict())}
    save_file(model.state_dict(), tmp_path / "m.safetensors", metadata=meta)
    assert _cli(tmp_path / "m.safetensors").returncode == 0
    save_file(_flip_one(model.state_dict(), "2.bias"), tmp_path / "bad.safetensors", metadata=meta)
    r = _cli(tmp_path / "bad.safetensors")
    assert r.returncode == 1 and "  2.bias" in r.stdout and "0.weight" not in r.stdout
    save_file(model.state_dict(), tmp_path / "bare.safetensors")
    r = _cli(tmp_path / "bare.safetensors")
    assert r.returncode == 2 and "no 'sdc_certificate' in the safetensors metadata" in r.stderr


def _sharded(directory: Path, state: dict[str, torch.Tensor], cert: WeightCertificate | None) -> None:
    """Save ``state`` as Hugging Face does for a large model: two safetensors shards and their index."""
    save_file = pytest.importorskip("safetensors.torch").save_file
    directory.mkdir(parents=True, exist_ok=True)
    names = list(state)
    shards = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    for file, part in shards.items():
        save_file({n: state[n].contiguous() for n in part}, directory / file, metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
             "weight_map": {n: file for file, part in shards.items() for n in part}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    if cert is not None:
        (directory / "sdc_certificate.json").write_text(json.dumps(cert.to_dict()))


def test_cli_sharded_safetensors_with_index(tmp_path: Path) -> None:
    """Sharded safetensors with model.safetensors.index.json verify through the index or their directory (exit 0);
    a flip in the second shard exits 1 naming it; a missing shard exits 2 naming the file."""
    model = _gpt_like()
    cert = WeightCertificate.from_tensors(12, model, last_passing_audit=10)
    _sharded(tmp_path / "good", model.state_dict(), cert)
    assert _cli(tmp_path / "good" / "model.safetensors.index.json").returncode == 0
    r = _cli(tmp_path / "good")
    assert r.returncode == 0 and "intact: 6 tensors" in r.stdout
    _sharded(tmp_path / "bad", _flip_one(model.state_dict(), "2.weight"), cert)
    r = _cli(tmp_path / "bad")
    assert r.returncode == 1 and "  2.weight" in r.stdout and "1.weight" not in r.stdout
    (tmp_path / "good" / "model-00002-of-00002.safetensors").unlink()
    r = _cli(tmp_path / "good")
    assert r.returncode == 2 and "model-00002-of-00002.safetensors" in r.stderr and "missing" in r.stderr


def test_cli_hugging_face_directory(tmp_path: Path) -> None:
    """A save_pretrained directory (model.safetensors, tied weights dropped) with sdc_certificate.json exits 0; a
    flipped element exits 1; no certificate, or no weights, exits 2 saying which."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=8,
                                                                 vocab_size=32))
    cert = WeightCertificate.from_tensors(10, model)
    model.save_pretrained(tmp_path / "checkpoint-10")
    assert (tmp_path / "checkpoint-10" / "model.safetensors").is_file()
    r = _cli(tmp_path / "checkpoint-10")
    assert r.returncode == 2 and "sdc_certificate.json" in r.stderr
    (tmp_path / "checkpoint-10" / "sdc_certificate.json").write_text(json.dumps(cert.to_dict()))
    r = _cli(tmp_path / "checkpoint-10")
    assert r.returncode == 0 and f"intact: {len(cert.fingerprints)} tensors verified (step 10)" in r.stdout
    with torch.no_grad():
        _flip_bit(model.transformer.h[0].mlp.c_fc.weight, index=3, bit=9)
    model.save_pretrained(tmp_path / "checkpoint-10")
    r = _cli(tmp_path / "checkpoint-10")
    assert r.returncode == 1 and r.stdout.splitlines()[1:] == ["  transformer.h.0.mlp.c_fc.weight"]
    (tmp_path / "empty").mkdir()
    r = _cli(tmp_path / "empty")
    assert r.returncode == 2 and "without model weights" in r.stderr


def test_cli_lightning_checkpoint_names(tmp_path: Path) -> None:
    """A Lightning-style .ckpt (weights under 'state_dict') verifies against its certificate, and against one made
    from the inner module whose names lack the LightningModule's 'model.' prefix."""
    inner = _gpt_like()
    state = {f"model.{k}": v for k, v in inner.state_dict().items()}
    ckpt = {"epoch": 0, "global_step": 8, "pytorch-lightning_version": "2.6", "state_dict": state, "loops": {}}
    torch.save({**ckpt, "sdc_certificate": WeightCertificate.from_tensors(8, state).to_dict()}, tmp_path / "a.ckpt")
    r = _cli(tmp_path / "a.ckpt")
    assert r.returncode == 0, r.stderr
    torch.save({**ckpt, "sdc_certificate": WeightCertificate.from_tensors(8, inner).to_dict()}, tmp_path / "b.ckpt")
    assert _cli(tmp_path / "b.ckpt").returncode == 0
    flipped = {**ckpt, "state_dict": _flip_one(state, "model.0.weight"),
               "sdc_certificate": WeightCertificate.from_tensors(8, inner).to_dict()}
    torch.save(flipped, tmp_path / "c.ckpt")
    r = _cli(tmp_path / "c.ckpt")
    assert r.returncode == 1 and "  0.weight" in r.stdout


def test_cli_empty_and_partial_certificates_exit_1(tmp_path: Path) -> None:
    """Through the command, an emptied certificate and one missing a tensor exit 1 (not intact), saying why."""
    model = _gpt_like()
    d = WeightCertificate.from_tensors(4, model).to_dict()
    partial = json.loads(json.dumps(d))
    for part in ("fingerprints", "shapes", "dtypes"):
        d[part] = {}
        del partial[part]["0.bias"]
    torch.save({"model": model.state_dict(), "sdc_certificate": d}, tmp_path / "empty.pt")
    torch.save({"model": model.state_dict(), "sdc_certificate": partial}, tmp_path / "partial.pt")
    r = _cli(tmp_path / "empty.pt")
    assert r.returncode == 1 and "covers no tensors" in r.stdout
    r = _cli(tmp_path / "partial.pt")
    assert r.returncode == 1 and "NOT COVERED: 1 tensors" in r.stdout and "  0.bias" in r.stdout


# ---- the checkpoint to resume from ----


def _certified_series(tmp_path: Path, audits: dict[int, int | None]) -> dict[int, Path]:
    """One checkpoint per step in ``audits`` (step -> last passing audit), all intact."""
    model = _gpt_like()
    paths = {}
    for step, audit in audits.items():
        paths[step] = tmp_path / f"ckpt-{step}.pt"
        cert = WeightCertificate.from_tensors(step, model, last_passing_audit=audit)
        torch.save({"model": model.state_dict(), "sdc_certificate": cert.to_dict()}, paths[step])
    return paths


def test_choose_checkpoint_by_last_passing_audit(tmp_path: Path) -> None:
    """The newest checkpoint whose step is at most the last audit that passed before the incident is chosen, not the
    newest one that verifies (its weights may hold a fault the replicas share); a corrupt one is passed over."""
    paths = _certified_series(tmp_path, {10: 0, 20: 10, 30: 20, 40: 30})
    choice = choose_checkpoint(list(paths.values()), 35)
    assert (choice.last_passing_audit, choice.path) == (30, str(paths[30]))
    assert any(p == str(paths[40]) and "after the last audit" in note for p, note in choice.notes)
    assert choose_checkpoint(paths.values(), 15).path == str(paths[10])
    assert choose_checkpoint(paths.values(), 35, last_passing_audit=20).path == str(paths[20])
    ckpt = torch.load(paths[30], weights_only=True)
    ckpt["model"] = _flip_one(ckpt["model"], "0.weight")
    torch.save(ckpt, paths[30])
    choice = choose_checkpoint(paths.values(), 35)
    assert choice.path == str(paths[20])
    assert any(p == str(paths[30]) and "0.weight" in note for p, note in choice.notes)
    none = choose_checkpoint(paths.values(), 5)  # the only earlier audit, step 0, precedes every checkpoint
    assert none.path is None and none.last_passing_audit == 0


def test_choose_checkpoint_without_a_passing_audit_or_readable_checkpoint(tmp_path: Path) -> None:
    """With no passing audit recorded, nothing is chosen; unreadable paths are noted and passed over."""
    paths = _certified_series(tmp_path, {10: None, 20: None})
    (tmp_path / "junk.pt").write_bytes(b"junk")
    choice = choose_checkpoint([*paths.values(), tmp_path / "junk.pt"], 25)
    assert choice.path is None and choice.last_passing_audit is None
    assert any(p.endswith("junk.pt") and "unusable" in note for p, note in choice.notes)
    with pytest.raises(ValueError, match="last_passing_audit"):
        choose_checkpoint(paths.values(), 25, last_passing_audit=25)


def test_cli_before_step_prints_the_checkpoint_to_resume_from(tmp_path: Path) -> None:
    """verify-checkpoint PATH... --before-step N prints only the chosen path on stdout (exit 0), the reasons on
    stderr; exit 1 when no checkpoint qualifies."""
    paths = _certified_series(tmp_path, {100: 50, 200: 150, 300: 250})
    r = _cli(*paths.values(), "--before-step", "260")
    assert (r.returncode, r.stdout.strip()) == (0, str(paths[200])), r.stderr
    assert "chosen" in r.stderr and "after the last audit that passed before the incident (step 250)" in r.stderr
    r = _cli(*paths.values(), "--before-step", "40")
    assert r.returncode == 1 and r.stdout == "" and "no checkpoint to resume from" in r.stderr


def test_cli_refuses_what_is_not_a_regular_file_without_blocking(tmp_path: Path) -> None:
    """A FIFO given as the checkpoint, as --certificate or as a directory's sdc_certificate.json is refused at once
    (exit 2, naming it), never read: nothing writes to it, so a read would block forever."""
    import os

    fifo = tmp_path / "pipe.pt"
    os.mkfifo(fifo)
    good = _save(tmp_path, {"model": {"w": torch.ones(2)}})
    cert_fifo = tmp_path / "cert.json"
    os.mkfifo(cert_fifo)
    for argv, what in (([str(fifo)], "checkpoint"), ([good, "--certificate", str(cert_fifo)], "certificate")):
        proc = subprocess.run([sys.executable, "-m", "sdc_telemetry.ops.cli", "verify-checkpoint", *argv],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and f"the {what}" in proc.stderr and "is a FIFO" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_cli_refuses_a_deeply_nested_certificate_with_exit_2(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A certificate JSON nested 100,000 levels deep (or merely deeper than the bound) is unusable input: exit 2 with a
    message, no RecursionError traceback, never reported as a corrupt checkpoint."""
    good = _save(tmp_path, {"model": {"w": torch.ones(2)}})
    for depth in (100_000, 40):
        hostile = tmp_path / f"deep{depth}.json"
        hostile.write_text("[" * depth + "]" * depth)
        assert main(["verify-checkpoint", good, "--certificate", str(hostile)]) == 2
        assert "nests deeper than" in capsys.readouterr().err
