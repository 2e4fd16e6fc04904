"""What the stack's host did during a level of ``bench stack``, read from outside its processes:

- ``RedisLatency``: Redis' own latency monitor and slow log (events inside the server over a threshold: a
  command, the append-only file's writes and fsyncs, forks, the expiry cycle), so a pipeline that took long as
  the front saw it can be told apart from one that waited inside Redis.
- ``ProcessCpu``: CPU time per thread of every process under ``pagedserve serve`` (from ``/proc``), so a role
  that is busy, or threads that should be idle and are not (a math library's pool spinning), show by name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, cast

import redis

_REDIS_TITLE = re.compile(r"redis-server [0-9.*]+:([0-9]+)")
_REDIS_ARGV = re.compile(r"redis-server .*--port ([0-9]+)")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def private_redis_url(root_pid: int) -> str | None:
    """The private Redis that ``pagedserve serve`` (``root_pid``) started: a redis-server under it, by its port."""
    for pid in _children(root_pid):
        line = " ".join(_cmdline(pid))  # redis-server sets its title to "redis-server HOST:PORT"
        match = _REDIS_TITLE.search(line) or _REDIS_ARGV.search(line)
        if match:
            return f"redis://127.0.0.1:{match.group(1)}/0"
    return None


class RedisLatency:
    """Arms Redis' latency monitor and slow log at ``threshold_ms``; ``take`` reads and resets both."""

    def __init__(self, url: str, threshold_ms: int = 2) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=5)
        self.threshold_ms = threshold_ms
        self.client.config_set("latency-monitor-threshold", threshold_ms)
        self.client.config_set("slowlog-log-slower-than", threshold_ms * 1000)
        self.client.config_set("slowlog-max-len", 1024)
        self.reset()

    def reset(self) -> None:
        self.client.execute_command("LATENCY", "RESET")
        self.client.slowlog_reset()

    def take(self) -> dict[str, Any]:
        """Events over the threshold since the last reset: per kind the count and the longest (ms), the slow
        commands by name (count, longest ms), and the persistence counters that say whether the disk waited."""
        events: dict[str, dict[str, int]] = {}
        for row in cast(list[Any], self.client.execute_command("LATENCY", "LATEST")):
            name = row[0].decode() if isinstance(row[0], bytes) else str(row[0])
            history = self.client.execute_command("LATENCY", "HISTORY", name)
            events[name] = {"count": len(history), "max_ms": int(row[2])}
        commands: dict[str, list[float]] = {}
        for entry in cast(list[dict[str, Any]], self.client.slowlog_get(1024)):
            command = entry["command"]
            name = (command.split()[0] if command else b"?").decode(errors="replace").upper()
            commands.setdefault(name, []).append(entry["duration"] / 1000)
        info = cast(dict[str, Any], self.client.info("persistence"))
        self.reset()
        return {
            "events": events,
            "slow_commands": {k: {"count": len(v), "max_ms": round(max(v), 2)} for k, v in commands.items()},
            "aof_delayed_fsync": info.get("aof_delayed_fsync"),
            "latest_fork_ms": round(info.get("latest_fork_usec", 0) / 1000, 2),
            "aof_rewrites": info.get("aof_rewrites"),
        }


def _children(pid: int) -> list[int]:
    tree, todo = [], [pid]
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    while todo:
        current = todo.pop()
        tree.append(current)
        todo += parents.get(current, [])
    return tree


def _threads(pid: int) -> dict[str, float]:
    """CPU seconds per thread (``comm/tid``) of one process; empty once it is gone."""
    out: dict[str, float] = {}
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm = text[text.index("(") + 1 : text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        out[f"{comm}/{stat.parent.name}"] = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return out


def _cmdline(pid: int) -> list[str]:
    try:
        return [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return []


def _process_name(pid: int) -> str:
    """``pid`` and its command line, short: a spawned child (the engine core) as such."""
    words = _cmdline(pid)
    if "--multiprocessing-fork" in words:
        return f"{pid} (spawned child)"
    return f"{pid} {' '.join([Path(words[0]).name, *words[1:5]])[:80]}" if words else str(pid)


class ProcessCpu:
    """CPU seconds per thread of the process tree under ``root_pid``, between ``start`` and ``take``."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self._before: dict[int, dict[str, float]] = {}

    def start(self) -> None:
        self._before = {pid: _threads(pid) for pid in _children(self.root_pid)}

    def take(self, wall_s: float, min_share: float = 0.02) -> list[str]:
        """One line per process (busy share of one core), with its threads over ``min_share`` of the wall."""
        lines = []
        for pid in _children(self.root_pid):
            before = self._before.get(pid, {})
            used = {name: cpu - before.get(name, 0.0) for name, cpu in _threads(pid).items()}
            total = sum(used.values())
            if total < min_share * wall_s:
                continue
            busy = sorted(((v, k) for k, v in used.items() if v >= min_share * wall_s), reverse=True)
            threads = ", ".join(f"{name} {100 * v / wall_s:.0f} %" for v, name in busy[:8])
            lines.append(f"  {_process_name(pid)}: {100 * total / wall_s:.0f} % of a core ({threads})")
        return lines


def _nvidia_smi(*args: str) -> list[str] | None:
    """The non-empty output lines of ``nvidia-smi ARGS``, or None without it (no NVIDIA GPU)."""
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30, check=False)
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def gpu_processes() -> list[str]:
    """The processes holding a CUDA context now (``nvidia-smi``), one ``pid, name, memory`` line each; empty
    without an NVIDIA GPU. A second context on the engine's GPU would share its time."""
    return _nvidia_smi("--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader") or []


def gpu_state() -> str | None:
    """The GPU's SM and memory clocks (MHz), temperature (C) and power draw (W) now, or None without
    ``nvidia-smi``: the engine's step moves by a few per cent between processes, and this tells a slower
    clock apart from a slower process."""
    lines = _nvidia_smi("--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw", "--format=csv,noheader,nounits")
    return lines[0] if lines else None


class StackProbes:
    """All of a level's probes of a running stack (``root_pid``: ``pagedserve serve``): CPU per process and
    thread, the GPU's contexts and state, and Redis' latency events where its private Redis is found."""

    def __init__(self, root_pid: int) -> None:
        self.cpu = ProcessCpu(root_pid)
        url = private_redis_url(root_pid)
        self.latency = RedisLatency(url) if url else None

    def start(self) -> None:
        self.cpu.start()
        if self.latency is not None:
            self.latency.reset()

    def take(self, level: int, wall_s: float) -> dict[str, Any]:
        """The level's numbers since ``start``, printed and returned for its summary."""
        taken: dict[str, Any] = {"host_cpu": self.cpu.take(wall_s), "gpu_processes": gpu_processes()}
        taken["gpu_state"] = gpu_state()
        print(f"host c={level}: CPU per process over {wall_s:.1f} s of waves", flush=True)
        print("\n".join(taken["host_cpu"]), flush=True)
        print(f"GPU contexts c={level}: {taken['gpu_processes']}", flush=True)
        if self.latency is not None:
            taken["redis_latency"] = self.latency.take()
            threshold = self.latency.threshold_ms
            print(f"redis c={level} (over {threshold} ms): {json.dumps(taken['redis_latency'])}", flush=True)
        return taken
