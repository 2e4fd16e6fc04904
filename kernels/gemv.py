"""Dense bf16/fp16 GEMV for a few rows: ``out[M, N] = x[M, K] @ W[N, K]^T (+ bias)`` (``F.linear``), M <= 16.

At batch 1 a decode step reads every weight once and does two flops per weight, so a projection can only
be as fast as its weight streams from HBM. cuBLAS reaches ~57-92 % of the copy bandwidth on the Llama-3-8B
shapes at M = 1 (issue 11); what a GEMV needs to do better on Hopper:

- bytes in flight: each SM must keep ~30 KB of loads outstanding (4.2 TB/s x ~1 us latency / 132 SMs). A
  program loads a ``[block_n, block_k]`` tile of W, contiguous along K (16-byte vectors per thread), the
  loop is software-pipelined (``num_stages``) and enough programs run (split-K when N alone gives too few);
- the activations ``[M, block_k]`` are re-read by every program from L1/L2 (``evict_last``), the weights
  streamed once (``evict_first``);
- fp32 accumulation, the output (and bias) cast once.

Two kernels (``kernel``):

- ``fma``: CUDA-core multiply-adds into an fp32 ``[M, block_n, block_k]`` accumulator (no reduction across
  threads inside the loop), summed along K once after the loop;
- ``dot``: ``W_tile @ x_tile^T`` on the tensor cores (rows padded to 16: "swap AB", W is the big operand),
  which the pipeliner feeds through shared memory.

Split-K (``split_reduce``), each deterministic except ``atomic``:

- ``counter``: the programs of one output tile store fp32 partials ``[split, M, N]``; the last to arrive
  (a per-tile arrival counter) sums them in split order, adds the bias and writes the output: one launch;
- ``atomic``: fp32 atomic adds into a zeroed ``[M, N]`` accumulator; the last program to arrive writes the
  output and zeroes the accumulator again. Summation order varies from run to run (so do the last bits);
- ``two_pass``: partials ``[split, M, N]``, summed in split order by a second small launch.

Counters and the atomic accumulator are per-device buffers that every launch leaves at zero (zeroed when
allocated, outside any CUDA graph; inside a graph they are zeroed again by the kernel that used them), so
calls of one device must not overlap on two streams.

``plan_gemv`` (``kernels.gemv_plan``) says, from (M, N, K, SM count) alone, whether the linear layers use this
kernel or cuBLAS, and with which knobs; ``loadtest.gemv_bench`` is the sweep that decides its constants. ``pdl``
(off) launches with programmatic dependent launch: the programs wait for the kernel before
(``griddepcontrol.wait``). ``gemv_normed`` / ``gemv_residual`` carry an RMSNorm (``kernels.fused_norm``).

``gemv_gated`` (``linear_gated``) reads the MLP's gate_up output ``x2 [M, 2K]`` and multiplies
``silu_and_mul(x2)`` (rounded as ``silu_and_mul_ref``), so the down projection needs no activation launch.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import torch.nn.functional as F

from kernels import gemv_plan
from kernels._triton import HAS_TRITON, require_triton, tl, triton
from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.decode_plan import num_sms
from kernels.fused_norm import NormIn, materialize, new_sumsq, normalize, residual_sum_ref, row_inv_rms
from kernels.gemv_launch import check_gemv_inputs, zeroed_buffer
from kernels.gemv_launch import scratch_is_zero as scratch_is_zero  # re-exported: tests and the benchmark check it
from kernels.gemv_plan import GEMV_LIMIT_M as GEMV_LIMIT_M  # re-exported with the plan: tests and the benchmark
from kernels.gemv_plan import GemvConfig as GemvConfig
from kernels.gemv_plan import GemvPlan as GemvPlan
from kernels.gemv_plan import plan_gemv as plan_gemv
from kernels.gemv_split import finish, gemv_reduce_kernel, load_x

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SPLIT_MODES = {"none": 0, "counter": 1, "atomic": 2, "two_pass": 3}
# The MLP's down projection reads gate_up's output itself where it runs on the GEMV (linear_gated), instead of an
# activation launch before it. H200 (2026-12-03): the 8B down shape in a CUDA graph, M = 1 29.64 us against 30.11 for
# the activation + GEMV (28.86 the GEMV alone: each program recomputes the activation of its K range), M = 8 32.70
# against 33.17; the 8B shape's batch-1 TPOT, alternating in one device call (gpu_session.sh f, eeac913), 4.305 /
# 4.307 ms against 4.429 / 4.428 without, more than the kernel alone saves. PAGEDSERVE_GEMV_GATED=0 turns it off,
# and the int4 down projection's gated GEMV too (engine.quantization.int4_linear; not yet timed on the H200).
GEMV_GATED = os.environ.get("PAGEDSERVE_GEMV_GATED", "1") != "0"


# ---- reference ----


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` in fp32, cast once to x's dtype: what the kernel computes, up to summation order."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), b).to(x.dtype)


def gemv_gated_ref(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``gemv_ref(silu_and_mul_ref(x2), weight, bias)``: what ``gemv_gated`` computes, up to summation order."""
    return gemv_ref(silu_and_mul_ref(x2), weight, bias)


