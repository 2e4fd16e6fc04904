"""``pagedserve serve``: one machine, three kinds of process — a private redis-server (unless --redis-url),
the API (uvicorn) and N engine workers — started, watched and stopped together (Ctrl-C / SIGTERM)."""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from types import FrameType

import modelfiles
from deploy.redis_server import RedisServer
from engine.args import EngineArgs

logger = logging.getLogger("pagedserve.launcher")


@dataclass
class Supervisor:
    """Child processes by name; if one dies the others are stopped too (a half-up server is worse than none)."""

    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    stopping: bool = False

    def start(self, name: str, argv: list[str]) -> None:
        logger.info("starting %s", name)
        # own process group: a terminal Ctrl-C reaches only the launcher, which forwards one SIGTERM
        self.procs[name] = subprocess.Popen(argv, start_new_session=True)

    def failed(self) -> str | None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                return f"{name} exited with status {proc.returncode}"
        return None

    def stop(self, timeout_s: float) -> None:
        """SIGTERM all (workers finish running jobs), then SIGKILL whatever is left after ``timeout_s``."""
        self.stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name, proc in self.procs.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in time: killing it", name)
                proc.kill()
                proc.wait()


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "deploy.cli", *args]


def _api_argv(args: argparse.Namespace, redis_url: str) -> list[str]:
    argv = _cli(
        "api",
        "--redis-url",
        redis_url,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--api-workers",
        str(args.api_workers),
        "--max-queue-depth",
        str(args.max_queue_depth),
        "--queue-deadline-s",
        str(args.queue_deadline_s),
        "--request-timeout-s",
        str(args.request_timeout_s),
        "--response-cache-ttl-s",
        str(args.response_cache_ttl_s),
        "--max-body-bytes",
        str(args.max_body_bytes),
        "--rate-limit-rps",
        str(args.rate_limit_rps),
        "--rate-limit-burst",
        str(args.rate_limit_burst),
        "--otel-exporter",
        args.otel_exporter,
        "--log-level",
        args.log_level,
        "--response-cache" if args.response_cache else "--no-response-cache",
    )
    for key in args.api_key:
        argv += ["--api-key", key]
    for flag, value in (
        ("--model", args.model),
        ("--served-model-name", args.served_model_name),
        ("--max-model-len", args.max_model_len),
    ):
        if value:
            argv += [flag, str(value)]
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
        "--log-level",
        args.log_level,
        *EngineArgs.from_cli_args(args).to_argv(),  # the engine flags that differ from the defaults, --model too
    )
    if args.served_model_name:
        argv += ["--served-model-name", args.served_model_name]
    if args.metrics_port is not None:
        argv += ["--metrics-port", str(args.metrics_port + index)]
    return argv


def serve(args: argparse.Namespace) -> int:
    if args.workers < 0:
        raise ValueError(f"--workers must be >= 0, got {args.workers}")
    # resolve once up front: a GGUF's tokenizer/config folder is written here, before API and workers read it
    files = modelfiles.resolve(args.model or None, args.served_model_name)
    logger.info("model %s from %s", files.name, files.gguf_path or files.folder)
    redis = None if args.redis_url else RedisServer().start()
    redis_url = args.redis_url or (redis.url if redis else "")
    if redis is not None:
        logger.info("private redis-server on %s", redis_url)
    sup = Supervisor()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if sup.stopping:
            return
        logger.info("%s: stopping API and workers", signal.Signals(signum).name)
        sup.stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    status = 0
    try:
        for i in range(args.workers):
            sup.start(f"worker-{i}", _worker_argv(args, redis_url, i))
        sup.start("api", _api_argv(args, redis_url))
        logger.info("OpenAI API on http://%s:%d/v1 (Ctrl-C stops everything)", args.host, args.port)
        while not sup.stopping:
            failure = sup.failed()
            if failure:
                logger.error("%s: stopping the rest", failure)
                status = 1
                break
            time.sleep(0.2)
    finally:
        sup.stop(timeout_s=args.drain_timeout_s)
        if redis is not None:
            redis.stop()
    return status
