"""/ui: the browser dashboard, static files that call the /v1 API from the page with the user's key.

The files hold no data and need no key; every request the page makes for data carries the key in its
Authorization header, so the files are served as they are, with a policy that lets them load nothing from
anywhere else (the pages work without internet access, and injected markup could not run or send data out).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, RedirectResponse
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

UI_DIR = Path(__file__).resolve().parent.parent / "ui"
UI_PATH = "/ui"

# uPlot sizes its elements through inline styles, hence 'unsafe-inline' for styles only; scripts come from
# the dashboard's own files and nowhere else.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
    "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'"
)

router = APIRouter(include_in_schema=False)


class DashboardFiles(StaticFiles):
    # The request metrics label a request with its route's template, read from scope["route"].path.
    path = f"{UI_PATH}/{{path:path}}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["route"] = self

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [
                    *message["headers"],
                    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
                    (b"x-content-type-options", b"nosniff"),
                    (b"referrer-policy", b"no-referrer"),
                    # Revalidated on every load (cheap: ETag), so an upgraded server never runs yesterday's script.
                    (b"cache-control", b"no-cache"),
                ]
            await send(message)

        await super().__call__(scope, receive, send_with_headers)


@router.get("/")
@router.get(UI_PATH)
def dashboard_redirect(request: Request) -> RedirectResponse:
    return RedirectResponse(f"{request.scope.get('root_path', '')}{UI_PATH}/", status_code=307)


# The API's docs pages load Swagger UI and ReDoc from files vendored beside uPlot (see each folder's VERSION and
# LICENSE), not from a CDN: self-hosted and air-gapped servers are the usual case, and /docs was a blank page there.
SWAGGER_UI = f"{UI_PATH}/vendor/swagger-ui"
REDOC = f"{UI_PATH}/vendor/redoc"
# Both docs pages show swagger-ui's icon.
FAVICON = f"{SWAGGER_UI}/favicon-32x32.png"
# The pages' own inline start-up script and the libraries' inline styles; ReDoc parses in a worker it makes from a
# blob. Nothing from another host: ReDoc's bundle would fetch its maker's logo from a CDN.
DOCS_CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self' 'unsafe-inline'; worker-src blob:; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; connect-src 'self'; form-action 'none'; "
    "frame-ancestors 'none'; base-uri 'none'"
)


def _docs_page(
    request: Request, render: Callable[..., HTMLResponse], assets: dict[str, str], **options: Any
) -> HTMLResponse:
    """A docs page as `render` builds it: the OpenAPI document and each of `assets` (argument name -> path)
    under the proxy's root path, the API's title, the page's own `options`; served under the docs' CSP."""
    root = request.scope.get("root_path", "")
    page = render(
        openapi_url=f"{root}{request.app.openapi_url}",
        title=f"{request.app.title} API",
        **{argument: f"{root}{path}" for argument, path in assets.items()},
        **options,
    )
    page.headers["Content-Security-Policy"] = DOCS_CONTENT_SECURITY_POLICY
    return page


@router.get("/docs")
def swagger_ui(request: Request) -> HTMLResponse:
    assets = {
        "swagger_js_url": f"{SWAGGER_UI}/swagger-ui-bundle.js",
        "swagger_css_url": f"{SWAGGER_UI}/swagger-ui.css",
        "swagger_favicon_url": FAVICON,
    }
    # No badge that asks the public validator about the spec.
    options = {"oauth2_redirect_url": None, "swagger_ui_parameters": {"validatorUrl": None}}
    return _docs_page(request, get_swagger_ui_html, assets, **options)


@router.get("/redoc")
def redoc(request: Request) -> HTMLResponse:
    assets = {"redoc_js_url": f"{REDOC}/redoc.standalone.js", "redoc_favicon_url": FAVICON}
    return _docs_page(request, get_redoc_html, assets, with_google_fonts=False)


def install_dashboard(app: FastAPI) -> None:
    """The dashboard and the API's docs pages (the app is created with docs_url=None, redoc_url=None)."""
    app.include_router(router)
    app.mount(UI_PATH, DashboardFiles(directory=UI_DIR, html=True), name="ui")
