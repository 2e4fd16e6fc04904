"""``pagedserve bench serve``: load an OpenAI-compatible server with Poisson arrivals (or a closed loop) and
report TTFT / TPOT / ITL / E2E percentiles, throughput, goodput and 429s.

    pagedserve bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 20
    pagedserve bench serve --cache-hit --no-stream --num-prompts 20000 --max-concurrency 8   # response-cache path
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

PROMPTS = [
    "Explain what a KV cache is in one paragraph.",
    "Write a haiku about the sea.",
    "List three uses of Redis.",
    "What is the capital of Australia?",
    "Summarise the plot of Hamlet in two sentences.",
    "Give me a recipe for pancakes.",
]


@dataclass
class Record:
    status: int
    e2e_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedserve bench serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals/s (inf = all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (closed loop)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--cache-hit", action="store_true", help="repeat one greedy request: measures the response cache")
    p.add_argument("--warmup", type=int, default=20, help="requests sent (and not counted) before measuring")
    p.add_argument("--slo-ttft-ms", type=float, default=500.0, help="goodput: TTFT at most this")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="goodput: TPOT at most this")
    p.add_argument(
        "--client",
        choices=("httpx", "raw"),
        default="httpx",
        help="raw: a minimal keep-alive HTTP/1.1 client (non-streaming only) so a 2-core box measures "
        "the server rather than httpx",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the summary to this file")
    return p


def _body(args: argparse.Namespace, i: int) -> dict[str, Any]:
    text = PROMPTS[0] if args.cache_hit else f"{PROMPTS[i % len(PROMPTS)]} (#{i})"
    body: dict[str, Any] = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": args.stream,
    }
    if args.cache_hit:
        body["temperature"] = 0.0
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if args.stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _stream(client: httpx.AsyncClient, path: str, body: dict[str, Any], t0: float) -> Record:
    rec = Record(0, 0.0)
    last = t0
    async with client.stream("POST", path, json=body) as resp:
        rec.status = resp.status_code
        if resp.status_code != 200:
            await resp.aread()
            rec.e2e_s = time.perf_counter() - t0
            return rec
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                rec.output_tokens = chunk["usage"]["completion_tokens"]
            texts = [c.get("text") or (c.get("delta") or {}).get("content") for c in chunk.get("choices", [])]
            if any(texts):
                now = time.perf_counter()
                if rec.ttft_s is None:
                    rec.ttft_s = now - t0
                else:
                    rec.itl_s.append(now - last)
                last = now
    rec.e2e_s = time.perf_counter() - t0
    return rec


async def _once(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Record:
    t0 = time.perf_counter()
    try:
        if body["stream"]:
            return await _stream(client, path, body, t0)
        resp = await client.post(path, json=body)
    except httpx.HTTPError:
        return Record(-1, time.perf_counter() - t0)
    e2e = time.perf_counter() - t0
    rec = Record(resp.status_code, e2e, ttft_s=e2e)
    if resp.status_code == 200:
        rec.output_tokens = resp.json()["usage"]["completion_tokens"]
    return rec


def _pcts(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))] * 1000  # noqa: E731
    return {"mean_ms": statistics.fmean(values) * 1000, "p50_ms": pick(0.5), "p90_ms": pick(0.9), "p99_ms": pick(0.99)}


def summarize(records: list[Record], wall_s: float, args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    good = [r for r in ok if (r.ttft_s or 0) * 1000 <= args.slo_ttft_ms and (r.tpot_s or 0) * 1000 <= args.slo_tpot_ms]
    return {
        "requests": len(records),
        "ok": len(ok),
        "rejected_429": sum(r.status == 429 for r in records),
        "errors": sum(not r.ok and r.status != 429 for r in records),
        "duration_s": wall_s,
        "request_throughput": len(ok) / wall_s,
        "output_token_throughput": sum(r.output_tokens for r in ok) / wall_s,
        "goodput": len(good) / wall_s,
        "ttft": _pcts([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot": _pcts([t for r in ok if (t := r.tpot_s) is not None]),
        "itl": _pcts([x for r in ok for x in r.itl_s]),
        "e2e": _pcts([r.e2e_s for r in ok]),
        "config": {k: v for k, v in vars(args).items() if k != "api_key"},
    }


class RawConnection:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and reads Content-Length bodies; nothing else."""

    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self.host, self.port = host, port
        self.extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: dict[str, Any]) -> Record:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n{self.extra}\r\n"
        ).encode()
        t0 = time.perf_counter()
        self.writer.write(head + data)
        status_line = await self.reader.readline()
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        payload = await self.reader.readexactly(length)
        e2e = time.perf_counter() - t0
        rec = Record(int(status_line.split()[1]), e2e, ttft_s=e2e)
        if rec.ok:
            rec.output_tokens = json.loads(payload)["usage"]["completion_tokens"]
        return rec


async def run_raw(args: argparse.Namespace) -> dict[str, Any]:
    """Closed loop over ``max_concurrency`` raw connections (the response-cache benchmark)."""
    if args.stream:
        raise ValueError("--client raw measures non-streaming requests only: add --no-stream")
    url = httpx.URL(args.base_url)
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    conns = [RawConnection(url.host, url.port or 80, headers) for _ in range(args.max_concurrency or 1)]
    warm = iter(range(args.warmup))
    await asyncio.gather(*(_raw_loop(c, warm, path, args, None) for c in conns))
    records: list[Record] = []
    todo = iter(range(args.warmup, args.warmup + args.num_prompts))
    start = time.perf_counter()
    await asyncio.gather(*(_raw_loop(c, todo, path, args, records) for c in conns))
    return summarize(records, time.perf_counter() - start, args)


async def _raw_loop(
    conn: RawConnection, todo: Iterator[int], path: str, args: argparse.Namespace, records: list[Record] | None
) -> None:
    for i in todo:
        rec = await conn.post(path, _body(args, i))
        if records is not None:
            records.append(rec)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.client == "raw":
        return await run_raw(args)
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.max_concurrency or args.num_prompts
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=600, limits=limits) as client:
        await asyncio.gather(*(_once(client, path, _body(args, i)) for i in range(args.warmup)))
        sem = asyncio.Semaphore(limit)

        async def fire(i: int) -> Record:
            async with sem:
                return await _once(client, path, _body(args, i))

        tasks = []
        start = time.perf_counter()
        for i in range(args.num_prompts):
            tasks.append(asyncio.create_task(fire(i)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        records = await asyncio.gather(*tasks)
        return summarize(list(records), time.perf_counter() - start, args)


def _print(summary: dict[str, Any]) -> None:
    print(
        f"requests {summary['requests']}  ok {summary['ok']}  429 {summary['rejected_429']}  "
        f"errors {summary['errors']}  in {summary['duration_s']:.2f} s"
    )
    print(
        f"throughput {summary['request_throughput']:.1f} req/s  {summary['output_token_throughput']:.1f} tok/s  "
        f"goodput {summary['goodput']:.1f} req/s"
    )
    for name in ("ttft", "tpot", "itl", "e2e"):
        if summary[name]:
            print(f"{name:5s} " + "  ".join(f"{k} {v:.2f}" for k, v in summary[name].items()))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    summary = asyncio.run(run(args))
    _print(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return 0 if summary["ok"] else 1


__all__ = ["Record", "asdict", "main", "run", "summarize"]
