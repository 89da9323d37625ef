"""The HTTP server layer: uvicorn's httptools protocol with the limits an edge needs.

uvicorn bounds neither the request head nor how long a client may take to send it, and stops
reading the body of any request that asks for a protocol upgrade. ``EdgeProtocol`` closes
those gaps before a request reaches the gateway's ASGI app.
"""
