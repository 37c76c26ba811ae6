"""The page at ``/``: what a model sees (top labels or zero-shot scores, each Soft MoE layer's
routing maps over the picture, per-stage latency), drawn in the browser from the public /v1
endpoints only.

Plain files from server/http/page, no build step and nothing from another origin: the
Content-Security-Policy allows this origin only, plus data: and blob: images (the chosen picture).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from server.errors import NotFound

PAGE = Path(__file__).resolve().parents[1] / "page"
# The files a browser may fetch under /static, with their media types; nothing else is served.
ASSETS = {"page.js": "text/javascript; charset=utf-8", "page.css": "text/css; charset=utf-8"}
CSP = ("default-src 'self'; img-src 'self' data: blob:; object-src 'none'; base-uri 'none'; "
       "form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "Cache-Control": "no-cache"}  # revalidated (ETag) on every load: a new server's page is never stale

router = APIRouter(include_in_schema=False)


@router.get("/")
async def index() -> FileResponse:
    return FileResponse(PAGE / "index.html", media_type="text/html; charset=utf-8", headers=HEADERS)


@router.get("/static/{name}")
async def asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise NotFound(f"no page asset {name!r}; the page has {sorted(ASSETS)}")
    return FileResponse(PAGE / name, media_type=ASSETS[name], headers=HEADERS)
