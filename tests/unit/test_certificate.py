"""Weight certificates: made from tensors, saved with a checkpoint, and naming every tensor that changed."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from sdc_telemetry.core.certificate import WeightCertificate, fingerprint_algorithm, format_fingerprint
from sdc_telemetry.core.fingerprint import fingerprint
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


def test_extra_entries_such_as_buffers_are_ignored() -> None:
    """Entries of the state dict that the certificate does not name (buffers) do not make it fail."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    cert = WeightCertificate.from_tensors(3, model.named_parameters())
    assert cert.verify(model.state_dict()) == []


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
