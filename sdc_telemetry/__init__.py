"""sdc_telemetry: catch silent data corruption inside PyTorch training, name the rank, host and GPU.

>>> import sdc_telemetry as sdc
>>> sdc.SDCConfig(replay_every=50).weights_every
1
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
    "fingerprint",
]

__version__ = "0.1.0"
