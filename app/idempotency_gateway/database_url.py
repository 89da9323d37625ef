"""The database URL operators write, read the way Alembic (SQLAlchemy) and each store driver
want it.

A PostgreSQL URL may list several hosts, as libpq does, so the gateways follow a failover
without a restart (``docs/failover.md``)::

    postgresql://gateway@db1:5432,db2:5432/idempotency_gateway?target_session_attrs=read-write

SQLAlchemy's URL parser takes no comma-separated host list, so ``normalize_database_url`` moves
the hosts into SQLAlchemy's own multi-host form (``?host=db1:5432&host=db2:5432``) for the
migrations, and ``asyncpg_dsn_of`` writes them as one ``host=`` list for the store's asyncpg
pool. Both drivers then try the hosts in order and, with ``target_session_attrs=read-write``,
connect only to the one that accepts writes.

Only the migrations and the check of a configured URL parse with SQLAlchemy, and they import
it when they do: the stores read URLs with the standard library alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, quote, unquote

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

# The SQLAlchemy drivers the migrations run on: asyncpg, the store's own PostgreSQL driver,
# and the standard library's sqlite3 (``sqlite://`` is SQLAlchemy's pysqlite).
_MIGRATION_DRIVERS = {
    "postgresql": "postgresql+asyncpg",
    "postgres": "postgresql+asyncpg",
    "sqlite": "sqlite",
}
_DEFAULT_PORT = "5432"


def backend_of(url: str) -> str | None:
    """``"postgresql"`` or ``"sqlite"`` for a URL of either (any ``+driver`` suffix), else
    ``None``."""
    scheme, separator, _ = url.partition("://")
    backend = _MIGRATION_DRIVERS.get(scheme.partition("+")[0].lower()) if separator else None
    return None if backend is None else backend.partition("+")[0]


def sqlite_path(url: str) -> str:
    """The file of a ``sqlite://`` URL as SQLAlchemy reads it (``sqlite:///relative.db``,
    ``sqlite:////absolute.db``); ``:memory:`` when the URL names none."""
    rest = url.partition("://")[2].partition("?")[0]
    return unquote(rest.removeprefix("/")) or ":memory:"


def _with_migration_driver(url: str) -> str:
    """Accept the URLs operators write (``postgresql://``, or any ``+driver``) and pick the
    drivers the migrations run on."""
    scheme, separator, rest = url.partition("://")
    driver = _MIGRATION_DRIVERS.get(scheme.partition("+")[0].lower())
    return f"{driver}://{rest}" if separator and driver is not None else url


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
    """``url`` with the migrations' driver picked and a libpq host list (``h1:p1,h2:p2``)
    moved to SQLAlchemy's multi-host query form; a URL with one host keeps its hosts."""
    url = _with_migration_driver(url)
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
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(normalize_database_url(url))
    except ValueError as exc:
        raise ValueError(f"not a database URL: {exc}") from None
    except ArgumentError:  # its message would echo the URL, password and all
        raise ValueError("not a database URL (expected postgresql://... or sqlite://...)") from None


def asyncpg_dsn_of(url: str) -> str:
    """A PostgreSQL URL as asyncpg and libpq spell it: no ``+asyncpg`` driver suffix, and
    several hosts as one ``host=h1:p1,h2:p2`` parameter."""
    rest = normalize_database_url(url).partition("://")[2]
    location, _, query = rest.partition("?")
    parameters = parse_qsl(query, keep_blank_values=True)
    hosts = [value for name, value in parameters if name == "host"]
    others = [f"{name}={quote(value, safe='')}" for name, value in parameters if name != "host"]
    listed = [f"host={quote(','.join(hosts), safe='')}"] if hosts else []
    joined = "&".join(listed + others)
    return f"postgresql://{location}{'?' + joined if joined else ''}"
