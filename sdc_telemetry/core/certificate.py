"""Weight certificates: the exact fingerprint of every parameter at a step, saved with the checkpoint.

A certificate is made while the replicas are known to agree (``monitor.certificate()`` checks that first, on every
rank) and travels inside the checkpoint. On load, ``cert.verify(state_dict)`` names every parameter whose bits,
shape or dtype are not those that were certified, so a checkpoint corrupted in memory before the save, on disk or in
transfer is not resumed from::

    cert = monitor.certificate()                                   # collective: every rank calls it
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "sdc_certificate": cert.to_dict()}, path)

    ckpt = torch.load(path, weights_only=True)
    bad = sdc.WeightCertificate.from_dict(ckpt["sdc_certificate"]).verify(ckpt["model"])
    if bad:
        raise RuntimeError(f"checkpoint {path} differs from its certificate: {bad}")

``sdc-telemetry verify-checkpoint PATH`` does the second half from the command line, for the formats frameworks save
(``sdc_telemetry.ops.checkpoints``).

A certificate proves that the replicas agreed and that the bits did not change afterwards; it does not prove that the
numbers are right: a persistent compute fault spreads through the all-reduce, and the replicas then agree on corrupted
weights. ``last_passing_audit`` is the step of the last replay audit that passed on every rank when the certificate
was made (None before the first): after an incident, resume from the newest checkpoint whose step is at most the last
audit that passed before the incident (``sdc_telemetry.ops.checkpoints.choose_checkpoint``).

Coverage: a certificate vouches only for the tensors it names. ``verify`` therefore also returns the tensors it was
given that the certificate does not cover (a parameter of the module, or an entry of the state dict that is neither
certified nor one of the module's buffers listed in ``buffers``), and a certificate that covers no tensor at all never
verifies: its result starts with ``EMPTY_CERTIFICATE``.
"""

from __future__ import annotations

import importlib
import math
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

# The module, not the package's re-exported function of the same name.
_fingerprint_module = importlib.import_module(".fingerprint", __package__)
format_fingerprint = _fingerprint_module.format_fingerprint

__all__ = ["EMPTY_CERTIFICATE", "WeightCertificate", "fingerprint_algorithm", "format_fingerprint"]

#: First entry of ``verify()``'s result for a certificate that names no tensor (such a certificate vouches for
#: nothing, so it never verifies "intact"). Not a valid parameter name.
EMPTY_CERTIFICATE = "<the certificate covers no tensors>"

_DDP_PREFIX = "module."
_HEX_ROW = re.compile(r"[0-9a-f]{16}(-[0-9a-f]{16})*")
_FIELDS = ("step", "fingerprints", "shapes", "dtypes", "algorithm", "world_size", "created_unix")
_HASH_BATCH_BYTES = 256 << 20  # verify fingerprints at most this many bytes of tensors at once (lazy checkpoints)


def fingerprint_algorithm() -> str:
    """The id of the fingerprint this installation computes (``FINGERPRINT_ALGORITHM`` of the fingerprint module)."""
    return str(_fingerprint_module.FINGERPRINT_ALGORITHM)


def _fingerprints(tensors: list[torch.Tensor]) -> list[str]:
    """Fingerprint rows as text: one batched call per device, one host transfer per device at the end."""
    out: list[str] = [""] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        rows = _fingerprint_module.fingerprint([tensors[i] for i in idx]).cpu().tolist()
        for i, row in zip(idx, rows, strict=True):
            out[i] = format_fingerprint(row)
    return out


