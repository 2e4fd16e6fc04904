"""``pagedserve serve`` as a benchmark's subprocess: wait until a worker is live, stop it as a user does (Ctrl-C).
Shared by ``loadtest.stack_bench`` and ``loadtest.soak``."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx


def tail(path: Path, num_chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""


def wait_ready(
    proc: subprocess.Popen[bytes], base_url: str, timeout_s: float, log: Path, default_model: str
) -> dict[str, Any]:
    """Poll /ready until a worker is live; the served model's id from /v1/models (``default_model`` if refused)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pagedserve serve exited with {proc.returncode} before ready:\n{tail(log)}")
        try:
            ready = httpx.get(f"{base_url}/ready", timeout=5)
            if ready.status_code == 200:
                models = httpx.get(f"{base_url}/v1/models", timeout=5)
                model = models.json()["data"][0]["id"] if models.status_code == 200 else default_model
                return {**ready.json(), "model": model}
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"pagedserve serve not ready after {timeout_s:.0f} s:\n{tail(log)}")


def stop_stack(proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> int:
    """SIGINT (Ctrl-C) as a user stops it; SIGKILL only if it does not stop in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
