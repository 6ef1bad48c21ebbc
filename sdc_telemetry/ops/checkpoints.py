"""Checkpoints as frameworks save them: read one with its weight certificate, verify it, and choose the checkpoint to
resume from after an incident. ``sdc-telemetry verify-checkpoint`` is the command-line face of this module.

Formats read by ``open_checkpoint(path, certificate=None, key=None)``:

- a file written by ``torch.save`` (``.pt``, ``.bin``, a Lightning ``.ckpt``): loaded with
  ``torch.load(weights_only=True)`` (memory-mapped where the format allows), never unpickling code. A dict holding
  the certificate under ``sdc_certificate`` (``cert.to_dict()``) and the state dict under ``key``, else ``model``,
  else ``state_dict`` (Lightning), else the dict itself; or a plain state dict with ``certificate=``.
- a ``.safetensors`` file: the certificate as JSON in its metadata under ``sdc_certificate``
  (``save_file(tensors, path, metadata={"sdc_certificate": json.dumps(cert.to_dict())})``), else
  ``sdc_certificate.json`` beside it, else ``certificate=``.
- a sharded checkpoint's index (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``): its
  ``weight_map`` names each tensor's shard; the certificate in ``sdc_certificate.json`` beside it.
- a checkpoint directory (Hugging Face's ``checkpoint-N``, ``save_pretrained``): ``model.safetensors``, the sharded
  safetensors index, ``pytorch_model.bin`` or its index, in that order of preference, with the certificate in
  ``sdc_certificate.json`` inside it.

``certificate=`` (a JSON file holding ``cert.to_dict()``) always wins over a certificate found in the checkpoint.
Safetensors tensors are read one batch at a time, so verifying a large sharded model needs little memory.

Names: the state dict is matched to the certificate's parameter names as saved (a Lightning checkpoint's
``state_dict`` is keyed like the LightningModule's parameters, which the Lightning callback certifies). When no
certified name is found as is, a prefix that every name on one side carries and the other side lacks (Lightning's
``model.``, DDP's ``module.``) is dropped.

Rollback (``choose_checkpoint(paths, incident_step)``): a certificate proves replica agreement, and a persistent
compute fault spreads through the all-reduce so that the replicas agree on corrupted weights. The checkpoint to
resume from is therefore the newest one whose step is at most the last replay audit that passed before the incident
(``last_passing_audit`` of the certificates), and that verifies intact.

``safetensors`` (installed with ``transformers``) is imported only when a safetensors checkpoint is read.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sdc_telemetry.core.certificate import EMPTY_CERTIFICATE, WeightCertificate

__all__ = ["CERTIFICATE_FILE", "CERTIFICATE_KEY", "Checkpoint", "CheckpointError", "Choice", "Verification",
           "add_arguments", "choose_checkpoint", "open_checkpoint", "read_certificate_file", "run",
           "verify_checkpoint"]

CERTIFICATE_KEY = "sdc_certificate"  # the entry of a torch.save'd dict, and the safetensors metadata key
CERTIFICATE_FILE = "sdc_certificate.json"  # in a checkpoint directory
_SAFETENSORS, _SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
_TORCH_BIN, _TORCH_BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
_STATE_KEYS = ("model", "state_dict")  # where a torch.save'd dict usually keeps the weights (plain, Lightning)


class CheckpointError(ValueError):
    """The checkpoint or its certificate cannot be used (missing, unreadable, malformed): exit code 2."""


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint opened for verification: its certificate and its state dict (tensors may load lazily)."""

    path: str
    format: str
    certificate: WeightCertificate
    state: Mapping[str, Any]


@dataclass(frozen=True)
class Verification:
    """The outcome of verifying one checkpoint against its certificate.

    ``differ``: certified tensors that are missing or whose bits, shape or dtype differ. ``uncovered``: tensors of
    the checkpoint the certificate does not cover. ``empty``: the certificate covers no tensor. ``intact`` only when
    none of these."""

    path: str
    format: str
    certificate: WeightCertificate
    differ: list[str]
    uncovered: list[str]
    empty: bool

    @property
    def intact(self) -> bool:
        return not (self.differ or self.uncovered or self.empty)


