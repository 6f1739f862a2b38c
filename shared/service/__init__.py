"""The skeleton every service runs on: the common `__main__` (`main`: settings, logging, uvloop,
a clean stop) and the bus services' Prometheus endpoint and stream gauges (`telemetry`)."""
