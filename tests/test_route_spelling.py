"""Route policy by spelling: a route matches every spelling its upstream routes alike.

Express, ASP.NET Core and IIS route ``/V1/Charges`` to the ``/v1/charges`` handler, Rails
routes ``/v1/charges.json`` and ``/v1/charges.`` there too. The gateway's policy must match at
least as broadly (case folded unless ``match.case_sensitive``; format suffixes with
``match.format_suffixes``), and the operation is named in that one spelling, so one key sent
in several spellings executes once.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from idempotency_gateway.cli import main
from idempotency_gateway.config import ConfigError, IdempotencyConfig, RouteMatch
from idempotency_gateway.idempotency.policy import RoutePolicy, resolver_for
from idempotency_gateway.main import create_gateway
from idempotency_gateway.routing import PrefixRouter, folded, route_collisions, spelled
from idempotency_gateway.target import RequestTarget
from tests.support.gateway import GatewayLauncher, RunningGateway, gateway_config, route
from tests.support.problems import problem_slug
from tests.support.upstream import RecordingUpstream

CHARGE = {"amount": "100"}


def _route(prefix: str, *, name: str | None = None, **match: Any) -> dict[str, Any]:
    entry = route(prefix, name=name, key="required", anonymous="refuse")
    entry["match"].update(match)
    return entry


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/V1/Charges", "/v1/charges"),
        ("/v1/CAF%C3%89", "/v1/caf%C3%A9"),  # É -> é, in upper-case hex again
        ("/v1/STRA%C3%9FE", "/v1/strasse"),  # ß folds to ss
        ("/v1/%E2%84%AA", "/v1/k"),  # the Kelvin sign folds to k
        ("/v1/%C4%B1nvoices", "/v1/invoices"),  # ASP.NET and Java read the dotless i as I
        ("/v1/%C5%BFessions", "/v1/sessions"),  # and the long s as S
        ("/v1/%C4%B0nvoices", "/v1/invoices"),  # Java's lower case of the dotted I is i
        ("/v1/A%3AB", "/v1/a%3Ab"),  # an encoded ASCII octet keeps its hex
        ("/v1/%FF%C3", "/v1/%FF%C3"),  # octets that are not UTF-8 stay as they are
    ],
)
def test_folded_spelling(path: str, expected: str) -> None:
    assert folded(path) == expected


def test_folding_keeps_distinct_octets_apart() -> None:
    assert folded("/x/%FF") != folded("/x/%FE")
    assert folded("/x/%3A") != folded("/x/:")


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/v1/charges.json", "/v1/charges"),
        ("/v1/charges.", "/v1/charges"),
        ("/v1/Charges.JSON;x=1", "/v1/charges"),
        ("/v1/charges/ch_1.xml", "/v1/charges/ch_1"),
        ("/v1/charges.json/", "/v1/charges"),  # Rails drops the trailing slash
        ("/v1/.well-known", "/v1/.well-known"),  # a leading dot is no suffix
        ("/v1/a.b/c", "/v1/a.b/c"),  # only the last segment
    ],
)
def test_format_suffix_spelling(path: str, expected: str) -> None:
    assert spelled(path, RouteMatch(path_prefix="/", format_suffixes=True)) == expected


def test_router_matches_spellings_by_route() -> None:
    router = PrefixRouter(
        [
            (RouteMatch(path_prefix="/v1/charges", format_suffixes=True), "charges"),
            (RouteMatch(path_prefix="/v1/Refunds", case_sensitive=True), "refunds"),
            (RouteMatch(path_prefix="/v1/caf\u00e9"), "cafe"),
            (RouteMatch(path_prefix="/"), "root"),
        ]
    )
    for path in (
        "/V1/CHARGES",
        "/v1/charges.json",
        "/v1/Charges.",
        "/v1/charges/ch_1.json",
        "/v1/charges.json/",
        "/v1/charges;jsessionid=1.json",
    ):
        assert router.match(path) == "charges", path
    assert router.match("/v1/chargesX") == "root"
    assert router.match("/v1/Refunds/re_1") == "refunds"
    assert router.match("/v1/refunds") == "root"
    assert router.match("/v1/CAF%C3%89/x") == "cafe"


def test_the_operation_is_named_in_the_routes_spelling() -> None:
    suffixes = RouteMatch(path_prefix="/v1/charges", format_suffixes=True)
    policy = RoutePolicy("charges", IdempotencyConfig(), suffixes)
    assert policy.operation("POST", RequestTarget(b"/V1/Charges.json;x=1", b"")) == (
        "POST /v1/charges"
    )
    exact = RoutePolicy(
        "exact", IdempotencyConfig(), RouteMatch(path_prefix="/", case_sensitive=True)
    )
    assert exact.operation("POST", RequestTarget(b"/V1/Charges", b"")) == "POST /V1/Charges"
    # Express, Rails and ASP.NET Core run /v1/charges/ as /v1/charges, whatever the case rule.
    assert exact.operation("POST", RequestTarget(b"/V1/Charges/", b"")) == "POST /V1/Charges"
    assert exact.operation("POST", RequestTarget(b"/v1/charges/;x", b"")) == "POST /v1/charges"
    assert exact.operation("POST", RequestTarget(b"/", b"")) == "POST /"


def test_a_library_users_prefix_map_matches_every_case() -> None:
    resolve = resolver_for({"/v1/charges": IdempotencyConfig(key="required")})
    policy = resolve(RequestTarget(b"/V1/CHARGES", b""))
    assert policy is not None
    assert policy.operation("POST", RequestTarget(b"/V1/CHARGES", b"")) == "POST /v1/charges"


@pytest.mark.parametrize(
    ("first", "second", "collide"),
    [
        ({"path_prefix": "/v1/charges"}, {"path_prefix": "/V1/Charges/"}, True),
        ({"path_prefix": "/v1/caf\u00e9"}, {"path_prefix": "/v1/CAF%C3%89"}, True),
        ({"path_prefix": "/v1/x/../charges"}, {"path_prefix": "/v1/charges"}, True),
        (
            {"path_prefix": "/v1/charges", "case_sensitive": True},
            {"path_prefix": "/V1/Charges"},
            True,
        ),
        (
            {"path_prefix": "/v1/charges", "case_sensitive": True},
            {"path_prefix": "/V1/Charges", "case_sensitive": True},
            False,
        ),
        ({"path_prefix": "/v1/charges"}, {"path_prefix": "/v1/charges.json"}, False),
    ],
)
def test_colliding_routes(first: dict[str, Any], second: dict[str, Any], collide: bool) -> None:
    config = gateway_config(
        "http://127.0.0.1:1",
        routes=[
            {"name": "a", "match": first, "upstream": "primary"},
            {"name": "b", "match": second, "upstream": "primary"},
        ],
    )
    assert bool(route_collisions(config.routes)) is collide


def test_check_config_and_create_gateway_refuse_colliding_routes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    routes = [_route("/v1/charges", name="charges"), _route("/V1/CHARGES", name="shouting")]
    config_file = tmp_path / "gateway.yaml"
    config_file.write_text(
        yaml.safe_dump({"upstreams": {"primary": {"url": "http://127.0.0.1:1"}}, "routes": routes})
    )

    assert main(["check-config", str(config_file)]) == 2
    error = capsys.readouterr().err
    assert "'charges' and 'shouting' match the same paths" in error
    with pytest.raises(ConfigError, match="match the same paths"):
        create_gateway(gateway_config("http://127.0.0.1:1", routes=routes))


@pytest.fixture
async def gateway(upstream: RecordingUpstream, postgres_url: str) -> AsyncIterator[RunningGateway]:
    config = gateway_config(
        upstream.url,
        routes=[
            _route("/v1/charges", format_suffixes=True),
            _route("/v1/caf\u00e9", name="cafe"),
            _route("/v1/Refunds", name="refunds", case_sensitive=True),
            route("/", key="off"),
        ],
    )
    async with GatewayLauncher() as launcher:
        yield await launcher.start(config, database_url=postgres_url)


@pytest.mark.parametrize(
    "path",
    [
        "/V1/Charges",
        "/v1/CHARGES",
        "/v1/charges.json",
        "/v1/charges.",
        "/v1/charges.json/",
        "/v1/charges%2Ejson",
        "/v1/CAF%C3%89",
    ],
)
async def test_an_unkeyed_request_in_another_spelling_gets_the_policy(
    gateway: RunningGateway, upstream: RecordingUpstream, path: str
) -> None:
    response = await gateway.client.post(path, json=CHARGE, headers={"Authorization": "Bearer a"})
    assert response.status_code == 400
    assert problem_slug(response.content) == "idempotency-key-missing"
    anonymous = await gateway.client.post(path, json=CHARGE, headers={"Idempotency-Key": "k"})
    assert anonymous.status_code == 401
    assert upstream.executions == []


async def test_a_case_sensitive_route_leaves_other_spellings_to_other_routes(
    gateway: RunningGateway, upstream: RecordingUpstream
) -> None:
    response = await gateway.client.post("/v1/refunds", json=CHARGE)
    assert response.status_code == 201
    refused = await gateway.client.post("/v1/Refunds", json=CHARGE)
    assert refused.status_code == 400
    assert [execution.path for execution in upstream.executions] == ["/v1/refunds"]


async def test_one_key_in_several_spellings_executes_once(
    gateway: RunningGateway, upstream: RecordingUpstream
) -> None:
    headers = {"Idempotency-Key": str(uuid.uuid4()), "Authorization": f"Bearer {uuid.uuid4()}"}
    first = await gateway.client.post("/v1/charges", json=CHARGE, headers=headers)
    assert first.status_code == 201
    again = await gateway.client.post("/v1/charges", json=CHARGE, headers=headers)
    assert again.headers["idempotent-replayed"] == "true"
    for path in (
        "/V1/Charges",
        "/v1/charges.json",
        "/v1/CHARGES.",
        "/v1/charges/",
        "/v1/charges.json/",
        "/v1/charges/;jsessionid=1",
    ):
        other = await gateway.client.post(path, json=CHARGE, headers=headers)
        # One operation: the record of the first; the path as sent differs, so a 422.
        assert other.status_code == 422, path
        assert problem_slug(other.content) == "idempotency-key-reused"
    assert len(upstream.executions) == 1
