"""The stack benchmark's host probes: Redis' latency monitor read through a real server (a command that sleeps
inside it shows as an event and a slow command, and reading resets both), and CPU per thread of a real process
tree (a busy child shows, an idle one does not)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from deploy.redis_server import RedisServer
from loadtest.stack_probes import ProcessCpu, RedisLatency, gpu_processes, gpu_state, private_redis_url

SPIN_20_MS = """
local t = redis.call('TIME')
local start = t[1] * 1e6 + t[2]
repeat t = redis.call('TIME') until t[1] * 1e6 + t[2] - start >= 20000
return 1
"""
BUSY = "import time\nend = time.time() + 1.0\nwhile time.time() < end: pass\n"


def test_redis_latency_sees_a_stall_inside_the_server(redis_url: str) -> None:
    probe = RedisLatency(redis_url, threshold_ms=2)
    redis.Redis.from_url(redis_url).eval(SPIN_20_MS, 0)  # 20 ms inside the server
    taken = probe.take()
    assert taken["events"]["command"]["count"] == 1 and taken["events"]["command"]["max_ms"] >= 20, taken
    assert taken["slow_commands"]["EVAL"]["count"] == 1 and taken["slow_commands"]["EVAL"]["max_ms"] >= 20
    assert probe.take()["events"] == {} and probe.take()["slow_commands"] == {}  # taking resets


def test_process_cpu_names_the_busy_child_only(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {BUSY!r}])\n"]
    )
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])
    try:
        time.sleep(0.3)  # the busy grandchild has started
        cpu = ProcessCpu(parent.pid)
        cpu.start()
        time.sleep(0.5)
        lines = cpu.take(wall_s=0.5, min_share=0.2)
        assert len(lines) == 1 and "% of a core" in lines[0] and f"{idle.pid} " not in lines[0], lines
        assert ProcessCpu(idle.pid).take(wall_s=0.5, min_share=0.2) == []
    finally:
        parent.wait(5)
        idle.kill()
        idle.wait()


def test_the_private_redis_is_found_under_the_stack(redis_server: RedisServer) -> None:
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    try:
        assert private_redis_url(parent.pid) is None  # no redis-server under it
    finally:
        parent.wait(5)
    assert redis_server.proc is not None
    assert private_redis_url(redis_server.proc.pid) == redis_server.url  # the server itself is in its own tree


def test_gpu_probes_read_nvidia_smi_and_are_empty_without_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi here (CI has no GPU)
    assert gpu_state() is None and gpu_processes() == []
    tool = tmp_path / "nvidia-smi"  # a stand-in with nvidia-smi's CSV output for the two queries
    tool.write_text(
        "#!/bin/sh\ncase \"$1\" in --query-gpu*) echo '1980, 3201, 41, 402.5';; *) echo '77, python, 129670 MiB';; esac\n"
    )
    tool.chmod(0o755)
    assert gpu_state() == "1980, 3201, 41, 402.5"
    assert gpu_processes() == ["77, python, 129670 MiB"]
