"""`pagedserve worker --tensor-parallel-size 2` serves requests through Redis (CPU, gloo), and its greedy
text equals the offline TP=1 engine's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from deploy.redis_server import RedisServer
from tests.api.conftest import start_api
from tests.helpers import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def test_tp2_worker_serves_and_matches_tp1(redis_server: RedisServer, redis_url: str, tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path / "tiny", "llama", seed=21)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    worker = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "worker", "--redis-url", redis_url, "--model", str(folder),
         "--device", "cpu", "--tensor-parallel-size", "2", "--worker-id", "tp2", "--log-level", "warning"],
        env=env, cwd=ROOT,
    )  # fmt: skip
    api = start_api(redis_server, model=str(folder), response_cache=False)
    try:
        deadline = time.monotonic() + 120
        while httpx.get(api.url + "/ready").json().get("workers") != 1:
            assert worker.poll() is None, "the TP=2 worker died at start"
            assert time.monotonic() < deadline, "the TP=2 worker did not become ready"
            time.sleep(0.3)
        client = openai.OpenAI(base_url=api.url + "/v1", api_key="none")
        served = client.completions.create(model=folder.name, prompt="hello there", max_tokens=12, temperature=0)
        from engine import LLM, SamplingParams

        offline = LLM(str(folder), device="cpu").generate("hello there", SamplingParams(temperature=0, max_tokens=12))
        assert served.choices[0].text == offline[0].outputs[0].text
        assert served.usage is not None and served.usage.completion_tokens == len(offline[0].outputs[0].token_ids)
    finally:
        api.stop()
        worker.terminate()
        worker.wait(30)
