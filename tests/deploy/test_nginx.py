"""deploy/nginx.conf as shipped, but for its two addresses: ``nginx -t`` accepts it, and a real nginx started on
it streams an SSE response as it comes (proxy_buffering off) and refuses a body over its limit. The test copy
points the upstream (``api:8000``, compose's DNS name) at a backend on 127.0.0.1 and listens on a free port,
with every path nginx writes under a temporary prefix (no root, no /etc/hosts). Skipped without nginx."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from deploy.redis_server import free_port

CONF = Path(__file__).resolve().parents[2] / "deploy" / "nginx.conf"
NGINX = shutil.which("nginx") or (shutil.which("nginx", path="/usr/sbin:/usr/local/sbin") or "")
pytestmark = pytest.mark.skipif(not NGINX, reason="nginx is not installed (apt-get install -y nginx)")
PAUSE_S = 1.5  # between the backend's two events


class SlowSse(BaseHTTPRequestHandler):
    """Stands in for the API: one event, a pause, a second event (HTTP/1.0: the body ends with the connection)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b"data: first\n\n")
        self.wfile.flush()
        time.sleep(PAUSE_S)
        self.wfile.write(b"data: second\n\n")

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
        pass


def _config_copy(tmp_path: Path, backend_port: int, port: int) -> Path:
    """The shipped file with its upstream and listen address replaced, and its writable paths in ``tmp_path``."""
    text = CONF.read_text()
    assert text.count("server api:8000;") == 1 and text.count("listen 80;") == 1, "the test copy needs updating"
    replaced = text.replace("server api:8000;", f"server 127.0.0.1:{backend_port};")
    replaced = replaced.replace("listen 80;", f"listen 127.0.0.1:{port};")
    temp_paths = "".join(f"  {kind}_temp_path {tmp_path / kind};\n" for kind in ("client_body", "proxy", "fastcgi"))
    temp_paths += "".join(f"  {kind}_temp_path {tmp_path / kind};\n" for kind in ("uwsgi", "scgi"))
    replaced = replaced.replace("http {\n", f"http {{\n  access_log {tmp_path / 'access.log'};\n{temp_paths}", 1)
    path = tmp_path / "nginx.conf"
    path.write_text(replaced)
    return path


def _nginx(conf: Path, *args: str) -> list[str]:
    prefix = conf.parent
    return [NGINX, "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log"), *args]


@pytest.fixture
def backend() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowSse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_nginx_accepts_the_config(tmp_path: Path) -> None:
    conf = _config_copy(tmp_path, free_port(), free_port())
    result = subprocess.run(_nginx(conf, "-t", "-g", f"pid {tmp_path / 'nginx.pid'};"), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr


def test_nginx_streams_events_as_they_come_and_limits_bodies(tmp_path: Path, backend: int) -> None:
    port = free_port()
    conf = _config_copy(tmp_path, backend, port)
    proc = subprocess.Popen(_nginx(conf, "-g", f"daemon off; pid {tmp_path / 'nginx.pid'};"), stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "nginx did not listen"
                time.sleep(0.05)
        started = time.monotonic()
        with httpx.stream("GET", f"http://127.0.0.1:{port}/v1/completions", timeout=10) as resp:
            chunks = resp.iter_text()
            first = next(chunks)
            first_s = time.monotonic() - started
            rest = "".join(chunks)
        assert "data: first" in first and first_s < PAUSE_S / 2, (first, first_s)  # not held until the end
        assert "data: second" in rest
        big = httpx.post(f"http://127.0.0.1:{port}/v1/completions", content=b"x" * (2 << 20), timeout=10)
        assert big.status_code == 413  # client_max_body_size 1m
    finally:
        proc.terminate()
        proc.wait(10)
