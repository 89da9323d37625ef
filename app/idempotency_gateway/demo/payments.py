"""A tiny in-memory payments API, the upstream behind `idempotency-gateway demo`.

It exists to make the gateway's guarantees visible: every charge records the
`Idempotency-Key` and `Idempotency-Fencing-Token` the gateway forwarded, and
`/v1/stats` counts how often the charge handler really ran, so a retried request
that the gateway replayed shows up as *no* new execution.
"""

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import FastAPI, Header, HTTPException, status
from pydantic import BaseModel, Field

# A client-chosen sleep must not be able to pin a handler (and the gateway's lease) for long.
MAX_DEMO_DELAY_SECONDS = 30.0


class ChargeRequest(BaseModel):
    # strict: a payments API should not quietly turn "100", 99.5 or true into an amount.
    amount: Annotated[int, Field(gt=0, strict=True)]
    currency: Annotated[str, Field(pattern=r"^[A-Za-z]{3}$")]


class Charge(BaseModel):
    id: str
    object: str = "charge"
    amount: int
    currency: str
    created: int
    # Kept verbatim (not parsed) so the demo shows exactly what the gateway forwarded.
    idempotency_key: str | None
    fencing_token: str | None


class Stats(BaseModel):
    executions: int
    charges: int


@dataclass
class Ledger:
    """All mutable state of one app instance, so two apps (or two tests) never share charges."""

    charges: dict[str, Charge] = field(default_factory=dict)
    executions: int = 0


def create_payments_app() -> FastAPI:
    app = FastAPI(title="Demo payments API", version="1")
    ledger = Ledger()
    # Exposed on app.state so the CLI and tests can inspect it; the routes close over the
    # same object to keep it typed (app.state attributes are Any).
    app.state.ledger = ledger

    @app.post("/v1/charges", status_code=status.HTTP_201_CREATED)
    async def create_charge(
        body: ChargeRequest,
        idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
        fencing_token: Annotated[str | None, Header(alias="Idempotency-Fencing-Token")] = None,
        demo_delay: Annotated[float | None, Header(alias="X-Demo-Delay", ge=0)] = None,
    ) -> Charge:
        # Counted before the delay: a request that is cancelled while sleeping still reached
        # the upstream, which is exactly what the gateway must prevent from happening twice.
        ledger.executions += 1
        if demo_delay:
            # The delay keeps the first request in flight so the demo can show the gateway
            # answering a concurrent duplicate with 409.
            await asyncio.sleep(min(demo_delay, MAX_DEMO_DELAY_SECONDS))
        charge = Charge(
            id=f"ch_{secrets.token_hex(6)}",
            amount=body.amount,
            currency=body.currency,
            created=int(time.time()),
            idempotency_key=idempotency_key,
            fencing_token=fencing_token,
        )
        ledger.charges[charge.id] = charge
        return charge

    @app.get("/v1/charges/{charge_id}")
    async def get_charge(charge_id: str) -> Charge:
        charge = ledger.charges.get(charge_id)
        if charge is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail="no such charge")
        return charge

    @app.get("/v1/stats")
    async def stats() -> Stats:
        return Stats(executions=ledger.executions, charges=len(ledger.charges))

    return app
