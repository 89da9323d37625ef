"""``Lease``: how long an owner may act on a record without asking the database again.

The classic lease rule. The database grants (reserve, take-over) or extends (renewal) a lease
of ``length`` seconds on its own clock, at some instant after the owner sent the statement.
So the owner may trust the lease without a round trip only until

    sent_at + length - margin

where ``sent_at`` is read on the owner's own lease clock *before* sending that statement,
and the margin (``MARGIN_FRACTION`` of the lease) absorbs the rate at which two clocks may
drift apart over one lease. A stall of any kind (a GC pause, SIGSTOP, a frozen VM, a
starved CPU, a partitioned database link) shows up as elapsed time on that clock, so a
stalled owner finds out it may no longer trust its lease before it sends anything.

Past that, ``confirm()`` extends the lease in one compare-and-set on owner id and fencing
token, judged by the database's clock (``RecordStore.renew_lease``). Fenced, unreachable or
too slow: ``LeaseNotConfirmed``, and the lease stays untrusted until a confirmation succeeds.
Fenced is for good.
"""

from __future__ import annotations

import asyncio
import logging

from idempotency_gateway.clock import Monotonic, lease_clock
from idempotency_gateway.errors import LeaseNotConfirmed, StoreUnavailable
from idempotency_gateway.storage.base import RecordStore
from idempotency_gateway.storage.records import Fence, RecordKey

log = logging.getLogger(__name__)

# The part of a lease an owner never counts on: a fifth, so a lease of 30 s is trusted for
# 24 s after the statement that granted it was sent.
MARGIN_FRACTION = 0.2


class Lease:
    """One execution's lease on its record, as its owner knows it.

    Arguments:
        store: where the record lives.
        key: the record.
        fence: the owner id and fencing token the lease was granted to.
        length: the lease in seconds, as granted and renewed.
        sent_at: the lease clock's reading taken before the granting statement was sent.
        clock: the lease clock (tests move it by hand).
    """

    def __init__(
        self,
        store: RecordStore,
        key: RecordKey,
        fence: Fence,
        *,
        length: float,
        sent_at: float,
        clock: Monotonic = lease_clock,
    ) -> None:
        self.store = store
        self.key = key
        self.fence = fence
        self.length = length
        self.margin = length * MARGIN_FRACTION
        self._clock = clock
        self._trusted_until = sent_at + length - self.margin
        # When the lease granted last runs out, counted without the margin: until then no
        # other owner can take the record, so an owner's write is worth trying again.
        self._granted_until = sent_at + length
        self.fenced = False

    def is_trusted(self) -> bool:
        return not self.fenced and self._clock() < self._trusted_until

    def remaining(self) -> float:
        """Seconds until the lease granted last runs out (negative once it has)."""
        return self._granted_until - self._clock()

    def check(self) -> None:
        """Raise ``LeaseNotConfirmed`` unless the lease may be trusted right now: called
        just before the bytes of an attempt are written."""
        if not self.is_trusted():
            raise self._refusal("the lease is no longer confirmed")

    async def confirm(self, *, fresh: bool = False) -> None:
        """Make sure the lease may be trusted: no I/O while it is (unless ``fresh``, after a
        pause), else one renewal. Raises ``LeaseNotConfirmed`` when that fails."""
        if self.fenced:
            raise self._refusal("another owner took the record over")
        if fresh or not self.is_trusted():
            await self.renew()
            if not self.is_trusted():
                # The renewal's answer came back later than the lease it granted could be
                # trusted: it extended nothing usable.
                raise self._refusal("the lease renewal answered too late")

    async def renew(self) -> None:
        """One compare-and-set renewal; on success the lease is trusted again from the
        moment it was sent. Waits no longer than the trusted part of the lease: a later
        answer could not be trusted anyway."""
        sent_at = self._clock()
        try:
            async with asyncio.timeout(self.length - self.margin):
                renewed = await self.store.renew_lease(self.key, self.fence, lease=self.length)
        except StoreUnavailable as exc:
            # A failed renewal is a failed renewal: nothing more goes out until one succeeds.
            self._trusted_until = float("-inf")
            raise self._refusal(f"the lease could not be renewed: {exc.detail}") from exc
        except TimeoutError as exc:
            self._trusted_until = float("-inf")
            raise self._refusal("the lease renewal was not answered in time") from exc
        if not renewed:
            self.fenced = True
            raise self._refusal("another owner took the record over")
        # max: a renewal sent earlier that answers last must not shorten a later one's trust.
        self._trusted_until = max(self._trusted_until, sent_at + self.length - self.margin)
        self._granted_until = max(self._granted_until, sent_at + self.length)

    def _refusal(self, why: str) -> LeaseNotConfirmed:
        return LeaseNotConfirmed(
            f"{why}; this attempt was not sent upstream. Retry with the same key to get the "
            "answer of record",
            fenced=self.fenced,
        )
