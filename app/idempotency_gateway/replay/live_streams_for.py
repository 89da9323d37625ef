"""``live_streams_for``: where a gateway's live streams are kept, by whether it has Redis.

A module of its own because it names both kinds: ``redis_live_streams`` builds on
``live_streams``, so the choice between them can live in neither.
"""

from __future__ import annotations

from idempotency_gateway.replay.live_streams import LiveStreams, LocalLiveStreams


def live_streams_for(redis_url: str | None) -> LiveStreams:
    """Through Redis when the gateway has one, else within this process."""
    if redis_url is None:
        return LocalLiveStreams()
    # Imported here: only a gateway with a Redis URL needs redis-py.
    from idempotency_gateway.replay.redis_live_streams import redis_live_streams

    return redis_live_streams(redis_url)
