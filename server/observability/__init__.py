"""What operators read of a running server beside its metrics: its log lines (``logs``: text or one
JSON object a line) and its traces (``tracing``: OpenTelemetry spans over OTLP/HTTP)."""
