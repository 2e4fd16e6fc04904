"""One job in flight on this worker: what its client has been sent, and its next events.

The output processor hands each job ``ChoiceUpdate``s (new text and tokens per sample). A job keeps them as
pending deltas until it is flushed, so updates from several engine steps that arrive together (a busy
front, ``--stream-interval`` > 1) go out as one event. After a lost worker, the text and tokens that the
client already has (``PriorAttempt``) are checked against the rerun and not sent again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from engine.output_processor import ChoiceUpdate
from engine.request import RequestOutput, TokenLogprobs
from engine.sampling_params import SamplingParams
from wire import keys
from wire.messages import ChoiceDelta, ChoiceResult, DeltaEvent, JobPayload, JobResult, TokenLogprob
from worker.failover import PriorAttempt


def token_logprobs(token_ids: list[int], logprobs: list[TokenLogprobs], k: int) -> list[TokenLogprob]:
    """The chosen tokens' logprobs and their top-``k`` alternatives, best first."""
    result = []
    for token_id, lps in zip(token_ids, logprobs, strict=False):
        top = sorted(lps.items(), key=lambda kv: kv[1], reverse=True)[:k]
        result.append(TokenLogprob(token_id, lps.get(token_id, float("-inf")), top))
    return result


@dataclass
class _Choice:
    """One sample's progress: produced by this attempt, already sent (by an earlier one), pending."""

    sent_chars: int = 0
    sent_tokens: int = 0
    num_chars: int = 0
    num_tokens: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass(eq=False)
class ActiveJob:
    """A job between its arq start and its final event."""

    payload: JobPayload
    params: SamplingParams
    next_seq: int
    prior: PriorAttempt
    started: float  # unix s
    done: asyncio.Future[str]
    choices: dict[int, _Choice] = field(default_factory=dict)
    first_token_at: float | None = None
    last_event_at: float | None = None
    num_unflushed_tokens: int = 0
    finished: bool = False

    def __post_init__(self) -> None:
        for index, (chars, tokens) in self.prior.sent().items():
            self.choices[index] = _Choice(sent_chars=chars, sent_tokens=tokens)

    @property
    def channel(self) -> str:
        return self.payload.reply_channel or keys.stream_channel(self.payload.request_id)

    def take(self, update: ChoiceUpdate) -> None:
        """Add one sample's new output; raises ``DivergedError`` if a rerun contradicts what was sent."""
        c = self.choices.get(update.index)
        if c is None:
            c = self.choices[update.index] = _Choice()
        if self.prior.tokens or self.prior.chars:  # a rerun: check it, and skip what the client already has
            self.prior.check(update.index, c.num_tokens, update.token_ids, update.finish_reason is not None)
            skip_tokens = max(0, c.sent_tokens - c.num_tokens)
            new_ids = update.token_ids[skip_tokens:]
            new_text = update.text[max(0, c.sent_chars - c.num_chars) :]
        else:
            skip_tokens, new_ids, new_text = 0, update.token_ids, update.text
        c.token_ids += new_ids
        if update.logprobs is not None:
            c.logprobs += update.logprobs[skip_tokens:]
        c.text += new_text
        c.num_tokens += len(update.token_ids)
        c.num_chars += len(update.text)
        self.num_unflushed_tokens += len(new_ids)

    def should_flush(self, stream_interval: int) -> bool:
        """The first output goes out at once, then every ``stream_interval`` tokens, and the end."""
        if self.finished:
            return True
        if self.num_unflushed_tokens == 0:
            return False
        return self.last_event_at is None or self.num_unflushed_tokens >= stream_interval

    def delta(self) -> DeltaEvent | None:
        """The pending deltas as the next event (None if there is nothing new); numbers it."""
        deltas = []
        for index in sorted(self.choices) if len(self.choices) > 1 else self.choices:
            c = self.choices[index]
            if not c.text and not c.token_ids:
                continue
            lps = None
            if self.params.logprobs is not None:
                lps = token_logprobs(c.token_ids, c.logprobs, self.params.logprobs)
            deltas.append(ChoiceDelta(index, c.text, c.token_ids, lps))
            c.text, c.token_ids, c.logprobs = "", [], []
        self.num_unflushed_tokens = 0
        if not deltas:
            return None
        return DeltaEvent(self.take_seq(), deltas)

    def take_seq(self) -> int:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        return seq

    def delivered(self, index: int) -> tuple[int, int]:
        """(chars, tokens) of sample ``index`` its client has from deltas: this attempt's and an earlier one's."""
        c = self.choices.get(index)
        return (0, 0) if c is None else (max(c.sent_chars, c.num_chars), max(c.sent_tokens, c.num_tokens))

    def result(self, out: RequestOutput, now: float) -> JobResult:
        """The final event's result. A streamed job's choices hold only what its deltas did not carry (they were
        flushed just before: usually nothing), see ``FinalEvent.streamed``."""
        k = self.params.logprobs
        choices = []
        for o in out.outputs:
            chars, tokens = self.delivered(o.index) if self.payload.stream else (0, 0)
            ids = o.token_ids[tokens:]
            lps = None
            if k is not None and o.logprobs is not None:
                lps = token_logprobs(ids, o.logprobs[tokens:], k)
            choices.append(
                ChoiceResult(o.index, o.text[chars:], list(ids), o.finish_reason or "abort", lps, o.stop_reason)
            )
        p = self.payload
        return JobResult(
            p.request_id,
            p.model,
            choices,
            len(p.prompt_token_ids),
            sum(len(o.token_ids) for o in out.outputs),
            out.num_cached_tokens,
            queue_time_s=self.started - p.enqueue_time,
            ttft_s=None if self.first_token_at is None else self.first_token_at - p.enqueue_time,
            e2e_s=now - p.enqueue_time,
        )
