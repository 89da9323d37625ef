#!/bin/sh
# The image's entrypoint: `idempotency-gateway` with the container's arguments.
#
# With GATEWAY_MIGRATE_ON_START=1 a `serve` first runs `migrate`, waiting up to
# GATEWAY_MIGRATE_WAIT seconds (default 60) for the database to accept connections. Use it
# for a single gateway (docker run, a small compose file); with several replicas run one
# migration job instead (docker-compose.yml and deploy/k8s/ do), so replicas never race on DDL.
set -eu

if [ "${GATEWAY_MIGRATE_ON_START:-0}" = "1" ] && [ "${1:-}" = "serve" ]; then
    idempotency-gateway migrate --wait "${GATEWAY_MIGRATE_WAIT:-60}"
fi

# exec: the gateway becomes this process and receives SIGTERM itself, so it drains.
exec idempotency-gateway "$@"
