"""Asyncio front of the engine: ``generate()`` as an async iterator, ``abort()`` that frees blocks at once.

The engine loop runs in its own thread (torch releases the GIL in its kernels), so the event loop that
talks to Redis and HTTP stays responsive. Commands reach the loop through a thread-safe queue as typed
messages; outputs come back to each caller's asyncio queue with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.engine import Engine, EngineStats
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineStats"]


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    """One engine, many concurrent async callers."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = Engine(config)
        self.max_model_len = self.engine.max_model_len
        self.capacity = config.scheduler.max_num_seqs
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams and the stats snapshot
        self._stats = self.engine.stats()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="engine-loop")
        self._thread.start()

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request; the last has ``finished=True``. Raises ``ValueError`` on bad
        input before yielding. Closing or cancelling the iterator aborts the request."""
        self.engine.validate(prompt_token_ids, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._commands.put(_Add(request_id, list(prompt_token_ids), params, priority))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)
            with self._lock:
                self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def stats(self) -> EngineStats:
        with self._lock:
            return self._stats

    async def shutdown(self) -> None:
        self._stopped = True
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join, 30)
        self.engine.shutdown()

    # ---- the engine thread ------------------------------------------------------------------------
    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _handle(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Add):
            try:
                self.engine.add_request(
                    command.request_id, command.prompt_token_ids, command.params, priority=command.priority
                )
            except ValueError as exc:
                self._deliver(command.request_id, exc)
        else:
            final = self.engine.abort_request(command.request_id)
            if final is not None:
                self._deliver(command.request_id, final)

    def _run(self) -> None:
        while not self._stopped:
            block = not self.engine.has_unfinished_requests()
            try:
                command = self._commands.get(block=block, timeout=1.0 if block else None)
                while True:
                    if command is None:
                        return
                    self._handle(command)
                    command = self._commands.get_nowait()
            except queue.Empty:
                pass
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a broken step must not leave callers hanging
                logger.exception("engine step failed")
                with self._lock:
                    ids = list(self._streams)
                for rid in ids:
                    self._deliver(rid, RuntimeError(f"engine step failed: {exc}"))
                    self.engine.abort_request(rid)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
            with self._lock:
                self._stats = self.engine.stats()
