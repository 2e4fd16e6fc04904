"""OpenAI request schemas (pydantic) and their translation to the job's sampling params
(``wire.sampling.SamplingSpec``, the fields of ``engine.sampling_params.SamplingParams``: ``api`` never
imports ``engine``).

The models are the endpoints' FastAPI body types, so the OpenAPI schema declares them, and they are the
only place a request is checked before it is tokenized: unknown fields are refused (``extra="forbid"``),
parameters this server does not implement are accepted only at their no-op value, and a check that spans
fields raises ``request_error`` (answered by ``api.errors`` with exactly that message, param and code)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

from api.tokenizer import RESERVED_TEMPLATE_KWARGS
from wire.messages import JobKind
from wire.sampling import SamplingSpec, SamplingSpecError

MAX_N = 16
MAX_STOP_SEQUENCES = 16
INT32_MAX = 2**31 - 1  # bound of ints that cross to the engine as tensor or msgpack values (token ids, top_k)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes

REQUEST_ERROR = "openai_request_error"  # the pydantic error type of ``request_error``
# forbid: a misspelt or unimplemented field is a 400 naming it, never silently dropped; no NaN/inf floats
_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)


def request_error(message: str, param: str | None = None, code: str | None = "unsupported_parameter") -> Exception:
    """A validation error that ``api.errors`` answers with exactly this message, param and code (the message
    travels in the context: a template would read braces in it as placeholders)."""
    return PydanticCustomError(REQUEST_ERROR, "{message}", {"message": message, "param": param, "code": code})


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's usage in every chunk: not implemented, refused when true


# OpenAI's and vLLM's parameters this server does not implement: null (or its no-op value in _NO_OP) is accepted,
# anything else is a 400 with this message, never silently ignored
NOT_IMPLEMENTED: dict[str, str] = {
    "response_format": "response_format other than text (JSON mode, schemas) is not supported",
    "tools": "tool and function calling are not supported",
    "functions": "tool and function calling are not supported",
    "tool_choice": "tool_choice is not supported (no tools)",
    "function_call": "function_call is not supported (no functions)",
    "parallel_tool_calls": "parallel_tool_calls is not supported (no tools)",
    "audio": "audio output is not supported",
    "modalities": "modalities other than text are not supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning_effort is not supported",
    "verbosity": "verbosity is not supported",
    "web_search_options": "web search is not supported",
    "store": "stored completions are not supported",
    "metadata": "metadata is not supported (it is stored with store, which is not supported)",
    "service_tier": "service tiers other than auto are not supported",
    "prompt_logprobs": "prompt logprobs are not supported",
    "structured_outputs": "structured outputs (guided decoding) are not supported",
    "guided_json": "guided decoding is not supported",
    "guided_regex": "guided decoding is not supported",
    "guided_choice": "guided decoding is not supported",
    "guided_grammar": "guided decoding is not supported",
    "guided_decoding_backend": "guided decoding is not supported",
    "guided_whitespace_pattern": "guided decoding is not supported",
}
_NO_OP: dict[str, tuple[Any, ...]] = {
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"),
    "modalities": (["text"],),
    "store": (False,),
    "metadata": ({},),
    "service_tier": ("auto", "default"),
}


def _unset() -> Any:
    return Field(None, description="not implemented: only null (or its no-op value) is accepted")


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, plus vLLM's extras)."""

    model_config = _STRICT

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(le=INT32_MAX)]] | None = None  # < 0: SamplingSpec names it
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    safety_identifier: str | None = None  # OpenAI's successor of user: an opaque id, no effect on output
    prompt_cache_key: str | None = None  # a routing hint for OpenAI's cache; prefix caching needs none
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = Field(0, ge=-INT32_MAX - 1, le=INT32_MAX)
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None  # only equal to n
    response_format: dict[str, Any] | None = _unset()
    tools: list[Any] | None = _unset()
    tool_choice: Any = _unset()
    functions: list[Any] | None = _unset()
    function_call: Any = _unset()
    parallel_tool_calls: Any = _unset()
    audio: Any = _unset()
    modalities: Any = _unset()
    prediction: Any = _unset()
    reasoning_effort: Any = _unset()
    verbosity: Any = _unset()
    web_search_options: Any = _unset()
    store: Any = _unset()
    metadata: Any = _unset()
    service_tier: Any = _unset()
    prompt_logprobs: Any = _unset()
    structured_outputs: Any = _unset()
    guided_json: Any = _unset()
    guided_regex: Any = _unset()
    guided_choice: Any = _unset()
    guided_grammar: Any = _unset()
    guided_decoding_backend: Any = _unset()
    guided_whitespace_pattern: Any = _unset()

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first requested feature this server does not have, or None."""
        for name, message in NOT_IMPLEMENTED.items():
            value = getattr(self, name)
            if value is not None and value not in _NO_OP.get(name, ()):
                return name, message
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of other than n is not supported"
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            return "stream_options.continuous_usage_stats", "continuous_usage_stats is not supported"
        return None

    @model_validator(mode="after")
    def _check_combination(self) -> Self:
        refused = self.unsupported()
        if refused is not None:
            raise request_error(refused[1], refused[0])
        if self.stream_options is not None and not self.stream:
            raise request_error("stream_options is only allowed when stream is true", "stream_options", None)
        return self

    def stop_list(self) -> list[str]:
        """The stop strings, at most ``MAX_STOP_SEQUENCES`` (``SamplingSpec`` refuses empty ones)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise SamplingSpecError("stop", f"stop must be at most {MAX_STOP_SEQUENCES} strings, got {len(stops)}")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_spec(self, max_tokens: int, logprobs: int | None) -> SamplingSpec:
        """The job's sampling params, defaults as vLLM's OpenAI server applies them. Raises
        ``SamplingSpecError`` (its ``param`` names the field) on a value out of range."""
        return SamplingSpec.from_dict(
            {
                "n": self.n,
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p,
                "top_k": 0 if self.top_k is None else self.top_k,
                "min_p": self.min_p or 0.0,
                "presence_penalty": self.presence_penalty or 0.0,
                "frequency_penalty": self.frequency_penalty or 0.0,
                "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
                "seed": self.seed,
                "max_tokens": max_tokens,
                "min_tokens": min(self.min_tokens, max_tokens),
                "stop": self.stop_list(),
                "stop_token_ids": list(self.stop_token_ids or []),
                "ignore_eos": self.ignore_eos,
                "logprobs": logprobs,
                "skip_special_tokens": self.skip_special_tokens,
                "include_stop_str_in_output": self.include_stop_str_in_output,
                "logit_bias": self.logit_bias or None,  # str keys (JSON's): the spec reads them as token ids
            }
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts: one string, one token-id list, or a batch of either."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: str


class NonTextPart(BaseModel):
    """An image, audio or file content part: recognised so that the 400 can say what is not supported."""

    model_config = ConfigDict(extra="allow")

    type: Literal["image_url", "input_audio", "file", "refusal"]


ContentPart = Annotated[TextPart | NonTextPart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    # what the openai SDK's message objects carry when a client sends a reply back: accepted when empty
    tool_calls: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    refusal: str | None = None
    annotations: list[Any] | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: str | list[TextPart | NonTextPart] | None) -> Any:
        for part in content if isinstance(content, list) else ():
            if isinstance(part, NonTextPart):
                kind = "image" if part.type == "image_url" else part.type.replace("input_", "")
                raise request_error(f"{kind} content parts are not supported (text only)")
        return content

    @model_validator(mode="after")
    def _no_calls(self) -> Self:
        if self.tool_calls or self.function_call is not None or self.audio is not None:
            raise request_error("tool calls and audio in messages are not supported")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))


