"""sdc_telemetry: catch silent data corruption inside PyTorch training, name the rank, host and GPU.

>>> import sdc_telemetry as sdc
>>> sdc.SDCConfig(replay_every=50).weights_every
1

The stop recipe, one line around any training loop (a function or not): on ``SDCDetected`` every rank closes the
monitor and exits with ``sdc.EXIT_SDC`` (75), also when the launcher sends SIGTERM to ranks still stopping::

    monitor = sdc.SDCMonitor(model, optimizer, loss_fn=compute_loss, config=sdc.SDCConfig(on_suspect="raise"))
    with sdc.exit_on_sdc(monitor):          # or sdc.exit_on_sdc(trainer) / (callback) for HF and Lightning
        for batch in loader:
            with monitor.step(batch) as step:
                step.backward(compute_loss(model, batch))
            optimizer.step()
            optimizer.zero_grad()
"""

from sdc_telemetry.checks.replay import check_shippable
from sdc_telemetry.core.certificate import WeightCertificate
from sdc_telemetry.core.config import SDCConfig
from sdc_telemetry.core.fingerprint import digest, fingerprint
from sdc_telemetry.core.identity import RankIdentity
from sdc_telemetry.core.incident import EXIT_SDC, Incident, SDCDetected
from sdc_telemetry.monitor import SDCMonitor
from sdc_telemetry.sinks.observer import Observer, ReplayDeltas, StepReport
from sdc_telemetry.step import StepContext
from sdc_telemetry.stop import exit_on_sdc

__all__ = [
    "EXIT_SDC",
    "Incident",
    "Observer",
    "RankIdentity",
    "ReplayDeltas",
    "SDCConfig",
    "SDCDetected",
    "SDCMonitor",
    "StepContext",
    "StepReport",
    "WeightCertificate",
    "check_shippable",
    "digest",
    "exit_on_sdc",
    "fingerprint",
]

__version__ = "0.1.0"
