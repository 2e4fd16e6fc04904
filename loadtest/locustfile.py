"""Locust load test for a pagedserve (or any OpenAI-compatible) server.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --users 50 --spawn-rate 10
    PAGEDSERVE_MODEL=... PAGEDSERVE_API_KEY=... PAGEDSERVE_MAX_TOKENS=32 locust -f loadtest/locustfile.py ...

Streaming requests report time to first token as a separate "TTFT" entry; 429s are counted as "429" so
backpressure shows up apart from real failures.
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, task

MODEL = os.environ.get("PAGEDSERVE_MODEL", "SmolLM2-135M-Instruct")
API_KEY = os.environ.get("PAGEDSERVE_API_KEY", "")
MAX_TOKENS = int(os.environ.get("PAGEDSERVE_MAX_TOKENS", "32"))
PROMPTS = [
    "Explain paged attention in two sentences.",
    "Write a limerick about queues.",
    "What does Redis pub/sub do?",
    "Name five prime numbers.",
]


class ChatUser(HttpUser):
    wait_time = between(0.1, 1.0)

    def on_start(self) -> None:
        if API_KEY:
            self.client.headers["Authorization"] = f"Bearer {API_KEY}"

    def _body(self, stream: bool, greedy: bool = False) -> dict[str, object]:
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": random.choice(PROMPTS)}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0 if greedy else 0.8,
            "stream": stream,
        }

    @task(3)
    def chat_stream(self) -> None:
        start = time.perf_counter()
        with self.client.post(
            "/v1/chat/completions", json=self._body(True), stream=True, catch_response=True, name="chat (stream)"
        ) as resp:
            if resp.status_code == 429:
                resp.success()
                self.environment.events.request.fire(
                    request_type="POST", name="429", response_time=0, response_length=0, exception=None, context={}
                )
                return
            first = True
            for line in resp.iter_lines():
                if first and line.startswith(b"data:") and not line.endswith(b"[DONE]"):
                    ttft_ms = (time.perf_counter() - start) * 1000
                    self.environment.events.request.fire(
                        request_type="SSE",
                        name="TTFT",
                        response_time=ttft_ms,
                        response_length=0,
                        exception=None,
                        context={},
                    )
                    first = False
                if line.startswith(b"data:") and b'"error"' in line:
                    resp.failure(json.loads(line[5:])["error"]["message"])
                    return

    @task(1)
    def chat_cached(self) -> None:
        """Greedy and repeated: after the first time, the response cache answers."""
        self.client.post("/v1/chat/completions", json=self._body(False, greedy=True), name="chat (greedy, cached)")
