"""The chat page at / in Debian's chromium (Playwright): history, streamed tokens and the tokens/s, a connection
cut mid-stream resumed without gaps or repeats (checked against the job's final result), the stop button, and
all of it behind an API key (the events URL opened by a job token, the key never in a URL)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import redis
from fastapi import FastAPI

from api.auth import JOB_TOKEN_TTL_S, JobTokens
from tests.api.conftest import MODEL, ServerThread
from tests.browser.conftest import API_KEY, CHROMIUM, CuttableProxy, PacedWorker
from wire import keys

if TYPE_CHECKING:
    from playwright.sync_api import Page, Request

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install -y chromium)"),
]
pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')")

ANSWER = (
    "Paged attention keeps each sequence's KV cache in fixed-size blocks, so the batch can grow and shrink "
    "without copying: a block table maps token positions to blocks, and finished requests free theirs at once."
)


def _pieces(text: str) -> list[str]:
    """Word-sized pieces (one token id each for the paced worker)."""
    return re.findall(r"\S+\s*", text)


def _open(page: Page, url: str, key: str | None = None) -> None:
    page.goto(url + "/")
    if key is not None:
        page.locator("#key-form").wait_for(state="visible")
        page.fill("#key", key)
        page.click("#key-form button")
    page.wait_for_function(f"document.getElementById('model').textContent === {MODEL!r}")


def _send(page: Page, text: str) -> dict[str, Any]:
    """Type and send ``text``; the JSON body the page posted to /v1/jobs (its answer's bubble is there)."""
    num_answers = page.locator(".msg.assistant").count()
    page.fill("#prompt", text)
    with page.expect_request(lambda r: r.url.endswith("/v1/jobs") and r.method == "POST") as posted:
        page.press("#prompt", "Enter")
    page.wait_for_function("n => document.querySelectorAll('.msg.assistant').length > n", arg=num_answers)
    body: dict[str, Any] = posted.value.post_data_json or {}
    return body


def _answer_text(page: Page) -> str:
    return str(page.locator(".msg.assistant").last.locator("span").first.text_content())


def _wait_state(page: Page, state: str, timeout_ms: int = 20_000) -> str:
    """Wait for the last answer's state; its job id."""
    answer = page.locator(".msg.assistant").last
    page.wait_for_function(
        "s => [...document.querySelectorAll('.msg.assistant')].pop()?.dataset.state === s",
        arg=state,
        timeout=timeout_ms,
    )
    return str(answer.get_attribute("data-job-id"))


def _wait_chars(page: Page, num_chars: int) -> None:
    page.wait_for_function(
        "n => ([...document.querySelectorAll('.msg.assistant')].pop()?.textContent.length ?? 0) >= n", arg=num_chars
    )


def _final_text(api: ServerThread, job_id: str, key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    job = httpx.get(f"{api.url}/v1/jobs/{job_id}", headers=headers, timeout=10).json()
    assert job["status"] == "completed", job
    return str(job["result"]["choices"][0]["message"]["content"])


def test_chat_streams_tokens_with_history(api: ServerThread, worker: PacedWorker, page: Page) -> None:
    worker.pieces = _pieces("Hello! Ask me about paged attention.")
    _open(page, api.url)
    page.fill("#temperature", "0.3")
    page.fill("#max-tokens", "64")
    page.fill("#top-p", "0.9")
    first = _send(page, "Hi")
    assert first["messages"] == [{"role": "user", "content": "Hi"}]
    assert (first["temperature"], first["max_tokens"], first["top_p"]) == (0.3, 64, 0.9)
    job_id = _wait_state(page, "done")
    assert _answer_text(page) == _final_text(api, job_id) == "Hello! Ask me about paged attention."

    worker.pieces = _pieces(ANSWER)
    second = _send(page, "What is paged attention?")
    assert second["messages"] == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! Ask me about paged attention."},
        {"role": "user", "content": "What is paged attention?"},
    ]
    _wait_chars(page, 10)  # tokens arrive while the job runs: part of the text, the answer still streaming
    assert page.locator(".msg.assistant").last.get_attribute("data-state") == "streaming"
    assert 0 < len(_answer_text(page)) < len(ANSWER)
    job_id = _wait_state(page, "done")
    assert _answer_text(page) == _final_text(api, job_id) == ANSWER
    rate = float(re.fullmatch(r"([\d.]+) tok/s", str(page.text_content("#rate"))).group(1))  # type: ignore[union-attr]
    assert 5 < rate < 1000  # the worker sends 20 tokens/s
    if path := os.environ.get("PAGEDSERVE_SCREENSHOT"):  # docs/chat-page.png: the README's picture
        page.screenshot(path=path)


def _events_requests(page: Page) -> list[Request]:
    seen: list[Request] = []
    page.on("request", lambda r: seen.append(r) if "/events" in r.url else None)
    return seen


def test_cut_connection_resumes_without_gaps_or_repeats(api: ServerThread, worker: PacedWorker, page: Page) -> None:
    worker.pieces = [f"t{i:02d} " for i in range(60)]  # 3 s of tokens, as long as the browser waits to reconnect
    requests = _events_requests(page)
    with CuttableProxy(api.port) as proxy:
        _open(page, proxy.url)
        _send(page, "Count")
        _wait_chars(page, 40)
        proxy.cut()
        assert len(_answer_text(page)) < 120  # mid-stream
        job_id = _wait_state(page, "done", timeout_ms=30_000)
    assert _answer_text(page) == _final_text(api, job_id) == "".join(worker.pieces)
    assert len(requests) == 2, "the connection was not cut, or resumed more than once"
    assert requests[1].all_headers().get("last-event-id"), "the reconnect did not resume"


@pytest.mark.parametrize("is_keyed", [False, True], ids=["open", "api-key"])
def test_stop_cancels_the_job(
    request: pytest.FixtureRequest, is_keyed: bool, worker: PacedWorker, page: Page, redis_url: str
) -> None:
    api: ServerThread = request.getfixturevalue("keyed_api" if is_keyed else "api")
    worker.pieces = [f"s{i:03d} " for i in range(200)]  # 10 s unless stopped
    _open(page, api.url, API_KEY if is_keyed else None)
    _send(page, "Talk for a while")
    _wait_chars(page, 20)
    with page.expect_request(lambda r: r.method == "DELETE") as deleted:
        page.click("#stop")
    job_id = _wait_state(page, "stopped")
    assert deleted.value.url.endswith(f"/v1/jobs/{job_id}")
    assert redis.Redis.from_url(redis_url).zscore(keys.ARQ_ABORT_SET, job_id) is not None
    headers = {"Authorization": f"Bearer {API_KEY}"} if is_keyed else {}
    assert httpx.get(f"{api.url}/v1/jobs/{job_id}", headers=headers, timeout=10).json()["status"] == "failed"
    shown = _answer_text(page)
    assert 0 < len(shown) < len("".join(worker.pieces)) and "".join(worker.pieces).startswith(shown)
    assert page.is_enabled("#send") and page.is_disabled("#stop")
    assert str(page.text_content(".msg.assistant .note")) == "stopped"


@contextmanager
def _token_ttl(api: ServerThread, ttl_s: int) -> Iterator[None]:
    """The running API's job tokens live ``ttl_s`` meanwhile."""
    app = api.server.config.app
    assert isinstance(app, FastAPI)
    tokens: JobTokens = app.state.auth.job_tokens
    tokens.ttl_s = ttl_s
    try:
        yield
    finally:
        tokens.ttl_s = JOB_TOKEN_TTL_S


def test_api_key_and_an_expired_token_mid_stream(
    keyed_api: ServerThread, worker: PacedWorker, page: Page, redis_url: str
) -> None:
    """The page asks for the key (a wrong one is refused), streams through the job token, and when a reconnect
    meets an expired token (401) it fetches a fresh events_url with the key and resumes where it was."""
    worker.pieces = [f"k{i:02d} " for i in range(60)]
    requests = _events_requests(page)
    statuses: list[int] = []
    page.on("response", lambda r: statuses.append(r.status) if "/events" in r.url else None)
    # tokens of 2 s: the browser's 3 s wait before it reconnects outlives them
    with CuttableProxy(keyed_api.port) as proxy, _token_ttl(keyed_api, 2):
        page.goto(proxy.url + "/")
        page.fill("#key", "sk-wrong")
        page.click("#key-form button")
        page.wait_for_function("document.getElementById('status').textContent.includes('another key')")
        assert page.is_visible("#key-form") and page.is_disabled("#send")
        _open(page, proxy.url, API_KEY)
        assert page.evaluate("sessionStorage.getItem('pagedserve.apiKey')") == API_KEY
        _send(page, "Count")
        _wait_chars(page, 40)
        proxy.cut()
        job_id = _wait_state(page, "done", timeout_ms=30_000)
    assert _answer_text(page) == _final_text(keyed_api, job_id, API_KEY) == "".join(worker.pieces)
    assert statuses == [200, 401, 200]  # the first stream, the reconnect with the stale token, the fresh one
    assert all("token=" in r.url and API_KEY not in r.url for r in requests)
    assert "last_event_id=" in requests[2].url  # a new EventSource resumes through the URL
