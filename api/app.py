"""The API tier's FastAPI app. Never imports torch or ``engine``: API nodes install without them.

Run with ``pagedserve api`` or ``uvicorn --factory api.app:create_app`` (settings from PAGEDSERVE_* env vars).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from arq.connections import ArqRedis, RedisSettings, create_pool
from fastapi import FastAPI

import modelfiles
from api.auth import Authenticator
from api.errors import CatchAll, install_error_handlers
from api.generation_config import load_generation_defaults
from api.jobs import JobQueue
from api.metrics import ApiMetrics
from api.middleware import BodySizeLimit
from api.page import install_page
from api.reaper import QueueReaper
from api.relay import EventRelay
from api.request_id import RequestIdHeader
from api.routes import router
from api.service import CompletionService
from api.settings import ApiSettings, load_chat_template, model_max_len
from api.tokenizer import PromptTokenizer
from api.tracing import setup_api_tracing
from api.validation import install_openapi
from cache.responses import ResponseCache
from deploy.gc_heap import freeze_startup_heap
from wire import keys
from wire.messages import dumps, loads

logger = logging.getLogger(__name__)


async def connect_redis(redis_url: str) -> ArqRedis:
    """An arq pool (a redis.asyncio client that can also enqueue jobs) with the JSON job serializer."""
    settings = RedisSettings.from_dsn(redis_url)
    settings.conn_retries = 2
    return await create_pool(settings, job_serializer=dumps, job_deserializer=loads, default_queue_name=keys.QUEUE)


def _build_service(app: FastAPI, settings: ApiSettings, redis: ArqRedis) -> CompletionService:
    files = modelfiles.resolve(settings.model or None, settings.served_model_name)
    tokenizer_folder = Path(settings.tokenizer) if settings.tokenizer else files.folder
    tokenizer = PromptTokenizer(tokenizer_folder, load_chat_template(settings.chat_template))
    max_model_len = settings.max_model_len or model_max_len(files.folder) or 2048
    app.state.generation_defaults = load_generation_defaults(settings.generation_config, files.folder)
    queue = JobQueue(
        redis, settings.max_queue_depth, settings.retry_after_s, settings.worker_ttl_s, settings.queue_without_workers_s
    )
    cache = ResponseCache(redis, keys.CACHE_PREFIX, settings.response_cache_ttl_s) if settings.response_cache else None
    metrics = ApiMetrics(files.name, max_model_len)
    app.state.queue_depth = 0
    metrics.watch_workers(lambda: queue._workers, lambda: int(app.state.queue_depth))
    relay = EventRelay(redis)
    return CompletionService(settings, tokenizer, files.name, max_model_len, queue, relay, cache, metrics)


def create_app(settings: ApiSettings | None = None) -> FastAPI:
    """The app; Redis, the tokenizer and the pub/sub relay are set up in its lifespan."""
    settings = settings or ApiSettings.from_env()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = await connect_redis(settings.redis_url)
        svc = _build_service(app, settings, redis)
        await svc.relay.start()
        app.state.redis = redis
        app.state.svc = svc
        app.state.auth = Authenticator(redis, settings.api_keys, settings.rate_limit_rps, settings.rate_limit_burst)
        app.state.started = int(time.time())
        app.state.reaper = QueueReaper(redis, settings.queue_deadline_s, settings.events_ttl_s)
        sweeper = asyncio.create_task(app.state.reaper.run(), name="queue-reaper")
        logger.info("serving %s (max_model_len %d) on queue %s", svc.model_name, svc.max_model_len, keys.QUEUE)
        freeze_startup_heap()  # start-up objects (tokenizer, app, modules) out of the collector's reach (deploy.gc_heap)
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            await svc.relay.stop()
            await redis.aclose()

    app = FastAPI(title="pagedserve", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.settings = settings
    install_error_handlers(app)
    app.include_router(router)
    install_page(app)
    install_openapi(app)
    setup_api_tracing(app, settings.otel_exporter)
    app.add_middleware(CatchAll)  # first added = innermost: just outside the routes' exception handlers
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["Retry-After", "X-Request-Id"],
        )
    app.add_middleware(RequestIdHeader)  # outermost: every response carries it, 413s and CORS preflights too
    return app
