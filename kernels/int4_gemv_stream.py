"""Stream-K launch of the factored int4 GEMV (``kernels.int4_gemv``'s tile, same weight layout): a fixed grid of
programs shares the layer's work evenly instead of one program per (column tile, K split).

Why (#13, batch 1): with a split-K grid each program of the 8B projections at M = 1 does one to four K tiles (o:
1024 programs of one tile; qkv 768 of two; gate_up 3584 of two), so a program loads, then computes, then reduces,
with little of its own loading under its arithmetic, and the grids of o, gate_up and down take more than one wave of
the programs the SMs hold (by registers: ~7 an SM for the default tile, 4 gated, 8 wide). Here the layer is a row of
units, (column tile, K tile), column tile by column tile; program ``p`` of ``P`` takes units
``[p U / P, (p + 1) U / P)``, one pipelined loop per column tile its run touches (one or two mostly), so every
program has about ``U / P`` tiles in one pipeline and ``P`` is what the SMs hold at once.

Each column tile's partial sums meet in ``kernels.int4_split``'s atomic reduction: fp32 atomic adds into the zeroed
accumulator, and the last of the tile's programs (their number follows from the runs) writes the output and zeroes
the accumulator again. The arithmetic of a tile is ``kernels.int4_gemv.factored_tile``'s, so only the order of the
split-K sums differs from the split launch.

Factored tiles only (no g_idx, each K tile inside one group, K a multiple of the K tile); ``kernels.int4_plan``
chooses it (``GEMV_STREAM``) and falls back to the split launch elsewhere.
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, tl, triton
from kernels.int4_gemv import _words_fit, factored_tile, prepared_tile, tile_words, tile_x
from kernels.int4_split import finish_tile, split_target
from kernels.pdl import launch_dependents, pdl_supported, wait_prior_grids


@triton.jit
def owner(u, units, programs):
    """The program whose run holds unit ``u`` (program ``p`` runs ``[p units // programs, (p + 1) units //
    programs)``): the largest ``p`` with ``p units // programs <= u``."""
    return ((u + 1) * programs - 1) // units


