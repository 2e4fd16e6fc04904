"""Continuous-batching scheduler: decides which requests run in a step and how many tokens each computes.

There are no separate prefill and decode phases. Each step has ONE token budget
(``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``). A request's next chunk is simply
``num_tokens - num_computed_tokens`` tokens (a whole prompt, a slice of it under chunked prefill, or the
one newest token when decoding), clipped to what is left of the budget. Running requests are served
first, then waiting ones. When the KV pool runs dry, running requests are preempted, each by swap (its
blocks go to the host pool, ``cache.swap``, and come back as they were) or by recompute (its blocks are
freed; it recomputes prompt + generated tokens later), whichever costs less. Either way it goes back to
the FRONT of the queue (by priority under the priority policy), so it runs again before any later arrival.
Under the priority policy a waiting request that does not fit also preempts running requests of lower
priority (a larger value), lowest first; equal priorities never preempt each other (FCFS among them).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field

from cache.kv import KVCacheManager
from cache.swap import SwapKVCacheManager
from engine.config import SchedulerConfig
from engine.request import Request, RequestStatus

# Moving one token's K/V to the host and back, in tokens of recompute: for 8B-70B models over PCIe 5 (K/V of
# 128-320 KiB per token at ~50 GB/s each way, against 2 x params FLOPs per token at ~60 % of an H200's peak)
# a swap costs 0.1-0.3 of a recompute. The one exception is a prefix the device still caches (free to recompute).
SWAP_TOKEN_COST = 0.25


@dataclass
class ScheduledChunk:
    request: Request
    num_new_tokens: int  # tokens computed for this request in this step

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the known tokens, so this step yields the next token."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """The one contract between the scheduler and the model runner for one step."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write
    # run before the copies above, in this order: swap-out (device block, host block), swap-in (host, device)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """Owns the waiting and running queues; talks to the KV cache manager, never to the model."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.swap = kv if isinstance(kv, SwapKVCacheManager) else None
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[Request]] = {}  # group id -> its n samples
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self.num_recompute_preemptions = 0

    # ---- queue management -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.groups.setdefault(request.group_id, []).append(request)
        if not request.waiting_for_fork:
            self._enqueue(request)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        if self.swap is not None and self.swap.is_swapped(request):
            request.status = RequestStatus.SWAPPED
        else:
            request.status = RequestStatus.WAITING if request.num_preemptions == 0 else RequestStatus.PREEMPTED
        if self.config.policy == "priority":
            key = (request.priority, request.arrival_time)
            keys = [(r.priority, r.arrival_time) for r in self.waiting]
            # a preempted request goes before later arrivals of its priority (it arrived earlier than them)
            self.waiting.insert(bisect.bisect_right(keys, key), request)
        elif front:
            self.waiting.insert(0, request)
        else:
            self.waiting.append(request)

    def abort_group(self, group_id: str) -> list[Request]:
        """Abort every sample of a caller request; blocks are freed at once."""
        aborted = []
        for request in self.groups.get(group_id, []):
            if not request.is_finished:
                self.finish(request, RequestStatus.FINISHED_ABORTED)
                aborted.append(request)
        return aborted

    def finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.num_output_placeholders = 0  # the token of a step in flight: dropped with the request
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)  # (its host blocks too, if it is swapped out)

    def release_group(self, group_id: str) -> None:
        """Forget a group once the caller has its final output."""
        for request in self.groups.pop(group_id, []):
            self.requests.pop(request.request_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        # One token budget shared by everything; running requests first (oldest first), then waiting.
        out = SchedulerOutput()
        scheduled: dict[str, ScheduledChunk] = {}
        budget = self._schedule_running(out, scheduled, self.config.token_budget)
        self._schedule_waiting(out, scheduled, budget)
        out.chunks = list(scheduled.values())
        if not out.chunks:  # nothing runs, so nothing would copy: the copies wait for the next step that does
            return out
        if self.swap is not None:
            plan = self.swap.take_swaps()
            out.blocks_to_swap_out, out.blocks_to_swap_in = plan.swap_out, plan.swap_in
        out.blocks_to_copy = self.kv.take_pending_copies()
        return out

    def _schedule_running(self, out: SchedulerOutput, scheduled: dict[str, ScheduledChunk], budget: int) -> int:
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING or self._is_done(request):  # preempted / about to finish
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self._pick_victim()
                budget += self._preempt(victim, out, scheduled)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = ScheduledChunk(request, num_new)
                budget -= num_new
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, scheduled: dict[str, ScheduledChunk], budget: int) -> None:
        """Admit waiting requests in queue order (preempted ones sit at its front). Only when nothing had to be
        preempted (memory is tight otherwise), unless the request outranks a running one (priority policy)."""
        while self.waiting and budget > 0:
            request = self.waiting[0]
            can_preempt = self._lower_priority_victim(request) is not None
            if out.num_preempted and not can_preempt:
                break
            num_new: int | None = None
            if len(self.running) < self.config.max_num_seqs:
                num_new = self._allocate_waiting(request, budget)
            if num_new is None:
                victim = self._lower_priority_victim(request)
                if victim is None:
                    break
                budget += self._preempt(victim, out, scheduled)
                continue
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request.request_id] = ScheduledChunk(request, num_new)
            budget -= num_new

    def _allocate_waiting(self, request: Request, budget: int) -> int | None:
        """Blocks for the next chunk of a waiting request (swapped in, or from its prefix-cache hit): the chunk
        size, or None (nothing taken) when it does not fit."""
        swapped = self.swap is not None and self.swap.is_swapped(request)
        computed_ids: list[int] | None = None
        if not request.block_ids and not swapped:
            computed_ids, num_hit = self.kv.get_computed_blocks(request)
            request.num_computed_tokens = num_hit
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit
        num_new = request.num_tokens - request.num_computed_tokens
        fits = self.config.enable_chunked_prefill or num_new <= budget
        num_new = min(num_new, budget)
        if swapped and self.swap is not None:
            if not fits or not self.swap.can_swap_in(request, num_new):
                return None
            self.swap.swap_in(request)
        if not fits or self.kv.allocate_slots(request, num_new, computed_ids or None) is None:
            if swapped:
                raise RuntimeError(f"swapped-in request {request.request_id} found no room that can_swap_in promised")
            if not request.block_ids:  # undo the prefix-hit bookkeeping; no references were taken
                request.num_computed_tokens = 0
            return None
        return num_new

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _lower_priority_victim(self, request: Request) -> Request | None:
        """Under the priority policy: the running request to preempt for ``request``, if one ranks below it."""
        if self.config.policy != "priority" or not self.running:
            return None
        victim = self._pick_victim()
        return victim if victim.priority > request.priority else None

    def _preempt(self, request: Request, out: SchedulerOutput, scheduled: dict[str, ScheduledChunk]) -> int:
        """Take ``request`` off the running list by swap or recompute; returns the budget its chunk (if it was
        scheduled this step) gives back."""
        self.running.remove(request)
        if self._should_swap(request) and self.swap is not None and self.swap.swap_out(request):
            self.num_swap_preemptions += 1
        else:
            self.kv.free(request)
            request.num_computed_tokens = 0
            self.num_recompute_preemptions += 1
        request.num_preemptions += 1
        self.num_preemptions += 1
        out.num_preempted += 1
        self._enqueue(request, front=True)
        chunk = scheduled.pop(request.request_id, None)
        return chunk.num_new_tokens if chunk is not None else 0

    def _should_swap(self, request: Request) -> bool:
        """Swap when moving the blocks costs less than recomputing the tokens (the host pool has room)."""
        mode = self.config.preemption_mode
        if self.swap is None or mode == "recompute" or not self.swap.can_swap_out(request):
            return False
        if mode == "swap":
            return True
        num_recompute = request.num_computed_tokens - self.swap.num_shared_prefix_tokens(request)
        num_moved = self.swap.num_blocks_to_swap_out(request) * self.kv.block_size
        return num_moved * SWAP_TOKEN_COST < num_recompute

    # ---- after the model ran ----------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: Mapping[str, tuple[int, dict[int, float] | None]]) -> list[Request]:
        """Synchronous form: ``advance`` then ``resolve`` with the sampled tokens. ``sampled`` maps request
        id -> (token id, logprobs) for every chunk that sampled. Returns the requests that got a new token."""
        rows = self.advance(out)
        # A row whose request finished meanwhile gets no token: resolve skips it without reading the id.
        results = [(0, None) if r.is_finished else sampled[r.request_id] for r in rows]
        return self.resolve(out, rows, [t for t, _ in results], [lp for _, lp in results])

    def advance(self, out: SchedulerOutput) -> list[Request]:
        """Once the step is launched: count its tokens as computed and give every sampling chunk an output
        placeholder (``num_output_placeholders``) until ``resolve`` has its id. Returns the request of each
        sampling row, in chunk order (the order of the sampler's rows); aborted requests keep their row."""
        rows: list[Request] = []
        for chunk in out.chunks:
            request = chunk.request
            samples = chunk.samples
            if request.is_finished:  # aborted while the step was built
                if samples:
                    rows.append(request)
                continue
            request.num_computed_tokens += chunk.num_new_tokens
            if samples:
                if request.num_output_tokens == 0:
                    self._fork_siblings(request)
                request.num_output_placeholders += 1
                rows.append(request)
        return rows

    def resolve(
        self,
        out: SchedulerOutput,
        rows: list[Request],
        token_ids: list[int],
        logprobs: list[dict[int, float] | None],
    ) -> list[Request]:
        """Turn the placeholders of a step into its sampled tokens, register newly full blocks in the prefix
        cache, apply the token-level stop rules and free finished requests. With asynchronous scheduling the
        next step has already been scheduled: a request that stops here drops the token that step is
        computing (``finish`` clears its placeholder)."""
        changed: list[Request] = []
        for request, token_id, lp in zip(rows, token_ids, logprobs, strict=True):
            if request.is_finished:  # aborted (or stopped) while the step ran: its placeholder is gone
                continue
            # Steps resolve in launch order, so this step's token is the oldest placeholder: the next slot.
            request.num_output_placeholders -= 1
            request.output_token_ids.append(token_id)
            if lp is not None:
                request.output_logprobs.append(lp)
        # After the ids are in: the computed tokens (this step's, and the next step's input, which is this
        # step's token) are all known now, so the hashed blocks hold real ids only.
        for chunk in out.chunks:
            if chunk.request.status == RequestStatus.RUNNING:
                self.kv.cache_full_blocks(chunk.request)
        for request, token_id in zip(rows, token_ids, strict=True):
            if request.is_finished:
                continue
            status = self._stop_status(request, token_id, len(request.output_token_ids))
            if status is not None:
                self.finish(request, status)
            changed.append(request)
        return changed

    def _fork_siblings(self, leader: Request) -> None:
        """n > 1: the group's other samples share the leader's prompt blocks and recompute only the last
        prompt token (copy-on-write of its block), so each draws its own first token."""
        for sibling in self.groups.get(leader.group_id, []):
            if sibling is leader or not sibling.waiting_for_fork:
                continue
            self.kv.fork(leader, sibling)
            sibling.num_computed_tokens = leader.num_computed_tokens - 1
            sibling.waiting_for_fork = False
            self._enqueue(sibling, front=True)

    def _stop_status(self, request: Request, token_id: int, num_output: int) -> RequestStatus | None:
        """Stop rules for the ``num_output``-th output token (a later step's placeholder may follow it)."""
        params = request.sampling_params
        if num_output >= params.min_tokens:  # the sampler masks stop ids before that
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_prompt_tokens + num_output >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _is_done(self, request: Request) -> bool:
        """Already at its length limit, waiting for ``resolve`` to finish it (asynchronous scheduling): the
        counts include the placeholder, so no step is scheduled past max_tokens / max_model_len."""
        max_tokens = request.sampling_params.max_tokens
        full = max_tokens is not None and request.num_output_tokens >= max_tokens
        return full or request.num_tokens >= self.max_model_len
