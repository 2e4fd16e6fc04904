"""The one-launch split-K reduction of the int4 kernels (``kernels.int4_gemv``, ``kernels.int4_gemm``'s tl.dot
tiles), and the zeroed scratch that the Gluon kernels'
(``kernels.int4_gemv_mma``, ``kernels.int4_gemm_wgmma``) atomics share. Its own module since several kernels use it.

Split-K (``SPLIT_MODE``) when N alone does not give every SM enough programs, reduced in the same launch:

- ``counter``: each program stores its fp32 partial ``[M, BLOCK_N]`` to a workspace ``[split, M, N]`` and
  counts itself in on a per-tile counter; the last to arrive sums the partials in split order (the result
  does not depend on the arrival order) and writes the output in x's dtype.
- ``atomic``: fp32 atomic adds into a zeroed ``[M, N]`` accumulator; the last to arrive writes the output
  and zeroes the accumulator again; no ``[split, M, N]`` traffic, but the summation order (so the last bits
  of the result) varies from run to run.

The counters (and the atomic accumulator) are left at zero by every launch, so one zeroed buffer per device
serves every GEMM, eager or replayed from a CUDA graph; kernels that use them must not overlap on two
streams of one device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._triton import tl, triton

SPLIT_MODES = {"none": 0, "counter": 1, "atomic": 2}
SPLIT_CHUNK_ELEMS = 4096  # fp32 partials the last program of a tile loads at once: [chunk, BM, BN]


@triton.jit
def _sum_partials(total, ws_ptr, mn, mask, plane, num_splits, SPLIT_CHUNK: tl.constexpr):
    """Adds the ``num_splits`` partials ``ws[s, m, n]``, ``SPLIT_CHUNK`` of them per load (one L2 round trip
    each); ``.cg`` reads L2, where the other programs' stores are, not this SM's L1."""
    offs_s = tl.arange(0, SPLIT_CHUNK)
    for s0 in range(0, num_splits, SPLIT_CHUNK):
        sp = s0 + offs_s
        parts = tl.load(
            ws_ptr + sp[:, None, None] * plane + mn[None, :, :],
            mask=(sp < num_splits)[:, None, None] & mask[None, :, :], other=0.0, cache_modifier=".cg",
        )  # [chunk, BM, BN]  # fmt: skip
        total += tl.sum(parts, axis=0)
    return total


@triton.jit
def _store(total, out_ptr, offs_m, offs_n, mask, stride_om):
    """A finished fp32 tile ``total [BM, BN]`` written in the output's dtype."""
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def finish_tile(
    acc, out_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, tile, pid_k, num_splits,
    SPLIT_MODE: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
):  # fmt: skip
    """Writes a program's fp32 ``acc [BM, BN]`` (rows ``offs_m``, columns ``offs_n``, unit stride along N)
    as the module docstring's split modes say; ``tile`` numbers the output tile for its counter."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    mn = offs_m[:, None] * N + offs_n[None, :]  # [BM, BN] offsets in a contiguous fp32 [M, N] plane
    if SPLIT_MODE == 0:  # none
        _store(acc, out_ptr, offs_m, offs_n, mask, stride_om)
    else:
        if SPLIT_MODE == 1:  # counter
            tl.store(ws_ptr + pid_k * M * N + mn, acc, mask=mask)
        else:  # atomic
            tl.atomic_add(ws_ptr + mn, acc, mask=mask, sem="relaxed")
        # Ordering (PTX memory model, the pattern of a cooperative-groups grid sync): the barrier makes
        # every thread's part above visible to thread 0, whose acq_rel add below releases them at GPU
        # scope. In the last program that add acquires the other programs' parts; every thread learns its
        # result through shared memory behind a barrier, so their loads below come after the acquire.
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == num_splits - 1:  # the last program of this tile: every other part is visible
            if SPLIT_MODE == 1:
                total = _sum_partials(tl.zeros_like(acc), ws_ptr, mn, mask, M * N, num_splits, SPLIT_CHUNK)
            else:
                total = tl.load(ws_ptr + mn, mask=mask, other=0.0, cache_modifier=".cg")
                # Triton may give this load and the zeroing store different thread layouts (it does for
                # the 4- and 8-row GEMV and the 64- and 128-row dot tiles): without the barrier a warp
                # zeroes sums that another warp has yet to read (wrong outputs on an H200 at 7f8955d)
                tl.debug_barrier()
                tl.store(ws_ptr + mn, tl.zeros_like(acc), mask=mask)
            _store(total, out_ptr, offs_m, offs_n, mask, stride_om)
            tl.store(cnt_ptr + tile, 0)  # ready for the next launch


_ZEROED: dict[tuple[str, int | None, torch.dtype], list[torch.Tensor]] = {}


def zeroed_scratch(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """At least ``numel`` zeros of ``dtype`` that every kernel using them leaves zero. Grown on demand and
    never freed, as a captured CUDA graph keeps the address; growing inside a capture is refused (the
    zeroing would only be recorded, not run), and the engine runs each shape before capturing it."""
    bufs = _ZEROED.setdefault((device.type, device.index, dtype), [])
    if not bufs or bufs[-1].numel() < numel:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("int4_gemm split-K: run this shape once before capturing it in a CUDA graph")
        size = max(numel, 2 * bufs[-1].numel() if bufs else 1 << 14)
        bufs.append(torch.zeros(size, dtype=dtype, device=device))
    return bufs[-1]


@dataclass(frozen=True)
class SplitTarget:
    """Where a launch's programs put their partials (``workspace``/``counters`` are ``out`` when unused)."""

    mode: int  # SPLIT_MODES value
    workspace: torch.Tensor
    counters: torch.Tensor
    chunk: int  # SPLIT_CHUNK of the counter mode


def split_target(reduce: str, split: int, num_tiles: int, tile_elems: int, out: torch.Tensor) -> SplitTarget:
    m, n = out.shape
    if split == 1:
        return SplitTarget(SPLIT_MODES["none"], out, out, 1)
    counters = zeroed_scratch(out.device, torch.int32, num_tiles)
    if reduce == "counter":
        ws = torch.empty((split, m, n), dtype=torch.float32, device=out.device)
        chunk = max(1, min(32, SPLIT_CHUNK_ELEMS // tile_elems))  # not from split: one compile per tile
        return SplitTarget(SPLIT_MODES["counter"], ws, counters, chunk)
    return SplitTarget(SPLIT_MODES["atomic"], zeroed_scratch(out.device, torch.float32, m * n), counters, 1)
