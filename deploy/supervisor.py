"""Keeping the processes of ``pagedserve serve`` running: a child that exits is started again after a backoff
(a dead worker's jobs meanwhile go to the other workers through their leases); a child that keeps crashing
makes the launcher give up loudly, since restarting it forever would hide a broken deployment."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("pagedserve.launcher")


class GaveUpError(RuntimeError):
    """A child crashed more often than the restart policy allows."""


@dataclass
class RestartPolicy:
    """How often a child may crash: more than ``max_restarts`` exits within ``window_s`` and the launcher stops.
    The n-th restart in the window waits ``backoff_s * 2**(n-1)`` s, at most ``max_backoff_s``."""

    max_restarts: int = 5
    window_s: float = 300.0  # long enough to see a worker that crashes after its 30 s model load
    backoff_s: float = 1.0
    max_backoff_s: float = 15.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.window_s <= 0 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError("--restart-window-s must be > 0 and the backoff range non-negative")

    def delay_s(self, num_recent_crashes: int) -> float:
        return float(min(self.max_backoff_s, self.backoff_s * 2 ** max(0, num_recent_crashes - 1)))


@dataclass(eq=False)
class Child:
    """One supervised process. ``tier``: higher tiers are stopped first (the workers drain through Redis)."""

    name: str
    spawn: Callable[[], subprocess.Popen[bytes]]
    tier: int
    proc: subprocess.Popen[bytes] | None = None
    crashes: deque[float] = field(default_factory=deque)  # monotonic times of recent exits
    restart_at: float | None = None
    num_restarts: int = 0

    def start(self) -> None:
        self.restart_at = None
        self.proc = self.spawn()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid


def popen_in_own_group(argv: list[str]) -> subprocess.Popen[bytes]:
    # own process group: a terminal Ctrl-C reaches only the launcher, which forwards one SIGTERM
    return subprocess.Popen(argv, start_new_session=True)


def _how(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


def _kill_group(pid: int) -> None:
    """What a dead child left behind (a uvicorn worker, an engine core): its group goes with it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class Supervisor:
    """Child processes by name, restarted by ``check`` according to ``policy``."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.children: dict[str, Child] = {}
        self.stopping = False

    def add(self, name: str, spawn: Callable[[], subprocess.Popen[bytes]], tier: int = 1) -> Child:
        logger.info("starting %s", name)
        child = self.children[name] = Child(name, spawn, tier)
        child.start()
        return child

    def check(self, now: float | None = None) -> None:
        """Notice exits and run due restarts; raises ``GaveUpError`` when a child crashed too often."""
        now = time.monotonic() if now is None else now
        for child in self.children.values():
            if child.restart_at is None and child.proc is not None and child.proc.poll() is not None:
                self._exited(child, _how(child.proc.returncode), now)
            if child.restart_at is not None and now >= child.restart_at and not self.stopping:
                child.num_restarts += 1
                logger.warning("restarting %s (restart %d)", child.name, child.num_restarts)
                try:
                    child.start()
                except (OSError, RuntimeError) as exc:  # e.g. redis-server refusing to start
                    child.proc = None
                    self._exited(child, f"failed to start: {exc}", now)

    def _exited(self, child: Child, what: str, now: float) -> None:
        if child.pid is not None:
            _kill_group(child.pid)
        child.crashes.append(now)
        while child.crashes and child.crashes[0] < now - self.policy.window_s:
            child.crashes.popleft()
        num_recent = len(child.crashes)
        if num_recent > self.policy.max_restarts:
            raise GaveUpError(
                f"{child.name} {what}; it stopped {num_recent} times within {self.policy.window_s:.0f} s "
                f"(--max-restarts {self.policy.max_restarts})"
            )
        delay = self.policy.delay_s(num_recent)
        child.restart_at = now + delay
        logger.error(
            "%s %s: restarting it in %.1f s (%d exits in the last %.0f s)",
            child.name,
            what,
            delay,
            num_recent,
            self.policy.window_s,
        )

    def stop(self, timeout_s: float) -> None:
        """Highest tier first: SIGTERM (workers finish running jobs), SIGKILL what is left after ``timeout_s``."""
        self.stopping = True
        for tier in sorted({c.tier for c in self.children.values()}, reverse=True):
            group = [c for c in self.children.values() if c.tier == tier and c.proc is not None]
            for child in group:
                assert child.proc is not None
                if child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for child in group:
                assert child.proc is not None
                try:
                    child.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop in time: killing it", child.name)
                    child.proc.kill()
                    child.proc.wait()