def _strip_ddp_prefix(names: Iterable[str]) -> dict[str, str]:
    """Map each name to itself without ``module.`` when EVERY name has that prefix (a DDP-wrapped model)."""
    names = list(names)
    strip = bool(names) and all(n.startswith(_DDP_PREFIX) for n in names)
    return {n: n[len(_DDP_PREFIX):] if strip else n for n in names}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class WeightCertificate:
    """The fingerprints, shapes and dtypes of a model's parameters at ``step``, as certified across replicas.

    ``fingerprints``: parameter name -> fingerprint row as text (``format_fingerprint``). ``shapes``: name -> shape.
    ``dtypes``: name -> dtype name (``"float32"``). ``algorithm``: the fingerprint's id; a certificate is only
    verified by the same algorithm. ``world_size``: ranks that agreed. ``created_unix``: wall-clock creation time.
    ``last_passing_audit``: the step of the last replay audit that passed on every rank before the certificate was
    made, or None (no audit yet, or audits off); at most ``step``. ``buffers``: names of the module's buffers, which
    are not certified (they may differ across replicas, such as batch-norm statistics) and which ``verify`` therefore
    does not count as uncovered entries of a state dict.

    >>> import torch
    >>> w = {"fc.weight": torch.ones(2, 3)}
    >>> cert = WeightCertificate.from_tensors(7, w)
    >>> cert.verify(w), cert.verify({"fc.weight": torch.zeros(2, 3)})
    ([], ['fc.weight'])
    """

    step: int
    fingerprints: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    algorithm: str = field(default_factory=fingerprint_algorithm)
    world_size: int = 1
    created_unix: float = field(default_factory=time.time)
    last_passing_audit: int | None = None
    buffers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.buffers, list):  # a list of names is stored as a tuple
            object.__setattr__(self, "buffers", tuple(self.buffers))
        _check(self)

    @classmethod
    def from_tensors(cls, step: int,
                     named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | torch.nn.Module,
                     *, world_size: int = 1, last_passing_audit: int | None = None,
                     buffers: Iterable[str] = ()) -> WeightCertificate:
        """Certify ``named_tensors`` (a state dict, ``module.named_parameters()``, pairs, or a module) at ``step``.

        A module certifies its parameters and lists its buffers in ``buffers``. The tensors must be whole (not shards)
        and on one device per batch: fingerprints are computed in one call per device and copied to the host once.
        """
        if isinstance(named_tensors, torch.nn.Module):
            buffers = [*buffers, *(n for n, _ in named_tensors.named_buffers())]
            named_tensors = list(named_tensors.named_parameters())
        pairs = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        tensors: dict[str, torch.Tensor] = {}
        for name, t in pairs:
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise TypeError(f"named_tensors must hold (str, torch.Tensor) pairs, got ({type(name).__name__}, "
                                f"{type(t).__name__})")
            if name in tensors:
                raise ValueError(f"named_tensors names {name!r} twice")
            tensors[name] = t
        rows = _fingerprints(list(tensors.values()))
        return cls(step=step, fingerprints=dict(zip(tensors, rows, strict=True)),
                   shapes={n: tuple(t.shape) for n, t in tensors.items()},
                   dtypes={n: _dtype_name(t.dtype) for n, t in tensors.items()}, world_size=world_size,
                   last_passing_audit=last_passing_audit,
                   buffers=tuple(dict.fromkeys(b for b in buffers if b not in tensors)))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (shapes as lists); ``from_dict`` reads it back."""
        return {"step": self.step, "last_passing_audit": self.last_passing_audit, "algorithm": self.algorithm,
                "world_size": self.world_size, "created_unix": self.created_unix,
                "fingerprints": dict(self.fingerprints), "shapes": {n: list(s) for n, s in self.shapes.items()},
                "dtypes": dict(self.dtypes), "buffers": list(self.buffers)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WeightCertificate:
        """Read ``to_dict()``'s output back; ``ValueError`` naming the missing or malformed field. A dict written
        before ``last_passing_audit`` and ``buffers`` existed reads as None and no buffers."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a certificate must be a dict, got {type(d).__name__}")
        missing = [f for f in _FIELDS if f not in d]
        if missing:
            raise ValueError(f"certificate is missing field(s) {', '.join(missing)}")
        shapes = d["shapes"]
        if not isinstance(shapes, Mapping) or not all(
                isinstance(s, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in s)
                for s in shapes.values()):
            raise ValueError("certificate field 'shapes' must map names to lists of integers")
        buffers = d.get("buffers", [])
        if not isinstance(buffers, (list, tuple)) or not all(isinstance(b, str) for b in buffers):
            raise ValueError("certificate field 'buffers' must be a list of names")
        return cls(step=d["step"], fingerprints=d["fingerprints"], shapes={n: tuple(s) for n, s in shapes.items()},
                   dtypes=d["dtypes"], algorithm=d["algorithm"], world_size=d["world_size"],
                   created_unix=d["created_unix"], last_passing_audit=d.get("last_passing_audit"),
                   buffers=tuple(buffers))

    def verify(self, state_dict_or_module: Mapping[str, Any] | torch.nn.Module) -> list[str]:
        """What keeps these weights from being those certified; an empty list means they are exactly those.

        The list names, in this order: ``EMPTY_CERTIFICATE`` when the certificate covers no tensor at all; the
        certified parameters that are missing, or whose shape, dtype or fingerprint differs (as the certificate
        spells them); then the tensors given that the certificate does not cover (as given): for a module, its
        parameters that are not certified; for a state dict, its tensor entries that are neither certified nor
        listed in ``buffers`` (a second name of a certified tensor, as tied weights have in a state dict, is
        covered). Non-tensor entries of a state dict are ignored.

        Accepts a module (its ``named_parameters()``) or a state dict (any mapping; its tensors are read one batch
        at a time, so a lazily loading mapping keeps memory bounded). A DDP ``module.`` prefix is tolerated on
        either side: when every key of one side starts with ``module.`` it is removed from that side's keys before
        matching, so a DDP model, its ``.module`` and their state dicts all verify against one certificate.
        ``ValueError`` when the certificate was made with another fingerprint algorithm.
        """
        current = fingerprint_algorithm()
        if self.algorithm != current:
            raise ValueError(f"certificate made with fingerprint algorithm {self.algorithm!r}, but this "
                             f"sdc_telemetry computes {current!r}: verify with the version that made it")
        module = isinstance(state_dict_or_module, torch.nn.Module)
        if isinstance(state_dict_or_module, torch.nn.Module):
            given: Mapping[str, Any] = dict(state_dict_or_module.named_parameters())
        elif isinstance(state_dict_or_module, Mapping):
            given = state_dict_or_module
        else:
            raise TypeError(f"verify needs a state dict or a torch.nn.Module, got {type(state_dict_or_module)}")
        key_of = {short: key for key, short in _strip_ddp_prefix(k for k in given if isinstance(k, str)).items()}
        cert_names = _strip_ddp_prefix(self.fingerprints)
        certified = set(cert_names.values())
        buffers = set() if module else set(_strip_ddp_prefix(self.buffers).values())
        # Storage identities of the certified tensors, to recognise a second name of one of them (tied weights). Only
        # for a dict, whose tensors stay alive: a lazy mapping could reuse a freed tensor's address.
        aliases: set[tuple[Any, ...]] | None = set() if isinstance(given, dict) else None
        bad: set[str] = set()
        batch: list[tuple[str, torch.Tensor]] = []
        batch_bytes = 0

        def flush() -> None:
            nonlocal batch, batch_bytes
            rows = _fingerprints([t for _, t in batch])
            bad.update(name for (name, _), row in zip(batch, rows, strict=True) if row != self.fingerprints[name])
            batch, batch_bytes = [], 0

        for name, short in cert_names.items():
            key = key_of.get(short)
            t = given[key] if key is not None else None
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != self.shapes[name] \
                    or _dtype_name(t.dtype) != self.dtypes[name]:
                bad.add(name)
                continue
            if aliases is not None:
                aliases.add(_storage_identity(t))
            batch.append((name, t))
            batch_bytes += t.numel() * t.element_size()
            if batch_bytes >= _HASH_BATCH_BYTES:
                flush()
        flush()
        uncovered: list[str] = []
        for short, key in key_of.items():
            if short in certified or short in buffers:
                continue
            t = given[key]
            if isinstance(t, torch.Tensor) and (module or aliases is None or _storage_identity(t) not in aliases):
                uncovered.append(key)
        return [*([EMPTY_CERTIFICATE] if not self.fingerprints else []),
                *(n for n in self.fingerprints if n in bad), *uncovered]


