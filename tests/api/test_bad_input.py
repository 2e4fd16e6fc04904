"""Anything a client can send gets a 4xx with OpenAI's error JSON, never a 500."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import httpx
import openai
import pytest

import modelfiles
from api.formatting import ResponseFormatter
from api.settings import ApiSettings
from api.tokenizer import PromptTokenizer
from deploy.redis_server import RedisServer
from tests.api.conftest import MODEL, ScriptedWorker, ServerThread, start_api
from wire.messages import ChoiceResult, JobResult, TokenLogprob

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]

BAD_JSON: list[tuple[str, str, Any, int]] = [
    ("missing model", CHAT, {"messages": MSGS}, 400),
    ("missing messages", CHAT, {"model": MODEL}, 400),
    ("empty messages", CHAT, {"model": MODEL, "messages": []}, 400),
    ("missing prompt", COMP, {"model": MODEL}, 400),
    ("messages not a list", CHAT, {"model": MODEL, "messages": "hi"}, 400),
    ("bad role", CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("temperature not a number", CHAT, {"model": MODEL, "messages": MSGS, "temperature": "hot"}, 400),
    ("max_tokens a string", COMP, {"model": MODEL, "prompt": "a", "max_tokens": "many"}, 400),
    ("max_tokens a fraction", COMP, {"model": MODEL, "prompt": "a", "max_tokens": 1.5}, 400),
    ("n = 0", CHAT, {"model": MODEL, "messages": MSGS, "n": 0}, 400),
    ("n too large", CHAT, {"model": MODEL, "messages": MSGS, "n": 1000}, 400),
    ("max_tokens = 0", COMP, {"model": MODEL, "prompt": "a", "max_tokens": 0}, 400),
    ("huge max_tokens", COMP, {"model": MODEL, "prompt": "a", "max_tokens": 10**9}, 400),
    ("huge max_completion_tokens", CHAT, {"model": MODEL, "messages": MSGS, "max_completion_tokens": 10**9}, 400),
    ("prompt over context", COMP, {"model": MODEL, "prompt": list(range(9000)), "max_tokens": 1}, 400),
    ("token id out of vocab", COMP, {"model": MODEL, "prompt": [10**8], "max_tokens": 1}, 400),
    ("negative temperature", CHAT, {"model": MODEL, "messages": MSGS, "temperature": -1}, 400),
    ("top_p 0", CHAT, {"model": MODEL, "messages": MSGS, "top_p": 0}, 400),
    ("top_logprobs too many", CHAT, {"model": MODEL, "messages": MSGS, "logprobs": True, "top_logprobs": 50}, 400),
    ("top_logprobs without logprobs", CHAT, {"model": MODEL, "messages": MSGS, "top_logprobs": 2}, 400),
    ("stop not strings", CHAT, {"model": MODEL, "messages": MSGS, "stop": [1, 2]}, 400),
    ("empty stop string", CHAT, {"model": MODEL, "messages": MSGS, "stop": [""]}, 400),
    ("empty prompt", COMP, {"model": MODEL, "prompt": ""}, 400),
    ("empty prompt list", COMP, {"model": MODEL, "prompt": []}, 400),
    ("suffix", COMP, {"model": MODEL, "prompt": "a", "suffix": "b"}, 400),
    ("too many prompts", COMP, {"model": MODEL, "prompt": ["a"] * 100}, 400),
    ("unknown model", CHAT, {"model": "gpt-17", "messages": MSGS}, 404),
    ("body is a list", CHAT, [1, 2, 3], 400),
    ("stream not a bool", CHAT, {"model": MODEL, "messages": MSGS, "stream": "maybe"}, 400),
    ("logit_bias id out of vocab", COMP, {"model": MODEL, "prompt": "a", "logit_bias": {"99999999": -100}}, 400),
    ("logit_bias key not an id", COMP, {"model": MODEL, "prompt": "a", "logit_bias": {"blue": 5}}, 400),
    ("logit_bias value too big", COMP, {"model": MODEL, "prompt": "a", "logit_bias": {"5": 500}}, 400),
    ("logit_bias negative id", COMP, {"model": MODEL, "prompt": "a", "logit_bias": {"-3": 5}}, 400),
    ("negative stop_token_ids", COMP, {"model": MODEL, "prompt": "a", "stop_token_ids": [-1]}, 400),
    ("too many stops", COMP, {"model": MODEL, "prompt": "a", "stop": ["x"] * 17}, 400),
    ("json mode", CHAT, {"model": MODEL, "messages": MSGS, "response_format": {"type": "json_object"}}, 400),
    (
        "tools",
        CHAT,
        {"model": MODEL, "messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
    ),
    ("tool_choice required", CHAT, {"model": MODEL, "messages": MSGS, "tool_choice": "required"}, 400),
    ("best_of", COMP, {"model": MODEL, "prompt": "a", "best_of": 3}, 400),
    ("guided_choice", CHAT, {"model": MODEL, "messages": MSGS, "guided_choice": ["yes", "no"]}, 400),
]


def _check_error(resp: httpx.Response, status: int) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]


@pytest.mark.parametrize(("name", "path", "body", "status"), BAD_JSON, ids=[c[0] for c in BAD_JSON])
def test_bad_json_body(api: ServerThread, redis_url: str, name: str, path: str, body: Any, status: int) -> None:
    resp = httpx.post(api.url + path, json=body, timeout=10)
    _check_error(resp, status)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b'{"model": "x", "messages": [}'])
def test_invalid_json(api: ServerThread, redis_url: str, raw: bytes) -> None:
    resp = httpx.post(api.url + CHAT, content=raw, headers={"content-type": "application/json"}, timeout=10)
    _check_error(resp, 400)


def test_oversize_body(api: ServerThread, redis_url: str) -> None:
    body = json.dumps({"model": MODEL, "prompt": "x" * (2 << 20)})
    resp = httpx.post(api.url + COMP, content=body, headers={"content-type": "application/json"}, timeout=10)
    _check_error(resp, 413)


def test_oversize_chunked_body(api: ServerThread, redis_url: str) -> None:
    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}'

    resp = httpx.post(api.url + COMP, content=chunks(), headers={"content-type": "application/json"}, timeout=10)
    _check_error(resp, 413)


def test_unknown_route_is_openai_error(api: ServerThread, redis_url: str) -> None:
    _check_error(httpx.get(api.url + "/v1/nothing", timeout=10), 404)
    _check_error(httpx.get(api.url + "/v1/jobs/nope/events", timeout=10), 404)


def test_openai_client_raises_typed_errors(api: ServerThread, redis_url: str) -> None:
    client = openai.OpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=10**9)  # type: ignore[arg-type]
    assert "maximum context length" in str(exc.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")


def test_models(api: ServerThread, redis_url: str) -> None:
    client = openai.OpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0)
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL]


def test_unsupported_feature_names_its_parameter(api: ServerThread, redis_url: str) -> None:
    body = {"model": MODEL, "messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {}}}
    resp = httpx.post(api.url + CHAT, json=body, timeout=10)
    _check_error(resp, 400)
    assert resp.json()["error"]["param"] == "response_format"
    assert resp.json()["error"]["code"] == "unsupported_parameter"


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"stop_token_ids": [-1]}, "stop_token_ids"), ({"logit_bias": {"x": 1}}, "logit_bias"), ({"stop": [""]}, "stop")],
)
def test_sampling_error_names_its_parameter(
    api: ServerThread, redis_url: str, extra: dict[str, Any], param: str
) -> None:
    """SamplingSpec's range checks run in the API: a 400 naming the field, before anything is queued."""
    resp = httpx.post(api.url + COMP, json={"model": MODEL, "prompt": "a", **extra}, timeout=10)
    _check_error(resp, 400)
    assert resp.json()["error"]["param"] == param


