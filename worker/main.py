"""``pagedserve worker``: load the engine core, connect to Redis, serve jobs until signalled, shut down."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from arq.connections import RedisSettings, create_pool
from prometheus_client import start_http_server

import modelfiles
from engine.config import EngineConfig
from wire import keys
from wire.messages import dumps, loads
from worker.core_client import CoreClient
from worker.front import GenerationWorker
from worker.settings import WorkerSettings

logger = logging.getLogger(__name__)


def load_tokenizer(config: EngineConfig) -> Any:
    """The front's own tokenizer (the core never decodes text); None with ``skip_tokenizer_init``."""
    if config.model.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(modelfiles.resolve(config.model.model).folder)


async def run_worker(
    engine_config: EngineConfig, settings: WorkerSettings, model_name: str = "", log_level: str = "INFO"
) -> None:
    """The engine core loads in its own process while this one loads the tokenizer and connects to Redis."""
    if settings.metrics_port is not None:
        start_http_server(settings.metrics_port)
    core = CoreClient(engine_config, log_level)
    starting = asyncio.ensure_future(core.start())
    tokenizer = await asyncio.to_thread(load_tokenizer, engine_config)
    redis = await create_pool(
        RedisSettings.from_dsn(settings.redis_url),
        job_serializer=dumps,
        job_deserializer=loads,
        default_queue_name=keys.QUEUE,
    )
    try:
        await starting
        worker = GenerationWorker(core, settings, redis, model_name, tokenizer)
        watcher = core.watch(worker.on_core_death)
        try:
            await worker.serve()
        finally:
            watcher.cancel()
    finally:
        await core.shutdown()
        await redis.aclose()
