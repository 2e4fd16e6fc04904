"""arq's worker, with the jobs of one poll claimed in one round trip.

arq claims each job it polls with WATCH, EXISTS, ZSCORE and MULTI/EXEC: four sequential round trips per job,
run one job after another, so a burst of 512 requests took the worker front most of a second to start (on
the H200 the stack's TTFT p50 at 256 streams was 1.2 s against the engine's 0.1 s). ``BatchClaimWorker``
makes the same checks and the same in-progress mark for every polled job inside one Lua script (atomic, as
the WATCH transaction was), reads there what arq's ``run_job`` would read per job, and runs the claimed jobs
with ``worker.claimed`` (arq's outcomes, without its two round trips per job). It also polls as soon as the API
announces a job (``keys.JOBS_CHANNEL``) instead of up to a poll interval later (TTFT at one stream). Pinned to
arq 0.28's ``start_jobs`` contract: the semaphore and ``job_counter`` bookkeeping are arq's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from arq.constants import abort_jobs_ss, in_progress_key_prefix, job_key_prefix, retry_key_prefix
from arq.worker import Worker

from worker.claimed import RETRY_KEY_TTL_S, ClaimedJob, FinishBatch, run_claimed

# KEYS: the queue, the abort set; ARGV: in-progress ttl ms, now ms, in-progress prefix, how many to claim at most,
# job prefix, retry prefix, retry key ttl s, job ids. Returns {[id, score, job record ('' if gone), its try (the
# retry count, incremented), 1 if an abort mark was removed, ...] of the jobs claimed: not in progress elsewhere,
# still queued, due; [ids in progress elsewhere]}: what arq's run_job reads in a round trip of its own per job
# (``worker.claimed``). The ids are all that the poll read (arq reads 5x max_jobs), not only the first ``room``: a queue's
# oldest jobs may be running on other workers (they stay queued until done), and a worker that only tried those
# would take nothing. The worker skips those running elsewhere for a while (``skip_taken_s``), so that a burst's
# polls by several workers do not check the same running jobs again and again (each check is Redis time).
_CLAIM_SCRIPT = """
local claimed, taken = {}, {}
local ttl, now, prefix, limit = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], 5 * tonumber(ARGV[4])
local job_prefix, retry_prefix, retry_ttl = ARGV[5], ARGV[6], tonumber(ARGV[7])
for i = 8, #ARGV do
  if #claimed >= limit then break end
  local id = ARGV[i]
  local score = redis.call('ZSCORE', KEYS[1], id)
  if score and tonumber(score) <= now then
    if redis.call('EXISTS', prefix .. id) == 0 then
      redis.call('PSETEX', prefix .. id, ttl, '1')
      local job_try = redis.call('INCR', retry_prefix .. id)
      redis.call('EXPIRE', retry_prefix .. id, retry_ttl)
      claimed[#claimed + 1] = id
      claimed[#claimed + 1] = score
      claimed[#claimed + 1] = redis.call('GET', job_prefix .. id) or ''
      claimed[#claimed + 1] = job_try
      claimed[#claimed + 1] = redis.call('ZREM', KEYS[2], id)
    else
      taken[#taken + 1] = id
    end
  end
end
return {claimed, taken}
"""


class BatchClaimWorker(Worker):
    """``Worker`` whose ``start_jobs`` claims a whole poll's jobs in one script call, and which polls at once
    when ``wake()`` is called (the API announces every enqueue) or else every ``idle_poll_s``."""

    _claim: Any = None
    _finishes: FinishBatch | None = None
    _wake: asyncio.Event | None = None
    _taken: dict[str, float] | None = None  # job id -> until when (monotonic s) not to try it again
    idle_poll_s = 0.02
    # a job seen running elsewhere is not tried again for this long: if that worker dies, its job's lease
    # (seconds) lapses first anyway, so this delays no failover by more than this
    skip_taken_s = 1.0

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _poll_iteration(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), self.idle_poll_s)
        self._wake.clear()
        await super()._poll_iteration()

    async def start_jobs(self, job_ids: list[bytes]) -> None:
        room = self.max_jobs - self.job_counter
        if room <= 0 or not job_ids:
            return
        now = time.monotonic()
        if self._taken is None:
            self._taken = {}
        elif len(self._taken) > 4 * len(job_ids):
            self._taken = {j: until for j, until in self._taken.items() if until > now}
        taken = self._taken
        candidates = [j for j in (b.decode() for b in job_ids) if j not in self.tasks and taken.get(j, 0.0) <= now]
        if not candidates:
            return
        now_ms = int(time.time() * 1000)
        ttl_ms = int(self.in_progress_timeout_s * 1000)
        if self._claim is None:
            self._claim = self.pool.register_script(_CLAIM_SCRIPT)  # EVALSHA, the text only when missing
        args = [ttl_ms, now_ms, in_progress_key_prefix, room, job_key_prefix, retry_key_prefix, RETRY_KEY_TTL_S]
        reply, running_elsewhere = await self._claim(keys=[self.queue_name, abort_jobs_ss], args=[*args, *candidates])
        for job_id in running_elsewhere:
            taken[job_id.decode()] = now + self.skip_taken_s
        if self._finishes is None:
            self._finishes = FinishBatch(self.pool, self.queue_name, int(self.keep_result_s * 1000))
        for k in range(0, len(reply), 5):
            await self.sem.acquire()
            self.job_counter += 1
            job_id = reply[k].decode()
            job = ClaimedJob(job_id, int(float(reply[k + 1])), reply[k + 2], int(reply[k + 3]), bool(reply[k + 4]))
            task = self.loop.create_task(run_claimed(self, self._finishes, job))
            task.add_done_callback(lambda _: self._release_sem_dec_counter_on_complete())
            self.tasks[job_id] = task
