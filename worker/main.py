"""``pagedserve worker``: load the engine core, connect to Redis, serve jobs until signalled, shut down."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from arq.connections import ArqRedis, RedisSettings, create_pool
from prometheus_client import start_http_server
from redis.exceptions import RedisError

import modelfiles
from api.tracing import setup_tracing
from deploy.gc_heap import freeze_startup_heap
from engine.config import EngineConfig
from wire import keys
from wire.messages import dumps, loads
from worker.core_client import CoreClient
from worker.front import GenerationWorker
from worker.fronts import ExtraFronts, exit_on_front_death, front_settings, num_fronts
from worker.node import REDIS_DOWN
from worker.settings import WorkerSettings

logger = logging.getLogger(__name__)


def load_tokenizer(config: EngineConfig) -> Any:
    """The front's own tokenizer (the core never decodes text); None with ``skip_tokenizer_init``."""
    if config.model.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.model.tokenizer or modelfiles.resolve(config.model.model).folder)


async def connect(redis_url: str, max_delay_s: float = 5.0) -> ArqRedis:
    """The worker's Redis pool, waiting as long as it takes (backing off) for Redis to answer: a worker that
    starts while Redis is restarting waits for it instead of exiting."""
    settings = RedisSettings.from_dsn(redis_url)
    settings.conn_retries = 0  # the retries are this loop's (arq's own sleep a fixed second, then give up)
    delay = 0.5
    while True:
        try:
            return await create_pool(
                settings,
                job_serializer=dumps,
                job_deserializer=loads,
                default_queue_name=keys.QUEUE,
            )
        except (*REDIS_DOWN, RedisError) as exc:
            logger.warning("Redis at %s does not answer (%s): trying again in %.1f s", redis_url, exc, delay)
            await asyncio.sleep(delay)
            delay = min(max_delay_s, 2 * delay)


async def prewarm(redis: ArqRedis, count: int) -> None:
    """Open ``count`` pooled connections now. arq starts each job with a MULTI/EXEC of its own, so a burst of N
    job starts holds N connections at once; opened here, none of those starts waits for a TCP connect and the
    client handshake while its first token is due. (Best effort: Redis may be restarting.)"""
    pool = redis.connection_pool
    connections = []
    try:
        for _ in range(count):
            connections.append(await pool.get_connection("PING"))
    except (*REDIS_DOWN, RedisError) as exc:
        logger.warning("opened %d of %d Redis connections ahead (%s)", len(connections), count, exc)
    finally:
        for connection in connections:
            await pool.release(connection)


async def run_worker(
    engine_config: EngineConfig, settings: WorkerSettings, model_name: str = "", log_level: str = "INFO"
) -> None:
    """The engine core loads in its own process while this one loads the tokenizer and connects to Redis; then
    this process is front 0 of the node and starts the others (``worker.fronts``)."""
    setup_tracing("", "pagedserve-worker")  # OTEL_* variables (``--otel-exporter`` sets OTEL_TRACES_EXPORTER)
    if settings.metrics_port is not None:
        start_http_server(settings.metrics_port)
    count = num_fronts(settings)
    core = CoreClient(engine_config, log_level, num_clients=count)
    starting = asyncio.ensure_future(core.start())
    tokenizer = await asyncio.to_thread(load_tokenizer, engine_config)
    redis = await connect(settings.redis_url)
    extra = ExtraFronts()
    try:
        ready = await starting
        extra.start(core, engine_config, settings, model_name, log_level)
        mine = front_settings(settings, ready.capacity, count, 0)
        worker = GenerationWorker(core, mine, redis, model_name, tokenizer)
        await prewarm(redis, worker.max_jobs)
        freeze_startup_heap()
        watchers = [
            core.watch(worker.on_core_death),
            extra.watch(exit_on_front_death),
            asyncio.ensure_future(extra.drain_with(worker, settings.drain_timeout_s)),
        ]
        try:
            await worker.serve()
        finally:
            if worker.pump_trace is not None:
                worker.pump_trace.write()
            for watcher in watchers:
                watcher.cancel()
            await extra.stop(settings.drain_timeout_s)
    finally:
        await core.shutdown()
        await redis.aclose()


async def serve_front(core: CoreClient, config: EngineConfig, settings: WorkerSettings, model_name: str) -> None:
    """An extra front (``worker.fronts``) on a core that front 0 runs."""
    setup_tracing("", "pagedserve-worker")
    tokenizer = await asyncio.to_thread(load_tokenizer, config)
    redis = await connect(settings.redis_url)
    try:
        worker = GenerationWorker(core, settings, redis, model_name, tokenizer)
        await prewarm(redis, worker.max_jobs)
        freeze_startup_heap()
        try:
            await worker.serve()
        finally:
            if worker.pump_trace is not None:
                worker.pump_trace.write()
    finally:
        await core.shutdown()
        await redis.aclose()
