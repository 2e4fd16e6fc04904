"""The chat page at ``/``: static files under ``api/static`` (no build step; packaged with the API as package
data). Everything it does goes through the public API (/v1/models, /v1/jobs, their events and DELETE)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).with_name("static")
_NO_CACHE = {"Cache-Control": "no-cache"}  # revalidated (ETag): a new release's page is never stale


def install_page(app: FastAPI) -> None:
    """``/`` serves the page and ``/static/`` its script and style; neither needs an API key."""
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers=_NO_CACHE)
