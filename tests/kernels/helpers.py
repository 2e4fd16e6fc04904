"""Shared builders for the kernel tests: random paged caches whose unused slots hold NaN."""

from __future__ import annotations

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere fails."""
    assert not torch.isnan(out).any(), "output holds NaN (an element was not written or a hidden slot was read)"
    ref64 = ref.double()
    return float((out.double() - ref64).norm() / ref64.norm().clamp_min(1e-30))


def tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 1e-2


def paged_cache(
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    spare_blocks: int = 3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` and shuffled block tables
    ``[num_seqs, max_blocks + 1]`` (int32, padded with 0). Every slot no sequence owns is NaN, so a kernel
    that reads past a length or outside its table poisons its output."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(blocks_per_seq, default=0) + 1, dtype=torch.int32)
    used = 0
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        ids = perm[used : used + nb]
        used += nb
        table[i, :nb] = ids.to(torch.int32)
        live = torch.randn(2, nb * block_size, num_kv_heads, head_dim, generator=gen)[:, :n]  # [2, n, Hkv, D]
        flat = cache[:, ids].reshape(2, nb * block_size, num_kv_heads, head_dim)  # [2, nb * bs, Hkv, D]
        flat[:, :n] = live.to(dtype)
        cache[:, ids] = flat.reshape(2, nb, block_size, num_kv_heads, head_dim)
    return cache.to(DEVICE), table.to(DEVICE)
