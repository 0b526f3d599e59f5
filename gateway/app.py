"""The FastAPI application and the `llmserve gateway` entry point."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI

from common.settings import GatewaySettings
from common.telemetry import setup_logging
from common.tracing import Tracing
from gateway import batches, errors, observe, openai_api, page, resume, routes, tokenize
from gateway.batch_runner import BatchRunner
from gateway.bus import Bus
from gateway.connection import HeadLimits, limited_protocol
from gateway.grammar_check import GrammarChecker
from gateway.metrics import CountRequests
from gateway.middleware import Guard, Traced

UPLOAD_FRAMING = 64 << 10


def create_app(settings: GatewaySettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.bus = Bus(settings)
        app.state.grammars = GrammarChecker()
        app.state.batches = BatchRunner(app, app.state.bus)
        await app.state.bus.start()
        await app.state.grammars.start()
        app.state.batches.start()
        yield
        await app.state.batches.stop()
        await app.state.grammars.stop()
        await app.state.bus.stop()

    app = FastAPI(title="llmserve", lifespan=lifespan,
                  description="LLM serving over a Redis message bus: the native /generate routes and an "
                  "OpenAI-compatible API.")
    errors.install(app)
    app.include_router(routes.router)
    app.include_router(openai_api.router)
    app.include_router(resume.router)
    app.include_router(batches.router)
    app.include_router(tokenize.router)
    app.include_router(observe.router)
    app.include_router(page.router)
    keys = settings.api_key_list()
    # An upload's limit leaves room for its multipart framing; the file itself is checked against the setting.
    uploads = {"/v1/files": (settings.batch_file_bytes + UPLOAD_FRAMING, "BATCH_FILE_BYTES")}
    app.add_middleware(Guard, api_keys=keys, max_body=settings.max_message_bytes, body_timeout=settings.body_timeout,
                       uploads=uploads)
    app.add_middleware(Traced, tracing=Tracing("gateway"))
    # Outermost, so that refusals by the guard are counted too.
    app.add_middleware(CountRequests, routes=set(app.openapi()["paths"]))
    return app


def main() -> None:
    settings = GatewaySettings.from_env()
    setup_logging("gateway", settings.log_level)
    protocol = limited_protocol(HeadLimits(settings.max_header_bytes, settings.header_timeout))
    uvicorn.run(create_app(settings), host=settings.gateway_host, port=settings.gateway_port, http=protocol,
                log_config=None, access_log=False, timeout_graceful_shutdown=5)