# what chat_template_kwargs may not set: apply_chat_template's own parameters (the tokenizer refuses those
# too), and the Jinja environment's functions, which a template calling one would find replaced (TypeError)
RESERVED_TEMPLATE_VARS = RESERVED_TEMPLATE_KWARGS | {
    *("raise_exception", "strftime_now", "range", "dict", "lipsum", "cycler", "joiner", "namespace")
}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_vars(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        for key in kwargs or {}:
            if key in RESERVED_TEMPLATE_VARS:
                what = "a request field" if key in cls.model_fields else "the server's"
                raise request_error(f"chat_template_kwargs may not set {key} ({what})", "chat_template_kwargs", None)
        return kwargs

    @model_validator(mode="after")
    def _check_logprobs(self) -> Self:
        if self.top_logprobs and not self.logprobs:
            raise request_error("top_logprobs needs logprobs: true", "top_logprobs", None)
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the model's chat template."""

    model_config = _STRICT

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> Self:
        if (self.prompt is None) == (self.messages is None):
            raise request_error("give exactly one of prompt and messages", "prompt", None)
        return self


class DetokenizeRequest(BaseModel):
    model_config = _STRICT

    model: str | None = None
    tokens: list[int]


def _job_kind(data: Any) -> str:
    if isinstance(data, ChatCompletionRequest) or (isinstance(data, dict) and "messages" in data):
        return "chat"
    return "completion"


def _streamed(data: Any) -> Any:
    """/v1/jobs always streams (its events are read from the job's list): stream is true before checks."""
    return {**data, "stream": True} if isinstance(data, dict) else data


# /v1/jobs: a chat request (it has messages) or a completion request
JobRequest = Annotated[
    Annotated[ChatCompletionRequest, Tag("chat")] | Annotated[CompletionRequest, Tag("completion")],
    Discriminator(_job_kind),
    BeforeValidator(_streamed),
]

REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest,
    ChatCompletionRequest,
    ChatMessage,
    TextPart,
    NonTextPart,
    StreamOptions,
    TokenizeRequest,
    DetokenizeRequest,
)
FIELD_NAMES = frozenset(name for m in REQUEST_MODELS for name in m.model_fields)  # names in error locations

Kind = JobKind  # "completion" | "chat"
