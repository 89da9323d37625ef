# syntax=docker/dockerfile:1
#
# The idempotency gateway: a wheel built from pyproject.toml, installed into a virtualenv,
# and only that virtualenv in the runtime image.
#
#   docker build -t idempotency-gateway .
#   docker run --rm -p 8080:8080 -p 8081:8081 \
#       -e GATEWAY_DATABASE_URL=postgresql://user:password@db:5432/gateway \
#       -e GATEWAY_SCOPE_SECRET="$(openssl rand -hex 32)" \
#       -e GATEWAY_MIGRATE_ON_START=1 \
#       -v "$PWD/gateway.yaml:/etc/idempotency-gateway/gateway.yaml:ro" idempotency-gateway
#
# Proxy port 8080, admin port 8081 (/healthz, /readyz, /metrics, /admin/*, /docs).

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
WORKDIR /src
# Only what the wheel is built from (hatchling reads README.md for the long description;
# the migrations are force-included into the wheel as idempotency_gateway/migrations).
COPY pyproject.toml README.md ./
COPY app/ app/
COPY migrations/ migrations/
# The extras the standalone gateway runs with: the server (uvicorn, FastAPI for the admin
# API), both PostgreSQL and Redis (picked at run time by GATEWAY_DATABASE_URL and
# GATEWAY_REDIS_URL). Not [all]: the client helper's httpx is never imported by the gateway,
# and tracing stays out of the image, as it is off by default.
RUN /opt/venv/bin/pip wheel --no-deps --wheel-dir /tmp/dist . \
    && wheel="$(echo /tmp/dist/*.whl)" \
    && /opt/venv/bin/pip install "${wheel}[server,postgres,redis]" \
    && /opt/venv/bin/idempotency-gateway --help >/dev/null

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="idempotency-gateway" \
      org.opencontainers.image.description="Retried requests never execute twice." \
      org.opencontainers.image.licenses="Apache-2.0"
# GATEWAY_ADMIN_PORT is the port the HEALTHCHECK probes (and the CLI's admin port when
# --admin-port is not given): if you move the admin listener, set it to the same port.
ENV PATH="/opt/venv/bin:${PATH}" \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    GATEWAY_ADMIN_PORT=8081
# A fixed numeric uid, so Kubernetes' runAsNonRoot can check it; the working directory is
# the only writable place the gateway needs (the embedded SQLite store when no
# GATEWAY_DATABASE_URL is set; metrics of `--workers N` go to $TMPDIR).
RUN groupadd --system --gid 10001 gateway \
    && useradd --system --uid 10001 --gid gateway --no-create-home \
        --home-dir /var/lib/idempotency-gateway --shell /usr/sbin/nologin gateway \
    && install -d -o gateway -g gateway /var/lib/idempotency-gateway
COPY --from=builder /opt/venv /opt/venv
COPY --chmod=0755 deploy/docker-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
# A default config (the docker-compose example); mount your own over it.
COPY deploy/compose/gateway.yaml /etc/idempotency-gateway/gateway.yaml
WORKDIR /var/lib/idempotency-gateway
USER 10001:10001
EXPOSE 8080 8081
# python:slim has no curl: the check is the interpreter's own urllib (no proxy: the admin
# port is on this host), and any answer but 2xx, or none within 3 s, fails it.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:%s/healthz' % os.environ.get('GATEWAY_ADMIN_PORT', '8081'), timeout=3)"]
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8080", "--admin-port", "8081", "--config", "/etc/idempotency-gateway/gateway.yaml"]
