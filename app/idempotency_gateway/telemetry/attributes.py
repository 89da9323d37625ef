"""What a span attribute may hold: the value types OpenTelemetry accepts that the gateway uses.

A module of its own so that ``tracing`` (the hooks) and ``otel`` (the OpenTelemetry side, which
``tracing.enable`` imports) both name it without importing each other.
"""

AttributeValue = str | bool | int | float
