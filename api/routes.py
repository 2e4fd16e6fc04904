"""HTTP endpoints: OpenAI's /v1/completions, /v1/chat/completions, /v1/models; the EventSource job API
(/v1/jobs, /v1/jobs/{id}/events); /health, /ready, /metrics."""

from __future__ import annotations

import importlib.metadata
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from sse_starlette import EventSourceResponse
from starlette.types import Send

from api.auth import Authenticator
from api.batch import batch_stream, collect_all, response_body, start_all
from api.errors import ApiError, bad_request
from api.formatting import ResponseFormatter, replay_deltas
from api.generation_config import with_defaults
from api.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, JobRequest, TokenizeRequest
from api.request_id import log_request
from api.service import CompletionService, PreparedRequest
from api.streams import collect, formatter_for, job_event_stream, openai_stream, sse_frames
from api.tracing import annotate_request
from api.validation import BodyRoute
from wire import keys
from wire.messages import DeltaEvent, FinalEvent, JobMeta, JobResult, assemble, encode_event

try:
    VERSION = importlib.metadata.version("pagedserve")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    VERSION = "unknown"

# bodies are the protocol's pydantic models (declared in the OpenAPI schema), read by api.validation;
# no Content-Type is read as JSON, as before bodies were typed
router = APIRouter(route_class=BodyRoute, strict_content_type=False)


def _svc(request: Request) -> CompletionService:
    svc: CompletionService = request.app.state.svc
    return svc


async def _authorize(request: Request) -> str:
    """The caller's key id ("" without keys): it owns the jobs it creates and their cache namespace."""
    auth: Authenticator = request.app.state.auth
    return await auth.authorize(request.headers.get("authorization"), time.time())


# a dependency: it runs before FastAPI reports the body's validation errors (a caller without a key gets
# its 401 first), after the JSON itself was read
Tenant = Annotated[str, Depends(_authorize)]


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _sse(content: Any) -> EventSourceResponse:
    """EventSource streams (/v1/jobs): ids for Last-Event-ID and a ping every 15 s for browsers and proxies."""
    return EventSourceResponse(content, sep="\n", ping=15, headers=_SSE_HEADERS)


class _OpenAIStream(StreamingResponse):
    """OpenAI streams: the body's SSE bytes as they are (``data: <chunk>`` lines only, as OpenAI and vLLM send
    them). Plain Starlette streaming costs far less per event than sse-starlette's per-send cancel scope and
    encoding; the client's disconnect still cancels the stream, and the body is closed at once however the
    response ends, so a job whose client left is aborted."""

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def _openai_sse(frames: AsyncIterator[bytes]) -> StreamingResponse:
    return _OpenAIStream(frames, media_type="text/event-stream", headers=_SSE_HEADERS)


async def _framed(payloads: AsyncIterator[str]) -> AsyncIterator[bytes]:
    """``data:`` payloads (a batch's chunks, ``[DONE]``) as SSE events."""
    try:
        async for payload in payloads:
            yield sse_frames([payload])
    finally:
        aclose = getattr(payloads, "aclose", None)
        if aclose is not None:
            await aclose()


async def _serve(request: Request, prep: PreparedRequest) -> Response:
    # on the request's server span (FastAPI instrumentation); its context rides in the job payload to the worker
    annotate_request(prep.request_id, prompt_tokens=len(prep.prompt_token_ids), stream=prep.stream)
    if _svc(request).settings.log_requests:
        log_request(request, prep.request_id, prep.kind, len(prep.prompt_token_ids), prep.params)
    response = await _serve_traced(request, prep)
    response.headers["X-Cache"] = "hit" if prep.is_cache_hit else "miss"
    return response


async def _serve_traced(request: Request, prep: PreparedRequest) -> Response:
    svc = _svc(request)
    sub = await svc.start(prep)
    if isinstance(sub, JobResult):  # the response cache's answer
        if prep.stream:
            return _openai_sse(openai_stream(svc, prep, None, sub))
        return JSONResponse(formatter_for(svc, prep).response(sub))
    if prep.stream:
        return _openai_sse(openai_stream(svc, prep, sub))
    result = await collect(svc, prep, sub, request)
    return JSONResponse(formatter_for(svc, prep).response(result))


