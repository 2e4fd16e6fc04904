"""Does the order of a ragged decode batch's sequences change the paged decode kernel's time?

At 64+ sequences the decode plan gives each (sequence, KV head) one program (``kernels.decode_plan``), so a batch
of `mixed`'s lengths is thousands of programs of very different lengths, handed to the SMs in grid order. The last
ones decide the tail. Times ``paged_decode_attention`` (CUDA graph, tables as wide as the engine's 4096-token
graphs) on one batch of lengths uniform in [32, 1536] in three orders: as drawn, longest first, shortest first;
and a batch of the same size whose sequences all have the mean length (the same bytes, no raggedness).
Reports GB/s of K+V read against the device copy bandwidth measured in the same process.
``python -m loadtest.ragged_decode_bench [--batches 64 256 512] [--out F]``.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Any

import torch

from loadtest.kernel_bench_common import (
    BLOCK_SIZE,
    DTYPE,
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    rel_err,
    report_rows,
    time_graph,
)

TABLE_LEN = 4096
LENGTHS = (32, 1536)


def _inputs(lens: list[int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A paged cache holding ``lens`` tokens per sequence in shuffled blocks, the tables, the lengths."""
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(blocks) + 1
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE).cuda()
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.zeros(len(lens), TABLE_LEN // BLOCK_SIZE, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks):
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    return cache, tables.cuda(), torch.tensor(lens, dtype=torch.int32).cuda()


def bench_batch(batch: int, reps: int, gen: torch.Generator) -> dict[str, Any]:
    from kernels.paged_attention import paged_decode_attention

    lens = torch.randint(LENGTHS[0], LENGTHS[1] + 1, (batch,), generator=gen).tolist()
    cache, tables, seq_lens = _inputs(lens, gen)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen).to(DTYPE).cuda()
    scale = HEAD_DIM**-0.5
    kv_bytes = 2 * sum(lens) * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    ref = paged_decode_attention(query, cache, tables, seq_lens, scale)
    row: dict[str, Any] = {"batch": batch, "mean_len": sum(lens) / batch, "kv_mb": kv_bytes / 1e6}
    orders = {
        "drawn": torch.arange(batch),
        "longest_first": torch.argsort(torch.tensor(lens), descending=True, stable=True),
        "shortest_first": torch.argsort(torch.tensor(lens), stable=True),
    }
    for rnd in range(2):
        for name, order in orders.items():
            o = order.cuda()
            q, t, s = query[o].contiguous(), tables[o].contiguous(), seq_lens[o].contiguous()
            if rnd == 0:
                row[f"{name}_err"] = rel_err(paged_decode_attention(q, cache, t, s, scale), ref[o])
            secs = time_graph([partial(paged_decode_attention, q, cache, t, s, scale)] * 16, reps)
            row[f"{name}_us_{rnd}"] = round(secs * 1e6, 1)
            row[f"{name}_gbps_{rnd}"] = round(kv_bytes / secs / 1e9, 1)
    mean = round(sum(lens) / batch)
    cache_u, tables_u, lens_u = _inputs([mean] * batch, gen)
    secs = time_graph([partial(paged_decode_attention, query, cache_u, tables_u, lens_u, scale)] * 16, reps)
    uniform_bytes = 2 * mean * batch * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    row["uniform_us"], row["uniform_gbps"] = round(secs * 1e6, 1), round(uniform_bytes / secs / 1e9, 1)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("ragged_decode_bench needs a GPU", file=sys.stderr)
        return 2
    from loadtest.shapes import measure_copy_bandwidth

    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy_tb_s": round(measure_copy_bandwidth(), 3)}
    gen = torch.Generator().manual_seed(0)
    report_rows(report, (bench_batch(batch, args.reps, gen) for batch in args.batches), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
