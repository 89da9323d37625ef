"""What every RFC 9457 problem the gateway answers must look like, checked one way suite-wide.

    problem = assert_problem(response, 409, "request-in-progress")

``DOCUMENTED_5XX`` is every 5xx the gateway itself may answer, by problem type slug (README,
"What the client sees"): any other 5xx problem is a bug, whichever suite meets it.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from idempotency_gateway.errors import PROBLEM_TYPE_BASE
from idempotency_gateway.problems import PROBLEM_CONTENT_TYPE

PROBLEM_JSON = PROBLEM_CONTENT_TYPE.decode()
DOCUMENTED_5XX = {
    "store-unavailable": 503,
    "circuit-open": 503,
    "lease-not-confirmed": 503,
    "capacity-exhausted": 503,
    "upstream-unreachable": 502,
    "upstream-connection-lost": 502,
    "upstream-invalid-response": 502,
    "deadline-exhausted": 504,
    "upstream-timeout": 504,
    "outcome-unknown": 504,
    "transfer-coding-not-implemented": 501,
}


def slug_of(problem_type: str) -> str:
    """The slug of one of our problem types (the part after ``PROBLEM_TYPE_BASE``)."""
    assert problem_type.startswith(PROBLEM_TYPE_BASE), problem_type
    return problem_type[len(PROBLEM_TYPE_BASE) :]


def problem_slug(body: bytes) -> str | None:
    """The slug of a body that is one of our problem documents, else ``None``."""
    try:
        document = json.loads(body)
    except ValueError:
        return None
    kind = document.get("type") if isinstance(document, dict) else None
    if isinstance(kind, str) and kind.startswith(PROBLEM_TYPE_BASE):
        return kind[len(PROBLEM_TYPE_BASE) :]
    return None


def assert_problem(
    response: httpx.Response, status: int, slug: str, context: str = ""
) -> dict[str, Any]:
    """``response`` is our problem ``slug`` with ``status``, carrying a title and a detail."""
    assert response.status_code == status, (context, response.text)
    assert response.headers["content-type"] == PROBLEM_JSON, (context, response.headers)
    problem: dict[str, Any] = response.json()
    assert problem["type"] == PROBLEM_TYPE_BASE + slug, (context, problem)
    assert problem["status"] == status, (context, problem)
    for member in ("title", "detail"):
        assert isinstance(problem[member], str), (context, problem)
        assert problem[member], (context, problem)
    return problem
