"""The API's flags and where they go: ``PAGEDSERVE_*`` variables for the API processes (only the flags given,
so a variable set by the user is not overwritten by a default), the argv ``serve`` hands its API child, the
uvicorn keywords; and vLLM's ``serve`` flags, accepted where they mean something here and refused by name
where they do not."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from api.generation_config import load_generation_defaults
from api.settings import ApiSettings, load_chat_template
from worker.stats_log import interval_from_env

_DEFAULTS = ApiSettings()
KV_CACHE_DTYPES = ("auto",)  # the KV cache always has the model's dtype (--dtype)


def default_help(help_text: str, setting: str) -> str:
    """Help with the default the API takes when neither the flag nor ``PAGEDSERVE_<SETTING>`` is set."""
    default = getattr(_DEFAULTS, setting)
    env = f"PAGEDSERVE_{setting.upper()}"
    return f"{help_text}{'; ' if help_text else ''}default: ${env}, else {default!r}"


def _origins(raw: str) -> tuple[str, ...]:
    """vLLM's ``--allowed-origins '["https://a", "https://b"]'`` (JSON), or ``https://a,https://b``."""
    if raw.lstrip().startswith("["):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list of origins: {exc}") from exc
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError("a JSON list of origin strings, e.g. '[\"https://a.example\"]'")
        return tuple(value)
    return tuple(o.strip() for o in raw.split(",") if o.strip())


def add_vllm_api_args(p: argparse.ArgumentParser) -> None:
    """vLLM ``serve``'s API flags."""
    g = p.add_argument_group("API (vLLM's flag names)")
    g.add_argument(
        "--allowed-origins",
        type=_origins,
        dest="cors_origins",
        metavar="ORIGINS",
        help=default_help("CORS origins: a JSON list (as vLLM) or comma-separated; * = any", "cors_origins"),
    )
    g.add_argument(
        "--chat-template", help=default_help("a Jinja file, or the template itself (as vLLM)", "chat_template")
    )
    g.add_argument(
        "--generation-config",
        help=default_help(
            "request defaults: auto = the model's generation_config.json (as vLLM), vllm = the server's own, "
            "or a folder with a generation_config.json",
            "generation_config",
        ),
    )
    logs = g.add_mutually_exclusive_group()
    logs.add_argument(
        "--enable-log-requests",
        dest="log_requests",
        action="store_true",
        default=None,
        help="an INFO line per request: job id, X-Request-Id, prompt tokens, sampling parameters (not the text)",
    )
    logs.add_argument(
        "--disable-log-requests",
        dest="log_requests",
        action="store_false",
        help=default_help("no INFO line per request", "log_requests"),
    )
    g.add_argument("--uvicorn-log-level", default=None, help="uvicorn's log level (default: --log-level)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log line per request")
    g.add_argument("--root-path", default="", help="the path prefix a proxy serves the API under (ASGI root_path)")
    g.add_argument("--ssl-keyfile", default=None, help="HTTPS: the key file (with --ssl-certfile)")
    g.add_argument("--ssl-certfile", default=None, help="HTTPS: the certificate file (with --ssl-keyfile)")


def add_vllm_engine_args(p: argparse.ArgumentParser) -> None:
    """vLLM's engine flags that ``EngineArgs`` has no field for."""
    p.add_argument("--kv-cache-dtype", default="auto", help="auto only: the KV cache has the model's dtype")


