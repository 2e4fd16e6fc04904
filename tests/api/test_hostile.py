"""Hostile input, table-driven: every case gets a 4xx with OpenAI's error JSON (never a 500), and the same
keep-alive connection then serves a good request (unless the server said ``Connection: close``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.api.conftest import MODEL, ServerThread

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]
JSON_TYPE = {"content-type": "application/json"}


@dataclass
class Case:
    name: str
    path: str
    body: Any = None  # JSON-encoded (ensure_ascii: a lone surrogate goes out as its \\u escape) unless bytes
    status: int = 400
    param: str | None = None  # the error's param, when the case pins it
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON_TYPE))
    says: str | None = None  # a word the message must contain

    def content(self) -> bytes | None:
        if self.body is None or isinstance(self.body, bytes):
            return self.body
        return json.dumps(self.body).encode()


def chat(name: str, status: int = 400, param: str | None = None, says: str | None = None, **extra: Any) -> Case:
    return Case(name, CHAT, {"model": MODEL, "messages": MSGS, **extra}, status, param, says=says)


def comp(name: str, status: int = 400, param: str | None = None, says: str | None = None, **extra: Any) -> Case:
    return Case(name, COMP, {"model": MODEL, "prompt": "a", "max_tokens": 1, **extra}, status, param, says=says)


def raw(name: str, body: bytes, path: str = CHAT, status: int = 400, headers: dict[str, str] | None = None) -> Case:
    return Case(name, path, body, status, headers=dict(JSON_TYPE) if headers is None else headers)


def nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


def msg(content: Any, **extra: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content, **extra}]


GOOD_CHAT = json.dumps({"model": MODEL, "messages": MSGS})
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}

ENCODING = [
    raw("empty body", b""),
    raw("empty body, no content type", b"", headers={}),
    raw("whitespace body", b"  \n "),
    raw("null body", b"null"),
    raw("number body", b"123"),
    raw("string body", b'"hello"'),
    raw("list body", b"[]"),
    raw("true body", b"true"),
    raw("truncated JSON", GOOD_CHAT[:-5].encode()),
    raw("trailing garbage", GOOD_CHAT.encode() + b" {}"),
    raw("invalid UTF-8 in a string", GOOD_CHAT.replace("hi", "h\udcffi", 1).encode("utf-8", "surrogateescape")),
    raw("UTF-8 encoded surrogate bytes", GOOD_CHAT.replace("hi", "\ud800", 1).encode("utf-8", "surrogatepass")),
    raw("UTF-16 body", GOOD_CHAT.encode("utf-16")),
    raw("UTF-8 BOM", b"\xef\xbb\xbf" + GOOD_CHAT.encode()),
    raw("raw control character", GOOD_CHAT.replace("hi", "h\x01i").encode()),
    raw("NaN literal", GOOD_CHAT[:-1].encode() + b', "temperature": NaN}'),
    raw("Infinity literal", GOOD_CHAT[:-1].encode() + b', "temperature": Infinity}'),
    raw("-Infinity literal", GOOD_CHAT[:-1].encode() + b', "top_p": -Infinity}'),
    raw("1e999 overflows to inf", GOOD_CHAT[:-1].encode() + b', "temperature": 1e999}'),
    raw("1e999 as logit_bias", GOOD_CHAT[:-1].encode() + b', "logit_bias": {"5": 1e999}}'),
    raw("body nested 5000 deep", nested(5000).encode()),
    raw(
        "template kwargs nested 990 deep",
        GOOD_CHAT[:-1].encode() + b', "chat_template_kwargs": {"x": %s}}' % nested(990).encode(),
    ),
    raw("prompt nested 250 deep", b'{"model": "%s", "prompt": %s}' % (MODEL.encode(), nested(250).encode()), COMP),
    raw("unknown field nested 990 deep", GOOD_CHAT[:-1].encode() + b', "x": %s}' % nested(990).encode()),
    raw("text/plain", GOOD_CHAT.encode(), status=415, headers={"content-type": "text/plain"}),
    raw(
        "form-urlencoded",
        f"model={MODEL}&prompt=hi".encode(),
        COMP,
        415,
        {"content-type": "application/x-www-form-urlencoded"},
    ),
    raw(
        "multipart",
        b"--b\r\n\r\nx\r\n--b--\r\n",
        status=415,
        headers={"content-type": "multipart/form-data; boundary=b"},
    ),
    raw("xml", b"<chat/>", status=415, headers={"content-type": "application/xml"}),
    raw("body over the size limit", b'{"prompt": "' + b"x" * (2 << 20) + b'"}', COMP, 413),
]

SURROGATES = [
    chat("lone high surrogate in content", messages=msg("a\ud800b")),
    chat("lone low surrogate in content", messages=msg("\udc00")),
    comp("lone surrogate in prompt", prompt="\ud800"),
    comp("lone surrogate in a batch prompt", prompt=["ok", "\udfff"]),
    chat("lone surrogate in model", model="\ud800"),
    chat("lone surrogate in a stop string", stop=["\ud800"]),
    chat("lone surrogate as a logit_bias key", logit_bias={"\ud800": 1}),
    chat("lone surrogate as a field name", **{"\ud800": 1}),
    chat("lone surrogate in a template kwarg", chat_template_kwargs={"x": "\ud800"}),
    Case("lone surrogate in /tokenize", "/tokenize", {"prompt": "\ud800"}),
    Case("lone surrogate in /v1/jobs", "/v1/jobs", {"model": MODEL, "prompt": "\ud800"}),
]

TEMPLATE_KWARGS = [
    chat(
        "template kwargs: add_generation_prompt",
        param="chat_template_kwargs",
        chat_template_kwargs={"add_generation_prompt": False},
    ),
    chat("template kwargs: messages", param="chat_template_kwargs", chat_template_kwargs={"messages": []}),
    chat("template kwargs: tokenize", param="chat_template_kwargs", chat_template_kwargs={"tokenize": True}),
    chat("template kwargs: chat_template", param="chat_template_kwargs", chat_template_kwargs={"chat_template": "x"}),
    chat("template kwargs: raise_exception", param="chat_template_kwargs", chat_template_kwargs={"raise_exception": 1}),
    chat("template kwargs: namespace", param="chat_template_kwargs", chat_template_kwargs={"namespace": 1}),
    chat("template kwargs: strftime_now", param="chat_template_kwargs", chat_template_kwargs={"strftime_now": 1}),
    chat("template kwargs: a list", param="chat_template_kwargs", chat_template_kwargs=[1, 2]),
]

TYPES = [
    chat("model a number", param="model", model=5),
    chat("model null", param="model", model=None),
    chat("messages an object", param="messages", messages={"role": "user"}),
    chat("message a string", param="messages.[0]", messages=["hi"]),
    chat("content a number", param="messages.[0].content", messages=msg(5)),
    chat("role missing", param="messages.[0].role", messages=[{"content": "x"}]),
    chat("n a word", param="n", n="two"),
    chat("n a fraction", param="n", n=1.5),
    chat("temperature a list", param="temperature", temperature=[1]),
    chat("stop an object", param="stop", stop={"a": 1}),
    chat("logit_bias a list", param="logit_bias", logit_bias=[1, 2]),
    chat("logit_bias value a word", param="logit_bias", logit_bias={"5": "up"}),
    chat("stream_options a string", param="stream_options", stream=True, stream_options="usage"),
    chat("seed a word", param="seed", seed="abc"),
    chat("seed a fraction", param="seed", seed=1.5),
    comp("prompt a number", param="prompt", prompt=5),
    comp("prompt mixed ids and text", param="prompt.[1]", prompt=[1, "a"]),
    comp("prompt fractional ids", param="prompt.[0]", prompt=[1.5]),
    comp("echo a word", param="echo", echo="maybe"),
]

RANGES = [
    chat("seed 2**64", param="seed", seed=2**64),
    chat("seed below -2**63", param="seed", seed=-(2**63) - 1),
    chat("seed 10**30", param="seed", seed=10**30),
    comp("negative max_tokens", param="max_tokens", max_tokens=-5),
    chat("negative max_completion_tokens", param="max_completion_tokens", max_completion_tokens=-1),
    comp("max_tokens 1e20", param="max_tokens", max_tokens=1e20),
    chat("n a million", param="n", n=10**6),
    chat("n 10**30", param="n", n=10**30),
    chat("n negative", param="n", n=-1),
    chat("temperature 2.5", param="temperature", temperature=2.5),
    chat("top_p 1.5", param="top_p", top_p=1.5),
    chat("top_k -2", param="top_k", top_k=-2),
    chat("top_k 2**40", param="top_k", top_k=2**40),
    chat("presence_penalty 3", param="presence_penalty", presence_penalty=3),
    chat("frequency_penalty -3", param="frequency_penalty", frequency_penalty=-3),
    chat("repetition_penalty 0", param="repetition_penalty", repetition_penalty=0),
    chat("min_p 2", param="min_p", min_p=2),
    chat("min_tokens -1", param="min_tokens", min_tokens=-1),
    comp("logprobs 21", param="logprobs", logprobs=21),
    chat("top_logprobs -1", param="top_logprobs", logprobs=True, top_logprobs=-1),
    chat("priority 2**63", param="priority", priority=2**63),
    chat("stop_token_ids 2**40", param="stop_token_ids.[0]", stop_token_ids=[2**40]),
    chat("stop_token_ids negative", param="stop_token_ids", stop_token_ids=[-1]),
    chat("17 stop strings", param="stop", stop=["x"] * 17),
]

LOGIT_BIAS = [
    chat("logit_bias key a word", param="logit_bias", logit_bias={"abc": 1}),
    chat("logit_bias key a fraction", param="logit_bias", logit_bias={"1.5": 1}),
    chat("logit_bias key empty", param="logit_bias", logit_bias={"": 1}),
    chat("logit_bias key 5000 digits", param="logit_bias", logit_bias={"9" * 5000: 1}),
    chat("logit_bias key past the vocab", param="logit_bias", logit_bias={str(2**70): 1}),
    chat("logit_bias key negative", param="logit_bias", logit_bias={"-1": 1}),
    chat("logit_bias value -101", param="logit_bias", logit_bias={"5": -101}),
]

UNSUPPORTED = [
    chat("unknown field", param="foo", says="Unrecognized", foo=1),
    chat("misspelt max_tokens", param="max_token", max_token=5),
    chat("modalities audio", param="modalities", modalities=["text", "audio"]),
    chat("reasoning_effort", param="reasoning_effort", reasoning_effort="high"),
    chat("prediction", param="prediction", prediction={"type": "content", "content": "x"}),
    chat("web_search_options", param="web_search_options", web_search_options={}),
    chat("audio", param="audio", audio={"voice": "alloy", "format": "wav"}),
    chat("metadata", param="metadata", metadata={"a": "b"}),
    chat("store", param="store", store=True),
    chat("parallel_tool_calls", param="parallel_tool_calls", parallel_tool_calls=True),
    chat("service_tier flex", param="service_tier", service_tier="flex"),
    chat("verbosity", param="verbosity", verbosity="low"),
    comp("prompt_logprobs", param="prompt_logprobs", prompt_logprobs=1),
    chat("structured_outputs", param="structured_outputs", structured_outputs={"json": {}}),
    chat("guided_json", param="guided_json", guided_json={"type": "object"}),
    chat("guided_regex", param="guided_regex", guided_regex="a+"),
    chat("guided_decoding_backend", param="guided_decoding_backend", guided_decoding_backend="xgrammar"),
    chat("response_format json_schema", param="response_format", response_format={"type": "json_schema"}),
    comp("best_of 2", param="best_of", best_of=2),
    chat("stream_options without stream", param="stream_options", stream_options={"include_usage": True}),
    chat("stream_options with stream false", param="stream_options", stream=False, stream_options={}),
    chat(
        "continuous_usage_stats",
        param="stream_options.continuous_usage_stats",
        stream=True,
        stream_options={"continuous_usage_stats": True},
    ),
    chat("stream_options unknown key", param="stream_options.x", stream=True, stream_options={"x": 1}),
    chat("image content part", says="image", messages=msg([{"type": "text", "text": "?"}, IMAGE])),
    chat("audio content part", says="audio", messages=msg([{"type": "input_audio", "input_audio": {}}])),
    chat("unknown content part", param="messages.[0].content.[0]", messages=msg([{"type": "video_url"}])),
    chat("tool_calls in a message", messages=[{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]),
    chat("unknown message key", param="messages.[0].mood", messages=msg("x", mood="happy")),
    chat("top_logprobs without logprobs", param="top_logprobs", top_logprobs=2),
    comp("suffix", param="suffix", suffix="b"),
    comp("echo with logprobs", param="echo", echo=True, logprobs=1),
]

PROMPTS = [
    comp("empty prompt list", param="prompt", prompt=[]),
    comp("empty token list in a batch", param="prompt", prompt=[[]]),
    comp("negative token id", param="prompt", prompt=[-1]),
    comp("token id 2**70", param="prompt", prompt=[2**70]),
    chat("empty messages", param="messages", messages=[]),
    chat("unknown model", 404, "model", model="gpt-17"),
]

OTHER_ENDPOINTS = [
    Case("tokenize prompt and messages", "/tokenize", {"prompt": "a", "messages": MSGS}, param="prompt"),
    Case("tokenize neither", "/tokenize", {}, param="prompt"),
    Case("tokenize unknown field", "/tokenize", {"prompt": "a", "tools": []}, param="tools"),
    Case("tokenize image part", "/tokenize", {"messages": msg([IMAGE])}, says="image"),
    Case("detokenize words", "/detokenize", {"tokens": ["a"]}, param="tokens.[0]"),
    Case("detokenize negative id", "/detokenize", {"tokens": [-1]}, param="tokens"),
    Case("detokenize id 2**70", "/detokenize", {"tokens": [2**70]}, param="tokens"),
    Case("detokenize no body", "/detokenize", b""),
    Case("job empty object", "/v1/jobs", {}),
    Case("job unknown field", "/v1/jobs", {"model": MODEL, "prompt": "a", "foo": 1}, param="foo"),
    Case("job bad role", "/v1/jobs", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}),
    Case("job list body", "/v1/jobs", [1]),
]

METHODS = [
    Case("GET a POST route", COMP, method="GET", status=405),
    Case("PUT a job", "/v1/jobs/x", method="PUT", status=405),
    Case("DELETE the models", "/v1/models", method="DELETE", status=405),
    Case("POST health", "/health", b"{}", method="POST", status=405),
    Case("unknown route", "/v1/nothing", method="GET", status=404),
    Case("unknown job", "/v1/jobs/nope", method="GET", status=404),
    Case("job id with surrogate bytes", "/v1/jobs/%ED%A0%80/events", method="GET", status=404),
    Case("job id with a NUL", "/v1/jobs/%00", method="DELETE", status=404),
]

CASES = ENCODING + SURROGATES + TEMPLATE_KWARGS + TYPES + RANGES + LOGIT_BIAS + UNSUPPORTED + PROMPTS
CASES += OTHER_ENDPOINTS + METHODS


@pytest.fixture(scope="module")
def client(api: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api.url, timeout=10) as c:
        yield c


def _local_port(resp: httpx.Response) -> int:
    port: int = resp.extensions["network_stream"].get_extra_info("client_addr")[1]
    return port


def test_enough_cases() -> None:
    assert len(CASES) >= 85
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile(client: httpx.Client, redis_url: str, case: Case) -> None:
    resp = client.request(case.method, case.path, content=case.content(), headers=case.headers)
    assert resp.status_code == case.status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if case.param is not None:
        assert err["param"] == case.param, err
    if case.says is not None:
        assert case.says in err["message"], err
    if resp.status_code == 405:
        assert resp.headers["allow"], "a 405 names the methods the path takes"
        assert case.method not in resp.headers["allow"].split(", ")
    good = client.get("/v1/models")
    assert good.status_code == 200
    if resp.headers.get("connection", "").lower() != "close":
        assert _local_port(good) == _local_port(resp), "the server dropped the keep-alive connection"


def test_allow_lists_every_method_of_the_path(client: httpx.Client, redis_url: str) -> None:
    resp = client.put("/v1/jobs/x")
    assert resp.status_code == 405
    assert resp.headers["allow"] == "DELETE, GET"
    assert client.patch(COMP).headers["allow"] == "POST"
