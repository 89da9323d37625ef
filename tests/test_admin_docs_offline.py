"""The admin API's ``/docs`` and ``/redoc`` render with no internet access.

The admin port usually sits on a private network: the pages must load every script,
stylesheet and icon from the admin listener itself. Served over real HTTP on loopback; every
asset URL in the HTML is same-origin and answers 200 with the content type a browser needs to
run or apply it.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from urllib.parse import urljoin, urlsplit

import httpx
import pytest

from idempotency_gateway.main import create_gateway
from tests.support import serve_asgi
from tests.support.gateway import gateway_config

ASSET_REFERENCE = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']""")
EXPECTED_TYPES = {
    ".js": "javascript",
    ".css": "text/css",
    ".png": "image/png",
}


@pytest.fixture
async def admin() -> AsyncIterator[httpx.AsyncClient]:
    gateway = create_gateway(
        gateway_config("http://127.0.0.1:9"), database_url="sqlite:///:memory:"
    )
    async with (
        serve_asgi(gateway.admin) as url,
        httpx.AsyncClient(base_url=url, timeout=10.0, trust_env=False) as client,
    ):
        yield client


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
async def test_docs_pages_load_every_asset_from_the_admin_listener(
    admin: httpx.AsyncClient, page: str
) -> None:
    html = await admin.get(page)
    assert html.status_code == 200
    assert html.headers["content-type"].startswith("text/html")
    assets = ASSET_REFERENCE.findall(html.text)
    assert any(asset.endswith(".js") for asset in assets), assets
    for asset in assets:
        absolute = urljoin(str(html.url), asset)
        assert urlsplit(absolute).netloc == urlsplit(str(html.url)).netloc, f"{asset} elsewhere"
        answer = await admin.get(absolute)
        assert answer.status_code == 200, asset
        suffix = next(s for s in EXPECTED_TYPES if urlsplit(absolute).path.endswith(s))
        assert EXPECTED_TYPES[suffix] in answer.headers["content-type"], asset
        assert answer.content, asset
    # Nothing else in the page (inline script included) names another host.
    assert not re.search(r"https?://", html.text), "a page refers to another origin"


async def test_docs_page_points_swagger_ui_at_the_local_openapi_document(
    admin: httpx.AsyncClient,
) -> None:
    html = await admin.get("/docs")
    assert "url: '/openapi.json'" in html.text
    document = await admin.get("/openapi.json")
    assert document.status_code == 200
    assert document.json()["openapi"].startswith("3.1")
    (bundle_url,) = [a for a in ASSET_REFERENCE.findall(html.text) if a.endswith("bundle.js")]
    bundle = await admin.get(bundle_url)
    # The page's inline script calls SwaggerUIBundle: the local script must define it.
    assert "SwaggerUIBundle(" in html.text
    assert b"SwaggerUIBundle" in bundle.content


async def test_the_openapi_document_has_every_admin_operation_require_bearer_auth(
    admin: httpx.AsyncClient,
) -> None:
    # Swagger UI's "Authorize" button fills in what securitySchemes declares, and sends it
    # only on the operations whose security names the scheme.
    document = (await admin.get("/openapi.json")).json()
    schemes = document["components"]["securitySchemes"]
    assert schemes == {
        "HTTPBearer": {
            "type": "http",
            "scheme": "bearer",
            "description": "the admin token (GATEWAY_ADMIN_TOKEN)",
        }
    }
    operations = {
        (method, path): operation
        for path, methods in document["paths"].items()
        for method, operation in methods.items()
    }
    admin_operations = [key for key in operations if key[1].startswith("/admin/")]
    assert len(admin_operations) >= 8, admin_operations
    for key in admin_operations:
        assert operations[key].get("security") == [{"HTTPBearer": []}], key
    for key in operations.keys() - set(admin_operations):
        assert "security" not in operations[key], key