# ---- Triton ----


@triton.jit(do_not_specialize=["M"])  # one compile for every M of a block_m
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, nw_ptr, ssi_ptr, res_ptr, sso_ptr,
    M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_om, stride_rm, num_parts, eps,
    HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, SPLIT_MODE: tl.constexpr, EVEN: tl.constexpr,
    PDL: tl.constexpr, GATED: tl.constexpr, NORMED: tl.constexpr, PARTS: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """NORMED: x is ``h`` and every tile loaded is normalized (weight ``nw``, partial sums of squares ``ssi
    [M, num_parts]``); ADD_RESIDUAL: the output is ``out + res`` and its sums of squares go to ``sso``
    (``kernels.fused_norm``)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    # int64 rows: a 256k-vocab x 8k head has more than 2^31 elements
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (k_start + offs_k)[None, :]  # [BN, BK]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]  # [BM, BK]
    if PDL:  # launched before the kernel before has finished (whose output x may be): wait for it
        tl.inline_asm_elementwise(
            "griddepcontrol.wait; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )
    nw_ptrs = nw_ptr + (k_start + offs_k)[None, :]  # [1, BK] (NORMED)
    inv = row_inv_rms(ssi_ptr, offs_m, M, num_parts, K, eps, PARTS)[:, None] if NORMED else 1.0  # [BM, 1]
    if USE_DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    elif BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    # a dot-free loop is software-pipelined only when the loop itself carries num_stages
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN:  # masks along N and K only where there are tails: they would cut the 16-byte loads
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = load_x(x_ptrs, mask_m[:, None], K, GATED)
            if NORMED:
                x = normalize(x, tl.load(nw_ptrs, eviction_policy="evict_last"), inv)
        else:
            mask_k = (k0 + offs_k) < k_end
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0, eviction_policy="evict_first")
            x = load_x(x_ptrs, mask_m[:, None] & mask_k[None, :], K, GATED)
            if NORMED:
                x = normalize(x, tl.load(nw_ptrs, mask=mask_k[None, :], other=0.0, eviction_policy="evict_last"), inv)
        if USE_DOT:
            acc = tl.dot(w, tl.trans(x), acc)  # [BN, BM]
        elif BLOCK_M == 1:
            acc += w.to(tl.float32) * x.to(tl.float32)  # [BN, BK]
        else:
            acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]  # [BM, BN, BK]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        nw_ptrs += BLOCK_K
    if USE_DOT:
        total = tl.trans(acc)  # [BM, BN]
    elif BLOCK_M == 1:
        total = tl.sum(acc, axis=1)[None, :]  # [1, BN]
    else:
        total = tl.sum(acc, axis=2)  # [BM, BN]
    finish(
        total, out_ptr, b_ptr, ws_ptr, cnt_ptr, res_ptr, sso_ptr, offs_m, offs_n, M, N, stride_om, stride_rm, pid_n,
        pid_k, tl.num_programs(1), HAS_BIAS, SPLIT_MODE, ADD_RESIDUAL,
    )  # fmt: skip


# ---- launch (the checks and the zeroed scratch: kernels.gemv_launch) ----


def gemv(
    x: torch.Tensor,  # [M, K], M <= GEMV_LIMIT_M
    weight: torch.Tensor,  # [N, K], contiguous along K (nn.Linear's layout)
    bias: torch.Tensor | None = None,  # [N]
    config: GemvConfig | None = None,
    *,
    plan: GemvPlan | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the Triton GEMV with ``plan`` (default: ``plan_gemv``'s knobs, with
    ``config`` forcing some); CUDA-graph capturable once the shape has run eagerly (split-K counters)."""
    require_triton("gemv")
    check_gemv_inputs(x, weight, bias)
    return _launch(x, weight, bias, config, plan, gated=False)[0]


