"""Picking up a job whose worker died: what the earlier attempt already streamed, and how to go on from it.

arq runs a job again once the dead worker's in-progress lease runs out (the live worker renews it with every
heartbeat). A non-streaming job published nothing, so it simply runs again. A streaming job whose client has
already seen tokens can only be continued if generating again gives the same tokens: greedy or seeded
requests run again from the start, the tokens the client already has are checked and not sent twice, and the
stream goes on where it stopped. Anything else, or a rerun that comes out different, ends the stream with a
clear ``worker_lost`` error: a client never gets a stream spliced from two different generations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from redis.asyncio import Redis

from wire import keys
from wire.messages import DeltaEvent, decode_event


class DivergedError(Exception):
    """The rerun of a job produced tokens other than those its client already received."""


@dataclass
class PriorAttempt:
    """The events an earlier attempt of one job left in its events list."""

    num_events: int = 0
    finished: bool = False  # it wrote the final or error event: only arq's bookkeeping was lost
    tokens: dict[int, list[int]] = field(default_factory=dict)  # choice index -> token ids already sent
    chars: dict[int, int] = field(default_factory=dict)  # choice index -> characters of text already sent

    @classmethod
    async def load(cls, redis: Redis, job_id: str) -> PriorAttempt:
        raws = await redis.lrange(keys.events_key(job_id), 0, -1)  # type: ignore[misc]
        prior = cls(num_events=len(raws))
        for raw in raws:
            event = decode_event(raw)
            if not isinstance(event, DeltaEvent):
                prior.finished = True
                continue
            for c in event.choices:
                prior.tokens.setdefault(c.index, []).extend(c.token_ids)
                prior.chars[c.index] = prior.chars.get(c.index, 0) + len(c.text)
        return prior

    @property
    def sent_anything(self) -> bool:
        return any(self.tokens.values()) or any(self.chars.values())

    def sent(self) -> dict[int, tuple[int, int]]:
        """Per choice, (characters, tokens) already published: where the rerun's deltas start."""
        return {i: (self.chars.get(i, 0), len(t)) for i, t in self.tokens.items()}

    def check(self, index: int, start: int, token_ids: list[int], finished: bool) -> None:
        """Raise ``DivergedError`` if choice ``index``'s rerun tokens ``token_ids`` (from position ``start``)
        disagree with those already sent, or it ended before reaching them."""
        before = self.tokens.get(index)
        if not before or start >= len(before) and not finished:
            return
        overlap = before[start : start + len(token_ids)]
        if token_ids[: len(overlap)] != overlap or (finished and start + len(token_ids) < len(before)):
            raise DivergedError(f"choice {index} differs from what was streamed after token {start}")
