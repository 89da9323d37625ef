"""The fast path before the store: replay caches (in process, Redis) and wake-ups."""
