"""Request state and the outputs handed back to callers. State only: behaviour lives in the scheduler."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class RequestStatus(enum.StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # its blocks were freed: it recomputes its tokens when it runs again
    SWAPPED = "swapped"  # its blocks wait in the host pool: they are copied back when it runs again
    FINISHED_STOPPED = "finished_stopped"  # EOS, stop token or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}


# token id -> logprob, for the chosen token plus the top-k alternatives
TokenLogprobs = dict[int, float]


def validate_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """Raise ``ValueError`` for a request that could never be served (the core and the worker front both ask)."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty: give at least one token")
    if any(not isinstance(t, int) or t < 0 or t >= vocab_size for t in prompt_token_ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(prompt_token_ids)} tokens but max_model_len is {max_model_len}: "
            "shorten the prompt (at least one token must be left to generate)"
        )
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ())):
        unknown = [t for t in ids if t >= vocab_size]
        if unknown:
            raise ValueError(f"unknown token ids in {name} {unknown}: the vocabulary has {vocab_size} tokens")


@dataclass(eq=False)  # identity: requests sit in lists that are searched every step
class Request:
    """One sequence being generated. For n > 1 each sample is its own Request sharing a ``group_id``."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower value runs first under the priority policy (vLLM's convention)
    group_id: str = ""  # the caller's request id; shared by the n samples of one request
    sample_index: int = 0  # which of the group's n samples this is
    prompt: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)  # sampled and known on the host: real ids only
    # Output tokens sampled by a step still running on the device (asynchronous scheduling): they count
    # towards the length (scheduling, max_tokens) but their ids are not known yet, so they are not in
    # ``output_token_ids``. One per step in flight: 1, or 2 between launching a step and resolving the last.
    num_output_placeholders: int = 0
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_ids: list[int] = field(default_factory=list)  # owned by cache.kv.KVCacheManager
    num_preemptions: int = 0
    first_token_time: float | None = None
    waiting_for_fork: bool = False  # a sibling sample held back until the group's first sample prefilled
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache had when it was first admitted
    num_emitted_tokens: int = 0  # output tokens already handed out in a SeqOutput

    def __post_init__(self) -> None:
        if not self.group_id:
            self.group_id = self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens sampled so far, the ones still on the device included (length limits count them)."""
        return len(self.output_token_ids) + self.num_output_placeholders

    @property
    def num_tokens(self) -> int:
        """Prompt + output length, placeholders included: what the next chunk is scheduled against."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_output_placeholders

    @property
    def all_token_ids(self) -> list[int]:
        """The known token ids (no placeholders): what the prefix cache hashes."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens


@dataclass
class CompletionOutput:
    """One of the n samples of a request, as vLLM shapes it."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one caller request after a step: all its samples, text so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
