"""The request path shared by every endpoint: validate and tokenize, a seed for sampled requests, the response
cache (per tenant), subscribe-then-admit (backpressure and enqueue in one round trip: ``api.admission``). HTTP
framing lives in ``api.streams`` and the route modules."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from api.errors import ApiError, bad_request
from api.jobs import JobQueue
from api.metrics import ApiMetrics
from api.protocol import ChatCompletionRequest, CompletionRequest, Kind
from api.relay import EventRelay, Subscription
from api.settings import ApiSettings
from api.tokenizer import PromptTokenizer
from api.tracing import current_context_carrier
from cache.responses import ResponseCache, is_cacheable
from wire.messages import JobMeta, JobPayload, JobResult
from wire.sampling import SamplingSpec, SamplingSpecError

logger = logging.getLogger(__name__)

MAX_PROMPTS = 64  # prompts in one batched /v1/completions request


@dataclass
class PreparedRequest:
    """A validated, tokenized request, ready to be served from the cache or queued."""

    kind: Kind
    request_id: str
    model: str
    prompt_token_ids: list[int]
    params: SamplingSpec
    stream: bool
    include_usage: bool = False
    priority: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.monotonic)
    cache_key: str | None = None
    echo: str | None = None  # completions with echo: the prompt text, sent before the generated text
    tenant: str = ""  # the caller's API key id (api.auth.key_id), "" without keys: owns the job
    is_cache_hit: bool = False  # answered from the response cache (X-Cache: hit)

    @property
    def n(self) -> int:
        return self.params.n

    def meta(self) -> JobMeta:
        """What /v1/jobs/{id}/events needs to format this job's events."""
        return JobMeta(self.kind, self.model, self.created, self.n, self.include_usage, self.echo, self.tenant)


