"""The admin token: every ``/admin/*`` router depends on it."""

import secrets
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from idempotency_gateway.errors import AdminError
from idempotency_gateway.operations.admin.context import Context
from idempotency_gateway.operations.admin.problems import ADMIN_PROBLEMS, refuse_nul

# Declared the FastAPI way, so the OpenAPI document carries the scheme and /docs can call
# /admin/*; auto_error off, because the refusals are ours (404 when the API is off, a 401
# problem with a challenge otherwise). HTTPBearer reads the scheme in any case.
bearer = HTTPBearer(auto_error=False, description="the admin token (GATEWAY_ADMIN_TOKEN)")


def require_token(
    context: Context,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> None:
    if context.admin_token is None:
        raise AdminError(
            "the admin API is off: set GATEWAY_ADMIN_TOKEN to turn it on",
            status=404,
            slug="admin-api-off",
            title="Admin API disabled",
        )
    expected = context.admin_token.get_secret_value().encode()
    offered = b"" if credentials is None else credentials.credentials.encode()
    # Constant time: the comparison must not leak how much of a guess was right. No
    # configured token is empty, so a missing credential never matches.
    if not secrets.compare_digest(offered, expected):
        raise AdminError(
            "send Authorization: Bearer <admin token>",
            status=401,
            slug="unauthorized",
            title="Unauthorized",
        )


def admin_router(tag: str) -> APIRouter:
    """A router for ``/admin/*`` endpoints: the token check, NUL refused, and the problems
    every operation may answer listed in the OpenAPI document."""
    return APIRouter(
        tags=[tag],
        dependencies=[Depends(require_token), Depends(refuse_nul)],
        responses=ADMIN_PROBLEMS,
    )
