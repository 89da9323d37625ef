"""The demo upstream must behave predictably, or the demo would blame the gateway for its bugs."""

from collections.abc import AsyncIterator

import httpx
import pytest

from idempotency_gateway.demo.payments import create_payments_app


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    # A fresh app per test: state lives on the app instance, so tests cannot leak charges.
    transport = httpx.ASGITransport(app=create_payments_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://demo") as client:
        yield client


async def test_create_then_fetch_charge(client: httpx.AsyncClient) -> None:
    created = await client.post(
        "/v1/charges",
        json={"amount": 1250, "currency": "EUR"},
        headers={"Idempotency-Key": "order-42", "Idempotency-Fencing-Token": "3"},
    )
    assert created.status_code == 201
    charge = created.json()
    assert charge["id"].startswith("ch_")
    assert len(charge["id"]) == len("ch_") + 12
    assert charge["amount"] == 1250
    assert charge["currency"] == "EUR"
    assert charge["idempotency_key"] == "order-42"
    assert charge["fencing_token"] == "3"

    fetched = await client.get(f"/v1/charges/{charge['id']}")
    assert fetched.status_code == 200
    assert fetched.json() == charge


async def test_unknown_charge_is_404(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/charges/ch_000000000000")
    assert response.status_code == 404


@pytest.mark.parametrize(
    "body",
    [
        {"amount": 0, "currency": "EUR"},
        {"amount": "100", "currency": "EUR"},
        {"amount": 100, "currency": "EURO"},
        {"currency": "EUR"},
    ],
)
async def test_invalid_body_is_422(client: httpx.AsyncClient, body: dict[str, object]) -> None:
    response = await client.post("/v1/charges", json=body)
    assert response.status_code == 422


async def test_stats_count_executions_and_charges(client: httpx.AsyncClient) -> None:
    for _ in range(2):
        response = await client.post(
            "/v1/charges",
            json={"amount": 100, "currency": "usd"},
            headers={"X-Demo-Delay": "0.01"},
        )
        assert response.status_code == 201
    # A rejected body never reaches the handler, so it must not count as an execution.
    await client.post("/v1/charges", json={"amount": -1, "currency": "usd"})

    stats = await client.get("/v1/stats")
    assert stats.json() == {"executions": 2, "charges": 2}