@dataclass(frozen=True)
class Choice:
    """Which checkpoint to resume from after the incident at ``incident_step``.

    ``path``/``certificate``: the newest checkpoint whose step is at most ``last_passing_audit`` (the last replay
    audit known to have passed before the incident) and that verifies intact; None when there is none.
    ``notes``: (path, what was decided about it, and why), newest first, for every checkpoint looked at."""

    incident_step: int
    last_passing_audit: int | None
    path: str | None
    certificate: WeightCertificate | None
    notes: list[tuple[str, str]] = field(default_factory=list)


MAX_JSON_DEPTH = 32  # a certificate or shard index nests 3 levels; a deeper document is hostile or broken


def _regular(path: str | os.PathLike[str], what: str) -> None:
    """Refuse what is not a regular file (a FIFO would block the read forever, a device never ends)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise CheckpointError(f"cannot read the {what} {os.fspath(path)}: {e.strerror or e}") from e
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else \
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else \
            "not a regular file"
        raise CheckpointError(f"the {what} {os.fspath(path)} is {kind}, not a regular file: refused")


def _json(text: str, where: str) -> Any:
    """``json.loads`` with a bound on nesting: a deeper document is refused, never a RecursionError."""
    try:
        d = json.loads(text)
    except RecursionError:
        raise CheckpointError(f"{where} nests deeper than {MAX_JSON_DEPTH} levels: refused") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{where} is not JSON: {e}") from e
    stack = [(d, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise CheckpointError(f"{where} nests deeper than {MAX_JSON_DEPTH} levels: refused")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return d


def read_certificate_file(path: str | os.PathLike[str]) -> WeightCertificate:
    """A certificate from a JSON file holding ``cert.to_dict()`` (or ``{"sdc_certificate": cert.to_dict()}``)."""
    _regular(path, "certificate")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise CheckpointError(f"cannot read the certificate {os.fspath(path)}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise CheckpointError(f"the certificate {os.fspath(path)} is not JSON: {e}") from e
    return _certificate(_json(text, f"the certificate {os.fspath(path)}"), f"in {os.fspath(path)}")


def _certificate(d: Any, where: str) -> WeightCertificate:
    if isinstance(d, Mapping) and CERTIFICATE_KEY in d and "fingerprints" not in d:
        d = d[CERTIFICATE_KEY]
    try:
        return WeightCertificate.from_dict(d)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"malformed certificate {where}: {e}") from e


def open_checkpoint(path: str | os.PathLike[str], *, certificate: str | os.PathLike[str] | None = None,
                    key: str | None = None) -> Checkpoint:
    """Open ``path`` in any of the formats in the module docstring; ``CheckpointError`` saying what is wrong."""
    p = Path(path)
    given = read_certificate_file(certificate) if certificate is not None else None
    if p.is_dir():
        return _open_directory(p, given, key)
    if not p.exists():
        raise CheckpointError("no such file or directory")
    _regular(p, "checkpoint")
    return _open_file(p, given, key)


def _open_file(p: Path, given: WeightCertificate | None, key: str | None) -> Checkpoint:
    if p.name.endswith(".index.json"):
        return _open_index(p, given, key)
    if p.suffix == ".safetensors":
        return _open_safetensors(p, given, key)
    return _open_torch(p, given, key)


def verify_checkpoint(path: str | os.PathLike[str], *, certificate: str | os.PathLike[str] | None = None,
                      key: str | None = None) -> Verification:
    """Open ``path`` and check its weights against its certificate (see ``WeightCertificate.verify``)."""
    ckpt = open_checkpoint(path, certificate=certificate, key=key)
    cert = ckpt.certificate
    try:
        result = cert.verify(_align(ckpt.state, cert))
    except ValueError as e:  # another fingerprint algorithm, a shard that cannot be read
        raise CheckpointError(str(e)) from e
    differ_names = set(cert.fingerprints)
    return Verification(path=os.fspath(path), format=ckpt.format, certificate=cert,
                        differ=[n for n in result if n in differ_names],
                        uncovered=[n for n in result if n not in differ_names and n != EMPTY_CERTIFICATE],
                        empty=EMPTY_CERTIFICATE in result)


def choose_checkpoint(paths: Iterable[str | os.PathLike[str]], incident_step: int, *,
                      last_passing_audit: int | None = None) -> Choice:
    """The checkpoint to resume from after an incident at ``incident_step`` (the incident's ``step``).

    The last passing audit before the incident is ``last_passing_audit`` when given (for instance from the job's
    records), else the latest ``last_passing_audit`` below ``incident_step`` among the certificates. Checkpoints
    whose step is above it are not trusted, even when they verify: their weights may hold a fault that the replicas
    share. Among the others, the newest that verifies intact is chosen; unreadable, uncertified and corrupt ones
    are passed over (and noted)."""
    if isinstance(incident_step, bool) or not isinstance(incident_step, int) or incident_step < 0:
        raise ValueError(f"incident_step must be an integer >= 0, got {incident_step!r}")
    if last_passing_audit is not None and (isinstance(last_passing_audit, bool) or not isinstance(
            last_passing_audit, int) or not 0 <= last_passing_audit < incident_step):
        raise ValueError(f"last_passing_audit must be an integer from 0 to incident_step - 1 ({incident_step - 1}), "
                         f"got {last_passing_audit!r}")
    notes: list[tuple[str, str]] = []
    certified: list[tuple[str, WeightCertificate]] = []
    for path in (os.fspath(p) for p in paths):
        try:
            certified.append((path, open_checkpoint(path).certificate))
        except CheckpointError as e:
            notes.append((path, f"passed over: unusable: {e}"))
    audit = last_passing_audit
    if audit is None:
        audits = [c.last_passing_audit for _, c in certified
                  if c.last_passing_audit is not None and c.last_passing_audit < incident_step]
        audit = max(audits, default=None)
    choice = Choice(incident_step=incident_step, last_passing_audit=audit, path=None, certificate=None, notes=notes)
    for path, cert in sorted(certified, key=lambda pc: pc[1].step, reverse=True):
        if audit is None:
            notes.append((path, f"passed over: step {cert.step}: no replay audit is known to have passed before the "
                                f"incident at step {incident_step}"))
            continue
        if cert.step > audit:
            notes.append((path, f"passed over: step {cert.step} is after the last audit that passed before the "
                                f"incident (step {audit})"))
            continue
        if choice.path is not None:
            notes.append((path, f"older: step {cert.step}"))
            continue
        try:
            v = verify_checkpoint(path)
        except CheckpointError as e:
            notes.append((path, f"passed over: unusable: {e}"))
            continue
        if not v.intact:
            notes.append((path, f"passed over: step {cert.step}: does not verify: {_summary(v)}"))
            continue
        notes.append((path, f"chosen: step {cert.step}, at most the last audit that passed before the incident "
                            f"(step {audit}), verifies intact"))
        choice = Choice(incident_step=incident_step, last_passing_audit=audit, path=path, certificate=v.certificate,
                        notes=notes)
    return choice


def _summary(v: Verification) -> str:
    parts = (["the certificate covers no tensors"] if v.empty else []) \
        + ([f"{len(v.differ)} tensor(s) differ ({', '.join(v.differ[:5])})"] if v.differ else []) \
        + ([f"{len(v.uncovered)} tensor(s) not covered ({', '.join(v.uncovered[:5])})"] if v.uncovered else [])
    return "; ".join(parts)


# ---- the formats ----


def _open_torch(p: Path, given: WeightCertificate | None, key: str | None) -> Checkpoint:
    obj = _torch_load(p)
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"the checkpoint is a {type(obj).__name__}, not a dict (a state dict, or a dict holding "
                              f"'{CERTIFICATE_KEY}' and the state dict)")
    if given is not None:
        cert = given
    elif CERTIFICATE_KEY in obj:
        cert = _certificate(obj[CERTIFICATE_KEY], f"under '{CERTIFICATE_KEY}'")
    else:
        raise CheckpointError(f"no '{CERTIFICATE_KEY}' entry: save cert.to_dict() from monitor.certificate() with the "
                              f"model, or pass --certificate FILE")
    if key is not None:
        if key not in obj:
            raise CheckpointError(f"no entry {key!r} (entries: {', '.join(map(str, obj))})")
        name: str | None = key
    else:
        name = next((k for k in _STATE_KEYS if isinstance(obj.get(k), Mapping)), None)
    state = obj[name] if name is not None else {k: v for k, v in obj.items() if k != CERTIFICATE_KEY}
    if not isinstance(state, Mapping):
        raise CheckpointError(f"entry {name!r} is a {type(state).__name__}, not a state dict")
    fmt = "Lightning checkpoint" if name == "state_dict" and "pytorch-lightning_version" in obj else "torch.save"
    return Checkpoint(path=str(p), format=fmt, certificate=cert, state=state)


def _torch_load(p: Path) -> Any:
    try:
        try:
            return torch.load(p, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:  # the legacy (non-zip) format cannot be memory-mapped
            if "mmap" not in str(e):
                raise
            return torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # any unreadable file is reported the same way
        raise CheckpointError(f"cannot load with torch.load(weights_only=True): {type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from e


def _safe_open(p: Path) -> Any:
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise CheckpointError("reading .safetensors needs the safetensors package (pip install safetensors)") from e
    try:
        return safe_open(os.fspath(p), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError, OSError: reported the same way
        raise CheckpointError(f"cannot read {p.name} as safetensors: {type(e).__name__}: {e}") from e


class _SafetensorsState(Mapping[str, torch.Tensor]):
    """Tensor name -> tensor, read from the file that holds it when asked (one open handle per file)."""

    def __init__(self, where: dict[str, Path]) -> None:
        self._where = where
        self._handles: dict[Path, Any] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        file = self._where[name]
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = _safe_open(file)
        try:
            t: torch.Tensor = handle.get_tensor(name)
        except Exception as e:  # a truncated or damaged shard
            raise CheckpointError(f"cannot read tensor {name!r} from {file.name}: {type(e).__name__}: {e}") from e
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _open_safetensors(p: Path, given: WeightCertificate | None, key: str | None) -> Checkpoint:
    _no_key(key, "a .safetensors file")
    handle = _safe_open(p)
    cert = given
    if cert is None:
        text = (handle.metadata() or {}).get(CERTIFICATE_KEY)
        if text is not None:
            d = _json(text, f"the '{CERTIFICATE_KEY}' metadata")
            cert = _certificate(d, f"in the '{CERTIFICATE_KEY}' metadata")
        else:
            cert = _sibling_certificate(p.parent, f"no '{CERTIFICATE_KEY}' in the safetensors metadata")
    return Checkpoint(path=str(p), format="safetensors", certificate=cert,
                      state=_SafetensorsState({name: p for name in handle.keys()}))


def _open_index(p: Path, given: WeightCertificate | None, key: str | None) -> Checkpoint:
    _no_key(key, "a sharded checkpoint")
    _regular(p, "shard index")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read the shard index {p.name}: {e}") from e
    index = _json(text, f"the shard index {p.name}")
    weight_map = index.get("weight_map") if isinstance(index, Mapping) else None
    if not isinstance(weight_map, Mapping) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"the shard index {p.name} has no 'weight_map' of tensor names to shard files")
    shards = {name: p.parent / file for name, file in weight_map.items()}
    for file in sorted(set(shards.values())):
        if file.parent != p.parent:
            raise CheckpointError(f"the shard index {p.name} names a shard outside its directory: {file.name}")
        if not file.exists():
            raise CheckpointError(f"the shard {file.name} named in {p.name} is missing")
        _regular(file, f"shard named in {p.name}")
    cert = given if given is not None else _sibling_certificate(p.parent, "")
    if p.name.startswith("model.safetensors") or all(f.suffix == ".safetensors" for f in shards.values()):
        return Checkpoint(path=str(p), format="sharded safetensors", certificate=cert, state=_SafetensorsState(shards))
    state: dict[str, Any] = {}
    for file in sorted(set(shards.values())):
        shard = _torch_load(file)
        if not isinstance(shard, Mapping):
            raise CheckpointError(f"the shard {file.name} is a {type(shard).__name__}, not a state dict")
        state.update((name, shard[name]) for name, f in shards.items() if f == file and name in shard)
    return Checkpoint(path=str(p), format="sharded torch.save", certificate=cert, state=state)


def _open_directory(p: Path, given: WeightCertificate | None, key: str | None) -> Checkpoint:
    for name in (_SAFETENSORS, _SAFETENSORS_INDEX, _TORCH_BIN, _TORCH_BIN_INDEX):
        if (p / name).is_file():
            break
    else:
        files = sorted(f.name for f in p.iterdir())[:12]
        raise CheckpointError(f"a directory without model weights: none of {_SAFETENSORS}, {_SAFETENSORS_INDEX}, "
                              f"{_TORCH_BIN}, {_TORCH_BIN_INDEX} (it holds: {', '.join(files) or 'nothing'})")
    if given is None and (p / CERTIFICATE_FILE).is_file():
        given = read_certificate_file(p / CERTIFICATE_FILE)
    ckpt = _open_file(p / name, given, key)
    return Checkpoint(path=str(p), format=f"directory ({ckpt.format}, {name})", certificate=ckpt.certificate,
                      state=ckpt.state)


def _sibling_certificate(directory: Path, why: str) -> WeightCertificate:
    file = directory / CERTIFICATE_FILE
    if not file.is_file():
        raise CheckpointError(f"{why + ', ' if why else ''}no {CERTIFICATE_FILE} beside it, and no --certificate FILE")
    return read_certificate_file(file)


def _no_key(key: str | None, what: str) -> None:
    if key is not None:
        raise CheckpointError(f"--key selects an entry of a torch.save'd dict; {what} has none")


# ---- names ----


def _align(state: Mapping[str, Any], cert: WeightCertificate) -> Mapping[str, Any]:
    """``state`` as is when it names any certified parameter; else with a prefix that all of one side's names carry
    removed from that side (a LightningModule's ``model.``, DDP's ``module.``), when that makes names match."""
    certified = set(cert.fingerprints)
    keys = [k for k in state if isinstance(k, str)]
    if not certified or not keys or certified & set(keys):
        return state
    prefix = _common_prefix(keys)
    if prefix and certified & {k[len(prefix):] for k in keys}:
        return _Renamed(state, {k[len(prefix):]: k for k in keys})
    prefix = _common_prefix(certified)
    if prefix and {n[len(prefix):] for n in certified} & set(keys):
        return _Renamed(state, {prefix + k: k for k in keys})
    return state


def _common_prefix(names: Iterable[str]) -> str:
    """The first dotted component with its dot when every name starts with the same one, else ''."""
    firsts = {n.split(".", 1)[0] + "." if "." in n else "" for n in names}
    return firsts.pop() if len(firsts) == 1 else ""


class _Renamed(Mapping[str, Any]):
    """A view of ``state`` under new names (``new -> old``); values are read from ``state`` when asked."""

    def __init__(self, state: Mapping[str, Any], names: dict[str, str]) -> None:
        self._state, self._names = state, names

    def __getitem__(self, name: str) -> Any:
        return self._state[self._names[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


# ---- command line ----


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``sdc-telemetry verify-checkpoint``."""
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="a checkpoint: a torch.save'd file (.pt, .bin, Lightning .ckpt), a .safetensors file, a "
                        "sharded checkpoint's *.index.json, or a checkpoint directory (Hugging Face checkpoint-N)")
    p.add_argument("--certificate", default=None, metavar="FILE",
                   help="JSON file holding the certificate (cert.to_dict()); default: the one saved with the "
                        f"checkpoint ('{CERTIFICATE_KEY}' entry or metadata, or {CERTIFICATE_FILE})")
    p.add_argument("--key", default=None,
                   help="entry of a torch.save'd dict holding the state dict (default: 'model', else 'state_dict', "
                        "else the top-level dict itself)")
    p.add_argument("--before-step", type=int, default=None, metavar="N",
                   help="choose the checkpoint to resume from after an incident at step N: the newest of PATHs whose "
                        "step is at most the last replay audit that passed before N and that verifies intact; its "
                        "path is printed on stdout, the reasons on stderr (exit 0; 1 when none qualifies)")


