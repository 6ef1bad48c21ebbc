"""The checks: measuring (thin tensor code) and deciding (pure functions over gathered plain data).

Checks never import sinks or ops: they return ``Finding``s (``sdc_telemetry.core.findings``) and measurements, and
the monitor hands those on.
"""
