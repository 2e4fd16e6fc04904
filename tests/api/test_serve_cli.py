"""The README's run command: ``pagedserve serve`` starts a private redis-server, the API and a worker with
the default model; the openai SDK gets an answer, which the worker's periodic stats line (vLLM's) counts; Ctrl-C
(SIGINT) stops every process it started."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from deploy.redis_server import free_port
from tests.api.conftest import MODEL

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


STATS_LINE = re.compile(r"Engine \S+: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: ([\d.]+)")


def generation_rates(log: Path) -> list[float]:
    return [float(m.group(1)) for m in STATS_LINE.finditer(log.read_text(errors="replace"))]


def test_serve_answers_and_ctrl_c_stops_everything(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "VLLM_LOG_STATS_INTERVAL": "1"}
    argv = [sys.executable, "-m", "deploy.cli", "serve", "--port", str(port), "--device", "cpu"]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([*argv, "--max-num-seqs", "4"], env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, "pagedserve serve exited at start"
            assert time.monotonic() < deadline, "pagedserve serve did not become ready"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert "redis-server" in names and "worker" in names, names  # its own Redis, not one already running
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=5, temperature=0.0
        )
        assert reply.choices[0].message.content and reply.usage and reply.usage.completion_tokens >= 1
        deadline = time.monotonic() + 15  # a line a second (VLLM_LOG_STATS_INTERVAL), one of them with the tokens
        while not any(rate > 0 for rate in generation_rates(log)):
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [c.cmdline() for c in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
        for c in children:
            if c.is_running():
                c.kill()
