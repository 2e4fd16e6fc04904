"""Triton paged attention (decode and prefill) against the torch references."""

from __future__ import annotations

import gc
import json
import weakref
from typing import Any

import pytest
import torch

from kernels import decode_plan
from kernels.decode_plan import decode_partition_size
from kernels.paged_attention import (
    _COUNTERS,
    _arrival_counters,
    _paged_decode_attention,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from kernels.prefill_attention import _paged_prefill_attention, paged_prefill_attention, paged_prefill_attention_ref
from tests.kernels.helpers import DEVICE, paged_cache, rel_err, run_without_interpreter, tolerance

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEAD_DIM = 32
NUM_KV_HEADS = 2
# length 1, a partial first block, exactly one block, one past it, several blocks with a partial last one
DECODE_LENS = [1, 7, 16, 17, 100]


def _query(num_rows: int, num_heads: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(num_rows, num_heads, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)


GROUPS = [1, 4, 8]
# {}: one partition here; 32 (4 partitions): the reduce kernel (chunk2: its merge over two chunks); fused: the last program of each (seq, kv head)
# merges them; 48: three tiles, not a power of two; dynamic: each sequence's own length cut
# into the grid's partitions (3 here: 4 programs per SM of the interpreter's 8 "SMs", 5 sequences x 2 KV heads)
DECODE_KNOBS = {
    "one": {},
    "p32": {"partition_size": 32},
    "p32_fused": {"partition_size": 32, "fused_reduce": True},
    "p32_chunk2": {"partition_size": 32, "reduce_chunk": 2},
    "p48": {"partition_size": 48},
    "p48_fused": {"partition_size": 48, "fused_reduce": True},
    "dyn": {"dynamic": True},
    "dyn_fused": {"dynamic": True, "fused_reduce": True},
    "dyn16": {"dynamic": True, "programs_per_sm": 16},
}
# Each knob (how a sequence is cut into partitions and merged) runs 3 cases: every dtype, every GQA group and
# both windows, rotated so that every pair of (knob, dtype, group, window) values meets in some case. The dtype
# (loads, the output's cast) and the group (the query-head tile) are the same code whatever the partitioning, so
# the full product (162 cases, ~80 s under the interpreter) checked nothing these 27 do not.
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
    _assert_counters_zero(query.device)


def _assert_counters_zero(device: torch.device) -> None:
    """Every arrival counter is back at zero, so the next call (or graph replay) starts clean."""
    assert all(not buf.any() for buf in _COUNTERS.get(device, []))


def test_decode_fused_many_partitions_repeated(gen: torch.Generator) -> None:
    """16-token partitions: up to 9 per sequence, lengths that end mid-partition, on its edge, a sequence
    whose only token leaves every other partition empty, a window that hides whole partitions; called
    twice on the same counters. The merge reads the partitions in index order whoever merges, so the
    repeat is bitwise equal."""
    lens, sliding_window = [1, 16, 31, 130, 77], 40
    cache, tables = paged_cache(lens, 16, NUM_KV_HEADS, HEAD_DIM, torch.float32, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    query = _query(len(lens), NUM_KV_HEADS * 4, torch.float32, gen)
    ref = paged_decode_attention_ref(query, cache, tables, seq_lens, 0.17, sliding_window)
    outs = []
    for _ in range(2):
        outs.append(
            _paged_decode_attention(
                query,
                cache,
                tables,
                seq_lens,
                0.17,
                sliding_window,
                partition_size=16,
                block_n=16,
                fused_reduce=True,
            )  # fmt: skip
        )
        _assert_counters_zero(query.device)
    assert rel_err(outs[0], ref) < tolerance(torch.float32), f"seed {gen.initial_seed()}"
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_arrival_counters_keep_every_buffer() -> None:
    """A CUDA graph captured with the old buffer keeps its address: growing must not free it."""
    first = _arrival_counters(torch.device("cpu"), 8)
    alive = weakref.ref(first)
    grown = _arrival_counters(torch.device("cpu"), first.numel() + 1)
    del first
    gc.collect()
    assert grown.numel() > 8 and alive() is not None and not grown.any()
    assert _arrival_counters(torch.device("cpu"), 8) is grown  # later calls get the largest


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


@pytest.mark.parametrize("fused_max_seqs", [0, 16])
def test_decode_default_at_batch_1(fused_max_seqs: int, monkeypatch: pytest.MonkeyPatch, gen: torch.Generator) -> None:
    """Batch 1, 300 tokens, bf16: the public wrapper cuts 64-token partitions (8 SMs on CPU) and merges
    them where decode_plan.FUSED_REDUCE_MAX_SEQS says: in the last program, or in a second launch."""
    monkeypatch.setattr(decode_plan, "FUSED_REDUCE_MAX_SEQS", fused_max_seqs)
    cache, tables = paged_cache([300], 16, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, gen)
    seq_lens = torch.tensor([300], dtype=torch.int32, device=DEVICE)
    query = _query(1, NUM_KV_HEADS * 4, torch.bfloat16, gen)
    plan = decode_plan.plan_decode(1, NUM_KV_HEADS * 4, NUM_KV_HEADS, tables.shape[1] * 16, 8)
    assert plan.partition_size == 64 and plan.num_partitions == 5 and plan.fused_reduce == (fused_max_seqs > 0)
    out = paged_decode_attention(query, cache, tables, seq_lens, 0.2)
    assert rel_err(out, paged_decode_attention_ref(query, cache, tables, seq_lens, 0.2)) < 1e-2
    _assert_counters_zero(query.device)


# Compiles the fused decode kernel for sm_90 (no GPU needed) with the launcher's specialization of 16-aligned
# pointers and sizes, and prints its TTGIR: argv = constexprs (JSON).
_COMPILE_SM90 = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.paged_attention import _decode_partition_kernel as kernel

constexprs = json.loads(sys.argv[1])
types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "part_out_ptr": "*fp32",
         "part_stats_ptr": "*fp32", "scale_log2": "fp32", "kn_ptr": "*bf16", "vn_ptr": "*bf16",
         "cos_sin_ptr": "*fp32", "rope_pos_ptr": "*i64", "rope_slot_ptr": "*i64"}
names = kernel.arg_names
signature = {a: "constexpr" if a in constexprs else types.get(a, "*i32" if a.endswith("_ptr") else "i32")
             for a in names}
aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
           if a not in constexprs and a not in ("scale_log2", "sliding_window")}
compiled = triton.compile(ASTSource(kernel, signature, constexprs, aligned), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_stages": 3})
print(compiled.asm["ttgir"])
"""
_FUSED_8B = {
    "GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "BLOCK_SIZE": 16, "BLOCK_N": 64,
    "PARTITION_SIZE": 128, "SINGLE_PARTITION": False, "USE_WINDOW": False, "DOT_PRECISION": "tf32",
    "UPCAST": False, "FUSED_REDUCE": True, "CHUNK": 32, "DYNAMIC": False, "STEP_ROWS": False, "ROPE": False,
    "FENCE": False,
}  # fmt: skip


def test_fused_reduce_orders_partials_before_the_arrival() -> None:
    """Each warp stores its rows of the partial output; thread 0 alone issues the arrival atomic. Without
    a CTA barrier between them the last program may merge partials that another program's warps have yet
    to write (the race of int4_gemv's split-K). The interpreter cannot show it (programs run one by one,
    each op on the whole tile); the code compiled for sm_90 must have the barrier, an acq_rel GPU-scope
    arrival, and merge loads from L2 (.cg)."""
    ir = run_without_interpreter(_COMPILE_SM90, json.dumps(_FUSED_8B)).splitlines()
    arrival = next(i for i, line in enumerate(ir) if "tt.atomic_rmw add" in line)
    assert "acq_rel, gpu" in ir[arrival], ir[arrival]
    last_store = max(i for i in range(arrival) if "tt.store" in ir[i])
    assert any("barrier" in line for line in ir[last_store:arrival]), "\n".join(ir[last_store : arrival + 1])
    merge_loads = [line for line in ir[arrival:] if "tt.load" in line]
    assert merge_loads and all("cacheModifier = cg" in line for line in merge_loads), merge_loads


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
    assert decode_plan.plan_decode(2, 32, 8, 8192, 132, dynamic=True).num_partitions == 32  # 33 rounded down
    for max_len in (8192, 131072):
        plan = decode_plan.plan_decode(1, 32, 8, max_len, 132, dynamic=True)
        assert plan.dynamic and plan.num_partitions == wanted
    assert decode_plan.plan_decode(1, 32, 8, 256, 132, dynamic=True).num_partitions == 4  # 4 tiles of 64
    assert decode_plan.plan_decode(256, 32, 8, 4096, 132, dynamic=True).num_partitions == 1
    with pytest.raises(ValueError, match="dynamic"):
        decode_plan.plan_decode(1, 32, 8, 4096, 132, dynamic=True, partition_size=128)
    # the default rule: fixed partitions for small batches over short tables, dynamic past either bound
    assert not decode_plan.plan_decode(1, 32, 8, 4096, 132).dynamic
    assert decode_plan.plan_decode(1, 32, 8, 4096, 132).num_stages == decode_plan.SMALL_BATCH_TILE[1]
    long_table = decode_plan.plan_decode(1, 32, 8, 131072, 132)  # a small batch, dynamic: deeper pipeline
    assert long_table.num_stages == decode_plan.SMALL_BATCH_DYNAMIC_STAGES
    assert decode_plan.plan_decode(1, 32, 8, decode_plan.DYNAMIC_FROM_LEN, 132).dynamic
    assert decode_plan.plan_decode(decode_plan.SMALL_BATCH_MAX_SEQS + 1, 32, 8, 1024, 132).dynamic


def test_fused_reduce_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_plan, "FUSED_REDUCE_MAX_SEQS", 16)
    assert decode_plan.use_fused_reduce(1, 4, 64) and decode_plan.use_fused_reduce(16, 8, 64)
    assert not decode_plan.use_fused_reduce(17, 4, 64) and not decode_plan.use_fused_reduce(1, 4, 1)
    assert not decode_plan.use_fused_reduce(1, 32, 64)  # one KV head for 32 q heads: too big a merge for one program
    plan = decode_plan.plan_decode(1, 32, 8, 8192, 132, partition_size=8192, fused_reduce=True)
    assert plan.num_partitions == 1 and not plan.fused_reduce  # nothing to merge
    with pytest.raises(ValueError, match="multiple of block_n"):
        decode_plan.plan_decode(1, 32, 8, 8192, 132, block_n=64, partition_size=96)


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
