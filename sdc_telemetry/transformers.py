"""Public import path of the transformers integration (``sdc_telemetry.integrations.transformers``)."""

from sdc_telemetry.integrations.transformers import *  # noqa: F403
from sdc_telemetry.integrations.transformers import __all__  # noqa: F401
