"""JSON messages between the API and the workers: the job payload, the seq-numbered events of one job,
the final result and the worker heartbeat. No pickle crosses Redis.

Events of a job are numbered 0, 1, 2, ... by the worker (the only writer) and pushed to a Redis list at
index == seq before being published, so a reader that sees a gap (or nothing for a while) reads the list
from the next seq it expects: never a hole, and duplicates are dropped by seq.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal, get_args

import msgspec

from wire.sampling import SamplingSpec, check_fields

_COMPACT = json.JSONEncoder(separators=(",", ":"))  # one encoder: json.dumps with options builds one per call
_encode_str = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]  # the C string encoder
_IDS = msgspec.json.Encoder()  # lists of token ids


def dumps(obj: Any) -> bytes:
    """arq ``job_serializer``: compact JSON; anything exotic (an exception arq stores) becomes its str."""
    return json.dumps(obj, separators=(",", ":"), default=str).encode()


def loads(data: bytes | str) -> Any:
    """arq ``job_deserializer``."""
    return json.loads(data)


@dataclass
class JobPayload:
    """One generation job: the tokenized prompt and its sampling params, checked when the API built them."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    params: SamplingSpec
    enqueue_time: float  # unix s
    deadline: float  # unix s; a job not started by then is dropped with an error event, not generated late
    stream: bool = True  # False: only the final event is published
    priority: int = 0
    events_ttl_s: int = 3600  # how long the events list and result stay readable (resume, /v1/jobs)
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C traceparent carrier
    # the API process's channel for this job's events, batched with other jobs' per engine step; "" = the
    # job's own channel (keys.stream_channel), which any API process can follow (/v1/jobs EventSource)
    reply_channel: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (the arq job's argument)."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["prompt_token_ids"] = list(self.prompt_token_ids)
        data["params"] = self.params.to_dict()
        data["trace_context"] = dict(self.trace_context)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobPayload:
        """Inverse of ``to_dict``. Raises ``ValueError`` on unknown or missing keys (here or in ``params``)
        and on sampling params out of range: a payload from another version is refused, not half-read."""
        check_fields(cls, data)
        return cls(**{**data, "params": SamplingSpec.from_dict(data["params"])})


JobKind = Literal["completion", "chat"]


@dataclass
class JobMeta:
    """What /v1/jobs/{id}/events needs to format a job's events, stored by the API next to them (JSON)."""

    kind: JobKind  # which OpenAI response shape: /v1/completions or /v1/chat/completions
    model: str
    created: int  # unix s, the responses' ``created``
    n: int  # samples (choices) per prompt
    include_usage: bool  # stream_options.include_usage: a usage chunk before [DONE]
    echo: str | None = None  # completions with echo: the prompt text, sent before the generated text
    owner: str = ""  # the id of the API key that created the job (api.auth.key_id; "" without keys)

    def __post_init__(self) -> None:
        if self.kind not in get_args(JobKind):
            raise ValueError(f"JobMeta kind must be one of {get_args(JobKind)}, got {self.kind!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str) -> JobMeta:
        """Raises ``ValueError`` on unknown or missing keys."""
        data = json.loads(raw)
        check_fields(cls, data)
        return cls(**data)


@dataclass
class TokenLogprob:
    """The chosen token's logprob and the top alternatives as (token id, logprob) pairs."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)

    def to_json(self) -> list[Any]:
        return [self.token_id, self.logprob, [list(t) for t in self.top]]

    @classmethod
    def from_json(cls, data: list[Any]) -> TokenLogprob:
        return cls(int(data[0]), float(data[1]), [(int(i), float(lp)) for i, lp in data[2]])


def _logprobs_to_json(lps: list[TokenLogprob] | None) -> list[Any] | None:
    return None if lps is None else [lp.to_json() for lp in lps]


def _logprobs_from_json(data: list[Any] | None) -> list[TokenLogprob] | None:
    return None if data is None else [TokenLogprob.from_json(d) for d in data]


@dataclass
class ChoiceDelta:
    """New text and tokens of one of the n samples since the previous event."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass
class ChoiceResult:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | abort
    logprobs: list[TokenLogprob] | None = None
    stop_reason: int | str | None = None

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["token_ids"] = list(self.token_ids)
        data["logprobs"] = _logprobs_to_json(self.logprobs)
        return data


@dataclass
class JobResult:
    """A finished job, as stored in Redis and in the response cache."""

    request_id: str
    model: str
    choices: list[ChoiceResult]
    prompt_tokens: int
    completion_tokens: int
    num_cached_tokens: int = 0
    queue_time_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        # field by field, not dataclasses.asdict: asdict deep-copies every token list (a wave's 256 final
        # events in one step took ~50 us each in the worker front's profile)
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["choices"] = [c.to_json() for c in self.choices]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobResult:
        choices = [ChoiceResult(**{**c, "logprobs": _logprobs_from_json(c.get("logprobs"))}) for c in data["choices"]]
        return cls(**{**data, "choices": choices})


@dataclass
class DeltaEvent:
    seq: int
    choices: list[ChoiceDelta]
    kind: Literal["delta"] = "delta"


@dataclass
class FinalEvent:
    """A job's end. ``streamed``: the job's deltas came before it, and its choices carry only what they did not
    (usually nothing: an empty text and no token ids), besides the finish reasons and the usage; ``assemble``
    makes the whole result from both. A wave's end sends every stream's final within a few steps, and a
    streamed final with the whole answer was ~10x a delta to build and to write."""

    seq: int
    result: JobResult
    kind: Literal["final"] = "final"
    streamed: bool = False


def assemble(final: FinalEvent, deltas: list[DeltaEvent]) -> JobResult:
    """The whole result of a job: a streamed final's choices prefixed with what its deltas carried."""
    if not final.streamed:
        return final.result
    texts: dict[int, list[str]] = {}
    ids: dict[int, list[int]] = {}
    lps: dict[int, list[TokenLogprob]] = {}
    for event in deltas:
        for d in event.choices:
            texts.setdefault(d.index, []).append(d.text)
            ids.setdefault(d.index, []).extend(d.token_ids)
            if d.logprobs is not None:
                lps.setdefault(d.index, []).extend(d.logprobs)
    choices = [
        ChoiceResult(
            c.index,
            "".join(texts.get(c.index, [])) + c.text,
            ids.get(c.index, []) + c.token_ids,
            c.finish_reason,
            None if c.logprobs is None else lps.get(c.index, []) + c.logprobs,
            c.stop_reason,
        )
        for c in final.result.choices
    ]
    return replace(final.result, choices=choices)


@dataclass
class ErrorEvent:
    """The job ended without a result. ``status`` is the HTTP status a non-streaming caller gets."""

    seq: int
    message: str
    type: str = "server_error"  # OpenAI error type
    code: str | None = None
    status: int = 500
    kind: Literal["error"] = "error"


Event = DeltaEvent | FinalEvent | ErrorEvent


def _encode_delta(event: DeltaEvent) -> str:
    """A delta without logprobs, spelled out (the hot path: one per stream per engine step); the same JSON
    as the generic encoder gives (tested)."""
    parts = [
        f'{{"index":{c.index},"text":{_encode_str(c.text)},"token_ids":[{",".join(map(str, c.token_ids))}],'
        '"logprobs":null}'
        for c in event.choices
    ]
    return f'{{"kind":"delta","seq":{event.seq},"choices":[{",".join(parts)}]}}'


def _scalar(value: str | float | None) -> str:
    return str(_encode_str(value)) if isinstance(value, str) else _COMPACT.encode(value)


def _encode_final(event: FinalEvent) -> str:
    """A final event without logprobs, spelled out: the same JSON as the generic encoder gives (tested), in ~1/3 of
    its time (a 256-token answer on the 2-core VM: ~11 against ~34 us). A wave's end sends every stream's final
    within a few steps, each with its whole answer. Texts go through ``json``'s C string encoder (ASCII escapes,
    so the batch stays an ASCII string: raw UTF-8 from msgspec made redis-py's packing of a batch slower than
    msgspec's encoding saved), token ids through msgspec's."""
    r = event.result
    choices = ",".join(
        f'{{"index":{c.index},"text":{_encode_str(c.text)},"token_ids":{_IDS.encode(c.token_ids).decode()},'
        f'"finish_reason":{_scalar(c.finish_reason)},"logprobs":null,"stop_reason":{_scalar(c.stop_reason)}}}'
        for c in r.choices
    )
    return (
        f'{{"kind":"final","seq":{event.seq},"result":{{"request_id":{_encode_str(r.request_id)},'
        f'"model":{_encode_str(r.model)},"choices":[{choices}],"prompt_tokens":{r.prompt_tokens},'
        f'"completion_tokens":{r.completion_tokens},"num_cached_tokens":{r.num_cached_tokens},'
        f'"queue_time_s":{_scalar(r.queue_time_s)},"ttft_s":{_scalar(r.ttft_s)},"e2e_s":{_scalar(r.e2e_s)}}},'
        f'"streamed":{"true" if event.streamed else "false"}}}'
    )


def encode_event(event: Event) -> str:
    if isinstance(event, DeltaEvent) and all(c.logprobs is None for c in event.choices):
        return _encode_delta(event)
    if isinstance(event, FinalEvent) and all(c.logprobs is None for c in event.result.choices):
        return _encode_final(event)
    if isinstance(event, DeltaEvent):
        choices = [
            {"index": c.index, "text": c.text, "token_ids": c.token_ids, "logprobs": _logprobs_to_json(c.logprobs)}
            for c in event.choices
        ]
        data: dict[str, Any] = {"kind": "delta", "seq": event.seq, "choices": choices}
    elif isinstance(event, FinalEvent):
        data = {"kind": "final", "seq": event.seq, "result": event.result.to_json(), "streamed": event.streamed}
    else:
        data = asdict(event)
    return _COMPACT.encode(data)


def decode_event(raw: bytes | str) -> Event:
    return event_from_obj(json.loads(raw))


def event_from_obj(data: dict[str, Any]) -> Event:
    """An event from its decoded JSON object (a step's batch message carries many)."""
    kind = data.get("kind")
    if kind == "delta":
        choices = [
            ChoiceDelta(c["index"], c["text"], c["token_ids"], _logprobs_from_json(c.get("logprobs")))
            for c in data["choices"]
        ]
        return DeltaEvent(data["seq"], choices)
    if kind == "final":
        return FinalEvent(data["seq"], JobResult.from_json(data["result"]), streamed=bool(data.get("streamed", False)))
    if kind == "error":
        return ErrorEvent(**{k: v for k, v in data.items() if k != "kind"})
    raise ValueError(f"unknown event kind {kind!r}")


@dataclass
class WorkerHeartbeat:
    """A worker's liveness and engine stats, refreshed every few seconds under a TTL'd key."""

    worker_id: str
    model: str
    capacity: int  # max concurrent sequences (arq max_jobs)
    max_model_len: int
    active_jobs: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0  # all kinds: swap + recompute
    num_swap_preemptions: int = 0  # swap space (cache.swap): the request's KV blocks copied to host memory
    num_recompute_preemptions: int = 0  # blocks freed, the prompt prefilled again on resume
    num_blocks_swapped_out: int = 0  # running totals of KV blocks copied device -> host, host -> device
    num_blocks_swapped_in: int = 0
    cpu_kv_cache_usage: float = 0.0  # 0..1 of the host pool
    num_swapped: int = 0  # waiting requests whose KV blocks are on the host
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    jobs_done: int = 0
    draining: bool = False  # SIGTERM received: finishing running jobs, taking no new ones
    time: float = 0.0  # unix s of this beat
    host: str = ""
    pid: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str) -> WorkerHeartbeat:
        data = json.loads(raw)
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
