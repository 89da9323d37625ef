"""The bundled example upstream that `idempotency-gateway demo` puts behind the gateway."""