class CompletionService:
    """Turns OpenAI requests into jobs. One per app; safe to share between concurrent requests."""

    def __init__(
        self,
        settings: ApiSettings,
        tokenizer: PromptTokenizer,
        model_name: str,
        max_model_len: int,
        queue: JobQueue,
        relay: EventRelay,
        cache: ResponseCache | None,
        metrics: ApiMetrics,
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.queue = queue
        self.relay = relay
        self.cache = cache
        self.metrics = metrics
        self._background: set[asyncio.Task[None]] = set()

    # -- validation and tokenization -----------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(
                404,
                f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                "not_found_error",
                "model",
                "model_not_found",
            )

    def _max_tokens(self, requested: int | None, num_prompt: int) -> int:
        if num_prompt == 0:
            raise bad_request("the prompt is empty", "prompt")
        room = self.max_model_len - num_prompt
        if room < 1 or (requested is not None and requested > room):
            want = f"{num_prompt + (requested or 1)} tokens ({num_prompt} in the prompt, {requested or 1} to generate)"
            raise bad_request(
                f"this model's maximum context length is {self.max_model_len} tokens, but you requested {want}",
                "max_tokens",
                "context_length_exceeded",
            )
        return room if requested is None else requested

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        if any(t < 0 or t >= self.tokenizer.vocab_size for t in ids):
            raise bad_request(f"prompt token ids must be in [0, {self.tokenizer.vocab_size})", "prompt")
        return ids

    def prepare_completion(self, req: CompletionRequest, tenant: str = "") -> PreparedRequest:
        """One prompt (a string or token ids); several go through ``prepare_completions``."""
        (prep,) = self.prepare_completions(req, tenant, max_prompts=1)
        return prep

    def prepare_completions(
        self, req: CompletionRequest, tenant: str = "", max_prompts: int = MAX_PROMPTS
    ) -> list[PreparedRequest]:
        """One job per prompt of a (possibly batched) completion request; all are validated before any runs.
        ``tenant``: the caller's key id (``api.auth.key_id``), owner of the jobs and their cache namespace."""
        self.check_model(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo with logprobs (prompt logprobs) is not supported", "echo")
        prompts = req.prompt_list()
        if not prompts:
            raise bad_request("prompt must not be an empty list", "prompt")
        if len(prompts) > max_prompts:
            what = "batched prompts are not supported here" if max_prompts == 1 else "too many prompts"
            raise bad_request(f"{what}: at most {max_prompts} prompts per request, got {len(prompts)}", "prompt")
        preps = []
        for prompt in prompts:
            ids = self._prompt_ids(prompt)
            prep = self._prepared("completion", "cmpl", req, ids, req.max_tokens, req.logprobs, tenant)
            if req.echo:
                prep.echo = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
            preps.append(prep)
        return preps

    def prepare_chat(self, req: ChatCompletionRequest, tenant: str = "") -> PreparedRequest:
        self.check_model(req.model)
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in req.messages]
        try:
            ids = self.tokenizer.encode_chat(messages, req.add_generation_prompt, **(req.chat_template_kwargs or {}))
            logprobs = req.num_logprobs()
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from exc
        return self._prepared("chat", "chatcmpl", req, ids, req.requested_max_tokens(), logprobs, tenant)

    def _prepared(
        self,
        kind: Kind,
        id_prefix: str,
        req: CompletionRequest | ChatCompletionRequest,
        ids: list[int],
        requested_max: int | None,
        logprobs: int | None,
        tenant: str,
    ) -> PreparedRequest:
        refused = req.unsupported()
        if refused is not None:
            raise bad_request(refused[1], refused[0], "unsupported_parameter")
        max_tokens = self._max_tokens(requested_max, len(ids))
        try:
            params = req.sampling_spec(max_tokens, logprobs)  # checks every range that needs no tokenizer
        except SamplingSpecError as exc:
            raise bad_request(str(exc), exc.param) from exc
        if any(t >= self.tokenizer.vocab_size for t in params.logit_bias or ()):
            raise bad_request(f"logit_bias token ids must be in [0, {self.tokenizer.vocab_size})", "logit_bias")
        prep = PreparedRequest(
            kind,
            f"{id_prefix}-{uuid.uuid4().hex}",
            self.model_name,
            ids,
            params,
            req.stream,
            req.include_usage,
            req.priority,
            tenant=tenant,
        )
        if self.cache is not None and is_cacheable(params):  # before the seed below: that one is ours
            namespace = "" if self.settings.shared_response_cache else tenant
            prep.cache_key = self.cache.key(self.model_name, ids, params, namespace)
        if params.seed is None and params.temperature > 0.0:
            # the job's own seed, so a rerun after failover samples the same tokens (the worker then continues
            # a stream where it stopped). Greedy jobs need none (and a seed costs the engine a generator).
            params.seed = secrets.randbits(63)  # os.urandom: distinct in every API process
        return prep

    # -- cache, queue ---------------------------------------------------------------------------------------
    async def cached(self, prep: PreparedRequest) -> JobResult | None:
        if self.cache is None or prep.cache_key is None:
            return None
        return self._hit(prep, await self.cache.get(prep.cache_key))

    def _hit(self, prep: PreparedRequest, hit: dict[str, Any] | None) -> JobResult | None:
        if hit is None:
            self.metrics.cache_misses.inc()
            return None
        self.metrics.cache_hits.inc()
        prep.is_cache_hit = True
        return JobResult.from_json(hit)

    async def remember(self, prep: PreparedRequest, result: JobResult) -> None:
        if self.cache is not None and prep.cache_key and all(c.finish_reason != "abort" for c in result.choices):
            await self.cache.put(prep.cache_key, result.to_json())

    def payload(self, prep: PreparedRequest) -> JobPayload:
        now = time.time()
        return JobPayload(
            prep.request_id,
            prep.model,
            prep.prompt_token_ids,
            prep.params,
            now,
            now + self.settings.queue_deadline_s,
            prep.stream,
            prep.priority,
            self.settings.events_ttl_s,
            current_context_carrier(),
        )

    async def _admit(self, prep: PreparedRequest, payload: JobPayload, cache_key: str | None = None) -> bytes | None:
        try:
            return await self.queue.admit(payload, prep.meta(), cache_key)
        except ApiError as exc:
            if exc.code in ("queue_full", "no_live_worker"):
                self.metrics.rejected.labels(exc.code).inc()
            raise

    async def enqueue_detached(self, prep: PreparedRequest) -> None:
        """Queue a job nobody is listening to yet (/v1/jobs): its events are read from the list later."""
        payload = self.payload(prep)
        payload.stream = True
        await self._admit(prep, payload)

    async def start(self, prep: PreparedRequest) -> Subscription | JobResult:
        """The response cache's answer, or a subscription to the job queued for it. Listen for the job's events,
        then enqueue it: no event can be published before we listen. They come through this process's reply
        channel, batched per engine step with its other jobs' events. The cache lookup is part of the admission
        script: one round trip for both."""
        cache_key = prep.cache_key if self.cache is not None else None
        sub = await self.relay.subscribe(prep.request_id, own_channel=False)  # local: no round trip
        try:
            payload = self.payload(prep)
            payload.reply_channel = self.relay.reply_channel
            raw = await self._admit(prep, payload, cache_key)
        except BaseException:
            await self.relay.unsubscribe(sub)
            raise
        if self.cache is None or cache_key is None:
            return sub
        result = self._hit(prep, await self.cache.record(raw))
        if result is None:
            return sub
        await self.relay.unsubscribe(sub)
        return result

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run cleanup (abort, unsubscribe) detached: it must finish even when the request task is cancelled."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def release(self, sub: Subscription, abort: bool) -> None:
        try:
            if abort:
                logger.info("client gone: aborting %s", sub.job_id)
                await self.queue.abort(sub.job_id)
        finally:
            await self.relay.unsubscribe(sub)
