"""The gateway's web page: a playground, a live view of the cluster and the journey of the last requests.

Plain files in gateway/static, served as they are (no build step). Only the named files are served, so no
path from a URL ever reaches the file system."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from common.errors import ErrorCode
from gateway.errors import ApiError

STATIC = Path(__file__).parent / "static"
SCRIPT, STYLE = "text/javascript; charset=utf-8", "text/css; charset=utf-8"
# app.js: what the page's scripts share, and its start; playground.js: the playground; views.js: the cluster, the
# batch jobs and the journeys.
ASSETS = {"app.js": SCRIPT, "playground.js": SCRIPT, "views.js": SCRIPT, "style.css": STYLE}
# The files change with the package, not with time: let browsers keep them but check back each load.
REVALIDATE = {"Cache-Control": "no-cache"}

router = APIRouter(include_in_schema=False)


@router.get("/")
async def page() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8", headers=REVALIDATE)


@router.get("/static/{name}")
async def asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise ApiError.of(ErrorCode.NOT_FOUND, f"no static file '{name}'")
    return FileResponse(STATIC / name, media_type=ASSETS[name], headers=REVALIDATE)
