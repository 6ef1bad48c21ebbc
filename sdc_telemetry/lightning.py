"""Public import path of the lightning integration (``sdc_telemetry.integrations.lightning``)."""

from sdc_telemetry.integrations.lightning import *  # noqa: F403
from sdc_telemetry.integrations.lightning import __all__  # noqa: F401
