"""Public import path of the Accelerate integration (``sdc_telemetry.integrations.accelerate``)."""

from sdc_telemetry.integrations.accelerate import *  # noqa: F403
from sdc_telemetry.integrations.accelerate import __all__  # noqa: F401
