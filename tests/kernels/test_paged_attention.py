"""Triton paged attention (decode and prefill) against the torch references."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import _paged_decode_attention, paged_decode_attention, paged_decode_attention_ref
from kernels.prefill_attention import _paged_prefill_attention, paged_prefill_attention, paged_prefill_attention_ref
from tests.kernels.helpers import DEVICE, paged_cache, rel_err, tolerance

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEAD_DIM = 32
NUM_KV_HEADS = 2
# length 1, a partial first block, exactly one block, one past it, several blocks with a partial last one
DECODE_LENS = [1, 7, 16, 17, 100]


def _query(num_rows: int, num_heads: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(num_rows, num_heads, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("sliding_window", [None, 24])
# None: one partition here; 32: the reduce kernel; (32, fused): the last program of each head merges
@pytest.mark.parametrize(("partition_size", "fused_reduce"), [(None, False), (32, False), (32, True)])
def test_decode_matches_ref(
    dtype: torch.dtype,
    group: int,
    sliding_window: int | None,
    partition_size: int | None,
    fused_reduce: bool,
    gen: torch.Generator,
) -> None:
    cache, tables = paged_cache(DECODE_LENS, 16, NUM_KV_HEADS, HEAD_DIM, dtype, gen)
    seq_lens = torch.tensor(DECODE_LENS, dtype=torch.int32, device=DEVICE)
    query = _query(len(DECODE_LENS), NUM_KV_HEADS * group, dtype, gen)
    out = _paged_decode_attention(
        query, cache, tables, seq_lens, 0.17, sliding_window, partition_size=partition_size, block_n=16,
        fused_reduce=fused_reduce,
    )  # fmt: skip
    ref = paged_decode_attention_ref(query, cache, tables, seq_lens, 0.17, sliding_window)
    assert rel_err(out, ref) < tolerance(dtype), f"seed {gen.initial_seed()}"
    if fused_reduce:  # every arrival counter is back at zero, so the next call (or graph replay) starts clean
        from kernels.paged_attention import _COUNTERS

        assert int(_COUNTERS[query.device].abs().sum()) == 0


@pytest.mark.parametrize("block_size", [1, 8, 32, 64])
def test_decode_block_sizes(block_size: int, gen: torch.Generator) -> None:
    lens = [1, 33, 130]
    cache, tables = paged_cache(lens, block_size, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    query = _query(len(lens), NUM_KV_HEADS * 4, torch.bfloat16, gen)
    out = _paged_decode_attention(query, cache, tables, seq_lens, 0.2, partition_size=64, block_n=32)
    ref = paged_decode_attention_ref(query, cache, tables, seq_lens, 0.2)
    assert rel_err(out, ref) < 1e-2, f"seed {gen.initial_seed()}"


def test_decode_public_wrapper_and_padding_rows(gen: torch.Generator) -> None:
    """CUDA-graph padding rows (seq_len 1, block table of zeros) are harmless; head_dim need not be a power of 2."""
    lens = [45, 1, 1]
    cache, tables = paged_cache(lens, 16, NUM_KV_HEADS, 24, torch.float16, gen)
    cache[:, 0, 0] = torch.randn(2, NUM_KV_HEADS, 24, generator=gen).to(torch.float16).to(DEVICE)
    tables[1:] = 0
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    query = torch.randn(3, NUM_KV_HEADS * 4, 24, generator=gen).to(torch.float16).to(DEVICE)
    out = paged_decode_attention(query, cache, tables, seq_lens, 0.2)
    ref = paged_decode_attention_ref(query, cache, tables, seq_lens, 0.2)
    assert rel_err(out, ref) < 1e-2, f"seed {gen.initial_seed()}"


# (cached prefix, new tokens): a 1-token prompt, a full prefill, chunked prefills over a prefix that ends
# mid-block and on a block edge, and decode rows (q_len 1), all in one launch
PREFILL_ROWS = [(0, 1), (0, 23), (17, 9), (32, 16), (40, 1), (5, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("sliding_window", [None, 10])
@pytest.mark.parametrize("split_mask", [True, False])
def test_prefill_mixed_batch_matches_ref(
    dtype: torch.dtype, group: int, sliding_window: int | None, split_mask: bool, gen: torch.Generator
) -> None:
    seq_lens_list = [c + q for c, q in PREFILL_ROWS]
    cache, tables = paged_cache(seq_lens_list, 16, NUM_KV_HEADS, HEAD_DIM, dtype, gen)
    q_lens = torch.tensor([q for _, q in PREFILL_ROWS])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32).to(DEVICE)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device=DEVICE)
    query = _query(int(q_lens.sum()), NUM_KV_HEADS * group, dtype, gen)
    # block_m 16: several query tiles per sequence and several KV tiles per query tile
    out = _paged_prefill_attention(
        query, cache, tables, query_start_loc, seq_lens, 0.17, sliding_window, block_m=16, block_n=16,
        split_mask=split_mask,
    )  # fmt: skip
    ref = paged_prefill_attention_ref(query, cache, tables, query_start_loc, seq_lens, 0.17, sliding_window)
    assert rel_err(out, ref) < tolerance(dtype), f"seed {gen.initial_seed()}"


def test_prefill_public_wrapper_single_sequence(gen: torch.Generator) -> None:
    cache, tables = paged_cache([70], 16, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, gen)
    query_start_loc = torch.tensor([0, 70], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([70], dtype=torch.int32, device=DEVICE)
    query = _query(70, NUM_KV_HEADS * 4, torch.bfloat16, gen)
    out = paged_prefill_attention(query, cache, tables, query_start_loc, seq_lens, 0.2)
    ref = paged_prefill_attention_ref(query, cache, tables, query_start_loc, seq_lens, 0.2)
    assert rel_err(out, ref) < 1e-2, f"seed {gen.initial_seed()}"


def test_attention_rejects_bad_inputs(gen: torch.Generator) -> None:
    cache, tables = paged_cache([5], 16, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, gen)
    seq_lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    query = _query(1, NUM_KV_HEADS * 4, torch.bfloat16, gen)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(query.float(), cache, tables, seq_lens, 0.1)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(query[:, :3], cache, tables, seq_lens, 0.1)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(query, cache[:, :, :12], tables, seq_lens, 0.1)
    with pytest.raises(ValueError, match="int32 or int64"):
        paged_decode_attention(query, cache, tables.float(), seq_lens, 0.1)
    with pytest.raises(ValueError, match="contiguous"):
        paged_decode_attention(query.transpose(1, 2).contiguous().transpose(1, 2), cache, tables, seq_lens, 0.1)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(query, cache, tables, seq_lens, seq_lens, 0.1)
