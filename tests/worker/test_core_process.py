"""The engine core process on its own: it serves a request, survives malformed and oversized commands on its
IPC channel, and exits when its front process dies; with two fronts, each gets its own requests' outputs, and the
node goes down as one when a front dies. A real core process on a tiny random Llama."""

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
from worker.fronts import EXIT_FRONT_DIED

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


async def test_core_sends_each_front_only_its_own_requests(folder: Path) -> None:
    """Two fronts on one core (``--worker-fronts 2``): each gets its own requests' outputs and errors."""
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = {"a0": [5, 6, 7], "a1": [9, 8, 7, 6], "b0": [11, 12], "b1": [3, 4, 5, 6, 7]}
    llm = LLM(str(folder), device="cpu")
    expected = {
        rid: llm.generate({"prompt_token_ids": p}, greedy, use_tqdm=False)[0].outputs[0].token_ids
        for rid, p in prompts.items()
    }
    front0 = CoreClient(_config(folder), num_clients=2)
    ready = await front0.start(timeout_s=120)
    front1 = CoreClient.attach(_config(folder), front0.commands_addr, front0.outputs_addrs[1], ready, 1)
    try:
        for rid, prompt in prompts.items():
            (front0 if rid.startswith("a") else front1).add(rid, prompt, greedy.to_dict(), 0)
        front1.add("bad", [999999], greedy.to_dict(), 0)

        async def drain(front: CoreClient, count: int) -> tuple[dict[str, list[int]], list[str]]:
            tokens: dict[str, list[int]] = {}
            errors: list[str] = []
            finished = 0
            while finished < count:
                for message in await asyncio.wait_for(front.outputs(), 30):
                    errors += [e.request_id for e in message.errors]
                    for out in message.outputs:
                        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                        finished += out.finish_reason is not None
            return tokens, errors

        (got0, errors0), (got1, errors1) = await asyncio.gather(drain(front0, 2), drain(front1, 2))
        assert got0 == {"a0": expected["a0"], "a1": expected["a1"]} and errors0 == []
        assert got1 == {"b0": expected["b0"], "b1": expected["b1"]} and errors1 == ["bad"]
    finally:
        await front1.shutdown()
        await front0.shutdown()
    assert front0.process.exitcode == 0


def test_node_exits_when_one_of_its_fronts_dies(folder: Path, redis_url: str) -> None:
    """``--worker-fronts 2``: SIGKILL of the extra front takes front 0 (exit 5) and the core down with it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "deploy.cli", "worker", "--redis-url", redis_url, "--model", str(folder)]
    argv += ["--device", "cpu", "--worker-id", "two-fronts", "--worker-fronts", "2", "--log-level", "warning"]
    front = subprocess.Popen(argv, env=env, cwd=ROOT)
    try:
        client = redis.Redis.from_url(redis_url)
        deadline = time.monotonic() + 120
        while client.get(keys.worker_key("two-fronts-f1")) is None or client.get(keys.worker_key("two-fronts")) is None:
            assert front.poll() is None and time.monotonic() < deadline, "the worker's two fronts did not start"
            time.sleep(0.2)
        children = psutil.Process(front.pid).children(recursive=True)
        (extra,) = [c for c in children if os.getsid(c.pid) == c.pid]  # the extra front leads its own session
        extra.send_signal(signal.SIGKILL)
        assert front.wait(10) == EXIT_FRONT_DIED
        _, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, [c.cmdline() for c in alive]
    finally:
        if front.poll() is None:
            front.kill()
