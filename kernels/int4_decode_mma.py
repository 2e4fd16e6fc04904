"""The one-launch decode step's GEMV on the tensor cores (``StepTiles(mma=True)``, ``kernels.int4_decode_step``).

Why: the step's CUDA-core GEMV loop is ~5.5 SASS instructions a weight on sm_90 and bound by instruction issue
(docs/benchmarks.md, Session 28); the codes alone take 3 there (a shift, a LOP3 into an fp32 mantissa, an FFMA).
Here a warpgroup MMA does the multiply-adds: ``W^T [TN, K] @ x^T [K, 16]``, x in column 0..3 of the 16, and the
codes reach it in registers, two a 32-bit register from one shift and one LOP3 (bf16 ``128 + code``, as Session 23's
Gluon GEMV does). Compiled for sm_90 on the CPU (tests/kernels/test_int4_decode_mma.py): ~2.7 instructions a weight
at 128 columns, the words through cp.async and ldmatrix, four HGMMAs a 128-k tile per 64 columns; the scales, zeros
and x's sum loaded a tile ahead. What is left a tile: x's sum and the scales' move to the MMA rows cross warps
(three barriers), and the four products' columns are picked out (FSEL, FADD).

The order of k inside a tile does not change the sum, so the MMA takes k permuted: the words are read as 16-bit
halves, ``[TN, 2 R]`` for ``R = BK / 8`` word rows (column ``2 r + h``: half ``h`` of word row ``r``, whose nibble
``j`` is ``k = 8 r + 4 h + j``). Product ``j`` of four multiplies nibble ``j`` of every half by the x's at those k,
which sit in column ``j`` of one ``[2 R, 16]`` operand (the other columns' products are dropped). Scales and zeros
are applied per tile after the MMA: ``s (sum (128 + c) x - (128 + z) sum x)``.
"""

from __future__ import annotations

from kernels._triton import tl, triton


