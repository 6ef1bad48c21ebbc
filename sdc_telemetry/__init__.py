"""sdc_telemetry: catch silent data corruption inside PyTorch training, name the rank, host and GPU.

>>> import sdc_telemetry as sdc
>>> sdc.SDCConfig(replay_every=50).weights_every
1
"""

from .certificate import WeightCertificate
from .checks.replay import check_shippable
from .config import SDCConfig
from .fingerprint import digest, fingerprint
from .identity import RankIdentity
from .monitor import SDCMonitor
from .observer import Observer, ReplayDeltas, StepReport
from .response import EXIT_SDC, Incident, SDCDetected
from .step import StepContext

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
