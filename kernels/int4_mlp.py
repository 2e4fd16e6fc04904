"""The gated MLP of one token in one launch, on 4-bit weights: ``down(silu(gate(x)) * up(x))`` at M = 1.

Why: at batch 1 the int4 MLP is two GEMVs (gate_up, then down with the activation applied as it loads x), and
each is short enough that its ramp, its tail and its split-K reduction weigh (H200: 23.5 + 16.5 us against a
~21 us stream of the 88 MB; docs/benchmarks.md, #13). Here a program owns ``BLOCK_I`` columns of the
intermediate activation: it computes their gate and up over the whole hidden size (no split-K, so nothing
waits for another program), applies ``silu_and_mul``, and multiplies those ``BLOCK_I`` values by the matching
``BLOCK_I`` rows of the down projection at once. The down projection's split over the intermediate dimension is
reduced with fp32 atomics, and each output tile's last program writes it (``kernels.int4_split.finish_tile``,
the GEMVs' ``atomic`` split mode). The ``[1, I]`` activation never reaches memory.

Same weight layout and arithmetic as the GEMVs (``kernels.int4_gemv._factored_tile``: codes as ``1 + c / 16``
or as subnormals, scale and zero once per group): gate and up are rounded to x's dtype and the activation as
``silu_and_mul_ref`` rounds it, so the result differs from two GEMV launches only by the order of fp32 sums.
Needs no g_idx, group sizes that ``BLOCK_K`` and ``BLOCK_I`` divide, and shapes that the tiles divide;
:func:`fused_mlp_fits` says whether a layer qualifies.

**Not in the engine: it loses.** H200, Session 22 (docs/benchmarks.md): the best of 19 tiles took 84.8 us against
40.8 us for the two GEMVs (a copy of the same 92 MB: 24.5 us), and the int4 8B model's batch-1 TPOT rose from ~2.5
to 3.54 ms. Without split-K, each program's gate/up loop is a long chain of dependent tiles; and the finer the
intermediate is cut to give the SMs enough programs, the more fp32 atomics the down projection's reduction needs
(``H`` per program: 3.7 M at ``block_i`` 16). The kernel, its tests and ``loadtest.int4_mlp_bench`` stay so the
idea can be measured again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._triton import check_float, require_triton, tl, triton
from kernels.activation import silu_mul
from kernels.int4_dequant import PACK, check_int4_weights
from kernels.int4_gemm import int4_gemm_gated_ref, int4_gemm_ref
from kernels.int4_gemv import _factored_tile
from kernels.int4_split import finish_tile, split_target


@dataclass(frozen=True)
class Int4Weights:
    """One 4-bit linear layer in ``kernels.int4_dequant``'s layout."""

    qweight: torch.Tensor  # [K // 8, N] int32
    scales: torch.Tensor  # [num_groups, N]
    zeros: torch.Tensor  # [num_groups, N] uint8
    group_size: int
    g_idx: torch.Tensor | None = None


@dataclass(frozen=True)
class MlpTile:
    """Launch of :func:`int4_mlp`: intermediate columns per program, the gate/up K tile, the down column tile."""

    block_i: int = 32
    block_k: int = 64
    block_n: int = 512
    num_warps: int = 4
    num_stages: int = 3
    subnormal: bool = True


DEFAULT_TILE = MlpTile()


def int4_mlp_ref(x: torch.Tensor, gate_up: Int4Weights, down: Int4Weights) -> torch.Tensor:
    """``down(silu_and_mul(gate_up(x)))`` through the int4 GEMM references, each output rounded to x's dtype."""
    x2 = int4_gemm_ref(x, gate_up.qweight, gate_up.scales, gate_up.zeros, gate_up.group_size, gate_up.g_idx)
    return int4_gemm_gated_ref(x2, down.qweight, down.scales, down.zeros, down.group_size, down.g_idx)


def fused_mlp_fits(x: torch.Tensor, gate_up: Int4Weights, down: Int4Weights, tile: MlpTile = DEFAULT_TILE) -> bool:
    """Whether :func:`int4_mlp` takes this call: one row, no g_idx, and tiles that divide the shapes and groups."""
    hidden, inter = down.qweight.shape[1], down.qweight.shape[0] * PACK
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and x.is_contiguous()
        and gate_up.g_idx is None
        and down.g_idx is None
        and gate_up.qweight.shape == (hidden // PACK, 2 * inter)
        and x.shape[1] == hidden
        and hidden % tile.block_n == 0
        and inter % tile.block_i == 0
        and gate_up.group_size % tile.block_k == 0
        and down.group_size % tile.block_i == 0
        and tile.block_i % PACK == 0
        and tile.block_k % PACK == 0
    )


