"""Public import path of the Megatron-core integration (``sdc_telemetry.integrations.megatron``)."""

from sdc_telemetry.integrations.megatron import *  # noqa: F403
from sdc_telemetry.integrations.megatron import __all__  # noqa: F401
