"""Streaming clients for the stack benchmark: processes that each own a share of a wave's streams and time
every SSE chunk, so that 512 streams measure the server and not one client's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any
from urllib.parse import urlsplit


@dataclass
class Record:
    """One request's outcome, measured the same way on both sides; ``reason`` is None when it succeeded."""

    wave: int
    index: int
    reason: str | None = None
    num_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)  # between token (engine) or chunk (stack) arrivals
    # the stack with PAGEDSERVE_SSE_TIMES: per token arrival, when the API's relay got it and wrote it out
    relay_s: list[tuple[float, float]] = field(default_factory=list)
    start_s: float = 0.0
    end_s: float = 0.0


@dataclass
class StreamJob:
    """One streaming request a client process sends."""

    wave: int
    index: int
    body: dict[str, Any]


def finish_record(rec: Record, times_s: list[float], output_len: int) -> Record:
    """TTFT, TPOT and gaps from the arrival times of tokens (or chunks); a wrong count is a failure."""
    if times_s:
        rec.ttft_s = times_s[0] - rec.start_s
        rec.gaps_s = [b - a for a, b in zip(times_s, times_s[1:], strict=False)]
        if rec.num_tokens > 1:
            rec.tpot_s = (times_s[-1] - times_s[0]) / (rec.num_tokens - 1)
    if rec.reason is None and not times_s:
        rec.reason = "no token arrived"
    if rec.reason is None and rec.num_tokens != output_len:
        rec.reason = f"got {rec.num_tokens} tokens, expected {output_len}"
    return rec


# ---- the client: processes that each own a share of a wave's streams -------------------------------------
class SSEReader:
    """Parses ``data:`` lines as bytes arrive: arrival times of token chunks, usage, errors, [DONE]."""

    def __init__(self) -> None:
        self.buf = b""
        self.times_s: list[float] = []
        self.num_tokens: int | None = None
        self.error: str | None = None
        self.done = False
        self.relay_s: list[tuple[float, float]] = []  # per token time: the API's ": t" stamp before it
        self._stamp: tuple[float, float] | None = None

    def feed(self, data: bytes, now: float) -> None:
        *lines, self.buf = (self.buf + data).split(b"\n")
        for line in lines:
            if line.startswith(b": t "):  # the API's relay stamp (api.streams.SSE_TIMES) for the chunks after it
                pushed, written = line[4:].split()
                self._stamp = (float(pushed), float(written))
                continue
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            chunk = json.loads(payload)
            if "error" in chunk:
                self.error = f"error event: {json.dumps(chunk['error'])[:500]}"
            if chunk.get("usage"):
                self.num_tokens = int(chunk["usage"]["completion_tokens"])
            # a token's arrival: a chunk with text, or a delta ("" while its text is held back, as vLLM sends
            # them); the last chunk of a choice only counts if it brings text
            if any(c.get("text") or c.get("finish_reason") is None for c in chunk.get("choices") or ()):
                self.times_s.append(now)
                if self._stamp is not None:
                    self.relay_s.append(self._stamp)

    def reason(self) -> str | None:
        if self.error:
            return self.error
        if not self.done:
            return "stream ended without [DONE]"
        return "no usage chunk" if self.num_tokens is None else None


class ChunkedBody:
    """HTTP/1.1 ``Transfer-Encoding: chunked`` decoding as bytes arrive: ``feed`` returns the payload bytes of
    the chunks completed so far; ``done`` once the last (empty) chunk arrived."""

    def __init__(self) -> None:
        self.buf = b""
        self.done = False

    def feed(self, data: bytes) -> bytes:
        self.buf += data
        out = []
        while not self.done:
            head_end = self.buf.find(b"\r\n")
            if head_end < 0:
                break
            size = int(self.buf[:head_end].split(b";", 1)[0], 16)
            end = head_end + 2 + size
            if len(self.buf) < end + 2:
                break
            out.append(self.buf[head_end + 2 : end])
            self.buf = self.buf[end + 2 :]
            self.done = size == 0
        return b"".join(out)


def request_bytes(host: str, path: str, body: dict[str, Any]) -> bytes:
    """One HTTP/1.1 POST of ``body`` as JSON, its connection closed after the response."""
    data = json.dumps(body, separators=(",", ":")).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    return (head + f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    raw = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = raw.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers


async def _send(base_url: str, job: StreamJob, sse: SSEReader) -> str | None:
    """One POST on its own connection, read with asyncio streams (no HTTP library: with httpx a client process
    spent ~15 ms of CPU per request at 256 streams in flight on a 2-core VM, so it measured itself, not the
    server)."""
    url = urlsplit(base_url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    try:
        writer.write(request_bytes(f"{host}:{port}", "/v1/completions", job.body))
        status, headers = await _read_head(reader)
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        if status != 200:
            rest = await reader.read(1 << 16)
            return f"HTTP {status}: {(ChunkedBody().feed(rest) if chunked else rest).decode(errors='replace')[:500]}"
        body = ChunkedBody() if chunked else None
        while data := await reader.read(1 << 16):
            sse.feed(body.feed(data) if body is not None else data, time.perf_counter())
            if body is not None and body.done:
                break
    finally:
        writer.close()
    return sse.reason()


async def stream_one(base_url: str, job: StreamJob) -> Record:
    """One streaming request; any failure (status, error event, missing [DONE], exception) is its reason."""
    rec, sse = Record(job.wave, job.index, start_s=time.perf_counter()), SSEReader()
    try:
        rec.reason = await _send(base_url, job, sse)
    except Exception as exc:  # noqa: BLE001 - every failure is reported with its request, never raised
        rec.reason = f"{type(exc).__name__}: {exc}"[:500]
    rec.end_s = time.perf_counter()
    rec.num_tokens = sse.num_tokens or 0
    if len(sse.relay_s) == len(sse.times_s):  # every token had the API's stamp (PAGEDSERVE_SSE_TIMES)
        rec.relay_s = sse.relay_s
    return finish_record(rec, sse.times_s, job.body["max_tokens"])


async def _client_loop(conn: Connection, base_url: str) -> None:
    loop = asyncio.get_running_loop()
    while (jobs := await loop.run_in_executor(None, conn.recv)) is not None:
        # a fresh connection per request: one left idle since the last wave may be closed by the server
        # (uvicorn's 5 s keep-alive timeout) just as it is reused, which fails that request
        conn.send(await asyncio.gather(*(stream_one(base_url, job) for job in jobs)))


def _client_process(conn: Connection, base_url: str) -> None:
    try:
        import uvloop

        factory: Any = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(_client_loop(conn, base_url))


class ClientPool:
    """``num_procs`` processes, each an asyncio client sending its share of every wave at once."""

    def __init__(self, num_procs: int, base_url: str) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for _ in range(num_procs):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_client_process, args=(theirs, base_url), daemon=True)
            proc.start()
            self.conns.append(ours)
            self.procs.append(proc)

    def run(self, jobs: list[StreamJob]) -> list[Record]:
        n = len(self.conns)
        for i, conn in enumerate(self.conns):
            conn.send(jobs[i::n])
        return sorted((r for conn in self.conns for r in conn.recv()), key=lambda r: r.index)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # a client that died already
                conn.send(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
