"""The W4A16 GEMM for decode batches on the tensor cores (mma.sync), in Gluon: small- and mid-batch projections.

Why another kernel beside the CUDA-core GEMVs (``kernels.int4_gemv``): at M = 1 those spend 3-5 instructions on
every weight (unpack, convert, multiply-add) and reach only 0.5-0.66 of the copy bandwidth on an H200, at the same
speed whether the weights come from HBM or the L2 (docs/benchmarks.md, Sessions 11 and 21): the issue rate bounds
them, we thought. A ``tl.dot`` version of this kernel spent 4.8 instructions a weight (sm_90 SASS): Triton took
the dequantized tile through shared memory to reach the MMA's operand layout. Here Gluon's explicit layouts let
every thread load exactly the packed words whose codes its MMA fragments hold, so the codes go from the load to the
MMA in registers (``convert_layout(..., assert_trivial=True)`` checks that at compile time): 2.1 instructions a
weight. On the H200 (docs/benchmarks.md, Session 23) it ties the GEMV at M = 1 (so the issue rate was not the
GEMV's limit there) and takes a third to a half of the GEMV's and tl.dot's time at M = 2-8, where it is the default.

out^T = W^T x^T: the weights are the MMA's A operand (a warp's tile: 16 output features), x^T its B operand (8
columns per MMA; a program takes ``BLOCK_M`` rows of x, a multiple of 8, and more rows are more programs). Two forms
of the weights:

- **factored** (the default at 8 rows): the codes as ``base + c`` go to the MMA, zero and scale per group after it
  (below), with x's row sums from a second MMA;
- **dequantized** (``DEQUANT_A``, from 16 rows): each register pair becomes ``(c - z) s`` in two paired ``fma`` after
  the ``lop3`` (:func:`_weights_asm`), rounded to x's dtype exactly as the reference rounds every weight, and the MMA
  sums across groups into one accumulator: the per-group work no longer grows with the rows, the weights' does
  not either (it is per weight, shared by every row of the tile).

- **Which k a code stands for.** The MMA (m16n8k16) wants lane ``l`` to hold, for output features ``l // 4`` and
  ``l // 4 + 8`` of its tile and each 16-deep k step, the k's ``2q, 2q + 1, 2q + 8, 2q + 9`` (``q = l % 4``). A sum over k
  does not care about k's order, so the kernel gives the MMA a permuted k: the packed word ``i = 4p + q`` of an
  output feature (input features ``8i .. 8i + 7``) feeds lane ``q``, and its nibble ``j = 4h + 2 r1 + r0`` stands at
  MMA position ``32p + 16 r1 + 8 r0 + 2q + h`` (:func:`mma_position`). x is loaded in the same order. The
  permutation stays inside 32 consecutive k's, so inside a quantization group (group sizes that are multiples of
  32; no g_idx).
- **Codes as half floats by bit tricks** (:data:`_CODES_ASM`): ``(word >> 4r) & 0x000F000F`` or-ed with the bits
  of 128 (bf16; 1024 for fp16) twice is two halves reading ``base + code``, exactly: one shift and one ``lop3``
  for two weights, no int->float conversion.
- **Scale and zero per group and column, after the MMA**: ``sum_k (c_k - z) s x_k = s (sum_k (base + c_k) x_k -
  (base + z) sum_k x_k)``, with ``sum_k x_k`` from the MMA too (a tile of ones times x^T). Each product ``(base + c) x`` is exact in fp32 and the MMA sums in fp32. Not
  bit-identical to ``kernels.int4_gemm.int4_gemm_ref``, which rounds every weight to the scales' dtype first;
  like the factored GEMV, closer to the exact sum than that.

A program owns ``BLOCK_N`` columns and a K range; split-K partials are summed in the same launch (fp32 atomics
into a zeroed buffer and an arrival counter, as ``kernels.int4_gemv``'s "atomic" mode; the last program writes
the output and zeroes the buffer again). Gluon does not run under the CPU interpreter: there the torch
reference runs, and the CPU tests compile this kernel for sm_90.
"""

from __future__ import annotations

import torch

