"""Browser tests of the chat page: Debian's ``chromium`` driven by Playwright (never ``playwright install``),
the real API under uvicorn, and a paced scripted worker answering the real Redis queue."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pytest
import redis.asyncio as aioredis

from deploy.redis_server import RedisServer
from tests.api.conftest import ScriptedWorker, ServerThread, start_api
from wire import keys
from wire.messages import ChoiceDelta, ChoiceResult, JobPayload, JobResult
from wire.publisher import JobEventWriter

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

CHROMIUM = shutil.which("chromium")  # the tests skip without it (test_chat_page.py)

API_KEY = "sk-browser-test"


@dataclass
class PacedWorker(ScriptedWorker):
    """A scripted worker that sends one piece (one token id) per ``piece_delay_s``, as a slow engine would, and
    honours DELETE /v1/jobs/{id} as the real worker does: a job in arq's abort set ends with ``aborted``."""

    piece_delay_s: float = 0.05
    results: dict[str, JobResult] = field(default_factory=dict)

    async def answer(self, payload: JobPayload, finish_reason: str = "stop") -> JobResult | None:  # type: ignore[override]
        client = aioredis.Redis.from_url(self.redis_url)
        writer = JobEventWriter(client, payload.request_id, 600, channel=payload.reply_channel)
        try:
            for i, piece in enumerate(self.pieces):
                if await client.zscore(keys.ARQ_ABORT_SET, payload.request_id) is not None:
                    await writer.error("request aborted", "server_error", "aborted", 499)
                    return None
                await writer.delta([ChoiceDelta(0, piece, [100 + i])])
                await asyncio.sleep(self.piece_delay_s)
            ids = [100 + i for i in range(len(self.pieces))]
            choice = ChoiceResult(0, "".join(self.pieces), ids, finish_reason)
            result = JobResult(payload.request_id, payload.model, [choice], len(payload.prompt_token_ids), len(ids))
            await writer.final(result)
            self.results[payload.request_id] = result
            return result
        finally:
            await client.aclose()

    async def serve_forever(self, stop: threading.Event) -> None:
        tasks: set[asyncio.Task[JobResult | None]] = set()
        while not stop.is_set():
            try:
                payload = await self.take(timeout_s=0.2)
            except TimeoutError:
                continue
            task = asyncio.create_task(self.answer(payload))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks, return_exceptions=True)


class CuttableProxy:
    """A TCP proxy in front of the API, in its own thread: ``cut()`` drops every open connection at once, as a
    lost network would (Chromium's emulated offline mode leaves an open EventSource stream alone)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0
        listening = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(listening,), daemon=True)
        self._thread.start()
        listening.wait(5)

    def _run(self, listening: threading.Event) -> None:
        # here, not in the test's thread: the Playwright sync API keeps a loop marked running there
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        listening.set()
        self._loop.run_forever()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers.update((writer, up_writer))
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        self._writers.difference_update((writer, up_writer))

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    def cut(self) -> None:
        async def abort_all() -> None:
            for writer in list(self._writers):
                writer.transport.abort()

        asyncio.run_coroutine_threadsafe(abort_all(), self._loop).result(5)

    def __enter__(self) -> CuttableProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        async def shutdown() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()


@pytest.fixture
def worker(redis_url: str) -> Iterator[PacedWorker]:
    """A paced worker in its own thread and event loop (the Playwright sync API owns the test's thread)."""
    paced = PacedWorker(redis_url, pieces=[f"w{i:02d} " for i in range(40)])
    stop = threading.Event()
    thread = threading.Thread(target=asyncio.run, args=(paced.serve_forever(stop),), daemon=True)
    thread.start()
    yield paced
    stop.set()
    thread.join(10)


@pytest.fixture(scope="module")
def api(redis_server: RedisServer) -> Iterator[ServerThread]:
    server = start_api(redis_server, response_cache=False)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed_api(redis_server: RedisServer) -> Iterator[ServerThread]:
    server = start_api(redis_server, api_keys=(API_KEY,), response_cache=False)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Module-scoped, not session: the sync API keeps its event loop marked running in this thread meanwhile,
    which async tests of other modules would trip over."""
    from playwright.sync_api import sync_playwright

    assert CHROMIUM is not None
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 900, "height": 600})
    page = context.new_page()
    page.set_default_timeout(15_000)
    yield page
    context.close()
