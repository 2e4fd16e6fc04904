"""A private ``redis-server`` on a free local port (the launcher's default, and the tests' fixture)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RedisServer:
    """``with RedisServer() as r: r.url`` — bound to localhost, stopped (and its folder removed) on exit.

    ``appendonly``: an append-only file with ``appendfsync everysec`` in the server's folder, so that ``start()``
    after the process died (same port, same folder) comes back with the queue and the jobs' events. A killed
    process loses nothing it acknowledged (its writes are in the kernel before it replies; only a machine
    crash can lose the last second). Off by default: the tests' server needs no disk writes."""

    def __init__(self, port: int | None = None, binary: str = "redis-server", appendonly: bool = False) -> None:
        path = shutil.which(binary)
        if path is None:
            raise ValueError(
                f"{binary} not found on PATH: install it (Debian: apt-get install redis-server) or pass --redis-url"
            )
        self.binary = path
        self.port = port or free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="pagedserve-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return Path(self._dir.name) / "redis.log"

    def argv(self) -> list[str]:
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "everysec"] if self.appendonly else ["--appendonly", "no"]
        )
        return [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            *persistence,
            "--dir",
            self._dir.name,
            "--maxclients",
            "10000",
            "--loglevel",
            "warning",
        ]

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start the server (again, after it died: same port and folder) and wait until it answers PING."""
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            # own session: a terminal's Ctrl-C must not stop Redis before the workers have drained through it
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.log_path.read_text()}")
            if self._answers():
                return self
            time.sleep(0.02)
        self.stop_process()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s} s")

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")  # -LOADING while it replays the append-only file
        except OSError:
            return False

    def stop_process(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL after 5 s); its folder stays for a ``start()`` again."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def stop(self) -> None:
        """Stop the process and remove its folder."""
        self.stop_process()
        self.proc = None
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
