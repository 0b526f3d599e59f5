"""The FastAPI application and the `llmserve gateway` entry point."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI

from common.logs import setup_logging
from common.settings import Settings
from gateway import errors
from gateway.bus import Bus
from gateway.routes import router


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.bus = Bus(settings)
        await app.state.bus.start()
        yield
        await app.state.bus.stop()

    app = FastAPI(title="llmserve", lifespan=lifespan)
    errors.install(app)
    app.include_router(router)
    return app


def main() -> None:
    settings = Settings.from_env()
    setup_logging("gateway", settings.log_level)
    uvicorn.run(create_app(settings), host=settings.gateway_host, port=settings.gateway_port,
                log_config=None, access_log=False, timeout_graceful_shutdown=5)
