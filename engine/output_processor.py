"""From the core's per-step token deltas to what callers see: incremental text, stop strings, n > 1 grouping.

The engine core hands out, per step, each advanced sample's new token ids (``SeqOutput``). This processor keeps
each sample's detokenizer and token list, turns those into ``ChoiceUpdate``s (only what is new: text, tokens,
logprobs, how it finished) and, when a request ends, its cumulative ``RequestOutput``. A stop string is found
here, so the sample ends here: the caller then tells the core to abort it (``ProcessedStep.aborts``), and any
token the core computed after it is ignored. Used by the offline ``LLM`` and by the worker front alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.core_messages import SeqOutput
from engine.detokenizer import IncrementalDetokenizer
from engine.request import CompletionOutput, RequestOutput, TokenLogprobs
from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class ChoiceUpdate:
    """What one of a request's samples got in one step."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class ProcessedStep:
    updates: list[ChoiceUpdate] = field(default_factory=list)
    aborts: list[tuple[str, int]] = field(default_factory=list)  # (request id, sample) a stop string ended
    finished: list[str] = field(default_factory=list)  # requests whose every sample has ended


@dataclass(eq=False)
class _Sample:
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finish(self, reason: str, stop_reason: int | str | None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        if self.detok is not None:
            self.detok.finish()


@dataclass(eq=False)
class _RequestState:
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    num_cached_tokens: int = 0


class OutputProcessor:
    """Per-request output state of every request in flight. ``tokenizer`` None = token ids only."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None):
        """Start tracking a request (before it reaches the core). Raises ``ValueError`` on what only the
        front can refuse."""
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine runs with skip_tokenizer_init")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        samples = [
            _Sample(
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params) if self.tokenizer else None,
                logprobs=[] if params.logprobs is not None else None,
            )
            for _ in range(params.n)
        ]
        self._requests[request_id] = _RequestState(prompt, list(prompt_token_ids), samples)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def process(self, outputs: list[SeqOutput]) -> ProcessedStep:
        step = ProcessedStep()
        ended: dict[str, None] = {}  # requests a sample of which ended in this step
        for out in outputs:
            state = self._requests.get(out.request_id)
            if state is None or out.index >= len(state.samples):
                continue  # dropped by the caller (aborted) while the core was still stepping it
            sample = state.samples[out.index]
            if sample.finish_reason is not None:
                continue  # ended here by a stop string; the core's later tokens and its abort are ignored
            if out.num_cached_tokens and out.index == 0:
                state.num_cached_tokens = out.num_cached_tokens
            update = self._advance(out, sample)
            if update.finish_reason is not None:
                ended[out.request_id] = None
                if out.finish_reason is None:
                    step.aborts.append((out.request_id, out.index))
            step.updates.append(update)
        step.finished = [rid for rid in ended if all(s.finish_reason for s in self._requests[rid].samples)]
        return step

    @staticmethod
    def _advance(out: SeqOutput, sample: _Sample) -> ChoiceUpdate:
        """Take the sample's new tokens (one at a time if a stop string may end it at any of them)."""
        detok = sample.detok
        if detok is not None and detok.stop_strings:
            new_ids = OutputProcessor._add_watching_stops(out, sample, detok)
        else:  # the hot path: no stop strings, so every token is taken
            new_ids = out.new_token_ids
            if detok is not None:
                detok.add_tokens(new_ids)
            if sample.logprobs is not None and out.new_logprobs is not None:
                sample.logprobs.extend(out.new_logprobs)
        sample.token_ids.extend(new_ids)
        if sample.finish_reason is None and out.finish_reason is not None:
            sample.finish(out.finish_reason, out.stop_reason)
        text = detok.take_new_text() if detok is not None else ""
        logprobs = None
        if sample.logprobs is not None:
            logprobs = sample.logprobs[len(sample.logprobs) - len(new_ids) :] if new_ids else []
        return ChoiceUpdate(
            out.request_id, out.index, text, new_ids, logprobs, sample.finish_reason, sample.stop_reason
        )

    @staticmethod
    def _add_watching_stops(out: SeqOutput, sample: _Sample, detok: IncrementalDetokenizer) -> list[int]:
        """The new tokens up to and including the one that completes a stop string (which ends the sample)."""
        new_ids: list[int] = []
        for k, token_id in enumerate(out.new_token_ids):
            new_ids.append(token_id)
            if sample.logprobs is not None and out.new_logprobs is not None:
                sample.logprobs.append(out.new_logprobs[k])
            stop = detok.add_tokens([token_id])
            if stop is not None:
                last = k == len(out.new_token_ids) - 1
                if not (last and out.finish_reason is not None):  # else the core ended it here anyway: its reason
                    sample.finish_reason, sample.stop_reason = "stop", stop
                break
        return new_ids

    def output(self, request_id: str) -> RequestOutput:
        """The request's cumulative output (text and tokens so far; ``finished`` once every sample ended)."""
        state = self._requests[request_id]
        outputs = []
        for i, s in enumerate(state.samples):
            cumulative = None
            if s.logprobs is not None:
                cumulative = sum(lp[t] for lp, t in zip(s.logprobs, s.token_ids, strict=False))
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=s.detok.output_text if s.detok is not None else "",
                    token_ids=list(s.token_ids),
                    cumulative_logprob=cumulative,
                    logprobs=list(s.logprobs) if s.logprobs is not None else None,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
            )
        finished = all(s.finish_reason for s in state.samples)
        return RequestOutput(
            request_id, state.prompt, state.prompt_token_ids, outputs, finished, state.num_cached_tokens
        )

    def pop(self, request_id: str) -> RequestOutput:
        """The request's output, and forget it."""
        result = self.output(request_id)
        del self._requests[request_id]
        return result

    def drop(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
