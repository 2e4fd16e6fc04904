"""The packed 4-bit weight layout, its dequantization (torch reference and one-pass Triton kernel) and the
large-M path of the W4A16 linear: dequantize into a reused scratch buffer, then one cuBLAS GEMM.

One weight layout for every checkpoint format (``engine.quantization.formats`` repacks AWQ, GPTQ and
compressed-tensors into it, bits only, nothing dequantized):

- ``qweight`` int32 ``[K // 8, N]``: nibble ``j`` (bits ``4j .. 4j + 3``) of ``qweight[i, n]`` is the code of
  input feature ``k = 8 i + j`` (GPTQ's layout: a K-tile's codes are contiguous along N, so loads coalesce);
- ``scales`` float ``[num_groups, N]``, ``zeros`` uint8 ``[num_groups, N]`` (codes 0..15; 8 for symmetric);
- group of input feature ``k``: ``k // group_size`` (channel-wise: ``group_size = K``), or ``g_idx[k]``
  (GPTQ act-order) when given.

``w[n, k] = (code[k, n] - zeros[g(k), n]) * scales[g(k), n]``, computed in the scales' dtype, as
compressed-tensors, AutoAWQ and AutoGPTQ dequantize.

Why a dequantize-then-GEMM path (vLLM does the same for AWQ at large batch): the fused GEMM
(``kernels.int4_gemm``) dequantizes every weight again for every M tile, and that, not bytes, limits it
(0.27-0.42x cuBLAS at M >= 256 on an H200, docs/benchmarks.md, #13). Dequantizing once costs one write of
the dense weight, whatever M; above ``DEQUANT_MIN_M`` rows that is cheaper than the fused GEMM's extra work.
The dense weight lives only in the scratch, one layer at a time: the point of int4 is its memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels._triton import check_float, require_triton, tl, triton

PACK = 8  # 4-bit codes per int32
_SHIFTS = tuple(range(0, 32, 4))

# Rows from which the linear layer dequantizes + calls cuBLAS instead of the fused GEMM. H200, same device
# session (2026-12-03, after the dequantization lost its per-weight int->float conversion and hand rounding,
# 3.1-3.7 TB/s of bf16 written): an 8B layer's four projections take 183 us fused against 278 us dequant +
# cuBLAS at M = 64, and 345-352 us fused against 294 us (154 us dequantization + 140 us cuBLAS, timed apart)
# at M = 96, where the fused GEMM's 64-row tiles dequantize every weight twice; so every M above 64. Was 128
# (the estimate of the slower dequantization). ``python -m loadtest.int4_bench`` times both paths at every M:
# its "crossover" line says where dequant+matmul starts to win.
DEQUANT_MIN_M = 65


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[K, N]`` (0..15, any int dtype) -> ``qweight`` int32 ``[K // 8, N]`` (layout above)."""
    k, n = codes.shape
    if k % PACK:
        raise ValueError(f"input features ({k}) must be a multiple of {PACK} to pack 4-bit codes")
    c = codes.to(torch.int64).reshape(k // PACK, PACK, n)  # [K/8, 8, N]
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=codes.device)
    words = (c << shifts[None, :, None]).sum(dim=1)  # [K/8, N] in 0 .. 2^32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """``qweight`` int32 ``[K // 8, N]`` -> codes uint8 ``[K, N]``."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=qweight.device)
    codes = (qweight[:, None, :] >> shifts[None, :, None]) & 0xF  # [K/8, 8, N]
    return codes.reshape(-1, qweight.shape[1]).to(torch.uint8)


def dequantize_int4(
    qweight: torch.Tensor,  # [K // 8, N] int32
    scales: torch.Tensor,  # [num_groups, N]
    zeros: torch.Tensor,  # [num_groups, N] uint8
    group_size: int,
    g_idx: torch.Tensor | None = None,  # [K] int32
    out: torch.Tensor | None = None,  # [N, K], any strides
) -> torch.Tensor:
    """The dense weight ``[N, K]`` (PyTorch's Linear layout) in ``scales.dtype``, contiguous; with ``out``,
    written there in ``out.dtype`` (rounded from the scales' dtype) and returned."""
    codes = unpack_int4(qweight).t().contiguous()  # [N, K]
    k = codes.shape[1]
    groups = g_idx.long() if g_idx is not None else torch.arange(k, device=codes.device) // group_size  # [K]
    z = zeros.t()[:, groups]  # [N, K]
    s = scales.t()[:, groups]  # [N, K]
    w = (codes.to(torch.int16) - z.to(torch.int16)).to(scales.dtype) * s
    return w if out is None else out.copy_(w)


