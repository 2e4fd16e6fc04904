"""Triton paged attention (decode and prefill) against the torch references."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels import decode_plan
from kernels.decode_plan import decode_partition_size
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


GROUPS = [1, 4, 8]
# {}: one partition here; 32 (4 partitions): the reduce kernel (chunk2: its merge over two chunks); 48: three
# tiles, not a power of two; dynamic: each sequence's own length cut into the grid's partitions (3 here: 4
# programs per SM of the interpreter's 8 "SMs", 5 sequences x 2 KV heads)
DECODE_KNOBS = {
    "one": {},
    "p32": {"partition_size": 32},
    "p32_chunk2": {"partition_size": 32, "reduce_chunk": 2},
    "p48": {"partition_size": 48},
    "dyn": {"dynamic": True},
    "dyn16": {"dynamic": True, "programs_per_sm": 16},
    "p32_early": {"partition_size": 32, "early": True},  # inputs loaded before the PDL wait (DECODE_EARLY_INPUTS)
}
# Each knob (how a sequence is cut into partitions and merged) runs 3 cases: every dtype, every GQA group and
# both windows, rotated so that every pair of (knob, dtype, group, window) values meets in some case. The dtype
# (loads, the output's cast) and the group (the query-head tile) are the same code whatever the partitioning, so
# the full product (126 cases) checked nothing these 21 do not.
DECODE_CASES = [
    pytest.param(
        DTYPES[j], GROUPS[(j + k) % 3], (None, 24)[(j + k) % 2], knobs,
        id=f"{name}-g{GROUPS[(j + k) % 3]}-w{(None, 24)[(j + k) % 2]}-{str(DTYPES[j])[6:]}",
    )
    for k, (name, knobs) in enumerate(DECODE_KNOBS.items())
    for j in range(3)
]  # fmt: skip


@pytest.mark.parametrize(("dtype", "group", "sliding_window", "knobs"), DECODE_CASES)
def test_decode_matches_ref(
    dtype: torch.dtype, group: int, sliding_window: int | None, knobs: dict[str, Any], gen: torch.Generator
) -> None:
    cache, tables = paged_cache(DECODE_LENS, 16, NUM_KV_HEADS, HEAD_DIM, dtype, gen)
    seq_lens = torch.tensor(DECODE_LENS, dtype=torch.int32, device=DEVICE)
    query = _query(len(DECODE_LENS), NUM_KV_HEADS * group, dtype, gen)
    out = _paged_decode_attention(query, cache, tables, seq_lens, 0.17, sliding_window, block_n=16, **knobs)
    ref = paged_decode_attention_ref(query, cache, tables, seq_lens, 0.17, sliding_window)
    assert rel_err(out, ref) < tolerance(dtype), f"seed {gen.initial_seed()}"


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


def test_decode_default_at_batch_1(gen: torch.Generator) -> None:
    """Batch 1, 300 tokens, bf16: the public wrapper cuts 64-token partitions (8 SMs on CPU) and merges them in a
    second launch."""
    cache, tables = paged_cache([300], 16, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, gen)
    seq_lens = torch.tensor([300], dtype=torch.int32, device=DEVICE)
    query = _query(1, NUM_KV_HEADS * 4, torch.bfloat16, gen)
    plan = decode_plan.plan_decode(1, NUM_KV_HEADS, tables.shape[1] * 16, 8)
    assert plan.partition_size == 64 and plan.num_partitions == 5
    out = paged_decode_attention(query, cache, tables, seq_lens, 0.2)
    assert rel_err(out, paged_decode_attention_ref(query, cache, tables, seq_lens, 0.2)) < 1e-2


def test_partition_size_fills_the_sms_at_batch_1() -> None:
    """H200 (132 SMs), 8 KV heads: batch 1 gets between one and PROGRAMS_PER_SM programs per SM, each at
    least one KV tile long, with at most ~66 partitions to merge; big batches keep two partitions."""
    for seq_len in (1024, 8192, 32768, 131072):
        partition = decode_partition_size(1, 8, seq_len, 132, 64)
        num_programs = 8 * seq_len // partition
        assert partition >= 64 and partition & (partition - 1) == 0
        assert 0.9 * 132 <= num_programs <= 4 * 132 and seq_len // partition <= 66, (seq_len, partition)
    assert decode_partition_size(1, 8, 1024, 132, 128) == 128  # a block_n 128 tile: still one tile
    for batch, seq_len in [(64, 1024), (256, 32768)]:
        assert seq_len // decode_partition_size(batch, 8, seq_len, 132, 64) == 2


def test_fit_partition_size_fills_one_wave() -> None:
    """A whole number of tiles, at most programs_per_sm x SMs programs, and one partition once the batch alone
    fills them."""
    for seq_len, per_sm in [(8192, 3), (32768, 3), (32768, 4), (1024, 2)]:
        partition = decode_plan.fit_partition_size(1, 8, seq_len, 132, per_sm, 64)
        assert partition % 64 == 0 and 8 * -(-seq_len // partition) <= per_sm * 132, (seq_len, per_sm, partition)
        shorter = partition - 64
        assert partition == 64 or 8 * -(-seq_len // shorter) > per_sm * 132  # the shortest that fits
    assert decode_plan.fit_partition_size(1, 8, 8192, 132, 3, 64) == 192  # 43 partitions, not 64 of 128
    assert decode_plan.fit_partition_size(64, 8, 1024, 132, 4, 64) == 1024


def test_dynamic_plan_counts_partitions_not_tokens() -> None:
    """Dynamic partitions: the largest power of two that stays within PROGRAMS_PER_SM programs per SM (never more
    than the table has tiles), the same for an 8k- and a 128k-token table; batch 1's fit one merge chunk."""
    wanted = 64  # 4 * 132 // 8 = 66 programs per KV head, rounded down
    assert wanted <= decode_plan.PROGRAMS_PER_SM * 132 // 8 < 2 * wanted and wanted <= decode_plan.MERGE_CHUNK
    assert decode_plan.plan_decode(2, 8, 8192, 132, dynamic=True).num_partitions == 32  # 33 rounded down
    for max_len in (8192, 131072):
        plan = decode_plan.plan_decode(1, 8, max_len, 132, dynamic=True)
        assert plan.dynamic and plan.num_partitions == wanted
    assert decode_plan.plan_decode(1, 8, 256, 132, dynamic=True).num_partitions == 4  # 4 tiles of 64
    assert decode_plan.plan_decode(256, 8, 4096, 132, dynamic=True).num_partitions == 1
    with pytest.raises(ValueError, match="dynamic"):
        decode_plan.plan_decode(1, 8, 4096, 132, dynamic=True, partition_size=128)
    # the default rule: fixed partitions for small batches over short tables, dynamic past either bound
    assert not decode_plan.plan_decode(1, 8, 4096, 132).dynamic
    assert decode_plan.plan_decode(1, 8, 4096, 132).num_stages == decode_plan.SMALL_BATCH_TILE[1]
    long_table = decode_plan.plan_decode(1, 8, 131072, 132)  # a small batch, dynamic: deeper pipeline
    assert long_table.num_stages == decode_plan.SMALL_BATCH_DYNAMIC_STAGES
    assert decode_plan.plan_decode(1, 8, decode_plan.DYNAMIC_FROM_LEN, 132).dynamic
    assert decode_plan.plan_decode(decode_plan.SMALL_BATCH_MAX_SEQS + 1, 8, 1024, 132).dynamic


