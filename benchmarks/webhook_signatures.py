"""CPU per webhook signature verification, per scheme and body size.

    .venv/bin/python -m benchmarks.webhook_signatures [--runs 2000]

Each scheme's verifier as a webhook route runs it (``webhooks/``), on one secret, against a
delivery signed by the sender's code (tests/support/webhooks.py), beside the floor: one
HMAC-SHA256 of the same bytes. Standard Webhooks is verified by the ``standardwebhooks``
package, which decodes the body to text and re-encodes it before signing; that copy is what
it costs beyond the floor. CPU time (``time.process_time``), median of five batches.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import statistics
import time
from collections.abc import Callable

from idempotency_gateway.asgi import Headers
from idempotency_gateway.webhooks.github import GitHubSignature
from idempotency_gateway.webhooks.standard import StandardWebhooksSignature
from idempotency_gateway.webhooks.stripe import StripeSignature
from tests.support.webhooks import (
    GITHUB_SECRET,
    STANDARD_SECRET,
    STRIPE_SECRET,
    github_signature,
    standard_headers,
    stripe_signature,
)

SIZES = {"1 KiB": 1024, "64 KiB": 64 * 1024, "1 MiB": 1024 * 1024}


def _encoded(headers: dict[str, str]) -> Headers:
    return [(name.encode(), value.encode()) for name, value in headers.items()]


def _cases(body: bytes) -> dict[str, Callable[[], object]]:
    standard = StandardWebhooksSignature([STANDARD_SECRET], tolerance=300.0)
    standard_fields = _encoded(standard_headers(STANDARD_SECRET, "msg_1", body))
    github = GitHubSignature([GITHUB_SECRET])
    github_fields = _encoded({"x-hub-signature-256": github_signature(GITHUB_SECRET, body)})
    stripe = StripeSignature([STRIPE_SECRET], tolerance=300.0)
    stripe_fields = _encoded({"stripe-signature": stripe_signature(STRIPE_SECRET, body)})
    key = GITHUB_SECRET.encode()
    return {
        "one HMAC-SHA256 (floor)": lambda: hmac.new(key, body, hashlib.sha256).digest(),
        "standard-webhooks": lambda: standard.verify(standard_fields, body),
        "github": lambda: github.verify(github_fields, body),
        "stripe": lambda: stripe.verify(stripe_fields, body),
    }


def _per_call(run: Callable[[], object], runs: int) -> float:
    batches = []
    for _ in range(5):
        started = time.process_time()
        for _ in range(runs):
            run()
        batches.append((time.process_time() - started) / runs)
    return statistics.median(batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000, help="calls per batch at 1 KiB")
    args = parser.parse_args()
    print("| verifier | " + " | ".join(SIZES) + " |")
    print("|---|" + "---:|" * len(SIZES))
    rows: dict[str, list[str]] = {}
    for size in SIZES.values():
        body = b'{"data": "' + b"x" * (size - 12) + b'"}'
        runs = max(20, args.runs * 1024 // size)
        for name, run in _cases(body).items():
            rows.setdefault(name, []).append(f"{_per_call(run, runs) * 1e6:,.1f} µs")
    for name, cells in rows.items():
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
