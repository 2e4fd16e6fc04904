"""vLLM's periodic engine stats line in the worker's log, which operators of vLLM watch and their log tools parse:

    Engine <worker id>: Avg prompt throughput: 1234.5 tokens/s, Avg generation throughput: 567.8 tokens/s,
    Running: 12 reqs, Waiting: 0 reqs, GPU KV cache usage: 3.1%, Prefix cache hit rate: 40.0%

(one line; with requests swapped to the CPU, ``Swapped: N reqs, CPU KV cache usage: X%`` follow). It is built from
the heartbeat (the numbers /metrics and /ready carry), every ``interval_s`` (vLLM's variable
``VLLM_LOG_STATS_INTERVAL``, default 10 s; heartbeats come every second), at INFO while the engine works and once after it stops, else at DEBUG, as vLLM does. The averages and the hit
rate are over the interval (the hit rate keeps its last value through intervals without lookups); prompt tokens
count when their request reaches the engine. Front 0 of a node
logs it (``worker.fronts``); ``--disable-log-stats`` turns it off and leaves the Prometheus metrics as they are.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from wire.messages import WorkerHeartbeat

logger = logging.getLogger(__name__)

LOG_STATS_INTERVAL_S = 10.0


def interval_from_env() -> float:
    """``VLLM_LOG_STATS_INTERVAL`` (seconds, > 0), else ``LOG_STATS_INTERVAL_S``."""
    raw = os.environ.get("VLLM_LOG_STATS_INTERVAL", "")
    try:
        interval = float(raw) if raw else LOG_STATS_INTERVAL_S
    except ValueError:
        raise ValueError(f"VLLM_LOG_STATS_INTERVAL must be a number of seconds, got {raw!r}") from None
    if not interval > 0:
        raise ValueError(f"VLLM_LOG_STATS_INTERVAL must be > 0, got {raw!r}")
    return interval


@dataclass(frozen=True)
class _Mark:
    """The running totals at the last line."""

    at: float
    prompt: int
    generation: int
    queries: int
    hits: int

    @classmethod
    def of(cls, beat: WorkerHeartbeat, at: float) -> _Mark:
        totals = (beat.prompt_tokens_total, beat.generation_tokens_total)
        return cls(at, *totals, beat.prefix_cache_queries, beat.prefix_cache_hits)


class StatsLog:
    """Turns heartbeats into the periodic line (``observe`` each beat; it logs when a line is due)."""

    def __init__(
        self, worker_id: str, interval_s: float = LOG_STATS_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.worker_id = worker_id
        self.interval_s = interval_s
        self.clock = clock
        self._mark: _Mark | None = None
        self._was_active = False
        self._hit_rate = 0.0

    def observe(self, beat: WorkerHeartbeat) -> str | None:
        """Logs and returns the line when ``interval_s`` has passed since the last one (the first beat only
        starts the count), else None."""
        now = self.clock()
        if self._mark is None:
            self._mark = _Mark.of(beat, now)
            return None
        if now - self._mark.at < self.interval_s:
            return None
        line, active = self._line(beat, _Mark.of(beat, now))
        logger.log(logging.INFO if active or self._was_active else logging.DEBUG, line)
        self._was_active = active
        return line

    def _line(self, beat: WorkerHeartbeat, new: _Mark) -> tuple[str, bool]:
        old, self._mark = self._mark, new
        assert old is not None
        seconds = new.at - old.at
        prompt_rate = (new.prompt - old.prompt) / seconds
        generation_rate = (new.generation - old.generation) / seconds
        queries = new.queries - old.queries
        if queries > 0:
            self._hit_rate = (new.hits - old.hits) / queries
        line = (
            f"Engine {self.worker_id}: Avg prompt throughput: {prompt_rate:.1f} tokens/s, "
            f"Avg generation throughput: {generation_rate:.1f} tokens/s, Running: {beat.num_running} reqs, "
            f"Waiting: {beat.num_waiting} reqs, GPU KV cache usage: {100 * beat.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {100 * self._hit_rate:.1f}%"
        )
        if beat.num_swapped or beat.cpu_kv_cache_usage:
            line += f", Swapped: {beat.num_swapped} reqs, CPU KV cache usage: {100 * beat.cpu_kv_cache_usage:.1f}%"
        active = prompt_rate > 0 or generation_rate > 0 or beat.num_running > 0 or beat.num_waiting > 0
        return line, active