def run(args: argparse.Namespace) -> int:
    """``sdc-telemetry verify-checkpoint``: exit 0 intact, 1 not intact (the tensors named), 2 unusable input."""
    paths: Sequence[str] = args.paths
    if args.before_step is not None:
        return _run_choose(paths, args.before_step, args.certificate, args.key)
    if args.certificate is not None and len(paths) > 1:
        print("sdc-telemetry verify-checkpoint: --certificate applies to one PATH, got "
              f"{len(paths)}", file=sys.stderr)
        return 2
    return max(_run_one(path, args.certificate, args.key, label=len(paths) > 1) for path in paths)


def _run_one(path: str, certificate: str | None, key: str | None, *, label: bool) -> int:
    try:
        v = verify_checkpoint(path, certificate=certificate, key=key)
    except CheckpointError as e:
        print(f"sdc-telemetry verify-checkpoint: {path}: {e}", file=sys.stderr)
        return 2
    cert, head = v.certificate, f"{path}: " if label else ""
    audit = f", last passing audit {cert.last_passing_audit}" if cert.last_passing_audit is not None else ""
    n = len(cert.fingerprints)
    if v.intact:
        print(f"{head}intact: {n} tensors verified (step {cert.step}{audit})")
        return 0
    if v.empty:
        print(f"{head}NOT VERIFIED: the certificate of step {cert.step} covers no tensors: it vouches for nothing")
    if v.differ:
        print(f"{head}CORRUPT: {len(v.differ)} of {n} tensors differ from the certificate of step {cert.step} "
              f"(changed, missing, or of another shape or dtype):")
        for name in v.differ:
            print(f"  {name}")
    if v.uncovered:
        print(f"{head}NOT COVERED: {len(v.uncovered)} tensors of the checkpoint are not in the certificate of step "
              f"{cert.step}, which does not vouch for them:")
        for name in v.uncovered:
            print(f"  {name}")
    return 1


def _run_choose(paths: Sequence[str], incident_step: int, certificate: str | None, key: str | None) -> int:
    if certificate is not None or key is not None:
        print("sdc-telemetry verify-checkpoint: --before-step reads each checkpoint's own certificate and state dict: "
              "drop --certificate and --key", file=sys.stderr)
        return 2
    if incident_step < 0:
        print(f"sdc-telemetry verify-checkpoint: --before-step must be >= 0, got {incident_step}", file=sys.stderr)
        return 2
    choice = choose_checkpoint(paths, incident_step)
    for path, note in choice.notes:
        print(f"{path}: {note}", file=sys.stderr)
    if choice.path is None:
        why = "no replay audit is known to have passed before it" if choice.last_passing_audit is None else \
            f"none is at or before the last audit that passed before it (step {choice.last_passing_audit}) and intact"
        print(f"sdc-telemetry verify-checkpoint: no checkpoint to resume from after the incident at step "
              f"{incident_step}: {why}", file=sys.stderr)
        return 1
    print(choice.path)
    return 0
