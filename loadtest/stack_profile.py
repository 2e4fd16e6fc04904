"""py-spy profiles of the stack's processes while a benchmark level runs: the worker front, its engine core and
one API process. Each is written as folded stacks (py-spy's raw format) and summarised as the functions that
hold the most samples, so a run on the GPU host says where each process spends its time.

    python -m loadtest.stack_profile summarize worker-front-256.txt    # the summary of a profile made elsewhere
"""

from __future__ import annotations

import collections
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil


def stack_roles(serve_pid: int) -> dict[str, int]:
    """The pids of ``pagedserve serve``'s worker front, engine core and (first) API process."""
    roles: dict[str, int] = {}
    for proc in psutil.Process(serve_pid).children(recursive=True):
        try:
            cmd = " ".join(proc.cmdline())
            parent = " ".join(proc.parent().cmdline()) if proc.parent() else ""
        except psutil.Error:
            continue
        if "deploy.cli worker" in cmd:
            roles.setdefault("worker-front", proc.pid)
        elif "spawn_main" in cmd and "deploy.cli worker" in parent:
            roles.setdefault("engine-core", proc.pid)
        elif "deploy.cli api" in cmd:
            roles.setdefault("api-main", proc.pid)
        elif "deploy.cli api" in parent and "resource_tracker" not in cmd:
            roles.setdefault("api", proc.pid)  # a uvicorn worker process (--api-workers > 1)
    if "api" not in roles and "api-main" in roles:
        roles["api"] = roles["api-main"]
    roles.pop("api-main", None)
    return roles


class StackProfiler:
    """``start(tag)`` attaches py-spy to each role, ``stop()`` ends the recordings and writes summaries."""

    def __init__(self, serve_pid: int, out_dir: Path, rate_hz: int = 100) -> None:
        if shutil.which("py-spy") is None:
            raise RuntimeError("--profile-dir needs py-spy on PATH (pip install py-spy)")
        self.serve_pid = serve_pid
        self.out_dir = out_dir
        self.rate_hz = rate_hz
        self._running: list[tuple[subprocess.Popen[bytes], Path]] = []
        out_dir.mkdir(parents=True, exist_ok=True)

    def start(self, tag: str) -> None:
        for role, pid in stack_roles(self.serve_pid).items():
            path = self.out_dir / f"{role}-{tag}.txt"
            argv = ["py-spy", "record", "--pid", str(pid), "--rate", str(self.rate_hz), "--format", "raw"]
            argv += ["--output", str(path), "--nonblocking"]
            self._running.append((subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), path))

    def stop(self) -> list[str]:
        """Stop every recording; the summaries, one block per process."""
        blocks = []
        for proc, path in self._running:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            if path.exists():
                blocks.append(f"== {path.name}\n" + "\n".join(summarize(path)))
        self._running = []
        return blocks


def _frame_name(frame: str) -> str:
    name, _, where = frame.partition(" (")
    return f"{name} {where.split(':')[0].rsplit('/', 1)[-1]}" if where else name


def summarize(path: Path, top: int = 25) -> list[str]:
    """The functions with the most samples, inclusive (with their callees) and self, as percentages."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_frame_name(f) for f in stack.split(";")]
        for name in set(frames):
            inclusive[name] += n
        own[frames[-1]] += n
    if not total:
        return ["(no samples)"]
    lines = [f"{total} samples; inclusive:"]
    lines += [f"  {100 * v / total:5.1f}%  {k}" for k, v in inclusive.most_common(top)]
    lines.append("self:")
    lines += [f"  {100 * v / total:5.1f}%  {k}" for k, v in own.most_common(top // 2)]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "summarize":
        print("usage: python -m loadtest.stack_profile summarize PROFILE.txt", file=sys.stderr)
        return 2
    print("\n".join(summarize(Path(args[1]))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
