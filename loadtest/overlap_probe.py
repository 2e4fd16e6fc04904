"""Would two nano-batches on two streams pay at large decode batches? ``python -m loadtest.overlap_probe`` (GPU).

At a decode step of a few hundred sequences the layer's GEMMs are near the compute bound while decode attention
only streams the KV cache, so the two could overlap (NanoFlow's nano-batches): split the batch in two halves and
run one half's attention on a second stream while the other half's GEMMs run. This probe times 32 layers of the
8B shape built from the engine's own kernels (cuBLAS ``F.linear``, ``silu_and_mul``, ``paged_decode_attention``)
in CUDA graphs, three ways:

- ``whole``: the batch at once, one stream (what the engine does);
- ``halves``: two halves one after the other, one stream (what splitting alone costs the GEMMs);
- ``overlap``: two halves, attention on a second stream: half B's attention runs beside half A's o / MLP, half A's
  next-layer attention beside half B's.

Nothing else of a step (norms, rotary, sampling) is included: it is a bound on what the overlap could give.
``--carveouts``: the overlap again with cuBLAS told to leave that many SMs to other kernels
(``torch._C._set_sm_carveout_experimental``, set while the graph is captured), so attention has SMs of its own.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul
from kernels.paged_attention import paged_decode_attention
from loadtest.kernel_bench_common import BLOCK_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, time_graph

HIDDEN, INTER, LAYERS = 4096, 14336, 32
QKV = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM


@dataclass
class Half:
    """One nano-batch's inputs and scratch: hidden states, its block table and lengths."""

    x: torch.Tensor  # [B, HIDDEN]
    tables: torch.Tensor
    lens: torch.Tensor


def _weights(copies: int, dev: torch.device) -> list[dict[str, torch.Tensor]]:
    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02

    return [{"qkv": w(QKV, HIDDEN), "o": w(HIDDEN, HIDDEN), "gu": w(2 * INTER, HIDDEN), "down": w(HIDDEN, INTER)}
            for _ in range(copies)]  # fmt: skip


def _half(batch: int, ctx: int, first_block: int, dev: torch.device) -> Half:
    per_seq = -(-ctx // BLOCK_SIZE)
    ids = torch.arange(first_block, first_block + batch * per_seq, device=dev, dtype=torch.int32)
    return Half(
        torch.randn(batch, HIDDEN, device=dev, dtype=torch.bfloat16),
        ids.view(batch, per_seq).contiguous(),
        torch.full((batch,), ctx, device=dev, dtype=torch.int32),
    )


def _qkv(h: Half, w: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.linear(h.x, w["qkv"])[:, : NUM_HEADS * HEAD_DIM].reshape(-1, NUM_HEADS, HEAD_DIM)


def _attn(q: torch.Tensor, h: Half, cache: torch.Tensor) -> torch.Tensor:
    return paged_decode_attention(q, cache, h.tables, h.lens, HEAD_DIM**-0.5)


def _rest(a: torch.Tensor, h: Half, w: dict[str, torch.Tensor]) -> None:
    y = F.linear(a.reshape(a.shape[0], -1), w["o"])
    h.x.copy_(F.linear(silu_and_mul(F.linear(y, w["gu"])), w["down"]))


def _serial(halves: list[Half], layers: list[dict[str, torch.Tensor]], cache: torch.Tensor) -> None:
    for w in layers:
        for h in halves:
            _rest(_attn(_qkv(h, w), h, cache), h, w)


def _overlap(
    halves: list[Half], layers: list[dict[str, torch.Tensor]], cache: torch.Tensor, side: torch.cuda.Stream
) -> None:
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    for w in layers:
        outs = []
        for h in halves:  # both halves' qkv on the main stream, each attention on the side stream once its q is ready
            q = _qkv(h, w)
            q.record_stream(side)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                a = _attn(q, h, cache)
            a.record_stream(main)
            done = torch.cuda.Event()
            done.record(side)
            outs.append((a, done))
        for h, (a, done) in zip(halves, outs, strict=True):
            main.wait_event(done)
            _rest(a, h, w)
    main.wait_stream(side)


def _time(fn: Any, reps: int) -> float:
    """Milliseconds of one ``fn`` replayed from a CUDA graph (``time_graph``: warmed up on a side stream first)."""
    return time_graph([fn], reps) * 1e3


def _carved(fn: Any, carveout: int) -> Any:
    def run() -> None:
        torch._C._set_sm_carveout_experimental(carveout)
        try:
            fn()
        finally:
            torch._C._set_sm_carveout_experimental(None)

    return run


def probe(batch: int, ctx: int, reps: int, carveouts: list[int]) -> dict[str, Any]:
    dev = torch.device("cuda")
    per_seq = -(-ctx // BLOCK_SIZE)
    cache = torch.randn(2, batch * per_seq, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    layers = _weights(4, dev) * (LAYERS // 4)
    whole = [_half(batch, ctx, 0, dev)]
    halves = [_half(batch // 2, ctx, 0, dev), _half(batch - batch // 2, ctx, (batch // 2) * per_seq, dev)]
    side = torch.cuda.Stream()
    ms = {
        "whole": _time(lambda: _serial(whole, layers, cache), reps),
        "halves": _time(lambda: _serial(halves, layers, cache), reps),
        "overlap": _time(lambda: _overlap(halves, layers, cache, side), reps),
    }
    for c in carveouts:
        ms[f"overlap carve{c}"] = _time(_carved(lambda: _overlap(halves, layers, cache, side), c), reps)
        ms[f"whole carve{c}"] = _time(_carved(lambda: _serial(whole, layers, cache), c), reps)
    attn = _time(lambda: [_attn(_qkv(whole[0], w), whole[0], cache) for w in layers], reps)
    row = {"batch": batch, "ctx": ctx, **{k: round(v, 3) for k, v in ms.items()}, "qkv+attention": round(attn, 3)}
    row["overlap/whole"] = round(ms["overlap"] / ms["whole"], 3)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.overlap_probe", description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--ctx", type=int, nargs="+", default=[256, 800])
    parser.add_argument("--carveouts", type=int, nargs="*", default=[])
    parser.add_argument("--cublaslt", action="store_true", help="torch's preferred BLAS library: cuBLASLt")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("overlap_probe needs CUDA", flush=True)
        return 2
    if args.cublaslt:
        torch.backends.cuda.preferred_blas_library("cublaslt")
    rows = []
    for ctx in args.ctx:
        for batch in args.batches:
            rows.append(probe(batch, ctx, args.reps, args.carveouts))
            torch.cuda.empty_cache()
            print(json.dumps(rows[-1]), flush=True)
    print("32 layers of the 8B shape, ms: whole / halves / overlap (overlap / whole); qkv + attention alone")
    for r in rows:
        print(f"B {r['batch']:4d} ctx {r['ctx']:5d}: {r['whole']:.3f} / {r['halves']:.3f} / {r['overlap']:.3f} "
              f"({r['overlap/whole']:.3f}); {r['qkv+attention']:.3f}")  # fmt: skip
        for c in args.carveouts:
            print(f"    carveout {c} SMs: overlap {r[f'overlap carve{c}']:.3f}, whole {r[f'whole carve{c}']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
