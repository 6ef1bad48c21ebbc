"""Certificates for the checkpoints a framework saves (shared by the Lightning and Hugging Face integrations)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile

from sdc_telemetry.core.certificate import WeightCertificate
from sdc_telemetry.core.incident import SDCDetected
from sdc_telemetry.monitor import SDCMonitor

__all__ = ["CERTIFICATE_FILE", "CERTIFICATE_KEY", "certify", "write_certificate"]

log = logging.getLogger("sdc_telemetry")

CERTIFICATE_KEY = "sdc_certificate"  # entry of a torch.save'd checkpoint dict (sdc-telemetry verify-checkpoint)
CERTIFICATE_FILE = "sdc_certificate.json"  # inside a checkpoint directory


def certify(monitor: SDCMonitor | None, step: int, what: str) -> WeightCertificate | None:
    """The monitor's certificate for a checkpoint, labelled ``step`` in the framework's own numbering (the number of
    optimizer updates in the weights: Lightning's and Hugging Face's ``global_step``), with the module's buffer names.

    Collective: every rank calls it at the same save. None (logged, and counted as an internal error) when nothing can
    be certified: no running monitor, a hardware suspect still open (``SDCDetected`` from ``certificate()``, which is
    raised on instead when ``on_suspect="raise"``), or a failure; the checkpoint is then saved without a certificate
    and never verifies, which is the truth about it."""
    if monitor is None or monitor.closed:
        log.warning("sdc_telemetry: %s saved without a weight certificate: the SDC monitor is not running (before "
                    "training, after it, or after an error), so nothing was checked across replicas", what)
        return None
    try:
        cert = monitor.certificate()
        buffers = tuple(dict.fromkeys((*cert.buffers, *(n for n, _ in monitor.module.named_buffers()
                                                        if n not in cert.fingerprints))))
        return dataclasses.replace(cert, step=step, buffers=buffers)
    except SDCDetected as e:
        if monitor.config.on_suspect == "raise":
            raise
        log.warning("sdc_telemetry: %s saved without a weight certificate: a hardware suspect is open (%s at step "
                    "%d); do not resume from it", what, e.incident.check, e.incident.step)
    except Exception:
        log.exception("sdc_telemetry: %s saved without a weight certificate: certifying failed; training goes on", what)
        try:
            monitor.sinks.internal_error("certificate")
        except Exception:  # counting must not fail the save either
            log.debug("sdc_telemetry: counting the certificate error failed", exc_info=True)
    return None


def write_certificate(directory: str, cert: WeightCertificate | None) -> None:
    """Write ``cert`` as ``sdc_certificate.json`` into ``directory`` (created if needed) atomically, or remove a stale
    one when ``cert`` is None (a checkpoint saved again into the same directory must not keep an old certificate)."""
    path = os.path.join(directory, CERTIFICATE_FILE)
    if cert is None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        return
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{CERTIFICATE_FILE}.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(cert.to_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
