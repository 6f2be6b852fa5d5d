"""/ui: the browser dashboard, static files that call the /v1 API from the page with the user's key.

The files hold no data and need no key; every request the page makes for data carries the key in its
Authorization header, so the files are served as they are, with a policy that lets them load nothing from
anywhere else (the pages work without internet access, and injected markup could not run or send data out).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import RedirectResponse
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


def install_dashboard(app: FastAPI) -> None:
    app.include_router(router)
    app.mount(UI_PATH, DashboardFiles(directory=UI_DIR, html=True), name="ui")
