"""Host-side pieces of the attention kernels' launches (kernels.paged_attention, kernels.prefill_attention,
kernels.prefill_new_kv): input checks and the dtype choices of a launch.
A module of its own so that the kernels' files hold kernels and their wrappers."""

from __future__ import annotations

import torch

from kernels._triton import check_float, check_index, check_last_dim_contiguous, check_same_device


def _check_attention_inputs(
    query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    check_float("query", query)
    if query.dim() != 3:
        raise ValueError(f"query must be [tokens, num_heads, head_dim], got shape {tuple(query.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype != query.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} must equal query dtype {query.dtype}")
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if query.shape[2] != head_dim:
        raise ValueError(f"query head_dim {query.shape[2]} != kv_cache head_dim {head_dim}")
    if query.shape[1] % num_kv_heads:
        raise ValueError(f"num_heads {query.shape[1]} must be a multiple of num_kv_heads {num_kv_heads}")
    check_last_dim_contiguous("query", query)
    check_last_dim_contiguous("kv_cache", kv_cache)
    check_index("block_tables", block_tables, 2)
    check_index("seq_lens", seq_lens, 1)
    if block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but seq_lens has {seq_lens.shape[0]}")
    check_same_device(query=query, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens)


def _check_step_rows(
    query: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, out: torch.Tensor | None
) -> int:
    """A mixed step's rows: ``query_start_loc`` [num_seqs + 1] over ``query``'s rows, ``out`` shaped like query."""
    check_index("query_start_loc", query_start_loc, 1)
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(f"query_start_loc needs num_seqs + 1 = {seq_lens.shape[0] + 1} entries, "
                         f"got {query_start_loc.shape[0]}")  # fmt: skip
    if out is None or out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError("decode rows of a mixed step are written into out: a tensor shaped like query")
    check_last_dim_contiguous("out", out)
    return int(seq_lens.shape[0])


def _upcast(query: torch.Tensor) -> bool:
    # Triton 3.7's interpreter multiplies the raw uint16 bits of bf16 operands in tl.dot; on CPU (tests
    # under TRITON_INTERPRET=1) bf16 tiles are upcast to fp32 first. The GPU path stays native bf16.
    return query.device.type == "cpu" and query.dtype == torch.bfloat16


def _dot_precision(query: torch.Tensor) -> str:
    # fp32 (tests) must not round operands to tf32; half types take the native tensor-core path anyway
    return "ieee" if query.dtype == torch.float32 or _upcast(query) else "tf32"


def output_like(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The tensor an attention call writes: ``out`` checked (query's shape and dtype, contiguous in head_dim), or
    a new one like ``query``."""
    if out is None:
        return torch.empty_like(query)
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {query.dtype} {list(query.shape)} contiguous in head_dim")
    return out
