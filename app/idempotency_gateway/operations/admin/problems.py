"""Every admin refusal is an RFC 9457 problem, and the OpenAPI document lists them."""

from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from idempotency_gateway.errors import AdminError, GatewayError
from idempotency_gateway.problems import CHALLENGE, problem_body


class Problem(BaseModel):
    """An RFC 9457 problem document, as every admin error is answered."""

    type: str
    title: str
    status: int
    detail: str
    retryable: bool
    request_id: str | None = None


def _problems(**described: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for problem answers, so the document lists every status sent."""
    content = {"application/problem+json": {"schema": Problem.model_json_schema()}}
    return {
        int(status.removeprefix("s")): {"description": text, "content": content}
        for status, text in described.items()
    }


# What every /admin/* operation may answer besides its success (the token check, validation,
# a missing record or upstream, a store or cache that does not answer).
ADMIN_PROBLEMS = _problems(
    s401="the admin token is missing or wrong",
    s404="the admin API is off, or no such record or upstream",
    s422="invalid parameters",
    s503="the store or the replay cache does not answer",
)


def not_found(detail: str) -> AdminError:
    return AdminError(detail, status=404, slug="not-found", title="Not found")


def invalid(detail: str) -> AdminError:
    return AdminError(detail, status=422, slug="invalid-admin-request", title="Invalid request")


def refuse_nul(request: Request) -> None:
    """PostgreSQL text cannot hold NUL: refuse it here (422) instead of failing the store (503)."""
    values = [request.url.path, *request.path_params.values(), *request.query_params.values()]
    if any("\x00" in str(value) for value in values):
        raise invalid("a path or query parameter holds a NUL character (%00)")


# Starlette's own refusals (unknown path, wrong method), as problems of our tree.
_ROUTING_PROBLEMS = {
    404: ("not-found", "Not found", "no admin endpoint at this path"),
    405: ("method-not-allowed", "Method not allowed", "this endpoint does not take that method"),
}


def _routing_problem(error: HTTPException) -> AdminError:
    slug, title, detail = _ROUTING_PROBLEMS.get(
        error.status_code, ("http-error", "HTTP error", str(error.detail))
    )
    return AdminError(detail, status=error.status_code, slug=slug, title=title)


def _problem_response(error: GatewayError, headers: dict[str, str] | None = None) -> Response:
    return Response(
        problem_body(error, request_id=None),
        status_code=error.status,
        media_type="application/problem+json",
        headers=headers,
    )


async def _gateway_error(_request: Request, error: Exception) -> Response:
    assert isinstance(error, GatewayError)
    headers = {}
    if error.status == 401:
        headers["WWW-Authenticate"] = CHALLENGE.decode()
    if error.retry_after is not None:
        headers["Retry-After"] = str(error.retry_after)
    return _problem_response(error, headers)


async def _routing_error(_request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    # Keeps Allow on a 405: the client learns which methods the endpoint takes.
    return _problem_response(
        _routing_problem(error), dict(error.headers) if error.headers else None
    )


async def _invalid_request(_request: Request, error: Exception) -> Response:
    assert isinstance(error, RequestValidationError)
    problems = "; ".join(
        f"{'.'.join(str(part) for part in item['loc'])}: {item['msg']}" for item in error.errors()
    )
    return _problem_response(invalid(problems))


def answer_with_problems(app: FastAPI) -> None:
    """Our errors, Starlette's routing refusals and FastAPI's validation errors, all as
    problems."""
    app.add_exception_handler(GatewayError, _gateway_error)
    app.add_exception_handler(HTTPException, _routing_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
