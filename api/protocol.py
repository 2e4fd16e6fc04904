"""OpenAI request schemas (pydantic) and their translation to the job's sampling params
(``wire.sampling.SamplingSpec``, the fields of ``engine.sampling_params.SamplingParams``: ``api`` never
imports ``engine``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from wire.messages import JobKind
from wire.sampling import SamplingSpec, SamplingSpecError

MAX_N = 16
MAX_STOP_SEQUENCES = 16


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, plus vLLM's extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    logit_bias: dict[str, float] | None = None
    # accepted by OpenAI or vLLM but not implemented here: refused with a 400 when set (never silently ignored)
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    best_of: int | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first requested feature this server does not have, or None."""
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", "response_format other than text (JSON mode, schemas) is not supported"
        if self.tools or self.functions:
            return ("tools" if self.tools else "functions"), "tool and function calling are not supported"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice", "tool_choice is not supported (no tools)"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of other than n is not supported"
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                return name, "guided decoding is not supported"
        return None

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
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs needs logprobs: true")
            return None
        return self.top_logprobs or 0


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the model's chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


Kind = JobKind  # "completion" | "chat"
