"""RMSNorm carried by the dense GEMVs around it, for decode steps of a few rows (the engine: batch 1).

A pre-norm decoder layer runs ``norm(down + residual)`` between the MLP's down projection and the next layer's
qkv. At batch 1 that norm is a launch of ~2 us that moves 24 KB. Here it has no launch of its own:

- the producer (down_proj) adds the residual as it writes its output tile, rounded as ``rms_norm_ref`` rounds
  it (the product to the output dtype, then the sum), writes that sum ``h`` (the new residual stream) and,
  per row, the fp32 sum of ``h**2`` over its tile's columns into ``sumsq [M, P]``, one column per output tile
  (no atomics: the partials are summed in tile order by whoever reads them);
- the consumer (qkv_proj) computes each row's ``1 / rms`` from its ``P`` partials once per program and
  normalizes every activation it loads as ``rms_norm_ref`` does (``weight * (h * inv_rms)``, each product
  rounded to ``h``'s dtype).

``kernels.gemv`` takes either role; when the engine fuses is ``engine.models.llama.FUSED_NORM``'s measured
choice (4-bit weights never carry the norm: it lost on the H200).

The consumer differs from ``rms_norm_ref`` (and ``kernels.norm``) only in the order in which the squares are
summed; tests bound it. :class:`NormIn` / :func:`normed_ref` and :func:`residual_sum_ref` are the torch references
the CPU engine and the tests use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._triton import HAS_TRITON, next_pow2, tl, triton
from kernels.norm import rms_norm, rms_norm_ref

MAX_PARTS = 4096  # the consumer loads a row's partial sums in one [BM, next_pow2(P)] tile


@dataclass(frozen=True)
class NormIn:
    """A consumer's input ``rms_norm(h) * weight`` still to be computed, with ``h``'s partial sums of squares
    (``sumsq [M, P]`` fp32, any split of ``h``'s columns) from the GEMV that wrote ``h``."""

    h: torch.Tensor  # [M, K]
    sumsq: torch.Tensor  # [M, P] fp32
    weight: torch.Tensor  # [K], h's dtype
    eps: float

    def check(self, k: int) -> None:
        m = self.h.shape[0]
        if self.h.dim() != 2 or self.h.shape[1] != k or self.h.stride(1) != 1:
            raise ValueError(f"fused norm: h must be [M, {k}], contiguous along K, got {tuple(self.h.shape)}")
        if self.weight.shape != (k,) or self.weight.dtype != self.h.dtype or self.weight.stride(0) != 1:
            raise ValueError(f"fused norm: weight must be [{k}] of h's dtype {self.h.dtype}, got {self.weight.dtype}")
        s = self.sumsq
        if s.dtype != torch.float32 or s.dim() != 2 or s.shape[0] != m or not 1 <= s.shape[1] <= MAX_PARTS:
            raise ValueError(f"fused norm: sumsq must be fp32 [{m}, P <= {MAX_PARTS}], got {s.dtype} {tuple(s.shape)}")
        if not s.is_contiguous() or {s.device, self.weight.device} != {self.h.device}:
            raise ValueError("fused norm: sumsq must be contiguous and every tensor on h's device")

    @property
    def parts_block(self) -> int:
        return next_pow2(self.sumsq.shape[1])


def normed_ref(norm: NormIn) -> torch.Tensor:
    """What the consumer multiplies: ``rms_norm_ref(h, weight, eps)`` (its own sum of squares, not sumsq's)."""
    out = rms_norm_ref(norm.h, norm.weight, norm.eps)
    assert isinstance(out, torch.Tensor)
    return out


def materialize(norm: NormIn) -> torch.Tensor:
    """The consumer's input as its own launch (a consumer that cannot normalize as it loads): the Triton norm
    on CUDA, else :func:`normed_ref`; neither reads ``sumsq``."""
    if norm.h.is_cuda and HAS_TRITON:
        out = rms_norm(norm.h, norm.weight, norm.eps)
        assert isinstance(out, torch.Tensor)
        return out
    return normed_ref(norm)


def residual_sum_ref(out: torch.Tensor, residual: torch.Tensor, num_parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a producer writes: ``h = out + residual`` (as ``rms_norm_ref`` adds them) and ``h``'s sums of
    squares over ``num_parts`` column slices of equal width (the last one shorter) ``[M, num_parts]`` fp32."""
    h = residual + out
    width = -(-h.shape[1] // num_parts)
    sq = h.float().pow(2)
    parts = [sq[:, i : i + width].sum(-1) for i in range(0, h.shape[1], width)]
    return h, torch.stack(parts, dim=1)


def new_sumsq(m: int, num_parts: int, device: torch.device) -> torch.Tensor:
    if num_parts > MAX_PARTS:
        raise ValueError(f"fused norm: {num_parts} output tiles exceed the consumer's limit of {MAX_PARTS} partials")
    return torch.empty((m, num_parts), dtype=torch.float32, device=device)


# ---- Triton pieces the GEMV kernels call ----


@triton.jit
def row_inv_rms(ss_ptr, offs_m, M, num_parts, hidden, eps, PARTS: tl.constexpr):
    """``1 / rms`` of rows ``offs_m`` ``[BM]`` fp32 from their ``num_parts`` partial sums of squares (``ss [M,
    num_parts]``), as ``kernels.norm``: ``1 / sqrt(sum / hidden + eps)``."""
    offs_p = tl.arange(0, PARTS)
    mask = (offs_m < M)[:, None] & (offs_p < num_parts)[None, :]
    ss = tl.load(ss_ptr + offs_m[:, None] * num_parts + offs_p[None, :], mask=mask, other=0.0)
    return 1.0 / tl.sqrt(tl.sum(ss, axis=1) / hidden + eps)


@triton.jit
def normalize(h, w, inv):
    """``rms_norm_ref``'s output for activations ``h`` (``w``: the norm weight, ``inv``: 1 / rms, both
    broadcast to ``h``): ``h * inv`` rounded to h's dtype, times ``w``, rounded again."""
    y = (h.to(tl.float32) * inv).to(h.dtype).to(tl.float32)
    return (w.to(tl.float32) * y).to(h.dtype)


@triton.jit
def store_tile(
    total, out_ptr, res_ptr, ss_ptr, offs_m, offs_n, M, N, stride_om, stride_rm, tile, num_tiles,
    ADD_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """Writes a finished fp32 tile ``total [BM, BN]`` in the output's dtype. ``ADD_RESIDUAL``: writes ``h =
    out + residual`` instead (both rounded as ``rms_norm_ref``) and ``h``'s sums of squares over the tile's
    columns into ``ss[m, tile]`` (``num_tiles`` columns a row)."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out = total.to(out_ptr.dtype.element_ty)
    if ADD_RESIDUAL:
        r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0)
        out = (out.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
        h = tl.where(mask, out.to(tl.float32), 0.0)
        tl.store(ss_ptr + offs_m * num_tiles + tile, tl.sum(h * h, axis=1), mask=offs_m < M)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=mask)
