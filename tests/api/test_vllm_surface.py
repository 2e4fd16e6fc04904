"""vLLM's HTTP surface on the real app under real uvicorn, with a scripted worker on the real Redis queue:
/version and /ping, X-Request-Id, chat ``stop_reason``, a streamed response-cache hit replayed as deltas,
--allowed-origins, --chat-template, --tokenizer, --root-path and HTTPS (--ssl-keyfile/--ssl-certfile)."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis
import uvicorn
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

import modelfiles
from api.app import create_app
from api.formatting import ResponseFormatter, replay_deltas
from api.settings import ApiSettings
from api.tokenizer import PromptTokenizer
from deploy.api_args import uvicorn_kwargs
from deploy.cli import build_parser
from deploy.redis_server import RedisServer, free_port
from tests.api.conftest import MODEL, ScriptedWorker, ServerThread, start_api
from wire.messages import ChoiceDelta, ChoiceResult, FinalEvent, JobPayload, JobResult, TokenLogprob
from wire.publisher import JobEventWriter

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
# several tokens per emoji and accented letters: the replay must not split a character
ANSWER = "Hello, wörld! 🙂🙂 done."


@pytest.fixture(scope="module")
def api(redis_server: RedisServer) -> Iterator[ServerThread]:
    server = start_api(redis_server, cors_origins=("https://chat.example",), chat_template=TEMPLATE)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def folder() -> Path:
    return modelfiles.resolve(None).folder


async def _answer_by_token(redis_url: str, payload: JobPayload, text: str, folder: Path) -> list[str]:
    """A worker's stream of ``text``: one delta per token, decoded as the worker's detokenizer does
    (``DecodeStream``: nothing until a character is whole), then the final result with a stop reason. Returns
    the deltas' texts."""
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=False).ids
    client = aioredis.Redis.from_url(redis_url)
    writer = JobEventWriter(
        client, payload.request_id, 60, publish_deltas=payload.stream, channel=payload.reply_channel
    )
    try:
        stream = DecodeStream(skip_special_tokens=True)
        pieces = []
        for token_id in ids:
            pieces.append(stream.step(tok, token_id) or "")
            await writer.delta([ChoiceDelta(0, pieces[-1], [token_id])])
        choice = ChoiceResult(0, text, ids, "stop", stop_reason="</end>")
        await writer.final(JobResult(payload.request_id, payload.model, [choice], 5, len(ids)))
        return pieces
    finally:
        await client.aclose()


def _stream_chat(url: str, **extra: Any) -> tuple[list[dict[str, Any]], httpx.Headers]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True, "temperature": 0, **extra}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return [json.loads(line) for line in lines[:-1]], resp.headers


def _contents(chunks: list[dict[str, Any]]) -> list[str]:
    return [
        c["choices"][0]["delta"]["content"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")
    ]


async def test_a_streamed_cache_hit_replays_the_streams_deltas(api: ServerThread, redis_url: str, folder: Path) -> None:
    worker = ScriptedWorker(redis_url)

    async def serve_one() -> list[str]:
        return await _answer_by_token(redis_url, await worker.take(), ANSWER, folder)

    job = asyncio.ensure_future(serve_one())
    miss, miss_headers = await asyncio.to_thread(_stream_chat, api.url)
    sent = [piece for piece in await job if piece]
    hit, hit_headers = await asyncio.to_thread(_stream_chat, api.url)
    assert (miss_headers["x-cache"], hit_headers["x-cache"]) == ("miss", "hit")
    assert len(worker.payloads) == 1  # the second came from the cache
    assert "".join(_contents(hit)) == ANSWER
    assert "".join(_contents(miss)) == ANSWER  # (a lagging reader of the live stream gets deltas merged)
    assert _contents(hit) == sent and len(sent) > 5  # the worker's deltas, one by one, not one chunk
    assert hit[-1]["choices"][0]["finish_reason"] == "stop" and hit[-1]["choices"][0]["stop_reason"] == "</end>"
    assert all("stop_reason" not in c["choices"][0] for c in hit[:-1])  # vLLM: on the last chunk only


async def test_chat_stop_reason_and_the_request_log(
    api: ServerThread, redis_url: str, folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    worker = ScriptedWorker(redis_url)

    async def serve_one() -> None:
        await _answer_by_token(redis_url, await worker.take(), "Bye.", folder)

    job = asyncio.ensure_future(serve_one())
    client = openai.AsyncOpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0)
    with caplog.at_level(logging.INFO, logger="pagedserve.requests"):
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": "bye"}],
            max_tokens=5,
            temperature=0.5,
            extra_headers={"X-Request-Id": "logged-7"},
        )
    await job
    reply = raw.parse()
    assert raw.headers["x-request-id"] == "logged-7"
    assert reply.choices[0].message.content == "Bye."
    assert reply.choices[0].model_dump()["stop_reason"] == "</end>"
    (line,) = [r.getMessage() for r in caplog.records if "logged-7" in r.getMessage()]
    assert line.startswith(f"request {reply.id} (X-Request-Id logged-7): chat, ") and "prompt tokens" in line