# ApiSettings field -> (namespace dest, flag): what api_env / api_argv carry
_SETTING_FLAGS: dict[str, tuple[str, str]] = {
    "redis_url": ("redis_url", "--redis-url"),
    "model": ("model", "--model"),
    "served_model_name": ("served_model_name", "--served-model-name"),
    "tokenizer": ("tokenizer", "--tokenizer"),
    "max_model_len": ("max_model_len", "--max-model-len"),
    "api_keys": ("api_key", "--api-key"),
    "rate_limit_rps": ("rate_limit_rps", "--rate-limit-rps"),
    "rate_limit_burst": ("rate_limit_burst", "--rate-limit-burst"),
    "max_queue_depth": ("max_queue_depth", "--max-queue-depth"),
    "queue_deadline_s": ("queue_deadline_s", "--queue-deadline-s"),
    "request_timeout_s": ("request_timeout_s", "--request-timeout-s"),
    "response_cache": ("response_cache", "--response-cache"),
    "response_cache_ttl_s": ("response_cache_ttl_s", "--response-cache-ttl-s"),
    "shared_response_cache": ("shared_response_cache", "--shared-response-cache"),
    "queue_without_workers_s": ("queue_without_workers_s", "--queue-without-workers-s"),
    "max_body_bytes": ("max_body_bytes", "--max-body-bytes"),
    "otel_exporter": ("otel_exporter", "--otel-exporter"),
    "cors_origins": ("cors_origins", "--allowed-origins"),
    "chat_template": ("chat_template", "--chat-template"),
    "generation_config": ("generation_config", "--generation-config"),
    "log_requests": ("log_requests", "--enable-log-requests"),
}
_BOOL_OFF_FLAGS = {"--response-cache": "--no-response-cache", "--enable-log-requests": "--disable-log-requests"}
assert set(_SETTING_FLAGS) <= {f.name for f in dataclasses.fields(ApiSettings)}


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The settings whose flags were given (None, "" and [] are "not given")."""
    out = {}
    for setting, (dest, _) in _SETTING_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None and value != "" and value != [] and value != ():
            out[setting] = value
    return out


def api_env(args: argparse.Namespace) -> dict[str, str]:
    """The flags given, as ``PAGEDSERVE_*`` variables (every uvicorn worker process reads the same)."""
    env = {}
    for setting, value in _given(args).items():
        text = ",".join(value) if isinstance(value, list | tuple) else str(value)
        env[f"PAGEDSERVE_{setting.upper()}"] = text
    return env


def api_argv(args: argparse.Namespace) -> list[str]:
    """The flags given, as ``pagedserve api`` flags (``serve``'s API child); its uvicorn flags too."""
    argv: list[str] = []
    for setting, value in _given(args).items():
        if setting in ("redis_url", "otel_exporter"):
            continue  # the launcher passes the Redis it started, and the exporter to both tiers
        flag = _SETTING_FLAGS[setting][1]
        if isinstance(value, bool):
            argv.append(flag if value else _BOOL_OFF_FLAGS[flag])
        elif setting == "api_keys":
            for key in value:
                argv += [flag, key]
        elif setting == "cors_origins":
            argv += [flag, json.dumps(list(value))]
        else:
            argv += [flag, str(value)]
    for dest in ("uvicorn_log_level", "root_path", "ssl_keyfile", "ssl_certfile"):
        if getattr(args, dest):
            argv += ["--" + dest.replace("_", "-"), getattr(args, dest)]
    if args.disable_uvicorn_access_log:
        argv.append("--disable-uvicorn-access-log")
    return argv


def uvicorn_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``uvicorn.run`` keywords of the API command."""
    return {
        "host": args.host,
        "port": args.port,
        "workers": args.api_workers,
        "log_level": args.uvicorn_log_level or args.log_level,
        "access_log": not args.disable_uvicorn_access_log,
        "root_path": args.root_path,
        "ssl_keyfile": args.ssl_keyfile,
        "ssl_certfile": args.ssl_certfile,
    }


def check_vllm_args(args: argparse.Namespace) -> None:
    """``MODEL`` into ``--model``; vLLM flags this server does not implement, refused by name (``ValueError``)
    before anything starts."""
    if args.model_tag is not None:
        if args.model and args.model != args.model_tag:
            raise ValueError(f"two models: MODEL {args.model_tag!r} and --model {args.model!r}; give one")
        args.model = args.model_tag
    if args.command == "serve":
        _shared_from_env(args)
    if getattr(args, "trust_remote_code", False):
        raise ValueError(
            "--trust-remote-code is refused: this server runs no code from a checkpoint; its models (Llama, "
            "Mistral, Qwen2, Qwen3) are its own code. Drop the flag"
        )
    if getattr(args, "kv_cache_dtype", "auto") not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {args.kv_cache_dtype!r} is not supported: the KV cache has the model's dtype "
            "(--dtype); use auto"
        )
    if getattr(args, "generation_config", None) not in (None, "auto", "vllm"):
        load_generation_defaults(args.generation_config, Path())  # a folder without the file fails here
    if hasattr(args, "chat_template"):
        load_chat_template(args.chat_template)  # a path that is none fails here, not in the API child
    if bool(getattr(args, "ssl_keyfile", None)) != bool(getattr(args, "ssl_certfile", None)):
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    if args.command in ("serve", "worker") and not args.disable_log_stats:
        interval_from_env()  # a bad VLLM_LOG_STATS_INTERVAL fails here, not in a worker after its model loads


def _shared_from_env(args: argparse.Namespace) -> None:
    """``serve``: the settings both tiers must agree on, from ``PAGEDSERVE_*`` where no flag gave them, so its
    workers serve the model its API names (the API child alone would read the variables)."""
    for dest in ("model", "served_model_name", "max_model_len"):
        raw = os.environ.get(f"PAGEDSERVE_{dest.upper()}")
        if raw and getattr(args, dest) in (None, ""):
            setattr(args, dest, int(raw) if dest == "max_model_len" else raw)
