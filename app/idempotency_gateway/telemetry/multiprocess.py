"""Metrics across worker processes: set up before prometheus_client is first imported."""

from __future__ import annotations

import os
import tempfile

MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"


def prepare_metrics_directory() -> str:
    """A fresh directory for the workers' metric files; a scrape of any worker sums them."""
    directory = tempfile.mkdtemp(prefix="idempotency-gateway-metrics-")
    os.environ[MULTIPROCESS_ENV] = directory
    return directory
