"""Webhook senders' signature schemes and the JSON Pointer that finds a delivery id in a body.

Pure: each scheme checks the raw bytes and headers it is given against the route's secrets and
raises ``WebhookSignatureInvalid``; what a verified delivery then becomes (its key and scope)
is ``idempotency/webhooks.py``'s.
"""
