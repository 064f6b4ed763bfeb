"""Observability of SpecServe: the acceptance-drift detector (pure, :mod:`monitoring.drift`).

OpenTelemetry setup, the monitor actor and alert sinks build on the pure parts and live
beside them; nothing in this package is imported by ``specdec``.
"""