def check_int4_weights(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, g_idx: torch.Tensor | None
) -> None:
    """ValueError unless the tensors are packed weights in the layout above, on one device."""
    check_float("scales", scales)
    if qweight.dim() != 2 or scales.dim() != 2 or zeros.dim() != 2:
        raise ValueError("qweight [K // 8, N], scales and zeros [num_groups, N] must all be 2-D")
    if qweight.dtype != torch.int32:
        raise ValueError(f"qweight must be int32 [K // 8, N], got {qweight.dtype} {tuple(qweight.shape)}")
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    if zeros.dtype != torch.uint8:
        raise ValueError(f"zeros must be uint8 codes, got {zeros.dtype}")
    if scales.shape != zeros.shape or scales.shape[1] != n:
        raise ValueError(f"scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} must both be [num_groups, {n}]")
    if g_idx is None:
        if group_size < 1 or k % group_size or scales.shape[0] != k // group_size:
            raise ValueError(f"group_size {group_size} must divide K={k} into scales.shape[0]={scales.shape[0]} groups")
    elif g_idx.dtype != torch.int32 or g_idx.shape != (k,) or g_idx.device != qweight.device:
        raise ValueError(f"g_idx must be int32 [{k}] on {qweight.device}, got {g_idx.dtype} {tuple(g_idx.shape)}")
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name} must be contiguous along N, got strides {t.stride()}")
        if t.device != qweight.device:
            raise ValueError(f"{name} is on {t.device}, qweight on {qweight.device}")


# ---- Triton ----


