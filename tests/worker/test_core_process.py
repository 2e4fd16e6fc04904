"""The engine core process on its own: it serves a request, survives malformed and oversized commands on its
IPC channel, and exits when its front process dies. A real core process on a tiny random Llama."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis
import zmq

from engine import LLM, SamplingParams
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.core_messages import MAX_COMMAND_BYTES, AddRequest, StepOutputs, command_encoder
from tests.helpers import build_tiny_model
from wire import keys
from worker.core_client import CoreClient

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("core"), "llama", seed=5)


def _config(folder: Path) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(folder), max_model_len=128),
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=64),
        device="cpu",
    )


async def _collect(core: CoreClient, request_id: str) -> tuple[list[int], str | None, list[StepOutputs]]:
    tokens: list[int] = []
    messages: list[StepOutputs] = []
    while True:
        for message in await asyncio.wait_for(core.outputs(), 30):
            messages.append(message)
            for out in message.outputs:
                if out.request_id == request_id:
                    tokens += out.new_token_ids
                    if out.finish_reason is not None:
                        return tokens, out.finish_reason, messages


async def test_core_serves_and_shrugs_off_bad_commands(folder: Path, capfd: pytest.CaptureFixture[str]) -> None:
    prompt = [5, 6, 7, 8, 9]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    offline = LLM(str(folder), device="cpu").generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)
    expected = offline[0].outputs[0].token_ids
    core = CoreClient(_config(folder))
    ready = await core.start(timeout_s=120)
    assert ready.max_model_len == 128 and ready.vocab_size == 320
    rogue = zmq.Context().socket(zmq.PUSH)
    rogue.connect(core.commands_addr)
    try:
        rogue.send(b"\x93\xa3not a command")  # msgpack of the wrong shape
        rogue.send(b"\xff\xfe garbage")  # not msgpack at all
        rogue.send(b"\x00" * (MAX_COMMAND_BYTES + 1))
        # on the same socket, so it arrives after the bad ones (two sockets' messages may interleave)
        rogue.send(command_encoder.encode(AddRequest("r1", prompt, greedy.to_dict(), 0)))
        tokens, finish, messages = await _collect(core, "r1")
        assert tokens == expected and finish == "length"
        assert all(m.errors == [] for m in messages)
        # a request the engine refuses comes back as an error for that request only
        core.add("bad", [999999], greedy.to_dict(), 0)
        refused = [e for m in await asyncio.wait_for(core.outputs(), 30) for e in m.errors]
        assert [(e.request_id, e.kind) for e in refused] == [("bad", "invalid")]
        assert core.process.is_alive()
    finally:
        rogue.close(0)
        await core.shutdown()
    assert core.process.exitcode == 0
    err = capfd.readouterr().err
    assert err.count("dropped a malformed command") == 2 and "dropped a 67108865-byte command" in err


def test_core_exits_when_its_front_dies(folder: Path, redis_url: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "deploy.cli", "worker", "--redis-url", redis_url, "--model", str(folder)]
    argv += ["--device", "cpu", "--worker-id", "front-dies", "--log-level", "warning"]
    front = subprocess.Popen(argv, env=env, cwd=ROOT)
    try:
        client = redis.Redis.from_url(redis_url)
        deadline = time.monotonic() + 120
        while client.get(keys.worker_key("front-dies")) is None:
            assert front.poll() is None and time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.2)
        children = psutil.Process(front.pid).children(recursive=True)
        assert children, "no engine core process under the worker"
        front.send_signal(signal.SIGKILL)
        front.wait(10)
        _, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, [c.cmdline() for c in alive]
    finally:
        if front.poll() is None:
            front.kill()