def test_fixed_plan_partitions() -> None:
    assert decode_plan.plan_decode(1, 8, 8192, 132, partition_size=8192).num_partitions == 1  # nothing to merge
    with pytest.raises(ValueError, match="multiple of block_n"):
        decode_plan.plan_decode(1, 8, 8192, 132, block_n=64, partition_size=96)


# (cached prefix, new tokens): a 1-token prompt, a full prefill, chunked prefills over a prefix that ends
# mid-block and on a block edge, and decode rows (q_len 1), all in one launch
PREFILL_ROWS = [(0, 1), (0, 23), (17, 9), (32, 16), (40, 1), (5, 1)]


# 12 cases, not the product's 36: case i takes dtype i % 3, (split_mask, window) i % 4 and group i // 4, so every
# pair of values meets (each mask mode and window at every dtype and every group; each dtype at every group). The
# split mask runs only without a window (SPLIT_MASK = split_mask and no window): cases 0, 4, 8, one per dtype
# and per group.
PREFILL_CASES = [
    pytest.param(
        DTYPES[i % 3], GROUPS[i // 4], (None, 10)[i % 2], (True, False)[i % 4 // 2],
        id=f"g{GROUPS[i // 4]}-w{(None, 10)[i % 2]}-{('split', 'masked')[i % 4 // 2]}-{str(DTYPES[i % 3])[6:]}",
    )
    for i in range(12)
]  # fmt: skip


@pytest.mark.parametrize(("dtype", "group", "sliding_window", "split_mask"), PREFILL_CASES)
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