@triton.jit
def codes_tile(qw_ptr, k0, k_end, offs_k, offs_n, mask_n, stride_qk, stride_qn, UNPACK_IN_REGISTERS: tl.constexpr):
    """The codes ``[BK, BN]`` of input features ``offs_k`` (``k0 + arange(BK)``, ``k0`` a multiple of 8),
    columns ``offs_n``, as ``(fields, p)``: row ``k``'s code is ``(fields >> p[k]) & 15``.

    Unpacked in registers, a code stays where it is in its word (``p = 4j`` for nibbles ``j < 5``) or in
    ``words >> 12`` (``p = 4j - 12`` for the top three, so no field reaches bit 20): masking it in place costs
    one and, which ptxas merges with :func:`code_minus_zero`'s or into one LOP3, where shifting each code down
    took a shift and an extract (sm_90 SASS: the M = 16 / 64 tl.dot loops 603 -> 516 / 540 -> 458 instructions, the
    dequantization kernel 552 -> 464).
    Loaded once per row, the word is shifted down (``p = 0``): fewer instructions there (380 against 416).
    Nibble and word row come from ``arange(BK)``, not ``offs_k``: loop-invariant, folded per register."""
    BLOCK_K: tl.constexpr = offs_k.shape[0]
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    lane = tl.arange(0, BLOCK_K)
    j = lane % 8
    if UNPACK_IN_REGISTERS:  # load each int32 once, replicate it to its 8 rows in registers
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        mask_words = (offs_w * 8 < k_end)[:, None] & mask_n[None, :]
        words = tl.load(qw_ptr + offs_w[:, None] * stride_qk + offs_n[None, :] * stride_qn, mask=mask_words, other=0)
        # A broadcast gives each thread one column's run along K, so the tl.dot operand reaches shared memory
        # in 2-byte stores; repeating the words by joins kept adjacent columns per thread (16-byte stores, 458
        # -> 418 loop instructions at M = 64) but took 1.3-1.8x the time on the H200 (Session 15): not that.
        packed = tl.reshape(tl.broadcast_to(words[:, None, :], (BLOCK_K // 8, 8, BLOCK_N)), (BLOCK_K, BLOCK_N))
        top = j >= 5
        p = tl.where(top, 4 * j - 12, 4 * j)
        # >> is arithmetic: the sign's copies land in bits 20-31, above every field
        fields = tl.where(top[:, None], packed >> 12, packed)
    else:  # each int32 is read by its 8 rows of the tile (cache hits)
        mask_w = (offs_k < k_end)[:, None] & mask_n[None, :]
        packed = tl.load(
            qw_ptr + (k0 // 8 + lane // 8)[:, None] * stride_qk + offs_n[None, :] * stride_qn, mask=mask_w, other=0
        )
        p = j * 0
        fields = packed >> (4 * j)[:, None]
    return fields, p


# 2**23's fp32 bits: a code masked in place (code << p, p <= 16) and or-ed into its mantissa reads as
# 2**23 + code * 2**p (code_minus_zero). Passed to the kernels as an argument: with the literal, ptxas emits the
# mask's and and this or as two LOP3s, not one.
MAGIC_BITS = 0x4B000000


@triton.jit
def pow2(p):
    """``2.0 ** p`` fp32 for integer ``-126 <= p <= 127``, exactly, from its exponent bits."""
    return ((127 + p) << 23).to(tl.float32, bitcast=True)


@triton.jit
def code_minus_zero(fields, p, z, magic):
    """``(code - z) * 2**p`` as fp32, exact, from :func:`codes_tile`'s ``fields`` and ``p`` (``[BK]``) and the
    zeros ``z`` (``[1, BN]`` or ``[BK, BN]``), without an int->float conversion per weight: the code masked in
    place and or-ed with ``magic`` (:data:`MAGIC_BITS`) reads as ``2**23 + code * 2**p``, from which
    ``2**23 + z * 2**p`` is subtracted."""
    bits = (fields & (15 << p)[:, None]) | magic
    return bits.to(tl.float32, bitcast=True) - (z.to(tl.float32) * pow2(p)[:, None] + 8388608.0)


@triton.jit
def dequant_tile(fields, p, z, s, magic):
    """The weights ``(code - z) * s`` fp32 ``[BK, BN]`` (``z``, ``s``: ``[1, BN]`` or ``[BK, BN]``): the product
    :func:`code_minus_zero` ``* (s * 2**-p)`` is ``(code - z) * s`` exactly as the reference computes it in fp32
    (only powers of two were moved), one multiply-add of ``s`` and ``z`` per row and column, not per weight."""
    return code_minus_zero(fields, p, z, magic) * (s.to(tl.float32) * pow2(-p)[:, None])


@triton.jit
def _round(x, dtype: tl.constexpr, BY_HAND: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype``, to nearest even as torch rounds. BY_HAND (the CPU interpreter, whose
    bf16 cast truncates): bf16 by integer operations; compiled, the cast is ``cvt.rn`` (two values per F2FP:
    by hand it was ~6 of the kernel's 16 sm_90 instructions per weight, and the kernel is issue-bound)."""
    if BY_HAND and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)  # finite values only: no NaN in dequantized weights
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _int4_dequant_kernel(
    qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr,
    N, K, magic,
    stride_qk, stride_qn, stride_sg, stride_zg, stride_on, stride_ok,
    GROUP_SIZE: tl.constexpr, HAS_G_IDX: tl.constexpr, ONE_GROUP_PER_TILE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNPACK_IN_REGISTERS: tl.constexpr, ROUND_BY_HAND: tl.constexpr,
):  # fmt: skip
    """One program: the weights ``[BLOCK_K, BLOCK_N]`` of one K tile and one N tile, stored through the
    output's strides (``[N, K]`` contiguous along K, or a ``[K, N]`` buffer's transpose)."""
    k0 = tl.program_id(0) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    mask = (offs_k < K)[:, None] & mask_n[None, :]
    fields, p = codes_tile(qw_ptr, k0, K, offs_k, offs_n, mask_n, stride_qk, stride_qn, UNPACK_IN_REGISTERS)
    if ONE_GROUP_PER_TILE:  # one scale and zero per column
        g0 = k0 // GROUP_SIZE
        s = tl.load(s_ptr + g0 * stride_sg + offs_n, mask=mask_n, other=0.0)[None, :]
        z = tl.load(z_ptr + g0 * stride_zg + offs_n, mask=mask_n, other=0)[None, :]
    else:  # gathered per input feature (L1 hits: a few groups per tile)
        g = tl.load(g_ptr + offs_k, mask=offs_k < K, other=0) if HAS_G_IDX else offs_k // GROUP_SIZE
        s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=mask, other=0.0)
        z = tl.load(z_ptr + g[:, None] * stride_zg + offs_n[None, :], mask=mask, other=0)
    # (code - zero) * scale rounded once to the scales' dtype, as the reference: exact in fp32 for half
    # scales (5-bit int times an 8/11-bit mantissa), fp32's own rounding for fp32 scales; then to out's dtype
    w = _round(dequant_tile(fields, p, z, s, magic), s_ptr.dtype.element_ty, ROUND_BY_HAND)
    if out_ptr.dtype.element_ty != s_ptr.dtype.element_ty:
        w = _round(w.to(tl.float32), out_ptr.dtype.element_ty, ROUND_BY_HAND)
    out_ptrs = out_ptr + offs_n[None, :] * stride_on + offs_k[:, None] * stride_ok
    tl.store(out_ptrs, w, mask=mask)


@dataclass(frozen=True)
class DequantConfig:
    """Tile of one :func:`int4_dequant` program; the defaults are unmeasured (int4_bench times variants)."""

    block_k: int = 64  # 8 packed words deep: 128 B of bf16 along K per column when writing [N, K]
    block_n: int = 128
    unpack_in_registers: bool = True  # each packed word loaded once (else once per row, from L1)
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name, block in (("block_k", self.block_k), ("block_n", self.block_n)):
            if block < PACK or block & (block - 1):
                raise ValueError(f"{name} must be a power of two >= {PACK}, got {block}")


def int4_dequant(
    qweight: torch.Tensor,  # [K // 8, N] int32
    scales: torch.Tensor,  # [num_groups, N]
    zeros: torch.Tensor,  # [num_groups, N] uint8
    group_size: int,
    g_idx: torch.Tensor | None = None,  # [K] int32
    out: torch.Tensor | None = None,  # [N, K], any strides
    config: DequantConfig | None = None,
) -> torch.Tensor:
    """Triton version of :func:`dequantize_int4` (bit for bit): one pass over the packed weight."""
    require_triton("int4_dequant")
    check_int4_weights(qweight, scales, zeros, group_size, g_idx)
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    if out is None:
        out = torch.empty((n, k), dtype=scales.dtype, device=qweight.device)
    check_float("out", out)
    if out.shape != (n, k) or out.device != qweight.device:
        raise ValueError(f"out must be [{n}, {k}] on {qweight.device}, got {tuple(out.shape)} on {out.device}")
    if n == 0 or k == 0:
        return out
    cfg = config or DequantConfig()
    grid = (triton.cdiv(k, cfg.block_k), triton.cdiv(n, cfg.block_n))
    _int4_dequant_kernel[grid](
        qweight, scales, zeros, g_idx if g_idx is not None else qweight, out,
        n, k, MAGIC_BITS,
        qweight.stride(0), qweight.stride(1), scales.stride(0), zeros.stride(0), out.stride(0), out.stride(1),
        GROUP_SIZE=group_size, HAS_G_IDX=g_idx is not None,
        ONE_GROUP_PER_TILE=g_idx is None and group_size % cfg.block_k == 0,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, UNPACK_IN_REGISTERS=cfg.unpack_in_registers,
        ROUND_BY_HAND=not qweight.is_cuda, num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


class DequantScratch:
    """Memory for one dense weight, reused by every layer of a model in turn: on one stream a layer's GEMM
    has read it before the next layer's dequantization overwrites it. ``reserve`` each layer's (per-rank,
    tensor-parallel sliced) shape first, so the first :meth:`weight` allocates for the largest one at once.
    That must happen outside a CUDA graph capture (the engine's profile run or graph warm-up does it);
    captured graphs keep the address, so a buffer is never freed, even if an unreserved shape outgrows it."""

    def __init__(self) -> None:
        self.reserved_numel = 0
        self._buffers: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}

    def reserve(self, n: int, k: int) -> None:
        self.reserved_numel = max(self.reserved_numel, n * k)

    def weight(self, n: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A ``[N, K]`` contiguous view of the scratch (contents undefined)."""
        bufs = self._buffers.setdefault((device, dtype), [])
        if not bufs or bufs[-1].numel() < n * k:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "int4 dequant scratch: run an M >= DEQUANT_MIN_M step before capturing a CUDA graph "
                    f"(needs {n * k} elements, has {bufs[-1].numel() if bufs else 0})"
                )
            bufs.append(torch.empty(max(n * k, self.reserved_numel), dtype=dtype, device=device))
        return bufs[-1][: n * k].view(n, k)

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for bufs in self._buffers.values() for t in bufs)


def int4_dequant_linear(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K // 8, N] int32
    scales: torch.Tensor,  # [num_groups, N]
    zeros: torch.Tensor,  # [num_groups, N] uint8
    group_size: int,
    g_idx: torch.Tensor | None = None,  # [K] int32
    *,
    scratch: DequantScratch,
    config: DequantConfig | None = None,
) -> torch.Tensor:
    """``x @ dequant(W)^T`` as ``kernels.int4_gemm.int4_gemm_ref`` computes it: the weight dequantized into
    the scratch in x's dtype (``[N, K]``, the dense model's layout), then the dense model's ``F.linear``."""
    check_float("x", x)
    if x.dim() != 2 or x.shape[1] != qweight.shape[0] * PACK:
        raise ValueError(
            f"x must be [M, {qweight.shape[0] * PACK}] for qweight {tuple(qweight.shape)}, got {tuple(x.shape)}"
        )
    w = scratch.weight(qweight.shape[1], x.shape[1], x.dtype, x.device)  # [N, K]
    int4_dequant(qweight, scales, zeros, group_size, g_idx, out=w, config=config)
    return F.linear(x, w)
