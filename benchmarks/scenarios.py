"""What a run measures: the servers, the scenarios on each, and the targets between them.

Scenarios run server by server, in the order of ``SERVERS``; each server is started once, its
scenarios run, and it is stopped. Every scenario names its baseline (another scenario of the
same run) and the ratio of their throughputs is reported.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.loadgen import Load
from benchmarks.servers import ServerSpec

HELLO = "benchmarks.hello_app:app"
UPSTREAM = ServerSpec("upstream", "upstream direct", "upstream")
SERVERS: tuple[ServerSpec, ...] = (
    UPSTREAM,
    ServerSpec("nginx-proxy", "nginx proxy_pass (1 worker)", "nginx-proxy"),
    ServerSpec("minimal-proxy", "minimal aiohttp proxy (1 worker)", "asgi-app"),
    ServerSpec(
        "minimal-proxy-granian",
        "minimal aiohttp proxy under granian (1 worker)",
        "asgi-app",
        asgi_server="granian",
        requires=("granian",),
    ),
    ServerSpec(
        "minimal-proxy-pyreqwest",
        "minimal pyreqwest proxy (1 worker)",
        "asgi-app",
        app="benchmarks.minimal_proxy_pyreqwest:app",
        requires=("pyreqwest",),
    ),
    ServerSpec(
        "minimal-proxy-granian-pyreqwest",
        "minimal pyreqwest proxy under granian (1 worker)",
        "asgi-app",
        app="benchmarks.minimal_proxy_pyreqwest:app",
        asgi_server="granian",
        requires=("granian", "pyreqwest"),
    ),
    ServerSpec("hello-uvicorn", "constant answer under uvicorn", "asgi-app", app=HELLO),
    ServerSpec(
        "hello-edge",
        "constant answer under the gateway's EdgeProtocol",
        "asgi-app",
        app=HELLO,
        asgi_server="edge",
    ),
    ServerSpec(
        "hello-granian",
        "constant answer under granian",
        "asgi-app",
        app=HELLO,
        asgi_server="granian",
        requires=("granian",),
    ),
    ServerSpec("gw1", "gateway, 1 worker, PostgreSQL + Redis", "gateway", workers=1, redis=True),
    ServerSpec(
        "gw1-pg", "gateway, 1 worker, PostgreSQL only, no cache", "gateway", 1, cache_max_entries=0
    ),
    ServerSpec("gw2", "gateway, 2 workers, PostgreSQL + Redis", "gateway", workers=2, redis=True),
    ServerSpec(
        "gw2-pg", "gateway, 2 workers, PostgreSQL only, no cache", "gateway", 2, cache_max_entries=0
    ),
    ServerSpec("lib-plain", "FastAPI endpoint, no middleware", "library", library="plain"),
    ServerSpec("lib-gateway", "+ IdempotencyMiddleware (PostgreSQL)", "library", library="gateway"),
    ServerSpec(
        "lib-header-memory",
        "+ asgi-idempotency-header (MemoryBackend)",
        "library",
        library="header-memory",
    ),
    ServerSpec(
        "lib-header-redis",
        "+ asgi-idempotency-header (RedisBackend)",
        "library",
        library="header-redis",
    ),
)
SERVER_BY_ID = {server.id: server for server in SERVERS}

SMALL_POST = 32  # bytes of JSON in a "small" POST
BIG_POST = 100 * 1024

GET_SMALL = Load()
POST_NEW_KEY = Load("POST", "/small", SMALL_POST, "unique")
POST_SAME_KEY = Load("POST", "/small", SMALL_POST, "fixed")
POST_STORM = Load("POST", "/small", SMALL_POST, "storm", count_statuses=True)
POST_BIG_NO_KEY = Load("POST", "/upload", BIG_POST, "none")
POST_BIG_NEW_KEY = Load("POST", "/upload", BIG_POST, "unique")
GET_LARGE = Load("GET", "/large")
ONE = 1


@dataclass(frozen=True)
class Scenario:
    id: str
    table: str
    server: str  # a ServerSpec id
    load: Load
    baseline: str | None = None  # a scenario id
    warm_key: bool = False  # answer the fixed key once before measuring (replays)

    @property
    def label(self) -> str:
        return SERVER_BY_ID[self.server].label


def _one(load: Load) -> Load:
    return Load(load.method, load.path, load.body_bytes, load.keys, connections=ONE)


PASS = "Pass-through (GET /small, no key)"
NEW = "New key per request (POST /small, unique Idempotency-Key)"
REPLAY = "Replay of one key (POST /small, the same Idempotency-Key)"
STORM = "Same-key storm (POST /small, each new key sent by every connection at once)"
LARGE = "Large bodies (100 KiB POST with new keys; 1 MiB response streamed, no key)"
LATENCY = "Added latency at 1 connection"
LIBRARY = "Library mode (FastAPI POST /small, new key per request, uvicorn 1 worker)"
FLOOR = "ASGI server and upstream client of the minimal proxy (compare ms CPU/req in notes)"

SCENARIOS: tuple[Scenario, ...] = (
    # upstream direct
    Scenario("direct", PASS, "upstream", GET_SMALL),
    Scenario("direct-1c", LATENCY, "upstream", _one(GET_SMALL)),
    Scenario("direct-post-1c", LATENCY, "upstream", _one(Load("POST", "/small", SMALL_POST))),
    Scenario("direct-upload", LARGE, "upstream", POST_BIG_NO_KEY),
    Scenario("direct-large", LARGE, "upstream", GET_LARGE),
    # other proxies
    Scenario("nginx", PASS, "nginx-proxy", GET_SMALL, "direct"),
    Scenario("nginx-large", LARGE, "nginx-proxy", GET_LARGE, "direct-large"),
    Scenario("minproxy", PASS, "minimal-proxy", GET_SMALL, "direct"),
    Scenario("minproxy-upload", LARGE, "minimal-proxy", POST_BIG_NO_KEY, "direct-upload"),
    Scenario("minproxy-large", LARGE, "minimal-proxy", GET_LARGE, "direct-large"),
    # the same minimal proxy with another ASGI server or upstream client, and the servers
    # alone: what moving off uvicorn or aiohttp would save (the gateway's ratio stays to
    # `minproxy`, uvicorn + aiohttp, the stack it runs on)
    Scenario("minproxy-granian", FLOOR, "minimal-proxy-granian", GET_SMALL, "minproxy"),
    Scenario("minproxy-pyreqwest", FLOOR, "minimal-proxy-pyreqwest", GET_SMALL, "minproxy"),
    Scenario(
        "minproxy-pyreqwest-large", FLOOR, "minimal-proxy-pyreqwest", GET_LARGE, "minproxy-large"
    ),
    Scenario(
        "minproxy-granian-pyreqwest",
        FLOOR,
        "minimal-proxy-granian-pyreqwest",
        GET_SMALL,
        "minproxy",
    ),
    Scenario("hello-uvicorn", FLOOR, "hello-uvicorn", GET_SMALL),
    Scenario("hello-granian", FLOOR, "hello-granian", GET_SMALL, "hello-uvicorn"),
    Scenario("hello-edge", FLOOR, "hello-edge", GET_SMALL, "hello-uvicorn"),
    # the gateway, 1 worker
    Scenario("gw1-pass", PASS, "gw1", GET_SMALL, "minproxy"),
    Scenario("gw1-pass-1c", LATENCY, "gw1", _one(GET_SMALL), "direct-1c"),
    Scenario("gw1-new", NEW, "gw1", POST_NEW_KEY, "gw1-pass"),
    Scenario("gw1-new-1c", LATENCY, "gw1", _one(POST_NEW_KEY), "direct-post-1c"),
    Scenario("gw1-replay-redis", REPLAY, "gw1", POST_SAME_KEY, "gw1-pass", warm_key=True),
    Scenario("gw1-storm", STORM, "gw1", POST_STORM, "gw1-pass"),
    Scenario("gw1-upload", LARGE, "gw1", POST_BIG_NEW_KEY, "minproxy-upload"),
    Scenario("gw1-large", LARGE, "gw1", GET_LARGE, "minproxy-large"),
    Scenario("gw1-pg-new", NEW, "gw1-pg", POST_NEW_KEY, "gw1-pass"),
    Scenario("gw1-replay-pg", REPLAY, "gw1-pg", POST_SAME_KEY, "gw1-pass", warm_key=True),
    # the gateway, 2 workers
    Scenario("gw2-pass", PASS, "gw2", GET_SMALL, "minproxy"),
    Scenario("gw2-new", NEW, "gw2", POST_NEW_KEY, "gw2-pass"),
    Scenario("gw2-replay-redis", REPLAY, "gw2", POST_SAME_KEY, "gw2-pass", warm_key=True),
    Scenario("gw2-storm", STORM, "gw2", POST_STORM, "gw2-pass"),
    Scenario("gw2-upload", LARGE, "gw2", POST_BIG_NEW_KEY, "minproxy-upload"),
    Scenario("gw2-large", LARGE, "gw2", GET_LARGE, "minproxy-large"),
    Scenario("gw2-replay-pg", REPLAY, "gw2-pg", POST_SAME_KEY, "gw2-pass", warm_key=True),
    # library mode
    Scenario("lib-plain", LIBRARY, "lib-plain", POST_NEW_KEY),
    Scenario("lib-gateway", LIBRARY, "lib-gateway", POST_NEW_KEY, "lib-header-memory"),
    Scenario("lib-header-memory", LIBRARY, "lib-header-memory", POST_NEW_KEY, "lib-plain"),
    Scenario("lib-header-redis", LIBRARY, "lib-header-redis", POST_NEW_KEY, "lib-plain"),
)
SCENARIO_BY_ID = {scenario.id: scenario for scenario in SCENARIOS}
TABLES = (PASS, NEW, REPLAY, STORM, LARGE, LATENCY, LIBRARY, FLOOR)

# The memory check runs on this server after its scenarios: pass-through, then new keys.
MEMORY_SERVER = "gw1"
MEMORY_SCENARIO = "memory"
MEMORY_SHARE_PASS = 0.85  # of the requests; the rest are new keys (slower: keep it bounded)


def select(names: str | None) -> list[str]:
    """Scenario ids from a comma-separated list of ids or id prefixes: an exact id means that
    scenario alone, a prefix every scenario under it (``gw1`` is all of gw1 and gw1-pg)."""
    ids = [scenario.id for scenario in SCENARIOS] + [MEMORY_SCENARIO]
    if not names:
        return ids
    chosen: list[str] = []
    for name in (part.strip() for part in names.split(",") if part.strip()):
        matches = [name] if name in ids else [i for i in ids if i.startswith(name + "-")]
        if not matches:
            raise SystemExit(f"unknown scenario {name!r}; known: {', '.join(ids)}")
        chosen.extend(match for match in matches if match not in chosen)
    return [i for i in ids if i in chosen]