def test_tokenize_detokenize_and_model_card(api: ServerThread, redis_url: str) -> None:
    tok = httpx.post(api.url + "/tokenize", json={"model": MODEL, "prompt": "Hello world"}, timeout=10).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] > 0
    back = httpx.post(api.url + "/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}, timeout=10).json()
    assert back["prompt"].endswith("Hello world")
    chat = httpx.post(api.url + "/tokenize", json={"messages": MSGS}, timeout=10).json()
    assert chat["count"] > tok["count"] - 2  # the template adds role markers around "hi"
    _check_error(httpx.post(api.url + "/tokenize", json={"model": MODEL}, timeout=10), 400)
    _check_error(httpx.post(api.url + "/detokenize", json={"tokens": [10**9]}, timeout=10), 400)
    _check_error(httpx.post(api.url + "/tokenize", json={"model": "nope", "prompt": "x"}, timeout=10), 404)
    client = openai.OpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")


# -- what worked before bodies were typed still works ---------------------------------------------------------
NO_OP_VALUES: dict[str, Any] = {
    "tool_choice": "none",
    "tools": [],
    "response_format": {"type": "text"},
    "service_tier": "auto",
    "store": False,
    "modalities": ["text"],
    "parallel_tool_calls": None,
    "metadata": None,
    "user": "u-1",
    "safety_identifier": "s-1",
    "chat_template_kwargs": {"enable_thinking": False},
}


async def test_no_op_values_and_sdk_messages_are_accepted(api: ServerThread, redis_url: str) -> None:
    """The openai SDK's reply message sent back as history (its null refusal, annotations, audio, tool calls),
    each unimplemented parameter at its no-op value, and a body without a Content-Type: all served."""
    worker = ScriptedWorker(redis_url)
    client = openai.AsyncOpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0)
    first, _ = await asyncio.gather(
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4),  # type: ignore[arg-type]
        worker.serve(),
    )
    history = [*MSGS, first.choices[0].message.model_dump(), {"role": "user", "content": "and?"}]
    second, _ = await asyncio.gather(
        client.chat.completions.create(model=MODEL, messages=history, max_tokens=4, extra_body=NO_OP_VALUES),  # type: ignore[arg-type]
        worker.serve(),
    )
    assert second.choices[0].message.content == "Hello, world!"
    async with httpx.AsyncClient(base_url=api.url, timeout=10) as http:
        body = json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 2, "stream": True, "stream_options": {}})
        resp, _ = await asyncio.gather(http.post(COMP, content=body), worker.serve())
    assert resp.status_code == 200 and resp.text.rstrip().endswith("data: [DONE]")


