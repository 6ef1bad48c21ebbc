"""Where a step's result goes: telemetry (OpenTelemetry, the Prometheus endpoint, NVML), the incident log and the
Alertmanager pager. Built outside the monitor and handed to it."""
