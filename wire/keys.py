"""Every Redis key name and prefix pagedserve uses, in one place (arq's own keys listed for reference).

Per-job keys carry a TTL set by whoever writes them; nothing here is permanent except counters.
"""

from __future__ import annotations

PREFIX = "pagedserve"

# arq sorted set of job ids (score = enqueue time in ms). arq keeps a job in it until the job finishes,
# so ZCARD = queued + running.
QUEUE = f"{PREFIX}:queue"
# pub/sub channel the API pokes after each enqueue, so an idle worker starts the job now instead of at its next poll
JOBS_CHANNEL = f"{PREFIX}:jobs"
# the single job function the workers register
JOB_FUNCTION = "generate"

# arq's own keys (arq.constants), written by arq itself: job definition, in-progress marker, result, retries,
# and the sorted set of job ids to abort (we add to it on client disconnect; workers cancel the job task).
ARQ_JOB_PREFIX = "arq:job:"
ARQ_IN_PROGRESS_PREFIX = "arq:in-progress:"
ARQ_RESULT_PREFIX = "arq:result:"
ARQ_RETRY_PREFIX = "arq:retry:"
ARQ_ABORT_SET = "arq:abort"

# live workers: sorted set member = worker id, score = last heartbeat (unix s); stats under WORKER_PREFIX+id
WORKERS = f"{PREFIX}:workers"
WORKER_PREFIX = f"{PREFIX}:worker:"

# response cache entries: CACHE_PREFIX + [tenant (API key id) + ":"] + sha256 hex; no tenant = the shared cache
CACHE_PREFIX = f"{PREFIX}:cache:"
CACHE_STATS = f"{PREFIX}:cache-stats"  # hash: hits, misses (shared by all API nodes)
RATE_LIMIT_PREFIX = f"{PREFIX}:ratelimit:"  # token bucket per API key id (api.auth.key_id)


def stream_channel(job_id: str) -> str:
    """Pub/sub channel the worker publishes a job's events on."""
    return f"{PREFIX}:stream:{job_id}"


def events_key(job_id: str) -> str:
    """List of a job's events in seq order (index == seq): the source of truth a stream recovers from."""
    return f"{PREFIX}:events:{job_id}"


def job_meta_key(job_id: str) -> str:
    """What the API needs to format a job's events later (endpoint kind, model, created) and the API key id that
    owns the job: /v1/jobs/{id}/events. Written with the arq job by one script (api.admission)."""
    return f"{PREFIX}:job:{job_id}"


def worker_key(worker_id: str) -> str:
    return WORKER_PREFIX + worker_id


def cache_key(digest: str) -> str:
    return CACHE_PREFIX + digest


def rate_limit_key(key_digest: str) -> str:
    return RATE_LIMIT_PREFIX + key_digest