def _storage_identity(t: torch.Tensor) -> tuple[Any, ...]:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, some subclasses): never an alias
        return (id(t),)
    return ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype


def _check(c: WeightCertificate) -> None:
    """Validate every field, naming the first bad one."""
    if isinstance(c.step, bool) or not isinstance(c.step, int) or c.step < 0:
        raise ValueError(f"certificate field 'step' must be an integer >= 0, got {c.step!r}")
    lpa = c.last_passing_audit
    if lpa is not None and (isinstance(lpa, bool) or not isinstance(lpa, int) or not 0 <= lpa <= c.step):
        raise ValueError(f"certificate field 'last_passing_audit' must be None or an integer from 0 to the step "
                         f"({c.step}), got {lpa!r}")
    if isinstance(c.world_size, bool) or not isinstance(c.world_size, int) or c.world_size < 1:
        raise ValueError(f"certificate field 'world_size' must be an integer >= 1, got {c.world_size!r}")
    if not isinstance(c.algorithm, str) or not c.algorithm:
        raise ValueError(f"certificate field 'algorithm' must be a non-empty string, got {c.algorithm!r}")
    if isinstance(c.created_unix, bool) or not isinstance(c.created_unix, (int, float)) \
            or not math.isfinite(c.created_unix):
        raise ValueError(f"certificate field 'created_unix' must be a finite number, got {c.created_unix!r}")
    for name in ("fingerprints", "shapes", "dtypes"):
        value = getattr(c, name)
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ValueError(f"certificate field {name!r} must be a dict keyed by parameter name")
    if not isinstance(c.buffers, tuple) or not all(isinstance(b, str) for b in c.buffers):
        raise ValueError("certificate field 'buffers' must be a list of names")
    both = sorted(set(c.buffers) & set(c.fingerprints))
    if both:
        raise ValueError(f"certificate field 'buffers' names certified parameters {both[:5]}")
    bad = [n for n, fp in c.fingerprints.items() if not isinstance(fp, str) or not _HEX_ROW.fullmatch(fp)]
    if bad:
        raise ValueError(f"certificate field 'fingerprints' holds malformed values for {bad[:5]} (want 16 lower-case "
                         f"hex digits per column, joined with '-')")
    for name in ("shapes", "dtypes"):
        keys = set(getattr(c, name))
        if keys != set(c.fingerprints):
            diff = sorted(keys.symmetric_difference(c.fingerprints))
            raise ValueError(f"certificate field {name!r} does not name the same parameters as 'fingerprints' "
                             f"(differ: {diff[:5]})")
    if not all(isinstance(s, tuple) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s)
               for s in c.shapes.values()):
        raise ValueError("certificate field 'shapes' must map names to tuples of integers >= 0")
    if not all(isinstance(d, str) and isinstance(getattr(torch, d, None), torch.dtype) for d in c.dtypes.values()):
        raise ValueError("certificate field 'dtypes' must map names to torch dtype names such as 'float32'")
