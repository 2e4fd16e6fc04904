"""One ``pagedserve serve MODEL`` start, as a vLLM user types it: the positional model, vLLM's flags reaching
the API child (--chat-template from a file, --allowed-origins), a ``PAGEDSERVE_*`` variable that no default
overwrites, and what the real worker's answers look like through vLLM's surface (stop_reason, a streamed cache
hit replayed as the deltas of the stream it stored)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

import modelfiles
from api.tokenizer import PromptTokenizer
from deploy.redis_server import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
NAME = "smol"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


def _wait_ready(proc: subprocess.Popen[bytes], url: str) -> None:
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, "pagedserve serve exited at start"
        assert time.monotonic() < deadline, "pagedserve serve did not become ready"
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def _stream(url: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
        return [json.loads(line) for line in lines], resp.headers["x-cache"]


def test_serve_model_positional_with_vllm_flags(tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PAGEDSERVE_MAX_BODY_BYTES": "4096"}
    model = str(modelfiles.default_model_path())
    argv = [sys.executable, "-m", "deploy.cli", "serve", model, "--served-model-name", NAME, "--port", str(port)]
    argv += ["--device", "cpu", "--max-num-seqs", "4", "--log-level", "warning", "--chat-template", str(template)]
    argv += ["--allowed-origins", '["https://chat.example"]', "--kv-cache-dtype", "auto", "--disable-log-requests"]
    proc = subprocess.Popen(argv, env=env, cwd=ROOT)
    children: list[psutil.Process] = []
    try:
        _wait_ready(proc, url)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == NAME  # the positional model
        messages = [{"role": "user", "content": "Count: one, two, three, four"}]
        tokens = httpx.post(url + "/tokenize", json={"model": NAME, "messages": messages}).json()["tokens"]
        folder = modelfiles.resolve(model).folder
        expected = PromptTokenizer(folder, TEMPLATE).apply_chat_template(messages, True)
        assert tokens == PromptTokenizer(folder).encode(expected, add_special_tokens=False)  # the file's template
        big = httpx.post(url + "/v1/completions", content=b"x" * 5000, headers={"content-type": "application/json"})
        assert big.status_code == 413  # $PAGEDSERVE_MAX_BODY_BYTES, not the flag's default (1 MiB)
        preflight = httpx.options(
            url + "/v1/chat/completions",
            headers={"Origin": "https://chat.example", "Access-Control-Request-Method": "POST"},
        )
        assert preflight.headers["access-control-allow-origin"] == "https://chat.example"

        body = {"model": NAME, "messages": messages, "max_tokens": 24, "temperature": 0}
        reply = httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "abc"}, timeout=60)
        assert reply.headers["x-request-id"] == "abc"
        choice = reply.json()["choices"][0]
        assert "stop_reason" in choice  # null for a length or EOS finish, as vLLM
        stopped = httpx.post(url + "/v1/chat/completions", json={**body, "stop": [" "]}, timeout=60).json()
        if stopped["choices"][0]["finish_reason"] == "stop" and " " in choice["message"]["content"]:
            assert stopped["choices"][0]["stop_reason"] == " "

        streamed = {**body, "seed": 3, "max_tokens": 16}
        miss, miss_cache = _stream(url, streamed)
        hit, hit_cache = _stream(url, streamed)
        assert (miss_cache, hit_cache) == ("miss", "hit")

        def texts(chunks: list[dict[str, Any]]) -> list[str]:
            return [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]]

        assert "".join(texts(hit)) == "".join(texts(miss)) and "".join(texts(hit))
        pieces, live = [t for t in texts(hit) if t], [t for t in texts(miss) if t]
        assert len(pieces) > 1 and len(pieces) >= len(live)  # token by token (the live stream may merge some)
        assert hit[-1]["choices"][0]["finish_reason"] == miss[-1]["choices"][0]["finish_reason"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        for child in children:
            if child.is_running():
                child.kill()