from kernels.int4_dequant import unpack_int4
from kernels.int4_split import zeroed_scratch
from kernels.pdl import LAUNCH_DEPENDENTS_ASM, WAIT_ASM, pdl_supported

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # Triton 3.6 | 3.7
except ImportError:  # pragma: no cover - no Triton, or one without Gluon
    gluon = None

MMA_ROWS = 8  # the MMA's N, x^T's columns: the rows of x a program takes are a multiple of it
PERMUTE_SPAN = 32  # k's permuted among themselves (mma_position); group sizes must be multiples
# base + code as 16-bit floats, two to a register: 128's bf16 bits (7 mantissa bits: 128 + c is exact) and
# 1024's fp16 bits (10 mantissa bits)
BASE = {torch.bfloat16: (128.0, 0x43004300), torch.float16: (1024.0, 0x64006400)}

# One MMA operand register per shift r: nibble r of the word in the low half, nibble r + 4 in the high half, each or-ed
# with the base's bits ($6): lop3 0xEA is (a & b) | c. Packed two elements an instance (Triton's pack=2): the word
# comes in twice ($4, $5: the two elements of a join of the word with itself, h = 0 and 1), so output r holds
# element h = 0 (nibble r) and element h = 1 (nibble r + 4) in one register, the pair the MMA takes.
_CODES_ASM = (
    "{ .reg .b32 u;\n"
    + "".join(
        (f"shr.u32 u, $4, {4 * r};\n" if r else "mov.b32 u, $4;\n") + f"lop3.b32 ${r}, u, 0x000F000F, $6, 0xEA;\n"
        for r in range(4)
    )
    + "}"
)


def _weights_asm(kind: str, one_bits: int) -> str:
    """:data:`_CODES_ASM`, then each register's pair made weights ``(c - z) s`` (the dequantizing MMA, ``DEQUANT_A``):
    ``fma(base + c, 1, -(base + z))`` is ``c - z`` exactly, ``fma(c - z, s, -0)`` the product rounded once to the
    16-bit type, as ``kernels.int4_gemm.int4_gemm_ref`` rounds it. ``$8``: ``-(base + z)`` and ``$10``: ``s``, each in
    both halves of a register; ``fma.rn`` on pairs runs on sm_80+ (``mul`` on bf16 pairs needs sm_90)."""
    steps = "".join(
        (f"shr.u32 u, $4, {4 * r};\n" if r else "mov.b32 u, $4;\n")
        + f"lop3.b32 u, u, 0x000F000F, $6, 0xEA;\nfma.rn.{kind} u, u, one, $8;\nfma.rn.{kind} ${r}, u, $10, nz;\n"
        for r in range(4)
    )
    return f"{{ .reg .b32 u, one, nz;\nmov.b32 one, {one_bits:#x};\nmov.b32 nz, 0x80008000;\n{steps}}}"


_WEIGHTS_ASM = {True: _weights_asm("bf16x2", 0x3F803F80), False: _weights_asm("f16x2", 0x3C003C00)}


