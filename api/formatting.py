"""Job events → OpenAI response bodies: the non-streaming object and the streaming chunks, for
/v1/completions (``text_completion``) and /v1/chat/completions (``chat.completion``)."""

from __future__ import annotations

import json
import math
from typing import Any

from api.protocol import Kind
from api.tokenizer import PromptTokenizer
from wire.messages import ChoiceDelta, ChoiceResult, DeltaEvent, FinalEvent, JobResult, TokenLogprob

_quoted = json.encoder.encode_basestring  # type: ignore[attr-defined]  # a str as json.dumps writes it, in C


def dumps_chunk(body: dict[str, Any]) -> str:
    """A body as compact JSON, non-ASCII text as it is (what every streamed chunk is written as)."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False)


def usage_dict(result: JobResult) -> dict[str, Any]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.num_cached_tokens},
    }


MIN_LOGPROB = -9999.0  # what OpenAI and vLLM send for an impossible token: JSON has no -Infinity


def _logprob(value: float) -> float:
    """A logprob JSON can carry: -inf (a token masked by top-k or logit_bias) and NaN become ``MIN_LOGPROB``."""
    return max(value, MIN_LOGPROB) if math.isfinite(value) else MIN_LOGPROB


def _completion_logprobs(lps: list[TokenLogprob], tok: PromptTokenizer, offset: int) -> dict[str, Any]:
    tokens = [tok.token_text(lp.token_id) for lp in lps]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [_logprob(lp.logprob) for lp in lps],
        "top_logprobs": [{tok.token_text(i): _logprob(v) for i, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def _chat_logprobs(lps: list[TokenLogprob], tok: PromptTokenizer) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tok.token_text(token_id)
        return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode())}

    content = [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]} for lp in lps]
    return {"content": content}


class ResponseFormatter:
    """Builds response bodies for one request. Streaming state (text sent per choice) lives here, so a
    final event after missed or absent deltas (a cache hit) still sends the whole text exactly once."""

    def __init__(
        self,
        kind: Kind,
        request_id: str,
        model: str,
        created: int,
        tokenizer: PromptTokenizer,
        echo: str | None = None,
    ) -> None:
        self.kind = kind
        self.echo = echo  # completions with echo: the prompt text leads each choice's text
        self.request_id = request_id
        self.model = model
        self.created = created
        self._tok = tokenizer
        self._sent_chars: dict[int, int] = {}
        self._sent_tokens: dict[int, int] = {}
        self._echoed: set[int] = set()
        # a delta chunk's JSON around its index, text and logprobs (``delta_json``), in ``chunk``'s key order
        head = dumps_chunk({"id": request_id, "object": self._chunk_object, "created": created, "model": model})
        self._delta_head = head[:-1] + ',"choices":[{"index":'
        if kind == "chat":
            self._delta_parts = (',"delta":{"content":', '},"logprobs":', ',"finish_reason":null}]}')
        else:
            self._delta_parts = (',"text":', ',"logprobs":', ',"finish_reason":null,"stop_reason":null}]}')

    @property
    def _object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    # -- non-streaming -------------------------------------------------------------------------------------
    def response(self, result: JobResult) -> dict[str, Any]:
        choices = [self._full_choice(c) for c in sorted(result.choices, key=lambda c: c.index)]
        return {
            "id": self.request_id,
            "object": self._object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage_dict(result),
        }

    def _full_choice(self, c: ChoiceResult) -> dict[str, Any]:
        if self.kind == "chat":
            logprobs = _chat_logprobs(c.logprobs, self._tok) if c.logprobs is not None else None
            message = {"role": "assistant", "content": c.text}
            return {
                "index": c.index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,  # vLLM's: the stop string or token id that ended it, else null
            }
        logprobs = _completion_logprobs(c.logprobs, self._tok, 0) if c.logprobs is not None else None
        return {
            "index": c.index,
            "text": (self.echo or "") + c.text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    # -- streaming -----------------------------------------------------------------------------------------
    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.request_id,
            "object": self._chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return body

    def start_chunks(self, n: int) -> list[dict[str, Any]]:
        """Chat streams open with the assistant role, one chunk per choice (as OpenAI and vLLM do)."""
        if self.kind != "chat":
            return []
        return [
            self.chunk(
                [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
            )
            for i in range(n)
        ]

    def _advance(self, index: int, text: str, lps: list[TokenLogprob] | None) -> tuple[int, str]:
        """Count a chunk of choice ``index`` as sent: its text offset before it, and its text (a completion's
        echo first, once)."""
        offset = self._sent_chars.get(index, 0)
        self._sent_chars[index] = offset + len(text)
        self._sent_tokens[index] = self._sent_tokens.get(index, 0) + (len(lps) if lps else 0)
        if self.kind != "chat" and self.echo is not None and index not in self._echoed:
            self._echoed.add(index)
            text = self.echo + text
        return offset, text

    def _logprobs(self, lps: list[TokenLogprob] | None, offset: int) -> dict[str, Any] | None:
        if not lps:
            return None
        return _chat_logprobs(lps, self._tok) if self.kind == "chat" else _completion_logprobs(lps, self._tok, offset)

    def _choice_chunk(
        self,
        index: int,
        text: str,
        lps: list[TokenLogprob] | None,
        finish_reason: str | None,
        stop_reason: int | str | None = None,
    ) -> dict[str, Any]:
        offset, text = self._advance(index, text, lps)
        logprobs = self._logprobs(lps, offset)
        if self.kind == "chat":
            delta = {"content": text} if text or finish_reason is None else {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            if finish_reason is not None:  # as vLLM: on the last chunk of a choice only
                choice["stop_reason"] = stop_reason
            return self.chunk([choice])
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
        return self.chunk([choice])

    def delta_chunks(self, event: DeltaEvent) -> list[dict[str, Any]]:
        """A chunk per choice that advanced: with its text, or with "" for tokens whose text is held back (the
        first bytes of a character, a possible stop string), as vLLM streams them: one chunk per step."""
        return [
            self._choice_chunk(c.index, c.text, c.logprobs, None)
            for c in event.choices
            if c.text or c.token_ids or c.logprobs
        ]

    def delta_json(self, event: DeltaEvent) -> list[str]:
        """``delta_chunks`` as ``dumps_chunk`` writes them, from the stream's template: only the index, the
        text and the logprobs are encoded per chunk (a tenth of building and dumping the whole body)."""
        head, (before_text, before_logprobs, tail) = self._delta_head, self._delta_parts
        texts = []
        for c in event.choices:
            if c.text or c.token_ids or c.logprobs:
                offset, text = self._advance(c.index, c.text, c.logprobs)
                logprobs = self._logprobs(c.logprobs, offset)
                lp = "null" if logprobs is None else dumps_chunk(logprobs)
                texts.append(f"{head}{c.index:d}{before_text}{_quoted(text)}{before_logprobs}{lp}{tail}")
        return texts

    def final_chunks(self, event: FinalEvent, include_usage: bool) -> list[dict[str, Any]]:
        """Whatever text was not streamed yet (all of it for a cache hit), then each choice's finish reason. A
        streamed final (``FinalEvent.streamed``) holds only that rest; a whole result is cut after what was sent."""
        chunks = []
        for c in sorted(event.result.choices, key=lambda c: c.index):
            sent_chars, sent_tokens = (
                (0, 0) if event.streamed else (self._sent_chars.get(c.index, 0), self._sent_tokens.get(c.index, 0))
            )
            rest = c.text[sent_chars:]
            lps = c.logprobs[sent_tokens:] if c.logprobs is not None else None
            chunks.append(self._choice_chunk(c.index, rest, lps, c.finish_reason, c.stop_reason))
        if include_usage:
            chunks.append(self.chunk([], usage_dict(event.result)))
        return chunks


def replay_deltas(result: JobResult, tok: PromptTokenizer, skip_special_tokens: bool = True) -> list[DeltaEvent]:
    """A stored result as the deltas of a stream, one per token that adds text (the worker's stream with
    ``--stream-interval 1``), for a streamed response-cache hit. Tokens are decoded in a short window as an
    incremental detokenizer does (a character split over tokens comes whole); the pieces only ever spell a
    prefix of the stored text, and whatever is left (a stop string cut, a decoding that differs) comes with
    the final event (``final_chunks``)."""
    by_step: list[list[ChoiceDelta]] = []
    for c in sorted(result.choices, key=lambda c: c.index):
        for step, delta in enumerate(_choice_pieces(c, tok, skip_special_tokens)):
            if step == len(by_step):
                by_step.append([])
            by_step[step].append(delta)
    return [DeltaEvent(seq, choices) for seq, choices in enumerate(by_step)]  # seq 0..: a job's events


def _choice_pieces(c: ChoiceResult, tok: PromptTokenizer, skip_special_tokens: bool) -> list[ChoiceDelta]:
    pieces: list[ChoiceDelta] = []
    sent_chars = sent_tokens = 0
    prefix_offset = read_offset = 0  # the window: tokens [prefix, read) were decoded, [read, i] are new
    for i in range(len(c.token_ids)):
        before = tok.decode(c.token_ids[prefix_offset:read_offset], skip_special_tokens)
        after = tok.decode(c.token_ids[prefix_offset : i + 1], skip_special_tokens)
        if len(after) <= len(before) or after.endswith("\ufffd") or not after.startswith(before):
            continue  # nothing new yet, or half a character
        piece = after[len(before) :]
        if c.text[sent_chars : sent_chars + len(piece)] != piece:
            break  # past a stop string, or not the stored text: the rest goes with the final event
        lps = c.logprobs[sent_tokens : i + 1] if c.logprobs is not None else None
        pieces.append(ChoiceDelta(c.index, piece, list(c.token_ids[sent_tokens : i + 1]), lps))
        sent_chars += len(piece)
        sent_tokens = i + 1
        prefix_offset, read_offset = read_offset, i + 1
    return pieces
