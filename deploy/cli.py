"""``pagedserve``: serve (Redis + API + workers on one machine), api / worker (scale-out), bench."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from deploy.api_args import (
    add_vllm_api_args,
    add_vllm_engine_args,
    api_env,
    check_vllm_args,
    default_help,
    uvicorn_kwargs,
)
from engine.args import EngineArgs

BENCHES = {
    "kernels": "loadtest.kernels_bench",
    "throughput": "loadtest.throughput",
    "latency": "loadtest.throughput",
    "suite": "loadtest.throughput",
    "overhead": "loadtest.throughput",
    "sweep": "loadtest.throughput",
    "serve": "loadtest.serve_bench",
    "stack": "loadtest.stack_bench",
    "relay": "loadtest.relay_bench",
    "pump": "loadtest.pump_bench",
    "burst": "loadtest.burst_bench",
    "soak": "loadtest.soak",
    "swap": "loadtest.swap_bench",
}


def _add_common(p: argparse.ArgumentParser, redis_default: str | None) -> None:
    p.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="the model, as `vllm serve MODEL` (or --model)"
    )
    p.add_argument("--model", default="", help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None, help="the `model` clients send (default: from the path)")
    p.add_argument("--redis-url", default=redis_default, help="Redis for the queue, streams and caches")
    p.add_argument("--tokenizer", default=None, help="a tokenizer folder apart from the model's (API and workers)")
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--otel-exporter",
        default="",
        choices=["none", "console", "otlp"],
        help="trace exporter (default: OTEL_TRACES_EXPORTER, otlp if OTEL_EXPORTER_OTLP_ENDPOINT is set, else none)",
    )


def _add_api_args(p: argparse.ArgumentParser) -> None:
    """The API's flags. Those of ``ApiSettings`` default to None: a flag given wins, else its ``PAGEDSERVE_*``
    variable, else the settings' default (shown in the help)."""
    g = p.add_argument_group("API")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-workers", type=int, default=1, help="uvicorn worker processes of the API")
    g.add_argument("--api-key", action="append", default=[], help="accepted bearer key (repeat; none = no auth)")
    g.add_argument(
        "--rate-limit-rps", type=float, help=default_help("per-key requests/s (0 = unlimited)", "rate_limit_rps")
    )
    g.add_argument("--rate-limit-burst", type=int, help=default_help("token bucket size", "rate_limit_burst"))
    g.add_argument(
        "--max-queue-depth", type=int, help=default_help("waiting jobs above which requests get 429", "max_queue_depth")
    )
    g.add_argument(
        "--queue-deadline-s", type=float, help=default_help("drop jobs not started within this", "queue_deadline_s")
    )
    g.add_argument("--request-timeout-s", type=float, help=default_help("", "request_timeout_s"))
    g.add_argument("--response-cache", action=argparse.BooleanOptionalAction, help=default_help("", "response_cache"))
    g.add_argument("--response-cache-ttl-s", type=int, help=default_help("", "response_cache_ttl_s"))
    g.add_argument("--shared-response-cache", action="store_true", default=None, help="one cache for all API keys")
    g.add_argument(
        "--queue-without-workers-s",
        type=float,
        help=default_help(
            "with no live worker, still queue requests this long (0: 503 at once; inf: always queue)",
            "queue_without_workers_s",
        ),
    )
    g.add_argument("--max-body-bytes", type=int, help=default_help("", "max_body_bytes"))
    add_vllm_api_args(p)


def _add_worker_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("worker")
    g.add_argument("--worker-id", default=None)
    g.add_argument("--metrics-port", type=int, default=None, help="Prometheus port of the worker (default: off)")
    g.add_argument("--drain-timeout-s", type=float, default=600.0, help="SIGTERM: time running jobs get to finish")
    g.add_argument(
        "--job-lease-s", type=float, default=10.0, help="a dead worker's jobs run again elsewhere after this long"
    )
    g.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="stream an event every N tokens per request (the first at once); larger = fewer, bigger events",
    )
    g.add_argument(
        "--worker-fronts",
        type=int,
        default=1,
        help="front processes per engine core, sharing its per-token work (each takes a share of the jobs)",
    )
    g.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic engine stats line in the worker's log (vLLM's flag; the Prometheus metrics stay)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="Redis (private unless --redis-url), the API and worker(s), supervised")
    _add_common(serve, None)
    serve.add_argument("--workers", type=int, default=1, help="worker processes (one engine each)")
    serve.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="a process (worker, API, private Redis) that dies is restarted; more exits than this within "
        "--restart-window-s and serve stops everything and exits non-zero",
    )
    serve.add_argument("--restart-window-s", type=float, default=300.0, help="see --max-restarts")
    _add_api_args(serve)
    _add_worker_args(serve)
    EngineArgs.add_cli_args(serve, with_model=False)  # --model is in _add_common
    add_vllm_engine_args(serve)
    api = sub.add_parser("api", help="the API tier only (no torch)")
    _add_common(api, None)  # None: $PAGEDSERVE_REDIS_URL, else ApiSettings' default
    _add_api_args(api)
    api.add_argument("--max-model-len", type=int, default=None)
    worker = sub.add_parser("worker", help="one engine worker on the queue")
    _add_common(worker, "redis://127.0.0.1:6379/0")
    _add_worker_args(worker)
    EngineArgs.add_cli_args(worker, with_model=False)
    add_vllm_engine_args(worker)
    bench = sub.add_parser("bench", help=f"benchmarks: {' | '.join(BENCHES)} (-h after the name)")
    bench.add_argument("kind", choices=sorted(BENCHES))
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def run_api(args: argparse.Namespace) -> int:
    import uvicorn

    from api.metrics import multiprocess_dir

    os.environ.update(api_env(args))
    with multiprocess_dir(args.api_workers):  # several processes: /metrics sums them all
        uvicorn.run("api.app:create_app", factory=True, timeout_graceful_shutdown=5, **uvicorn_kwargs(args))
    return 0


def run_worker_command(args: argparse.Namespace) -> int:
    import modelfiles
    from worker.main import run_worker
    from worker.settings import WorkerSettings

    files = modelfiles.resolve(args.model or None, args.served_model_name)
    config = EngineArgs.from_cli_args(args).create_engine_config()
    settings = WorkerSettings(
        redis_url=args.redis_url,
        metrics_port=args.metrics_port,
        drain_timeout_s=args.drain_timeout_s,
        job_lease_s=args.job_lease_s,
        stream_interval=args.stream_interval,
        fronts=args.worker_fronts,
        log_stats=not args.disable_log_stats,
        **({"worker_id": args.worker_id} if args.worker_id else {}),
    )
    if args.otel_exporter:  # as the SDK's variable, so the node's extra fronts (spawned) trace alike
        os.environ["OTEL_TRACES_EXPORTER"] = args.otel_exporter
    asyncio.run(run_worker(config, settings, files.name, args.log_level.upper()))
    return 0


def run_bench(kind: str, argv: Sequence[str]) -> int:
    module = importlib.import_module(BENCHES[kind])
    argv = list(argv)
    if BENCHES[kind] == "loadtest.throughput":  # one main for several modes: the mode is its first argument
        argv = [kind, *argv]
    result = module.main(argv)
    return int(result or 0)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = getattr(args, "log_level", "info").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        if args.command != "bench":
            check_vllm_args(args)
        if args.command == "api":
            return run_api(args)
        if args.command == "worker":
            return run_worker_command(args)
        if args.command == "bench":
            return run_bench(args.kind, args.rest)
        from deploy.launcher import serve

        return serve(args)
    except ValueError as exc:
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