def mma_position(k: torch.Tensor) -> torch.Tensor:
    """The MMA position (module docstring) of input feature ``k`` (an int tensor): inside each 32 k's, word
    ``q = (k // 8) % 4`` and nibble ``j = k % 8 = 4h + 2 r1 + r0`` go to ``16 r1 + 8 r0 + 2q + h``."""
    base, q, j = k - k % PERMUTE_SPAN, (k // 8) % 4, k % 8
    h, r1, r0 = j // 4, (j // 2) % 2, j % 2
    return base + 16 * r1 + 8 * r0 + 2 * q + h


def gemv_mma_available(x: torch.Tensor, group_size: int, has_g_idx: bool) -> bool:
    """Whether this kernel can run ``x``: Gluon, an sm_80+ GPU, bf16/fp16 with unit stride along K, no g_idx,
    groups of multiples of 32 k's. Where it can't, ``kernels.int4_gemm`` runs the GEMV or tl.dot."""
    if gluon is None or x.device.type != "cuda" or torch.cuda.get_device_capability(x.device)[0] < 8:
        return False
    shape_ok = x.shape[1] <= 1 or x.stride(1) == 1
    return x.dtype in BASE and shape_ok and not has_g_idx and group_size % PERMUTE_SPAN == 0


if gluon is not None:

    @gluon.jit
    def _codes(words, base_bits, IS_BF16: gl.constexpr):
        """``[..., 2 (h)]`` 16-bit floats ``base + code`` of nibble ``r + 4h`` of each word, for r = 0..3 (4 tensors)."""
        pair = gl.join(words, words)
        if IS_BF16:
            out = gl.inline_asm_elementwise(
                _CODES_ASM_C, "=r,=r,=r,=r,r,r,r,r", [pair, base_bits], dtype=(gl.bfloat16,) * 4, is_pure=True, pack=2
            )
        else:
            out = gl.inline_asm_elementwise(
                _CODES_ASM_C, "=r,=r,=r,=r,r,r,r,r", [pair, base_bits], dtype=(gl.float16,) * 4, is_pure=True, pack=2
            )
        return out

    _CODES_ASM_C = gl.constexpr(_CODES_ASM)

    @gluon.jit
    def _griddepcontrol(WAIT: gl.constexpr):
        """``kernels.pdl``'s two instructions for a Gluon kernel: wait for the kernel before (WAIT), or let a
        PDL-launched next kernel start."""
        if WAIT:
            gl.inline_asm_elementwise(_WAIT_ASM_C, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        else:
            gl.inline_asm_elementwise(_LAUNCH_DEPENDENTS_ASM_C, "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    _WAIT_ASM_C = gl.constexpr(WAIT_ASM)
    _LAUNCH_DEPENDENTS_ASM_C = gl.constexpr(LAUNCH_DEPENDENTS_ASM)

    @gluon.jit
    def _dequant(words, base_bits, negz2, s2, IS_BF16: gl.constexpr):
        """:func:`_codes` as weights ``(c - z) s`` (``_weights_asm``); ``negz2``, ``s2``: packed pairs per column
        ``[BN]``, broadcast to the words."""
        pair = gl.join(words, words)
        nz = gl.join(words * 0 + negz2[None, None, :], words * 0 + negz2[None, None, :])
        sc = gl.join(words * 0 + s2[None, None, :], words * 0 + s2[None, None, :])
        if IS_BF16:
            out = gl.inline_asm_elementwise(
                _WEIGHTS_ASM_BF16, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [pair, base_bits, nz, sc], dtype=(gl.bfloat16,) * 4,
                is_pure=True, pack=2,
            )  # fmt: skip
        else:
            out = gl.inline_asm_elementwise(
                _WEIGHTS_ASM_F16, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [pair, base_bits, nz, sc], dtype=(gl.float16,) * 4,
                is_pure=True, pack=2,
            )  # fmt: skip
        return out

    _WEIGHTS_ASM_BF16 = gl.constexpr(_WEIGHTS_ASM[True])
    _WEIGHTS_ASM_F16 = gl.constexpr(_WEIGHTS_ASM[False])

    @gluon.jit
    def _packed_pair(v, IS_BF16: gl.constexpr):
        """``v`` (fp32) rounded to the 16-bit type, its bits in both halves of an int32."""
        if IS_BF16:
            bits = v.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        else:
            bits = v.to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        return bits | (bits << 16)

    @gluon.jit
    def _weight_operand(words, base_bits, negz2, s2, w_layout: gl.constexpr, IS_BF16: gl.constexpr,
                        DEQUANT_A: gl.constexpr):  # fmt: skip
        """``words [P, 4 (q), BN]`` -> the MMA's A operand ``[BN, 32 P]`` (output features by MMA positions), in
        registers: ``base + c``, or DEQUANT_A the weights ``(c - z) s``."""
        if DEQUANT_A:
            c0, c1, c2, c3 = _dequant(words, base_bits, negz2, s2, IS_BF16)
        else:
            c0, c1, c2, c3 = _codes(words, base_bits, IS_BF16)  # [P, 4, BN, 2 (h)], r = 0..3
        t = gl.join(gl.join(c0, c1), gl.join(c2, c3))  # [P, 4, BN, h, r0, r1]
        t = gl.permute(t, (2, 0, 5, 4, 1, 3))  # [BN, P, r1, r0, q, h]
        w = gl.reshape(t, (words.shape[2], words.shape[0] * 32))
        return gl.convert_layout(w, w_layout, assert_trivial=True)

    @gluon.jit
    def _x_operand(x_ptr, stride_xm, offs_m, M, k0, k_end, BLOCK_K: gl.constexpr, b_layout: gl.constexpr,
                   x_layout: gl.constexpr):  # fmt: skip
        """x's rows ``offs_m`` ``[BM, BLOCK_K]`` from ``k0`` (rows past M and k's past k_end zero), transposed and in
        MMA positions: the B operand ``[BLOCK_K, BM]``."""
        P: gl.constexpr = BLOCK_K // 32
        BM: gl.constexpr = offs_m.shape[0]
        offs_k = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_layout))
        mask = (offs_m < M)[:, None] & (offs_k < k_end)[None, :]
        x = gl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)  # [BM, BK]
        # input feature 32p + 8q + 4h + 2 r1 + r0 -> MMA position 32p + 16 r1 + 8 r0 + 2q + h
        t = gl.permute(gl.reshape(x, (BM, P, 4, 2, 2, 2)), (1, 4, 5, 2, 3, 0))  # [P, r1, r0, q, h, BM]
        return gl.convert_layout(gl.reshape(t, (BLOCK_K, BM)), b_layout)

    @gluon.jit
    def _int4_gemv_mma_kernel(
        x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr,
        M, N, K, K_PER_SPLIT, base_bits, base,
        stride_xm, stride_qk, stride_sg, stride_zg, stride_om,
        GROUP_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
        SPLIT: gl.constexpr, EVEN_N: gl.constexpr, IS_BF16: gl.constexpr,
        DEQUANT_A: gl.constexpr, W_LAYOUT: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """W_LAYOUT: :func:`words_layout`. out^T = W^T x^T: the weights are the MMA's A operand (16 output features a
        warp's tile, the MMA's rows), x^T its B (``BLOCK_M`` columns, a multiple of 8: rows ``pid_m * BLOCK_M ..`` of
        x). DEQUANT_A: the A operand is the weights ``(c - z) s``, dequantized in registers, accumulated by the MMA
        across groups; else (factored) ``base + c``, zero and scale applied per tile after the MMA. PDL (launched
        with ``launch_pdl``, ``kernels.pdl``): waits for the kernel before first of all, and lets the next kernel
        start after its K loop."""
        if PDL:
            _griddepcontrol(True)
        P: gl.constexpr = BLOCK_K // 32
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        w_layout: gl.constexpr = W_LAYOUT
        X_LANES_K: gl.constexpr = min(16, BLOCK_K // 8)  # x's tile [BLOCK_M, BLOCK_K] loaded in 16-byte vectors
        x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // X_LANES_K, X_LANES_K], [1, num_warps], [1, 0])
        pid_m = gl.program_id(0)  # fastest: the programs that read the same weights run together (L2 hits)
        pid_n = gl.program_id(1)
        pid_k = gl.program_id(2)
        w2: gl.constexpr = gl.SliceLayout(2, w_layout)
        offs_p = gl.arange(0, P, layout=gl.SliceLayout(1, w2))
        offs_q = gl.arange(0, 4, layout=gl.SliceLayout(0, w2))
        offs_wn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(1, w_layout)))
        word_rows = gl.expand_dims(4 * offs_p[:, None] + offs_q[None, :], 2)  # [P, 4, 1]
        w_cols = gl.expand_dims(gl.expand_dims(offs_wn, 0), 1)  # [1, 1, BN]
        offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
        offs_xm = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout))
        mask_n = offs_n < N
        k_start = pid_k * K_PER_SPLIT
        k_end = gl.minimum(k_start + K_PER_SPLIT, K)
        acc = gl.zeros((BLOCK_N, BLOCK_M), gl.float32, layout=mma)
        ones = gl.full((16 * num_warps, BLOCK_K), 1.0, x_ptr.dtype.element_ty, layout=a_layout)
        negz2 = offs_wn * 0
        s2 = offs_wn * 0
        for k0 in range(k_start, k_end, BLOCK_K):
            g = k0 // GROUP_SIZE
            if DEQUANT_A:  # (c - z) s per weight, rounded to x's dtype as the reference does: straight into acc
                mask_wn = offs_wn < N
                s2 = _packed_pair(
                    gl.load(s_ptr + g * stride_sg + offs_wn, mask=mask_wn, other=0.0).to(gl.float32), IS_BF16
                )
                z = gl.load(z_ptr + g * stride_zg + offs_wn, mask=mask_wn, other=0).to(gl.float32)
                negz2 = _packed_pair(-(base + z), IS_BF16)
            words = gl.load(qw_ptr + (k0 // 8 + word_rows) * stride_qk + w_cols, mask=(w_cols < N) | EVEN_N, other=0)
            xb = _x_operand(x_ptr, stride_xm, offs_xm, M, k0, k_end, BLOCK_K, b_layout, x_layout)
            a = _weight_operand(words, base_bits, negz2, s2, a_layout, IS_BF16, DEQUANT_A)
            if DEQUANT_A:
                acc = mma_v2(a, xb, acc)
            else:  # factored: base + c through the MMA, zero and scale per group and column after it
                d = mma_v2(a, xb, gl.zeros_like(acc))
                xs = mma_v2(ones, xb, gl.zeros((16 * num_warps, BLOCK_M), gl.float32, layout=mma))  # x's row sums
                s = gl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(gl.float32)
                z = gl.load(z_ptr + g * stride_zg + offs_n, mask=mask_n, other=0).to(gl.float32)
                acc += s[:, None] * (d - (base + z)[:, None] * gl.max(xs, axis=0)[None, :])
        if PDL:
            _griddepcontrol(False)
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
        store_split(acc, offs_n, offs_m, N, M, out_ptr, stride_om, ws_ptr, cnt_ptr, SPLIT)

    @gluon.jit
    def store_split(acc, offs_n, offs_m, N, M, out_ptr, stride_om, ws_ptr, cnt_ptr, SPLIT: gl.constexpr):
        """``acc [BN, BM]`` (features by rows of x) to ``out [M, N]``; split-K (``SPLIT`` programs along grid axis
        2 per tile): fp32 atomics into ``ws [M, N]`` and an arrival counter per tile, the last program writes the
        sum and leaves both at zero (``kernels.int4_split.zeroed_scratch``)."""
        mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
        out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        if SPLIT == 1:
            gl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            mn = offs_m[None, :] * N + offs_n[:, None]
            gl.atomic_add(ws_ptr + mn, acc, mask=mask, sem="relaxed")
            _cta_barrier()  # every thread's adds before thread 0's release (kernels.int4_split.finish_tile)
            tile = gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)
            arrived = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLIT - 1:
                total = gl.load(ws_ptr + mn, mask=mask, other=0.0, cache_modifier=".cg")
                _cta_barrier()
                gl.store(ws_ptr + mn, gl.zeros_like(total), mask=mask)
                gl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
                gl.store(cnt_ptr + tile, 0)


def words_layout(p: int, block_n: int, num_warps: int) -> object:
    """The packed words ``[P, 4 (q), BN]`` of a tile as the A operand's lanes want them: lane ``l`` holds word row
    ``4p + l % 4`` of output features ``l // 4`` and ``l // 4 + 8`` of its warp's 16, warp ``w`` the features
    ``16 w ..`` of every ``16 num_warps``."""
    log2 = {1 << i: i for i in range(16)}
    regs = [[0, 0, 8]] + [[0, 0, 16 * num_warps << i] for i in range(log2[block_n // (16 * num_warps)])]
    regs += [[1 << i, 0, 0] for i in range(log2[p])]
    lanes = [[0, 1, 0], [0, 2, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]]
    warps = [[0, 0, 16 << i] for i in range(log2[num_warps])]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=warps, block_bases=[],
                                      shape=[p, 4, block_n])  # fmt: skip


def int4_gemv_mma_ref(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K // 8, N] int32
    scales: torch.Tensor,  # [num_groups, N]
    zeros: torch.Tensor,  # [num_groups, N] uint8
    group_size: int,
) -> torch.Tensor:
    """The kernel's arithmetic in fp32 torch, in its order of k (``mma_position``): per group ``s (sum_k (base +
    c_k) x_k - (base + z) sum_k x_k)``, summed over the groups. For tests: the order the sums run in is the kernel's
    only up to fp32 rounding."""
    base = BASE[x.dtype][0] if x.dtype in BASE else 0.0
    k = x.shape[1]
    pos = mma_position(torch.arange(k))
    perm = torch.empty_like(pos)
    perm[pos] = torch.arange(k)  # position -> input feature
    codes = unpack_int4(qweight).float()[perm]  # [K, N] in MMA order
    xf = x.float()[:, perm]
    groups = k // group_size
    d = torch.einsum("mgk,gkn->mgn", xf.view(-1, groups, group_size), (codes + base).view(groups, group_size, -1))
    xs = xf.view(-1, groups, group_size).sum(-1)  # [M, G]
    s, z = scales.float(), zeros.float()
    return (s[None] * (d - (base + z)[None] * xs[:, :, None])).sum(1).to(x.dtype)


def int4_gemv_mma(
    x: torch.Tensor,  # [M, K] bf16 or fp16, unit stride along K
    qweight: torch.Tensor,  # [K // 8, N] int32, contiguous along N
    scales: torch.Tensor,  # [num_groups, N]
    zeros: torch.Tensor,  # [num_groups, N] uint8
    group_size: int,
    out: torch.Tensor,  # [M, N] contiguous, x.dtype
    *,
    block_n: int,
    block_k: int,
    split_k: int,
    num_warps: int,
    block_m: int = MMA_ROWS,
    dequant: bool = False,
    pdl: bool = False,
) -> None:
    """Launches on inputs ``kernels.int4_gemm.int4_gemm`` has checked (:func:`gemv_mma_available`);
    ``block_k`` (a multiple of 32) must divide the group, ``block_n`` be a multiple of ``16 * num_warps`` and
    ``block_m`` a power of two from 8: rows of x ``block_m`` at a time; ``dequant``: the weights dequantized in
    registers (``DEQUANT_A``), not factored; ``pdl``: launched with programmatic dependent launch where the device
    has it (``kernels.pdl``)."""
    m, k = x.shape
    n = qweight.shape[1]
    if gluon is None:
        raise RuntimeError("the MMA GEMV needs a Triton with Gluon")
    if group_size % block_k or block_k % PERMUTE_SPAN or block_n % (16 * num_warps):
        raise ValueError(f"block_k {block_k} must divide the group {group_size} in 32s, block_n {block_n} fill warps")
    if block_m < MMA_ROWS or block_m & (block_m - 1) or x.stride(1) != 1:
        raise ValueError(f"block_m {block_m} must be a power of two from {MMA_ROWS}; x needs unit stride along K")
    base, bits = BASE[x.dtype]
    k_per_split = -(-k // (split_k * block_k)) * block_k
    split = -(-k // k_per_split)
    num_tiles, m_tiles = -(-n // block_n), -(-m // block_m)
    ws = zeroed_scratch(x.device, torch.float32, m * n) if split > 1 else out
    counters = zeroed_scratch(x.device, torch.int32, num_tiles * m_tiles) if split > 1 else out
    pdl = pdl and pdl_supported(x)
    _int4_gemv_mma_kernel[(m_tiles, num_tiles, split)](
        x, qweight, scales, zeros, out, ws, counters,
        m, n, k, k_per_split, bits, base,
        x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0), out.stride(0),
        GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split,
        EVEN_N=n % block_n == 0, IS_BF16=x.dtype == torch.bfloat16, DEQUANT_A=dequant,
        W_LAYOUT=words_layout(block_k // PERMUTE_SPAN, block_n, num_warps),
        PDL=pdl, num_warps=num_warps, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