def test_disable_log_requests(redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    server = start_api(redis_server, log_requests=False)
    try:
        with caplog.at_level(logging.INFO, logger="pagedserve.requests"):
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
            with pytest.raises(httpx.ReadTimeout):  # nobody answers; the line would be written before queueing
                httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
        assert not [r for r in caplog.records if r.name == "pagedserve.requests"]
    finally:
        server.stop()


def test_version_and_ping(api: ServerThread) -> None:
    version = httpx.get(api.url + "/version").json()["version"]
    assert version and version != "unknown"
    for method in ("GET", "POST"):
        resp = httpx.request(method, api.url + "/ping")
        assert resp.status_code == 200 and resp.content == b""


def test_x_request_id_is_echoed_or_generated(api: ServerThread) -> None:
    assert httpx.get(api.url + "/health", headers={"X-Request-Id": "client-id-1"}).headers["x-request-id"] == (
        "client-id-1"
    )
    generated = httpx.get(api.url + "/health").headers["x-request-id"]
    assert len(generated) == 32 and int(generated, 16) >= 0
    replaced = httpx.get(api.url + "/health", headers={"X-Request-Id": "x" * 500}).headers["x-request-id"]
    assert len(replaced) == 32  # an id no log line should carry is replaced
    bad = httpx.post(api.url + "/v1/chat/completions", json={"model": MODEL}, headers={"X-Request-Id": "bad-1"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "bad-1"  # errors carry it too


def test_allowed_origins_answer_cors(api: ServerThread) -> None:
    headers = {"Origin": "https://chat.example", "Access-Control-Request-Method": "POST"}
    preflight = httpx.options(api.url + "/v1/chat/completions", headers=headers)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://chat.example"
    other = httpx.options(api.url + "/v1/chat/completions", headers={**headers, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    exposed = httpx.get(api.url + "/health", headers={"Origin": "https://chat.example"})
    assert "X-Request-Id" in exposed.headers["access-control-expose-headers"]


def test_chat_template_replaces_the_models(api: ServerThread, folder: Path) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    tokens = httpx.post(api.url + "/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    expected = PromptTokenizer(folder).encode("[user] Hi there\n[assistant]", add_special_tokens=False)
    assert tokens == expected


def test_tokenizer_folder_apart_from_the_model(redis_server: RedisServer, folder: Path, tmp_path: Path) -> None:
    tok = tmp_path / "tokenizer"
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).is_file():
            shutil.copy(folder / name, tok / name)
    (tok / "chat_template.jinja").write_text("{% for m in messages %}<<{{ m.content }}>>{% endfor %}")
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    server = start_api(redis_server, tokenizer=str(tok))
    try:
        messages = [{"role": "user", "content": "Hi"}]
        body = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": messages}).json()
        assert body["tokens"] == PromptTokenizer(folder).encode("<<Hi>>", add_special_tokens=False)
        max_len = json.loads((folder / "config.json").read_text())["max_position_embeddings"]
        assert body["max_model_len"] == max_len  # the model's config, though the tokenizer folder has none
    finally:
        server.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_https_and_root_path_through_uvicorns_keywords(redis_server: RedisServer, tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    port = free_port()
    argv = ["api", "--port", str(port), "--root-path", "/llm", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]
    kwargs = uvicorn_kwargs(build_parser().parse_args(argv))
    kwargs.pop("workers")  # one process, in a thread here
    app = create_app(ApiSettings(redis_url=redis_server.url))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", **{**kwargs, "log_level": "warning"}))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=str(cert)) as client:
            assert client.get("/version").status_code == 200
            assert client.get("/openapi.json").json()["servers"] == [{"url": "/llm"}]
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.parametrize("setting", ["auto", "vllm"])
async def test_generation_config_gives_the_defaults_a_request_leaves_out(
    redis_server: RedisServer, redis_url: str, folder: Path, tmp_path: Path, setting: str
) -> None:
    model = tmp_path / "my-model"  # the default model's folder, with a generation_config.json
    shutil.copytree(folder, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.25, "top_k": 7, "max_new_tokens": 9}))
    server = start_api(redis_server, model=str(model), generation_config=setting)
    worker = ScriptedWorker(redis_url)
    try:
        chat = {"model": "my-model", "messages": [{"role": "user", "content": "hi"}]}
        for body in (chat, {**chat, "temperature": 0.5, "max_completion_tokens": 3}):
            assert httpx.post(server.url + "/v1/jobs", json=body).status_code == 202
        left_out, given = (await worker.take()).params, (await worker.take()).params
    finally:
        server.stop()
    if setting == "auto":
        assert (left_out.temperature, left_out.top_k, left_out.max_tokens) == (0.25, 7, 9)
    else:  # the server's own defaults
        assert (left_out.temperature, left_out.top_k) == (1.0, 0) and left_out.max_tokens > 9
    assert (given.temperature, given.top_k, given.max_tokens) == (0.5, 7 if setting == "auto" else 0, 3)


async def test_a_cached_job_streams_its_deltas_over_eventsource(
    api: ServerThread, redis_url: str, folder: Path
) -> None:
    worker = ScriptedWorker(redis_url)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0}

    async def serve_one() -> list[str]:
        return await _answer_by_token(redis_url, await worker.take(), ANSWER, folder)

    job = asyncio.ensure_future(serve_one())
    await asyncio.to_thread(_stream_chat, api.url)  # the same request, streamed: its answer is cached
    sent = [piece for piece in await job if piece]
    second = httpx.post(api.url + "/v1/jobs", json=body).json()
    assert second["status"] == "completed" and len(worker.payloads) == 1
    text = (await asyncio.to_thread(httpx.get, api.url + second["events_url"], timeout=10)).text
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert _contents(chunks) == sent
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_replay_splits_by_token_and_leaves_a_cut_tail_to_the_final_event(folder: Path) -> None:
    tok = PromptTokenizer(folder)
    ids = tok.encode(ANSWER, add_special_tokens=False)
    logprobs = [TokenLogprob(t, -0.5) for t in ids]
    cut = ANSWER[: ANSWER.index(" done")] + " do"  # a stop string cut mid-token: " done" never fits the text
    result = JobResult("r", MODEL, [ChoiceResult(0, cut, ids, "stop", logprobs, "ne")], 3, len(ids))
    deltas = replay_deltas(result, tok)
    pieces = [d.choices[0].text for d in deltas]
    assert "".join(pieces) == ANSWER[: ANSWER.index(" done")] and "🙂" in pieces[-1]  # whole characters only
    assert [d.seq for d in deltas] == list(range(len(deltas)))
    fmt = ResponseFormatter("chat", "r", MODEL, 0, tok)
    chunks = [c for d in deltas for c in fmt.delta_chunks(d)] + fmt.final_chunks(FinalEvent(len(deltas), result), False)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == cut  # the tail with the final
    assert sum(len(c["choices"][0]["logprobs"]["content"]) for c in chunks if c["choices"][0]["logprobs"]) == len(ids)
    assert chunks[-1]["choices"][0]["stop_reason"] == "ne"