@triton.jit
def _codes(halves, J: tl.constexpr, dtype: tl.constexpr, COMPILED: tl.constexpr):
    """Nibble ``J`` of every 16-bit half as ``dtype`` (bf16 ``128 + code``, fp16 ``1024 + code``, both exact).
    ``COMPILED``: two halves a 32-bit register, one shift and one LOP3 (inline PTX); else (the interpreter) the same
    bits in 16-bit operations, which ptxas would run one half at a time."""
    MAGIC: tl.constexpr = 0x6400 if dtype == tl.float16 else 0x4300
    if COMPILED:
        LOP: tl.constexpr = (
            "lop3.b32 $0, t, 0x000F000F, 0x64006400, 0xea;"
            if dtype == tl.float16
            else "lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xea;"
        )
        SHIFT: tl.constexpr = (
            "mov.b32 t, $1;"
            if J == 0
            else "shr.u32 t, $1, 4;"
            if J == 1
            else "shr.u32 t, $1, 8;"
            if J == 2
            else "shr.u32 t, $1, 12;"
        )
        ASM: tl.constexpr = "{ .reg .b32 t; " + SHIFT + " " + LOP + " }"
        if dtype == tl.float16:
            return tl.inline_asm_elementwise(ASM, "=r,r", [halves], dtype=tl.float16, is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(ASM, "=r,r", [halves], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        return (((halves >> (4 * J)) & 0xF) | MAGIC).to(tl.int16).to(dtype, bitcast=True)


@triton.jit
def _product(halves, J: tl.constexpr, b, dtype: tl.constexpr, COMPILED: tl.constexpr):
    """``codes J @ b``, ``[TN, 16]`` fp32. The interpreter's products in fp32 (exact, as the MMA's): Triton 3.7's
    interpreter multiplies bf16 dot operands as their raw 16-bit integers."""
    a = _codes(halves, J, dtype, COMPILED)
    if COMPILED:
        return tl.dot(a, b)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _group_terms(x_ptr, s_ptr, z_ptr, k0, cols, N, GROUP: tl.constexpr, BK: tl.constexpr):
    """The tile at ``k0``'s scales and zeros ``[TN]`` and its x ``[BK]`` (summed where used, a tile later)."""
    sz = (k0 // GROUP) * N + cols
    return tl.load(s_ptr + sz), tl.load(z_ptr + sz), tl.load(x_ptr + k0 + tl.arange(0, BK))


@triton.jit
def gemv_mma(x_ptr, qw_ptr, s_ptr, z_ptr, offs_n, N, k_lo, k_hi,
             GROUP: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr, COMPILED: tl.constexpr):  # fmt: skip
    """``x[k_lo:k_hi] @ W[k_lo:k_hi]`` at columns ``offs_n [TN]``: ``[TN]`` fp32, as ``kernels.int4_decode_step._gemv``
    (x bf16 or fp16 and contiguous; W int4 ``[K // 8, N]`` int32 with scales and zeros ``[K // GROUP, N]``; ``k_lo``
    and ``k_hi`` whole ``BK`` tiles inside groups). ``BK >= 64`` and ``TN >= 16`` (the MMA's K and M). ``COMPILED``:
    False under the interpreter (:func:`_codes`, :func:`_product`)."""
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    OFFSET: tl.constexpr = 1024.0 if dtype == tl.float16 else 128.0
    R: tl.constexpr = BK // 8
    TN: tl.constexpr = offs_n.shape[0]
    c2 = tl.arange(0, 2 * R)
    col = tl.arange(0, 16)
    cols = tl.minimum(offs_n, N - 1)  # a tail's columns read the last one's weights (cheaper than masks a load)
    # half h of word (r, n) at int16 (r N + n) 2 + h; k = 8 r + 4 h + j of x in column j
    half_at = ((c2 // 2) * N * 2 + c2 % 2)[None, :] + cols[:, None] * 2  # [TN, 2R]
    x_at = 8 * (c2 // 2)[:, None] + 4 * (c2 % 2)[:, None] + col[None, :]  # [2R, 16]
    qw16 = qw_ptr.to(tl.pointer_type(tl.int16))
    acc = tl.zeros((TN, 16), dtype=tl.float32)  # s sum (offset + c) x, in columns 0..3
    zacc = tl.zeros((TN,), dtype=tl.float32)  # s (offset + z) sum x
    s_n, z_n, x_n = _group_terms(x_ptr, s_ptr, z_ptr, k_lo, cols, N, GROUP, BK)
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=NUM_STAGES):
        # loaded a tile ahead (Triton pipelines only the words' and b's copies); the last tile loads its own again
        # (in bounds, unused): cheaper than masks
        s, z, xv = s_n.to(tl.float32), z_n.to(tl.float32), x_n
        s_n, z_n, x_n = _group_terms(x_ptr, s_ptr, z_ptr, tl.minimum(k0 + BK, k_hi - BK), cols, N, GROUP, BK)
        halves = tl.load(qw16 + (k0 // 8) * N * 2 + half_at)
        b = tl.load(x_ptr + k0 + x_at, mask=col[None, :] < 4, other=0.0)
        d0, d1 = _product(halves, 0, b, dtype, COMPILED), _product(halves, 1, b, dtype, COMPILED)
        d2, d3 = _product(halves, 2, b, dtype, COMPILED), _product(halves, 3, b, dtype, COMPILED)
        d = tl.where(col[None, :] == 0, d0, 0.0) + tl.where(col[None, :] == 1, d1, 0.0)
        d += tl.where(col[None, :] == 2, d2, 0.0) + tl.where(col[None, :] == 3, d3, 0.0)
        acc += s[:, None] * d
        zacc += s * (OFFSET + z) * tl.sum(xv.to(tl.float32), axis=0)
    # acc's columns past 3 are zero, but picking 0-3 lets the compiler drop their work in the loop (346 SASS
    # instructions a tile in the step against 354 summing all 16)
    return tl.sum(tl.where(col[None, :] < 4, acc, 0.0), axis=1) - zacc
