"""How a worker node talks to the queue (the engine's own flags are ``engine.args.EngineArgs``)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field


@dataclass
class WorkerSettings:
    """How a worker talks to the queue. ``max_jobs`` None = the engine's capacity (max_num_seqs)."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    max_jobs: int | None = None
    poll_delay_s: float = 0.02  # how often an idle worker looks at the queue (arq's default 0.5 s adds TTFT)
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 10.0
    drain_timeout_s: float = 600.0  # on SIGTERM, how long running jobs may take to finish
    job_timeout_s: float = 3600.0
    job_lease_s: float = 10.0  # a dead worker's jobs run again elsewhere this long after its last heartbeat
    max_attempts: int = 3  # a job that took down this many workers gets an error instead of a fourth
    metrics_port: int | None = None  # Prometheus endpoint of this worker; None = off
    stream_interval: int = 1  # vLLM's --stream-interval: first token at once, then an event every N tokens
    fronts: int = 1  # worker front processes on the node's engine core (worker.fronts)
    log_stats: bool = True  # vLLM's periodic engine stats line (worker.stats_log); --disable-log-stats: off

    def __post_init__(self) -> None:
        if self.max_jobs is not None and self.max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {self.max_jobs}")
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_ttl_s must exceed heartbeat_interval_s")
        if self.job_lease_s <= 2 * self.heartbeat_interval_s:
            raise ValueError("job_lease_s must be more than two heartbeat intervals (each beat renews the lease)")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.fronts < 1:
            raise ValueError(f"fronts must be >= 1, got {self.fronts}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
