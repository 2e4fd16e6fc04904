"""Warm the L2 with bytes a later kernel will read: fire-and-forget prefetches, sm_90 and up.

Built to test one idea for batch-1 decode, and kept as ``loadtest.prefetch_bench``'s tool so that it can be
re-checked: a batch-1 GEMV starts with its weights cold in HBM, while the small kernels between two projections
(norms, attention) leave the HBM idle, so a prefetch a kernel ahead might let the GEMV read L2 hits.

H200 (2026-12-04, ``gpu_session.sh bp``): the idea does not pay, and the engine does not prefetch.

- A GEMV whose weights are all in the L2 is only 0-2 us faster (the int4 ones: qkv 9.1 -> 7.9 us, gate_up
  unchanged). The batch-1 GEMVs are bound by their own issue and reduction, not by HBM latency.
- Issuing the prefetch costs more than that. A 12 MB bulk prefetch on the step's stream took ~7 us. On a side
  stream beside the layer, the int4 8B model's batch-1 step went from 2.49 to 2.87 ms.

Two ways to issue one, both with no result a thread waits on, so the kernel ends once it has issued them:

- ``bulk``: one ``cp.async.bulk.prefetch.L2`` (the TMA unit) per ``chunk`` bytes, a thread each;
- ``line``: one ``prefetch.global.L2::evict_last`` per 128-byte line, a thread each.

Nothing is written, so a prefetch never changes a result.
"""

from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, require_triton, tl, triton

MODES = ("bulk", "line")
LINE_BYTES = 128
PROGRAM_THREADS = 32  # prefetches (= threads: one warp) a program, so the bytes spread over many SMs


# The two instructions, each predicated on its second operand (0: past the end) and returning a dummy register
# (inline asm must return something); constexprs for the kernels (plain strings without Triton).
BULK_ASM = "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }"
LINE_ASM = "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }"
_BULK_ASM = tl.constexpr(BULK_ASM) if HAS_TRITON else BULK_ASM
_LINE_ASM = tl.constexpr(LINE_ASM) if HAS_TRITON else LINE_ASM


@triton.jit
def _prefetch_kernel(ptr, nbytes, STEP: tl.constexpr, PER_PROGRAM: tl.constexpr, BULK: tl.constexpr):
    """One prefetch a thread, of ``STEP`` bytes from ``ptr + offs``: a bulk one of the bytes left in the chunk
    (a multiple of 16: nbytes and STEP are), or the line there while it starts inside."""
    offs = (tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)).to(tl.int64) * STEP
    left = tl.maximum(tl.minimum(nbytes - offs, STEP), 0)  # bytes of this chunk, 0 past the end
    arg = left.to(tl.int32) if BULK else (left > 0).to(tl.int32)
    tl.inline_asm_elementwise(
        _BULK_ASM if BULK else _LINE_ASM, "=r,l,r", [ptr + offs, arg], dtype=tl.int32, is_pure=False, pack=1
    )


def prefetch_l2(t: torch.Tensor, max_bytes: int | None = None, mode: str = "bulk", chunk: int = 8192) -> int:
    """Prefetches the first ``max_bytes`` (all by default) of ``t``'s bytes into the L2 on the current stream;
    returns how many it asked for (the bulk mode rounds down to 16 bytes). ``t`` must be contiguous."""
    require_triton("prefetch_l2")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not t.is_cuda:
        raise ValueError(f"prefetch_l2 needs a CUDA tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError("prefetch_l2 needs a contiguous tensor")
    if chunk <= 0 or chunk % 16:
        raise ValueError(f"chunk must be a positive multiple of 16, got {chunk}")
    nbytes = t.numel() * t.element_size()
    if max_bytes is not None:
        nbytes = min(nbytes, max_bytes)
    raw = t.view(-1).view(torch.uint8)
    bulk = mode == "bulk"
    if bulk:
        nbytes -= nbytes % 16
        if t.data_ptr() % 16:
            return 0
    if nbytes <= 0:
        return 0
    step = chunk if bulk else LINE_BYTES
    grid = (-(-nbytes // (step * PROGRAM_THREADS)),)
    _prefetch_kernel[grid](raw, nbytes, STEP=step, PER_PROGRAM=PROGRAM_THREADS, BULK=bulk, num_warps=1)
    return nbytes
