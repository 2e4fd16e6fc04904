"""Typed settings of the API tier, read from flags (deploy/cli.py) or ``PAGEDSERVE_*`` environment variables."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

_JINJA_CHARS = "{}\n"  # vLLM's test: a --chat-template value with none of these is a path, not a template


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template`` as vLLM reads it: a readable file's text, else the value itself when it looks like a
    template (has ``{``, ``}`` or a newline). Raises ``ValueError`` for what looks like a path but is none."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        if not any(c in value for c in _JINJA_CHARS):
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it cannot be read: {exc}") from exc
    return value


def model_max_len(folder: Path) -> int | None:
    """The model's context length from its config.json (the model's folder, not a separate tokenizer's)."""
    path = folder / "config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get("max_position_embeddings")
    return int(value) if value else None


@dataclass
class ApiSettings:
    """Everything the API process needs. Validation raises ``ValueError`` with a message a user can act on."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    model: str = ""  # folder or .gguf; "" = the default model (modelfiles.resolve)
    served_model_name: str | None = None
    max_model_len: int | None = None  # None = the model config's max_position_embeddings
    api_keys: tuple[str, ...] = ()  # empty = no auth
    rate_limit_rps: float = 0.0  # per API key, token bucket refill; 0 = off
    rate_limit_burst: int = 20
    max_queue_depth: int = 1024  # jobs waiting (not running) above which new work gets 429
    retry_after_s: int = 1
    queue_deadline_s: float = 60.0  # a job not started within this is dropped with an error
    request_timeout_s: float = 600.0  # a stream with no final event by then ends with an error
    events_ttl_s: int = 3600  # how long a job's events stay readable for resume / /v1/jobs
    response_cache: bool = True
    response_cache_ttl_s: int = 3600
    # with API keys on, each key has its own cache namespace; True shares one cache between keys (an answer
    # computed for one key may then be served to another)
    shared_response_cache: bool = False
    max_body_bytes: int = 1 << 20  # larger bodies get 413
    worker_ttl_s: float = 10.0  # a worker is live while its heartbeat is younger than this
    # with no live worker, requests are still queued until none has been live for this long (a restart's gap;
    # counted from this process's start when it never saw one); 0 = 503 at once, inf = always queue
    queue_without_workers_s: float = 0.0
    otel_exporter: str = ""  # none | console | otlp; "" = from OTEL_TRACES_EXPORTER etc. (api.tracing)
    cors_origins: tuple[str, ...] = ()  # --allowed-origins; empty = no CORS headers (vLLM's default is "*")
    tokenizer: str = ""  # a tokenizer folder apart from the model's (--tokenizer); "" = the model's own
    chat_template: str | None = None  # --chat-template: a file or the template itself; None = the model's
    # request defaults (api.generation_config): auto = the model's generation_config.json, as vLLM; vllm = the
    # server's own; or a folder holding a generation_config.json
    generation_config: str = "auto"
    log_requests: bool = True  # one INFO line per request (id, X-Request-Id, sizes); --disable-log-requests

    def __post_init__(self) -> None:
        if self.max_queue_depth < 0:
            raise ValueError(f"max_queue_depth must be >= 0, got {self.max_queue_depth}")
        if self.queue_deadline_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("queue_deadline_s and request_timeout_s must be > 0")
        if self.rate_limit_rps < 0 or self.rate_limit_burst < 1:
            raise ValueError("rate_limit_rps must be >= 0 and rate_limit_burst >= 1")
        if not self.queue_without_workers_s >= 0:  # also refuses NaN
            raise ValueError(f"queue_without_workers_s must be >= 0, got {self.queue_without_workers_s}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.generation_config not in ("auto", "vllm") and not Path(self.generation_config).is_dir():
            raise ValueError(f"generation_config must be auto, vllm or a folder, got {self.generation_config!r}")
        if self.otel_exporter not in ("", "none", "console", "otlp"):
            raise ValueError(f"otel_exporter must be none, console or otlp, got {self.otel_exporter!r}")

    @classmethod
    def from_env(cls, **overrides: object) -> ApiSettings:
        """``PAGEDSERVE_<FIELD>`` env vars (tuples comma-separated), then ``overrides`` on top."""
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = os.environ.get(f"PAGEDSERVE_{f.name.upper()}")
            if raw is None:
                continue
            values[f.name] = _parse(str(f.type), raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


def _parse(type_name: str, raw: str) -> object:
    if type_name.startswith("tuple"):
        return tuple(s.strip() for s in raw.split(",") if s.strip())
    if type_name.startswith("bool"):
        return raw.lower() in ("1", "true", "yes", "on")
    if type_name.startswith("int"):
        return None if raw == "" else int(raw)
    if type_name.startswith("float"):
        return float(raw)
    return raw or None if "None" in type_name else raw
