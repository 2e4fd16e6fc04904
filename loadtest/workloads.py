"""The fixed-seed workloads of ../shared/BENCHMARKS.md, as token ids (throughput does not depend on them)."""

from __future__ import annotations

import random
from dataclasses import dataclass

WORKLOADS = ("mixed", "mixed-128", "shared-prefix", "latency")


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def make_workload(name: str, vocab_size: int, num_requests: int | None = None) -> list[BenchRequest]:
    """``mixed``: 512 requests, inputs U[32, 1024], outputs U[16, 512], seed 0; ``mixed-128``: its first 128;
    ``shared-prefix``: 256 requests of one 2048-token prefix + 64 unique tokens, 128 out;
    ``latency``: one request, 128 in, 256 out."""
    rng = random.Random(0)
    if name in ("mixed", "mixed-128"):
        reqs = []
        for _ in range(512):
            n_in, n_out = rng.randint(32, 1024), rng.randint(16, 512)
            reqs.append(BenchRequest([rng.randrange(vocab_size) for _ in range(n_in)], n_out))
        count = 128 if name == "mixed-128" else 512
    elif name == "shared-prefix":
        prefix = [rng.randrange(vocab_size) for _ in range(2048)]
        reqs = [BenchRequest(prefix + [rng.randrange(vocab_size) for _ in range(64)], 128) for _ in range(256)]
        count = 256
    elif name == "latency":
        reqs = [BenchRequest([rng.randrange(vocab_size) for _ in range(128)], 256)]
        count = 1
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return reqs[: num_requests or count]
