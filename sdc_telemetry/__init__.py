"""sdc_telemetry: catch silent data corruption inside PyTorch DDP training, name the rank, host and GPU.

>>> import sdc_telemetry as sdc
>>> sdc.SDCConfig(replay_every=50).weights_every
1
"""

from .checks.replay import check_shippable
from .config import SDCConfig
from .fingerprint import fingerprint
from .identity import RankIdentity
from .monitor import SDCMonitor
from .observer import Observer
from .response import Incident, SDCDetected
from .step import StepContext

__all__ = [
    "Incident",
    "Observer",
    "RankIdentity",
    "SDCConfig",
    "SDCDetected",
    "SDCMonitor",
    "StepContext",
    "check_shippable",
    "fingerprint",
]

__version__ = "0.1.0"
