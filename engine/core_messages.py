"""What crosses the engine core's IPC channel (ZMQ, msgpack via msgspec): commands in, one message per step out.

Nothing cumulative crosses: a step's message carries, for every sample that advanced, only its new token ids
(and their logprobs) and how it finished. Detokenization, stop strings and grouping are the front's.
Structs are ``array_like`` (positional on the wire) and ``forbid_unknown_fields``: a message of another shape
is a decode error, never silently read.
"""

from __future__ import annotations

from typing import Any

import msgspec


class AddRequest(msgspec.Struct, tag="add", array_like=True, forbid_unknown_fields=True):
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams.to_dict(); the core re-validates it
    priority: int = 0
    client: int = 0  # which of the core's output sockets (worker fronts) gets this request's outputs


class AbortRequest(msgspec.Struct, tag="abort", array_like=True, forbid_unknown_fields=True):
    request_id: str
    sample_indices: list[int] | None = None  # None = every sample of the request


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True, forbid_unknown_fields=True):
    pass


Command = AddRequest | AbortRequest | Shutdown


class SeqOutput(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """What one sample of a request got in one step."""

    request_id: str  # the caller's request id (shared by its n samples)
    index: int  # which of the n samples
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None  # per new token: chosen + top-k alternatives
    finish_reason: str | None = None  # stop | length | abort; None while running
    stop_reason: int | None = None  # the stop token id that ended it, if one did
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (on the first output)


class CoreStats(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks held by requests
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    # swap space (cache.swap): vLLM v0's num_preemptions split by kind, blocks moved, its cpu_cache_usage_perc
    num_swap_preemptions: int = 0
    num_recompute_preemptions: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    cpu_kv_cache_usage: float = 0.0  # fraction of host blocks held by swapped requests
    num_swapped: int = 0  # waiting requests whose blocks are on the host (vLLM v0's num_requests_swapped)


class RequestError(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A request the core refused (bad input: ``invalid``) or lost to a failed step (``engine``)."""

    request_id: str
    message: str
    kind: str = "invalid"  # invalid | engine


class StepOutputs(msgspec.Struct, tag="step", array_like=True, forbid_unknown_fields=True):
    outputs: list[SeqOutput]
    stats: CoreStats
    errors: list[RequestError] = []
    sent_at: float = 0.0  # time.perf_counter() as the core sent it (CLOCK_MONOTONIC: the front's clock too)


class CoreReady(msgspec.Struct, tag="ready", array_like=True, forbid_unknown_fields=True):
    """Sent once the engine is loaded: what the front needs to validate requests without asking."""

    max_model_len: int
    vocab_size: int
    capacity: int  # max_num_seqs
    eos_token_ids: list[int]


class CoreFailed(msgspec.Struct, tag="failed", array_like=True, forbid_unknown_fields=True):
    """The engine could not start (sent instead of ``CoreReady``)."""

    message: str


CoreMessage = StepOutputs | CoreReady | CoreFailed

MAX_COMMAND_BYTES = 64 << 20  # a bigger command is dropped with an error in the log (a prompt is far smaller)

command_encoder = msgspec.msgpack.Encoder()
command_decoder = msgspec.msgpack.Decoder(Command)
output_encoder = msgspec.msgpack.Encoder()
output_decoder = msgspec.msgpack.Decoder(CoreMessage)