async def _serve_batch(request: Request, preps: list[PreparedRequest]) -> Response:
    svc = _svc(request)
    batch_id = f"cmpl-{uuid.uuid4().hex}"
    annotate_request(batch_id, prompts=len(preps))
    if svc.settings.log_requests:
        log_request(request, batch_id, "completion batch", sum(len(p.prompt_token_ids) for p in preps), preps[0].params)
    sources = await start_all(svc, preps)
    headers = {"X-Cache": "hit" if all(p.is_cache_hit for p in preps) else "miss"}
    if preps[0].stream:
        response = _openai_sse(_framed(batch_stream(svc, batch_id, sources, preps[0].include_usage)))
        response.headers.update(headers)
        return response
    results = await collect_all(svc, sources, request)
    return JSONResponse(response_body(svc, batch_id, sources, results), headers=headers)


@router.post("/v1/completions")
async def completions(request: Request, req: CompletionRequest, tenant: Tenant) -> Response:
    preps = _svc(request).prepare_completions(with_defaults(req, request.app.state.generation_defaults), tenant)
    return await (_serve(request, preps[0]) if len(preps) == 1 else _serve_batch(request, preps))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, req: ChatCompletionRequest, tenant: Tenant) -> Response:
    req = with_defaults(req, request.app.state.generation_defaults)  # --generation-config
    return await _serve(request, _svc(request).prepare_chat(req, tenant))


