"""The database URL operators write, read the way SQLAlchemy and asyncpg each want it.

A PostgreSQL URL may list several hosts, as libpq does, so the gateways follow a failover
without a restart (``docs/failover.md``)::

    postgresql://gateway@db1:5432,db2:5432/idempotency_gateway?target_session_attrs=read-write

SQLAlchemy's URL parser takes no comma-separated host list, so ``normalize_database_url`` moves the
hosts into SQLAlchemy's own multi-host form (``?host=db1:5432&host=db2:5432``), and
``asyncpg_dsn_of`` writes them as one ``host=`` list for asyncpg's request pool. Both drivers then
try the hosts in order and, with ``target_session_attrs=read-write``, connect only to the one
that accepts writes.
"""

from __future__ import annotations

from urllib.parse import quote

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

_ASYNC_DRIVERS = (
    ("postgresql://", "postgresql+asyncpg://"),
    ("postgres://", "postgresql+asyncpg://"),
    ("sqlite://", "sqlite+aiosqlite://"),
)
_DEFAULT_PORT = "5432"
# The store when no database URL is given: a file in the working directory, migrated at start.
EMBEDDED_DATABASE_URL = "sqlite+aiosqlite:///idempotency-gateway.db"


def database_url_or_default(url: str | None) -> str:
    return url or EMBEDDED_DATABASE_URL


def _with_async_driver(url: str) -> str:
    """Accept the URLs operators write (``postgresql://``) and pick the async drivers."""
    for plain, async_driver in _ASYNC_DRIVERS:
        if url.startswith(plain):
            return async_driver + url[len(plain) :]
    return url


def _host_with_port(host: str) -> str:
    if not host:
        raise ValueError("the host list has an empty entry")
    if host.startswith("["):
        raise ValueError("IPv6 addresses cannot be used in a host list; use host names")
    name, _, port = host.partition(":")
    if not name or (port and not port.isdigit()):
        raise ValueError(f"{host!r} in the host list is not host:port")
    # SQLAlchemy's multi-host form needs every port written out; libpq's default is 5432.
    return f"{name}:{port or _DEFAULT_PORT}"


def normalize_database_url(url: str) -> str:
    """``url`` with the async driver picked and a libpq host list (``h1:p1,h2:p2``) moved to
    SQLAlchemy's multi-host query form; a URL with one host is returned as it is."""
    url = _with_async_driver(url)
    scheme, separator, rest = url.partition("://")
    authority, _, tail = rest.partition("/")
    userinfo, at, hosts = authority.rpartition("@")
    if not separator or "," not in hosts or not scheme.startswith("postgresql"):
        return url
    listed = "&".join(f"host={quote(_host_with_port(host))}" for host in hosts.split(","))
    path, _, query = tail.partition("?")
    return f"{scheme}://{userinfo}{at}/{path}?{listed}{'&' + query if query else ''}"


def sqlalchemy_url(url: str) -> URL:
    """``url`` parsed; ``ValueError`` (never a password in the message) when it is no URL."""
    try:
        return make_url(normalize_database_url(url))
    except ValueError as exc:
        raise ValueError(f"not a database URL: {exc}") from None
    except ArgumentError:  # its message would echo the URL, password and all
        raise ValueError("not a database URL (expected postgresql://... or sqlite://...)") from None


def asyncpg_dsn_of(url: str | URL) -> str:
    """A PostgreSQL URL as asyncpg and libpq spell it: no ``+asyncpg`` driver suffix, and
    several hosts as one ``host=h1:p1,h2:p2`` parameter."""
    parsed = sqlalchemy_url(url) if isinstance(url, str) else url
    hosts = parsed.query.get("host")
    if isinstance(hosts, tuple):
        parsed = parsed.update_query_dict({"host": ",".join(hosts)})
    return parsed.set(drivername="postgresql").render_as_string(hide_password=False)