def gemv_gated(
    x2: torch.Tensor,  # [M, 2K]: gate | up, as the MLP's gate_up projection writes them
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    *,
    plan: GemvPlan | None = None,
) -> torch.Tensor:
    """``gemv(silu_and_mul(x2), weight, bias)`` in one launch: each program computes the activation of the x
    tiles it loads (rounded as ``silu_and_mul_ref``), so the ``[M, K]`` activation is never written."""
    require_triton("gemv_gated")
    check_gemv_inputs(x2, weight, bias, gated=True)
    return _launch(x2, weight, bias, config, plan, gated=True)[0]


def gemv_normed(
    norm: NormIn,  # x = rms_norm(norm.h) * norm.weight, [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    *,
    plan: GemvPlan | None = None,
) -> torch.Tensor:
    """``gemv(rms_norm(h) * norm_weight, weight, bias)`` in one launch: the GEMV normalizes every x tile it
    loads, from the partial sums of squares of the GEMV that wrote ``h`` (``kernels.fused_norm``)."""
    require_triton("gemv_normed")
    check_gemv_inputs(norm.h, weight, bias)
    norm.check(weight.shape[1])
    return _launch(norm.h, weight, bias, config, plan, gated=False, norm=norm)[0]


def gemv_residual(
    x: torch.Tensor,  # [M, K], or [M, 2K] (gate | up) when gated
    weight: torch.Tensor,  # [N, K]
    residual: torch.Tensor,  # [M, N], x's dtype
    config: GemvConfig | None = None,
    *,
    plan: GemvPlan | None = None,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = gemv(x, weight) + residual`` (``gemv_gated`` when ``gated``) and ``h``'s sums of squares over each
    output tile's columns ``[M, tiles]`` fp32: the next RMSNorm's statistics (``kernels.fused_norm``)."""
    require_triton("gemv_residual")
    check_gemv_inputs(x, weight, None, gated=gated)
    if residual.shape != (x.shape[0], weight.shape[0]) or residual.dtype != x.dtype or residual.stride(-1) != 1:
        raise ValueError(f"gemv_residual: residual must be [M, N] of x's dtype, got {residual.dtype} {residual.shape}")
    out, sumsq = _launch(x, weight, None, config, plan, gated=gated, residual=residual)
    assert sumsq is not None
    return out, sumsq


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig | None,
    plan: GemvPlan | None, gated: bool, norm: NormIn | None = None, residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The launch after the checks (K is weight's): the output, and its sums of squares with ``residual``."""
    m, (n, k) = x.shape[0], weight.shape
    sms = num_sms(x.device.index or 0) if x.is_cuda else 8
    plan = plan or plan_gemv(m, n, k, sms, config)
    if plan.block_m < m or (plan.kernel == "dot" and plan.block_m < 16):
        raise ValueError(f"gemv{'_gated' if gated else ''}: {plan} does not fit M={m}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    mode = SPLIT_MODES["none" if plan.split_k == 1 else plan.split_reduce]
    num_tiles = -(-n // plan.block_n)
    ws, cnt = out, out
    if mode in (1, 3):
        ws = torch.empty(plan.split_k, m, n, dtype=torch.float32, device=x.device)  # every element written
    elif mode == 2:
        ws = zeroed_buffer(x.device, torch.float32, m * n)
    if mode in (1, 2):
        cnt = zeroed_buffer(x.device, torch.int32, num_tiles)
    if residual is not None and mode == 3:
        raise ValueError("gemv_residual: the two_pass reduction does not add a residual (counter or atomic do)")
    sumsq = new_sumsq(m, num_tiles, x.device) if residual is not None else None
    b = bias if bias is not None else out
    pdl = plan.pdl and x.is_cuda and not _INTERPRET  # inline PTX: not under the interpreter
    _gemv_kernel[(num_tiles, plan.split_k)](
        x, weight, b, out, ws, cnt, out if norm is None else norm.weight, out if norm is None else norm.sumsq,
        out if residual is None else residual, out if sumsq is None else sumsq,
        m, n, k, plan.k_per_split, x.stride(0), weight.stride(0), out.stride(0),
        0 if residual is None else residual.stride(0), 1 if norm is None else norm.sumsq.shape[1],
        0.0 if norm is None else norm.eps,
        HAS_BIAS=bias is not None, USE_DOT=plan.kernel == "dot", BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        BLOCK_K=plan.block_k, NUM_STAGES=plan.num_stages, SPLIT_MODE=mode,
        EVEN=n % plan.block_n == 0 and k % plan.k_per_split == 0, PDL=pdl, GATED=gated,
        NORMED=norm is not None, PARTS=1 if norm is None else norm.parts_block, ADD_RESIDUAL=residual is not None,
        num_warps=plan.num_warps, num_stages=plan.num_stages, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    if mode == 3:
        gemv_reduce_kernel[(m, -(-n // 1024))](
            ws, b, out, m, n, plan.split_k, out.stride(0), HAS_BIAS=bias is not None, BLOCK_N=1024, num_warps=4
        )
    return out, sumsq


@lru_cache(maxsize=1024)
def _layer_plan(m: int, n: int, k: int, sms: int, max_m: int, max_elems: int) -> GemvPlan:
    """``plan_gemv`` of the layers, cached (~5 us of Python per call, eager steps make hundreds); the switch
    constants are part of the key, so changing them (tests, the benchmark) is seen."""
    return plan_gemv(m, n, k, sms)


def _layer_gemv_plan(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> GemvPlan | None:
    """The plan where the dense layers take the GEMV (CUDA, fp16/bf16, 2-D x, contiguous along the last dim,
    ``plan_gemv`` picks it for the shape), else None. The first test is on M alone, so prefill pays nothing
    for the check. ``gated``: x is ``x2 [M, 2K]``."""
    if (
        x.dim() != 2
        or x.shape[0] > gemv_plan.GEMV_MAX_M
        or not x.is_cuda
        or x.dtype not in (torch.float16, torch.bfloat16)
    ):
        return None
    (m, k), n = x.shape, weight.shape[0]
    k = k // 2 if gated else k
    plan = (
        _layer_plan(m, n, k, num_sms(x.device.index or 0), gemv_plan.GEMV_MAX_M, gemv_plan.GEMV_MAX_WEIGHT_ELEMS)
        if m
        else None
    )
    contiguous = x.stride(-1) == 1 and weight.stride(-1) == 1 and (bias is None or bias.stride(-1) == 1)
    if plan is None or not plan.use_gemv or weight.dtype != x.dtype or not contiguous:
        return None
    return plan


def takes_gemv(m: int, weight: torch.Tensor, gated: bool = False) -> bool:
    """Whether ``linear`` (``linear_gated`` when ``gated``) runs the GEMV for ``m`` rows of this weight."""
    if not weight.is_cuda or weight.dtype not in (torch.float16, torch.bfloat16) or weight.stride(-1) != 1:
        return False
    if not 1 <= m <= gemv_plan.GEMV_MAX_M or (gated and not GEMV_GATED):
        return False
    (n, k), sms = weight.shape, num_sms(weight.device.index or 0)
    return _layer_plan(m, n, k, sms, gemv_plan.GEMV_MAX_M, gemv_plan.GEMV_MAX_WEIGHT_ELEMS).use_gemv


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, by the GEMV where ``plan_gemv`` picks it for this shape: what the dense linear layers call."""
    plan = _layer_gemv_plan(x, weight, bias, gated=False)
    return F.linear(x, weight, bias) if plan is None else gemv(x, weight, bias, plan=plan)


def linear_gated(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(silu_and_mul(x2), weight, bias)`` (the MLP's down projection of gate_up's output): by the
    gated GEMV where ``linear`` takes the GEMV for that shape, else the activation (Triton on CUDA) and
    ``F.linear``."""
    plan = _layer_gemv_plan(x2, weight, bias, gated=True) if GEMV_GATED else None
    if plan is not None:
        return gemv_gated(x2, weight, bias, plan=plan)
    act = silu_and_mul(x2) if x2.is_cuda and HAS_TRITON else silu_and_mul_ref(x2)
    return linear(act, weight, bias)


def linear_normed(norm: NormIn, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(rms_norm(h) * norm_weight, weight, bias)``: by ``gemv_normed`` where ``linear`` takes the
    GEMV for this shape, else the norm (Triton on CUDA) and ``linear``."""
    plan = _layer_gemv_plan(norm.h, weight, bias, gated=False)
    if plan is not None:
        return gemv_normed(norm, weight, bias, plan=plan)
    return linear(materialize(norm), weight, bias)


def linear_residual(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, gated: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = F.linear(x, weight) + residual`` (of ``silu_and_mul(x)`` when ``gated``) and ``h``'s sums of
    squares ``[M, P]``: by ``gemv_residual`` where ``linear`` (``linear_gated``) takes the GEMV, else
    ``linear`` and ``kernels.fused_norm.residual_sum_ref`` (one partial a row)."""
    plan = _layer_gemv_plan(x, weight, None, gated=gated) if GEMV_GATED or not gated else None
    if plan is not None:
        return gemv_residual(x, weight, residual, plan=plan, gated=gated)
    return residual_sum_ref(linear_gated(x, weight) if gated else linear(x, weight), residual, 1)
