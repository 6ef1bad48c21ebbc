"""Public import path of the DeepSpeed integration (``sdc_telemetry.integrations.deepspeed``)."""

from sdc_telemetry.integrations.deepspeed import *  # noqa: F403
from sdc_telemetry.integrations.deepspeed import __all__  # noqa: F401
