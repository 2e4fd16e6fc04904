"""Exact-match response cache in Redis for deterministic requests (greedy, or seeded; n == 1).

Keyed by a canonical hash of (model, prompt token ids, sampling params): the same request always hashes the
same, whatever key order or float spelling the client used. Entries carry a TTL. Each tenant (API key) has its
own namespace, so one key's answers are never served to another; the empty namespace is the shared cache. Stdlib, redis and ``wire``
(itself stdlib only); the caller passes the key prefix so the key names stay in one module (``wire.keys``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from wire.sampling import SamplingSpec

# params that never change the generated tokens (they only shape the response) stay out of the key
_IGNORED_PARAMS = frozenset({"user", "stream", "stream_options"})


def is_cacheable(params: SamplingSpec) -> bool:
    """Greedy or seeded, one sample: the same request yields the same answer."""
    deterministic = params.temperature == 0.0 or params.seed is not None
    return deterministic and params.n == 1


def canonical_digest(model: str, prompt_token_ids: list[int], params: dict[str, Any]) -> str:
    """sha256 over a canonical JSON of the request (sorted keys, floats normalised)."""
    norm = {k: (float(v) if isinstance(v, int | float) and not isinstance(v, bool) else v) for k, v in params.items()}
    body = {
        "model": model,
        "prompt_token_ids": list(prompt_token_ids),
        "params": {k: v for k, v in sorted(norm.items()) if k not in _IGNORED_PARAMS},
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass
class CacheCounters:
    hits: int = 0
    misses: int = 0
    stores: int = 0


class ResponseCache:
    """get/put of finished results (JSON-able dicts) under ``key_prefix + digest`` with a TTL."""

    def __init__(self, redis: Redis, key_prefix: str, ttl_s: int = 3600, stats_key: str | None = None) -> None:
        if ttl_s < 1:
            raise ValueError(f"response cache ttl_s must be >= 1, got {ttl_s}")
        self._redis = redis
        self._prefix = key_prefix
        self._stats_key = stats_key
        self.ttl_s = ttl_s
        self.counters = CacheCounters()  # this process's hits/misses

    def key(self, model: str, prompt_token_ids: list[int], params: SamplingSpec, namespace: str = "") -> str:
        """Every field of ``params`` counts (``to_dict``: int ``logit_bias`` keys, so they sort as numbers and
        the digest is the one the former plain-dict params gave). ``namespace`` (a tenant id, hex) comes before
        the digest: ``prefix + namespace + ":" + digest``; "" keeps the shared ``prefix + digest``."""
        digest = canonical_digest(model, prompt_token_ids, params.to_dict())
        return f"{self._prefix}{namespace}:{digest}" if namespace else self._prefix + digest

    async def get(self, key: str) -> dict[str, Any] | None:
        return await self.record(await self._redis.get(key))

    async def record(self, raw: bytes | None) -> dict[str, Any] | None:
        """Count a lookup made elsewhere (the API's admission script reads the entry itself) and decode its hit."""
        if raw is None:
            self.counters.misses += 1
            await self._count("misses")
            return None
        self.counters.hits += 1
        await self._count("hits")
        value: dict[str, Any] = json.loads(raw)
        return value

    async def put(self, key: str, value: dict[str, Any]) -> None:
        await self._redis.set(key, json.dumps(value, separators=(",", ":")), ex=self.ttl_s)
        self.counters.stores += 1

    async def shared_counters(self) -> dict[str, int]:
        """Hits and misses summed over every API node (empty without a stats key)."""
        if self._stats_key is None:
            return {}
        raw = await self._redis.hgetall(self._stats_key)  # type: ignore[misc]
        return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}

    async def _count(self, field: str) -> None:
        if self._stats_key is not None:
            await self._redis.hincrby(self._stats_key, field, 1)  # type: ignore[misc]
