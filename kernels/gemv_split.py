"""The dense GEMV's (``kernels.gemv``) tile loads and stores and its split-K reductions: how a program loads x
(gated: ``silu(gate) * up``), writes its output tile (plus bias; plus the residual and its sums of squares for a
fused norm, ``kernels.fused_norm``), and how the split modes of ``kernels.gemv``'s docstring sum the partials.
A module of its own so the GEMV's kernel and launch stay readable."""

from __future__ import annotations

from kernels._triton import tl, triton
from kernels.activation import silu_mul
from kernels.fused_norm import store_tile


@triton.jit
def load_x(x_ptrs, mask, K, GATED: tl.constexpr):
    """x's ``[BM, BK]`` tile; GATED: ``silu(gate) * up`` of x2 ``[M, 2K]`` (up K columns on), rounded to
    x's dtype twice as ``silu_and_mul_ref`` (the silu, then the product)."""
    x = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_last")
    if GATED:
        x = silu_mul(x, tl.load(x_ptrs + K, mask=mask, other=0.0, eviction_policy="evict_last"))
    return x


@triton.jit
def _store_out(
    total, out_ptr, b_ptr, res_ptr, ss_ptr, offs_m, offs_n, M, N, stride_om, stride_rm, pid_n,
    HAS_BIAS: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """``total [BM, BN]`` fp32 (+ bias) cast once to the output's dtype (ADD_RESIDUAL: plus the residual, and
    the tile's sums of squares, ``kernels.fused_norm.store_tile``)."""
    if HAS_BIAS:
        total += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    store_tile(
        total, out_ptr, res_ptr, ss_ptr, offs_m, offs_n, M, N, stride_om, stride_rm, pid_n, tl.num_programs(0),
        ADD_RESIDUAL,
    )  # fmt: skip


@triton.jit
def finish(
    acc, out_ptr, b_ptr, ws_ptr, cnt_ptr, res_ptr, ss_ptr, offs_m, offs_n, M, N, stride_om, stride_rm, pid_n, pid_k,
    num_splits, HAS_BIAS: tl.constexpr, SPLIT_MODE: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """Writes one program's fp32 ``acc [BM, BN]`` as the module docstring's split modes say."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    mn = offs_m[:, None] * N + offs_n[None, :]  # [BM, BN] offsets in a contiguous fp32 [M, N] plane
    if SPLIT_MODE == 0:  # none
        _store_out(
            acc, out_ptr, b_ptr, res_ptr, ss_ptr, offs_m, offs_n, M, N, stride_om, stride_rm, pid_n, HAS_BIAS,
            ADD_RESIDUAL,
        )  # fmt: skip
    elif SPLIT_MODE == 3:  # two_pass: gemv_reduce_kernel sums the partials
        tl.store(ws_ptr + pid_k * M * N + mn, acc, mask=mask)
    else:
        if SPLIT_MODE == 1:  # counter
            tl.store(ws_ptr + pid_k * M * N + mn, acc, mask=mask)
        else:  # atomic
            tl.atomic_add(ws_ptr + mn, acc, mask=mask, sem="relaxed")
        # Ordering (PTX memory model, the pattern of a cooperative-groups grid sync): the barrier makes every
        # thread's part above visible to the thread that does the acq_rel add below, which releases them at
        # GPU scope. In the last program that add acquires the other programs' parts; every thread learns
        # its result through shared memory behind a barrier, so its loads below come after the acquire.
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if arrived == num_splits - 1:  # the last program of this tile: every other part is visible
            if SPLIT_MODE == 1:
                total = tl.zeros_like(acc)
                for s in range(0, num_splits):  # split order: the sum does not depend on arrival order
                    total += tl.load(ws_ptr + s * M * N + mn, mask=mask, other=0.0, cache_modifier=".cg")
            else:
                total = tl.load(ws_ptr + mn, mask=mask, other=0.0, cache_modifier=".cg")  # L2, not this L1
                # the load and the zeroing store may get different thread layouts: without the barrier a
                # warp could zero sums another warp has yet to read (the int4 GEMV's race at 7f8955d)
                tl.debug_barrier()
                tl.store(ws_ptr + mn, tl.zeros_like(acc), mask=mask)
            _store_out(
                total, out_ptr, b_ptr, res_ptr, ss_ptr, offs_m, offs_n, M, N, stride_om, stride_rm, pid_n, HAS_BIAS,
                ADD_RESIDUAL,
            )  # fmt: skip
            tl.store(cnt_ptr + pid_n, 0)  # ready for the next launch


@triton.jit
def gemv_reduce_kernel(
    ws_ptr, b_ptr, out_ptr, M, N, num_splits, stride_om, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr
):
    """two_pass: one program per (row, BLOCK_N columns) sums the partials in split order."""
    m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs_n < N
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(0, num_splits):
        total += tl.load(ws_ptr + (s * M + m) * N + offs_n, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(b_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=mask)