@triton.jit
def _int4_mlp_kernel(
    x_ptr, gq_ptr, gs_ptr, gz_ptr, dq_ptr, ds_ptr, dz_ptr, out_ptr, ws_ptr, cnt_ptr,
    INTER, HIDDEN, one_bits, stride_gq, stride_gs, stride_gz, stride_dq, stride_ds, stride_dz,
    GATE_GROUP: tl.constexpr, DOWN_GROUP: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, SUBNORMAL: tl.constexpr, SPLIT_MODE: tl.constexpr,
):  # fmt: skip
    ROWS: tl.constexpr = BLOCK_K // 8
    pid = tl.program_id(0)
    offs_c = pid * BLOCK_I + tl.arange(0, BLOCK_I)  # this program's intermediate columns (gate's; up's + INTER)
    offs_r = tl.arange(0, ROWS)
    acc_g = tl.zeros((1, BLOCK_I), dtype=tl.float32)
    acc_u = tl.zeros((1, BLOCK_I), dtype=tl.float32)
    for k0 in tl.range(0, HIDDEN, BLOCK_K, num_stages=NUM_STAGES):
        w_ptrs = gq_ptr + (k0 // 8 + offs_r)[:, None] * stride_gq + offs_c[None, :]
        w_gate = tl.load(w_ptrs)  # [R, BLOCK_I] int32
        w_up = tl.load(w_ptrs + INTER)
        xk = k0 + 8 * offs_r[:, None] + tl.arange(0, 8)[None, :]  # [R, 8]
        x = tl.load(x_ptr + xk)[None, :, :].to(tl.float32)  # [1, R, 8]
        g = k0 // GATE_GROUP
        acc_g += _factored_tile(
            w_gate, x, gs_ptr, gz_ptr, g, stride_gs, stride_gz, offs_c, 2 * INTER, one_bits, 1, ROWS, True, SUBNORMAL
        )
        acc_u += _factored_tile(
            w_up, x, gs_ptr, gz_ptr, g, stride_gs, stride_gz, offs_c + INTER, 2 * INTER, one_bits, 1, ROWS, True,
            SUBNORMAL,
        )  # fmt: skip
    # the two GEMVs' rounding: gate and up stored in x's dtype, then silu_and_mul_ref's two roundings
    h = silu_mul(acc_g.to(x_ptr.dtype.element_ty), acc_u.to(x_ptr.dtype.element_ty))  # [1, BLOCK_I]
    h8 = tl.reshape(h.to(tl.float32), (1, BLOCK_I // 8, 8))  # [1, word rows, 8]: element 8 r + j
    rows = pid * (BLOCK_I // 8) + tl.arange(0, BLOCK_I // 8)  # down's word rows of these columns
    g_down = (pid * BLOCK_I) // DOWN_GROUP
    offs_m = tl.arange(0, 1)
    num_tiles = HIDDEN // BLOCK_N
    for tile in range(0, num_tiles):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        w_down = tl.load(dq_ptr + rows[:, None] * stride_dq + offs_n[None, :])  # [BLOCK_I // 8, BLOCK_N]
        part = _factored_tile(
            w_down, h8, ds_ptr, dz_ptr, g_down, stride_ds, stride_dz, offs_n, HIDDEN, one_bits, 1, BLOCK_I // 8, True,
            SUBNORMAL,
        )  # fmt: skip
        finish_tile(
            part, out_ptr, ws_ptr, cnt_ptr, out_ptr, ws_ptr, offs_m, offs_n, 1, HIDDEN, HIDDEN, 0, tile, num_tiles,
            pid, tl.num_programs(0), SPLIT_MODE, 1, False,
        )  # fmt: skip


def _check(x: torch.Tensor, gate_up: Int4Weights, down: Int4Weights, tile: MlpTile) -> None:
    check_float("x", x)
    for w in (gate_up, down):
        check_int4_weights(w.qweight, w.scales, w.zeros, w.group_size, w.g_idx)
        if w.qweight.device != x.device:
            raise ValueError(f"the weights are on {w.qweight.device}, x on {x.device}")
    if not fused_mlp_fits(x, gate_up, down, tile):
        raise ValueError(
            f"int4_mlp takes a contiguous x [1, H], gate_up [H // 8, 2I], down [I // 8, H] without g_idx, with H a multiple of "
            f"block_n {tile.block_n}, I of block_i {tile.block_i}, groups of block_k {tile.block_k} / block_i; got "
            f"x {tuple(x.shape)}, gate_up {tuple(gate_up.qweight.shape)}, down {tuple(down.qweight.shape)}"
        )


def int4_mlp(x: torch.Tensor, gate_up: Int4Weights, down: Int4Weights, tile: MlpTile = DEFAULT_TILE) -> torch.Tensor:
    """Triton version of :func:`int4_mlp_ref` for one row: ``[1, H]`` in x's dtype."""
    require_triton("int4_mlp")
    _check(x, gate_up, down, tile)
    hidden, inter = x.shape[1], down.qweight.shape[0] * PACK
    out = torch.empty((1, hidden), dtype=x.dtype, device=x.device)
    num_tiles = hidden // tile.block_n
    programs = inter // tile.block_i
    target = split_target("atomic", programs, num_tiles, tile.block_n, out)
    _int4_mlp_kernel[(programs,)](
        x, gate_up.qweight, gate_up.scales, gate_up.zeros, down.qweight, down.scales, down.zeros, out,
        target.workspace, target.counters, inter, hidden, 0x3F800000,
        gate_up.qweight.stride(0), gate_up.scales.stride(0), gate_up.zeros.stride(0),
        down.qweight.stride(0), down.scales.stride(0), down.zeros.stride(0),
        GATE_GROUP=gate_up.group_size, DOWN_GROUP=down.group_size, BLOCK_I=tile.block_i, BLOCK_K=tile.block_k,
        BLOCK_N=tile.block_n, NUM_STAGES=tile.num_stages, SUBNORMAL=tile.subnormal, SPLIT_MODE=target.mode,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    return out