def test_unexpected_error_is_a_json_500_on_a_kept_connection(redis_server: RedisServer, redis_url: str) -> None:
    """CatchAll: an exception no handler takes is OpenAI's JSON 500, and the keep-alive connection stays up
    (Starlette's own handler re-raises, and uvicorn then drops the connection unannounced)."""
    server = ServerThread(ApiSettings(redis_url=redis_server.url))

    async def boom() -> None:
        raise RuntimeError("a bug")

    server.server.config.app.add_api_route("/test/boom", boom)
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            resp = client.get("/test/boom")
            assert resp.status_code == 500
            assert resp.json()["error"]["type"] == "server_error"
            good = client.get("/v1/models")
            assert good.status_code == 200
            port = resp.extensions["network_stream"].get_extra_info("client_addr")[1]
            assert good.extensions["network_stream"].get_extra_info("client_addr")[1] == port
    finally:
        server.stop()


def test_auth_comes_before_body_validation(redis_server: RedisServer, redis_url: str) -> None:
    server = start_api(redis_server, api_keys=("sk-test",))
    try:
        resp = httpx.post(server.url + CHAT, json={"model": MODEL, "messages": "not a list"}, timeout=10)
        _check_error(resp, 401)
        ok = {"Authorization": "Bearer sk-test"}
        resp = httpx.post(server.url + CHAT, json={"model": MODEL, "messages": "x"}, headers=ok, timeout=10)
        _check_error(resp, 400)
    finally:
        server.stop()


def test_openapi_declares_the_request_bodies(api: ServerThread, redis_url: str) -> None:
    spec = httpx.get(api.url + "/openapi.json", timeout=10).json()
    for path, model in [
        (COMP, "CompletionRequest"),
        (CHAT, "ChatCompletionRequest"),
        ("/tokenize", "TokenizeRequest"),
        ("/detokenize", "DetokenizeRequest"),
        ("/v1/jobs", "ChatCompletionRequest"),
    ]:
        operation = spec["paths"][path]["post"]
        assert model in json.dumps(operation["requestBody"]), path
        assert "422" not in operation["responses"] and "400" in operation["responses"]
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["additionalProperties"] is False and "messages" in chat["required"]


def test_non_finite_logprobs_are_sent_as_json_numbers() -> None:
    """A token masked by top-k or logit_bias has logprob -inf, which JSON cannot carry: -9999 as OpenAI sends."""
    tok = PromptTokenizer(modelfiles.resolve(None, None).folder)
    lps = [TokenLogprob(5, -math.inf, [(5, -math.inf), (6, math.nan)])]
    result = JobResult("r", MODEL, [ChoiceResult(0, "x", [5], "stop", lps)], 1, 1)
    for kind in ("completion", "chat"):
        body = json.dumps(ResponseFormatter(kind, "r", MODEL, 0, tok).response(result), allow_nan=False)
        assert "-9999.0" in body
