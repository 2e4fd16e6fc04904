"""``pagedserve serve``: one machine, three kinds of process — a private redis-server (unless --redis-url),
the API (uvicorn) and N engine workers — started and stopped together (Ctrl-C / SIGTERM), and supervised:
one that dies is restarted with a backoff while the rest go on serving (``deploy.supervisor``).

The private Redis keeps an append-only file, so a restarted one still has the queue and the jobs' events;
the API and the workers reconnect to it on their own."""

from __future__ import annotations

import argparse
import functools
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from types import FrameType

import modelfiles
from deploy.api_args import api_argv
from deploy.redis_server import RedisServer
from deploy.supervisor import GaveUpError, RestartPolicy, Supervisor, popen_in_own_group
from engine.args import EngineArgs

logger = logging.getLogger("pagedserve.launcher")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "deploy.cli", *args]


def _api_argv(args: argparse.Namespace, redis_url: str) -> list[str]:
    argv = _cli("api", "--redis-url", redis_url, "--host", args.host, "--port", str(args.port))
    argv += ["--api-workers", str(args.api_workers), "--log-level", args.log_level]
    argv += api_argv(args)  # only the API flags given: the child reads $PAGEDSERVE_* for the others
    if args.otel_exporter:  # else both tiers read the OTEL_* variables they inherit
        argv += ["--otel-exporter", args.otel_exporter]
    return argv


def _worker_argv(args: argparse.Namespace, redis_url: str, index: int) -> list[str]:
    argv = _cli(
        "worker",
        "--redis-url",
        redis_url,
        "--drain-timeout-s",
        str(args.drain_timeout_s),
        "--job-lease-s",
        str(args.job_lease_s),
        "--stream-interval",
        str(args.stream_interval),
        "--worker-fronts",
        str(args.worker_fronts),
        "--log-level",
        args.log_level,
        *EngineArgs.from_cli_args(args).to_argv(),  # the engine flags that differ from the defaults, --model too
    )
    if args.served_model_name:
        argv += ["--served-model-name", args.served_model_name]
    if args.otel_exporter:
        argv += ["--otel-exporter", args.otel_exporter]
    if args.metrics_port is not None:
        argv += ["--metrics-port", str(args.metrics_port + index)]
    if args.disable_log_stats:
        argv.append("--disable-log-stats")
    return argv


def _redis_spawner(redis: RedisServer) -> Callable[[], subprocess.Popen[bytes]]:
    def spawn() -> subprocess.Popen[bytes]:
        redis.start()  # waits until it answers (after replaying its append-only file)
        assert redis.proc is not None
        return redis.proc

    return spawn


def _start_all(sup: Supervisor, args: argparse.Namespace, redis: RedisServer | None) -> None:
    """Redis (tier 0: stopped last, the workers drain through it), the workers, the API."""
    if redis is not None:
        sup.add("redis", _redis_spawner(redis), tier=0)
        logger.info("private redis-server on %s (append-only file in its folder)", redis.url)
    redis_url = args.redis_url or (redis.url if redis else "")
    for i in range(args.workers):
        argv = _worker_argv(args, redis_url, i)
        sup.add(f"worker-{i}", functools.partial(popen_in_own_group, argv))
    sup.add("api", functools.partial(popen_in_own_group, _api_argv(args, redis_url)))


def serve(args: argparse.Namespace) -> int:
    if args.workers < 0:
        raise ValueError(f"--workers must be >= 0, got {args.workers}")
    policy = RestartPolicy(args.max_restarts, args.restart_window_s)
    # resolve once up front: a GGUF's tokenizer/config folder is written here, before API and workers read it
    files = modelfiles.resolve(args.model or None, args.served_model_name)
    logger.info("model %s from %s", files.name, files.gguf_path or files.folder)
    redis = None if args.redis_url else RedisServer(appendonly=True)
    sup = Supervisor(policy)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if sup.stopping:
            return
        logger.info("%s: stopping API and workers", signal.Signals(signum).name)
        sup.stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    status = 0
    try:
        _start_all(sup, args, redis)
        logger.info("OpenAI API on http://%s:%d/v1 (Ctrl-C stops everything)", args.host, args.port)
        while not sup.stopping:
            sup.check()
            time.sleep(0.2)
    except GaveUpError as exc:
        logger.error("%s: giving up, stopping everything", exc)
        status = 1
    finally:
        sup.stop(timeout_s=args.drain_timeout_s)
        if redis is not None:
            redis.stop()
    return status