@router.post("/tokenize")
async def tokenize(request: Request, req: TokenizeRequest, _: Tenant) -> dict[str, Any]:
    """vLLM's tokenizer endpoint: token ids of a prompt or of chat messages (after the chat template)."""
    svc = _svc(request)
    if req.model is not None:
        svc.check_model(req.model)
    if req.messages is not None:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            ids = svc.tokenizer.encode_chat(messages, req.add_generation_prompt)
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from exc
    else:
        ids = svc.tokenizer.encode(req.prompt or "", req.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": svc.max_model_len}


@router.post("/detokenize")
async def detokenize(request: Request, req: DetokenizeRequest, _: Tenant) -> dict[str, Any]:
    svc = _svc(request)
    if req.model is not None:
        svc.check_model(req.model)
    if any(not 0 <= t < svc.tokenizer.vocab_size for t in req.tokens):
        raise bad_request(f"token ids must be in [0, {svc.tokenizer.vocab_size})", "tokens")
    return {"prompt": svc.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def _model_card(request: Request) -> dict[str, Any]:
    svc = _svc(request)
    return {
        "id": svc.model_name,
        "object": "model",
        "created": request.app.state.started,
        "owned_by": "pagedserve",
        "root": svc.model_name,
        "max_model_len": svc.max_model_len,
    }


@router.get("/v1/models/{model:path}")
async def model(request: Request, model: str) -> dict[str, Any]:
    await _authorize(request)
    _svc(request).check_model(model)
    return _model_card(request)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    await _authorize(request)
    return {"object": "list", "data": [_model_card(request)]}


# -- EventSource job API ------------------------------------------------------------------------------------
@router.post("/v1/jobs", status_code=202)
async def create_job(request: Request, req: JobRequest, tenant: Tenant) -> dict[str, Any]:
    """Queue a chat (``messages``) or completion (``prompt``) request; read it from ``events_url``."""
    svc = _svc(request)
    req = with_defaults(req, request.app.state.generation_defaults)
    if isinstance(req, ChatCompletionRequest):
        prep = svc.prepare_chat(req, tenant)
    else:
        prep = svc.prepare_completion(req, tenant)
    cached = await svc.cached(prep)
    status = "queued"
    if cached is None:
        await svc.enqueue_detached(prep)
    else:  # the stored answer as a job's events (its deltas, then the final): read like any other job's
        ttl = svc.settings.events_ttl_s
        redis = request.app.state.redis
        deltas = replay_deltas(cached, svc.tokenizer, prep.params.skip_special_tokens)
        events = [*map(encode_event, deltas), encode_event(FinalEvent(len(deltas), cached))]
        async with redis.pipeline(transaction=True) as pipe:
            pipe.set(keys.job_meta_key(prep.request_id), prep.meta().to_json(), ex=ttl)
            pipe.rpush(keys.events_key(prep.request_id), *events)
            pipe.expire(keys.events_key(prep.request_id), ttl)
            await pipe.execute()
        status = "completed"
    return {
        "id": prep.request_id,
        "object": "job",
        "status": status,
        **request.app.state.auth.events_link(prep.request_id, time.time()),
    }


async def _job_meta(request: Request, job_id: str, token: str | None = None) -> JobMeta:
    """The job's meta, checking the caller's key (or the job's token) first: another key's job is a 404."""
    auth: Authenticator = request.app.state.auth
    is_token_ok = token is not None and auth.check_job_token(token, job_id, time.time())
    meta = await _svc(request).queue.job_meta(job_id, None if is_token_ok else await _authorize(request))
    if meta is None:
        raise ApiError(404, f"no job {job_id} (unknown or expired)", "not_found_error", "job_id", "job_not_found")
    return meta


@router.get("/v1/jobs/{job_id}/events")
async def job_events(
    request: Request, job_id: str, last_event_id: str | None = None, token: str | None = None
) -> Response:
    """EventSource stream; resumes after ``Last-Event-ID`` (header, or ``last_event_id`` query parameter).
    With API keys on, ``token`` (from the job's ``events_url``) stands in for the Authorization header."""
    svc = _svc(request)
    meta = await _job_meta(request, job_id, token)
    last_id = request.headers.get("last-event-id") or last_event_id
    sub = await svc.relay.subscribe(job_id)  # before reading the list: nothing falls between the two
    return _sse(job_event_stream(svc, job_id, meta, sub, last_id))


@router.get("/v1/jobs/{job_id}")
async def job_status(request: Request, job_id: str) -> dict[str, Any]:
    meta = await _job_meta(request, job_id)
    relay = _svc(request).relay
    events = await relay.read_events(job_id, -1)
    last = events[-1] if events else None
    if isinstance(last, FinalEvent) and last.streamed:  # its answer is in the deltas before it too
        events = await relay.read_events(job_id, 0)
    status = "queued" if last is None else {"delta": "running", "final": "completed", "error": "failed"}[last.kind]
    body: dict[str, Any] = {"id": job_id, "object": "job", "status": status, "model": meta.model}
    body.update(request.app.state.auth.events_link(job_id, time.time()))  # a fresh token, for a resume
    if isinstance(last, FinalEvent):
        fmt = ResponseFormatter(meta.kind, job_id, meta.model, meta.created, _svc(request).tokenizer, meta.echo)
        body["result"] = fmt.response(assemble(last, [ev for ev in events if isinstance(ev, DeltaEvent)]))
    return body


@router.delete("/v1/jobs/{job_id}")
async def cancel_job(request: Request, job_id: str) -> dict[str, Any]:
    await _job_meta(request, job_id)
    await _svc(request).queue.abort(job_id)
    return {"id": job_id, "object": "job", "status": "cancelling"}


# -- operations ---------------------------------------------------------------------------------------------
@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ping", operation_id="ping_get")
@router.post("/ping", operation_id="ping_post")
async def ping() -> Response:
    """vLLM's (SageMaker's) liveness check: 200 with an empty body, as vLLM's /health."""
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict[str, str]:
    """vLLM's /version: this server's package version."""
    return {"version": VERSION}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    svc = _svc(request)
    try:
        await request.app.state.redis.ping()
        workers = await svc.queue.workers(fresh=True)
    except Exception as exc:  # noqa: BLE001 - any Redis failure means not ready
        return JSONResponse({"status": "redis unavailable", "error": str(exc)}, status_code=503)
    live = [w for w in workers if not w.draining]
    body = {
        "status": "ready" if live else "no live worker",
        "workers": len(live),
        "capacity": sum(w.capacity for w in live),
    }
    return JSONResponse(body, status_code=200 if live else 503)


@router.get("/ready/api")
async def ready_api(request: Request) -> JSONResponse:
    """This API process can serve (its Redis answers), workers or not: the API pods' readiness probe, so a
    fleet with no worker up keeps its API pods in the Service (they answer 503 no_live_worker themselves)."""
    try:
        await request.app.state.redis.ping()
    except Exception as exc:  # noqa: BLE001 - any Redis failure means this process cannot serve
        return JSONResponse({"status": "redis unavailable", "error": str(exc)}, status_code=503)
    return JSONResponse({"status": "ready"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    svc = _svc(request)
    try:
        await svc.queue.workers(fresh=True)
        request.app.state.queue_depth = await svc.queue.num_waiting()
    except Exception:  # noqa: BLE001 - still export the API's own metrics when Redis is away
        pass
    return Response(svc.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