@triton.jit(do_not_specialize=["M"])
def _int4_gemv_stream_kernel(
    x_ptr, xs_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, one_bits,
    stride_xm, stride_xk, stride_qk, stride_sg, stride_zg, stride_om,
    GROUP_SIZE: tl.constexpr, SUBNORMAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr,
    TRIGGER: tl.constexpr, X_WORDS: tl.constexpr, PREPARED: tl.constexpr,
):  # fmt: skip
    """Program ``p``'s run of units, one column tile at a time; PDL and TRIGGER as in ``kernels.int4_gemv``
    (TRIGGER: once the program's last K loop is done). PREPARED: x is :func:`prepare_x`'s (subnormal codes)."""
    ROWS: tl.constexpr = BLOCK_K // 8
    programs = tl.num_programs(0)
    k_tiles = K // BLOCK_K
    units = tl.cdiv(N, BLOCK_N) * k_tiles
    u = tl.program_id(0) * units // programs
    u_end = (tl.program_id(0) + 1) * units // programs
    offs_m = tl.arange(0, BLOCK_M)
    offs_i = tl.arange(0, ROWS)
    up_offset = K * stride_xk  # GATED: x is x2 [M, 2K], the up half K columns after the gate
    if PDL:
        wait_prior_grids()
    while u < u_end:
        tile = u // k_tiles
        t_end = tl.minimum(u_end - tile * k_tiles, k_tiles)  # this run's K tiles of the column tile: [u - .., t_end)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for t in tl.range(u - tile * k_tiles, t_end, num_stages=NUM_STAGES):
            k0 = t * BLOCK_K
            words = tile_words(qw_ptr, k0, K, offs_i, offs_n, mask_n, stride_qk, EVEN)
            x = tile_x(x_ptr, k0, K, offs_m, offs_i, M, stride_xm, stride_xk, up_offset, True, GATED, X_WORDS)
            if PREPARED:
                xs = tl.load(
                    xs_ptr + offs_m[:, None] * (K // 8) + (k0 // 8 + offs_i)[None, :], mask=(offs_m < M)[:, None]
                )
                acc += prepared_tile(
                    words, x, xs, s_ptr, z_ptr, k0 // GROUP_SIZE, stride_sg, stride_zg, offs_n, N, BLOCK_M, ROWS, EVEN
                )  # fmt: skip
            else:
                acc += factored_tile(
                    words, x, s_ptr, z_ptr, k0 // GROUP_SIZE, stride_sg, stride_zg, offs_n, N, one_bits, BLOCK_M,
                    ROWS, EVEN, SUBNORMAL,
                )  # fmt: skip
        u = tile * k_tiles + t_end
        if TRIGGER and u == u_end:
            launch_dependents()
        parts = owner((tile + 1) * k_tiles - 1, units, programs) - owner(tile * k_tiles, units, programs) + 1
        finish_tile(acc, out_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, tile, 0, parts, 2, 1)


def stream_fits(k: int, group_size: int, block_k: int, has_g_idx: bool) -> bool:
    """Whether the stream launch can take a layer: factored tiles (no g_idx, K tiles inside groups), whole K tiles."""
    return not has_g_idx and group_size % block_k == 0 and k % block_k == 0


def int4_gemv_stream_launch(
    x: torch.Tensor,  # [M, K], or [M, 2K] (gate | up) when gated
    qweight: torch.Tensor,  # [K // 8, N] int32, contiguous along N
    scales: torch.Tensor,  # [num_groups, N], contiguous along N
    zeros: torch.Tensor,  # [num_groups, N] uint8, contiguous along N
    group_size: int,
    out: torch.Tensor,  # [M, N] contiguous, x.dtype
    *,
    block_n: int,
    block_k: int,
    programs: int,
    num_warps: int,
    num_stages: int,
    subnormal: bool = False,
    gated: bool = False,
    pdl: bool = False,
    x_words: bool = False,
    prepared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Launches ``programs`` programs (at most one a unit) on inputs ``kernels.int4_gemm`` has checked and
    :func:`stream_fits` accepts; the other arguments as ``kernels.int4_gemv.int4_gemv_launch``'s. ``prepared``:
    :func:`prepare_x` of x, which the launch then reads instead of x (subnormal codes, not gated)."""
    m, k = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    n = qweight.shape[1]
    if not stream_fits(k, group_size, block_k, False):
        raise ValueError(f"stream GEMV: K={k} and the group {group_size} must be multiples of block_k {block_k}")
    if prepared is not None and (gated or not subnormal):
        raise ValueError("a prepared x is for subnormal codes of a plain (not gated) layer")
    num_tiles = -(-n // block_n)
    grid = min(programs, num_tiles * (k // block_k))
    target = split_target("atomic", 2, num_tiles, 0, out)  # split > 1: the atomic accumulator and counters
    hopper = pdl_supported(x)
    x_words = x_words and not gated and prepared is None and _words_fit(x, k, block_k)
    x_in, x_sums = prepared if prepared is not None else (x, x)
    _int4_gemv_stream_kernel[(grid,)](
        x_in, x_sums, qweight, scales, zeros, out, target.workspace, target.counters,
        m, n, k, 0x3F800000,
        x_in.stride(0), x_in.stride(1), qweight.stride(0), scales.stride(0), zeros.stride(0), out.stride(0),
        GROUP_SIZE=group_size, SUBNORMAL=subnormal, BLOCK_M=next_pow2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        NUM_STAGES=num_stages, EVEN=n % block_n == 0, GATED=gated, PDL=pdl and hopper, TRIGGER=hopper,
        X_WORDS=x_words, PREPARED=prepared is not None, num_warps=num_warps, num_stages=num_stages, **({"launch_pdl": True} if pdl and hopper else {}),
    )  # fmt: skip


def prepare_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` as a PREPARED stream launch reads it: fp32 ``x_k 2**(64 - P_(k mod 8))`` (``kernels.int4_gemv.
    subnormal_scales``; exact) and the sums of each word row's 8 values ``[M, K / 8]`` fp32, in the kernel's order.
    What the kernel that writes x (an RMSNorm, the attention merge) would write for the next layer's 4-bit GEMV, so
    that the GEMV neither converts, scales nor sums its activations (loadtest.layout_bench's row ``prepared``)."""
    m, k = x.shape
    v = x.float().reshape(m, k // 8, 8)
    p = torch.tensor([0, 4, 8, 12, 16, 8, 12, 16], device=x.device)
    scaled = (v * torch.exp2(64.0 - p.float())).reshape(m, k)
    sums = ((v[..., 0] + v[..., 1]) + (v[..., 2] + v[..., 3])) + ((v[..., 4] + v[..., 5]) + (v[..., 6] + v[..., 7]))
    return scaled.contiguous(), sums.contiguous()
