"""Row-wise argmax of logits ``[M, V]`` -> ``[M]`` int64, the index ``torch.argmax(x, dim=-1)`` returns: the
first index of the maximum, or of the first NaN where a row has one (torch counts NaN as the largest value).

Greedy decoding takes one argmax per row of the vocabulary (128k for Llama 3). torch's kernel reduces a row
inside one block, which is most of the time at batch 1: 28 us of a 4.4 ms decode step on the H200 (step
profile, 8B shape, 2026-12-02), more than all 32 layers' rotary + cache writes. Here every row is cut into
chunks of ``BLOCK`` values: one program per (row, chunk) reduces its chunk to (value, first index), a second
launch reduces each row's chunks in order. Ties and NaNs resolve as torch does because both passes keep the
lowest index among equal candidates and chunks are merged in index order.
"""

from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, next_pow2, require_triton, tl, triton

CHUNK = 4096  # values one program of the first pass reduces (128k vocab: 32 programs per row)
USE_TRITON = True  # greedy_ids on CUDA: this kernel (False: torch's, for a same-process A/B)


def argmax_ref(x: torch.Tensor) -> torch.Tensor:
    return torch.argmax(x, dim=-1)


@triton.jit
def _pick(values, offsets, BIG: tl.constexpr):
    """(the value, its offset) the argmax picks from 1-D ``values``: the first NaN if any, else the first
    maximum. Offsets are increasing, so the lowest offset is the first."""
    nan = values != values
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    best = tl.max(tl.where(nan, float("-inf"), values), axis=0)
    hit = tl.where(any_nan, nan, values == best)
    return tl.where(any_nan, float("nan"), best), tl.min(tl.where(hit, offsets, BIG), axis=0)


@triton.jit
def _argmax_chunks_kernel(x_ptr, val_ptr, idx_ptr, V, stride_xm, NUM_CHUNKS, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    # a chunk of -inf alone (a fully masked row) still names an index: the first of the chunk
    value, index = _pick(x, offs, 2147483647)
    tl.store(val_ptr + row * NUM_CHUNKS + chunk, value)
    tl.store(idx_ptr + row * NUM_CHUNKS + chunk, index)


@triton.jit
def _argmax_rows_kernel(val_ptr, idx_ptr, out_ptr, NUM_CHUNKS, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < NUM_CHUNKS
    values = tl.load(val_ptr + row * NUM_CHUNKS + offs, mask=mask, other=float("-inf"))
    indices = tl.load(idx_ptr + row * NUM_CHUNKS + offs, mask=mask, other=2147483647)
    _, chunk = _pick(values, offs, 2147483647)  # the first chunk holding the row's pick
    tl.store(out_ptr + row, tl.sum(tl.where(offs == chunk, indices, 0), axis=0).to(tl.int64))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Triton :func:`argmax_ref` of a 2-D float tensor contiguous along its rows, ``V`` < 2**31."""
    require_triton("argmax")
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"argmax: x must be a 2-D float tensor, got {x.dtype} of shape {tuple(x.shape)}")
    m, v = x.shape
    if v == 0 or (v > 1 and x.stride(1) != 1):
        raise ValueError(f"argmax: rows must be non-empty and contiguous, got shape {tuple(x.shape)}, {x.stride()}")
    out = torch.empty(m, dtype=torch.int64, device=x.device)
    if m == 0:
        return out
    block = min(CHUNK, next_pow2(v))
    chunks = -(-v // block)
    values = torch.empty(m, chunks, dtype=torch.float32, device=x.device)
    indices = torch.empty(m, chunks, dtype=torch.int32, device=x.device)
    _argmax_chunks_kernel[(m, chunks)](x, values, indices, v, x.stride(0), chunks, BLOCK=block, num_warps=4)
    _argmax_rows_kernel[(m,)](values, indices, out, chunks, BLOCK_C=max(16, next_pow2(chunks)), num_warps=1)
    return out


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """What the sampler calls: the Triton argmax on CUDA, torch's elsewhere."""
    if (
        USE_TRITON
        and HAS_TRITON
        and logits.is_cuda
        and logits.dim() == 2
        and logits.shape[1] > 0
        and logits.stride(1) == 1
    ):
        return argmax(logits)
    return argmax_ref(logits)
