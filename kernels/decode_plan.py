"""How a paged decode-attention call is cut: KV tile and partitions of each sequence.

A pure function of shapes and the SM count (no device sync), so a CUDA-graph replay keeps the plan it was
captured with, and the tests check it on CPU by passing an H200's 132 SMs. The constants below are what an
H200 sweep (``python -m loadtest.kernels_bench --sweep``, whose variant names are in the comments) decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from kernels._triton import next_pow2

# Programs per SM the partitioning aims at (H200, 2026-11-29: ~4 beat ~8, whose last wave left SMs idle).
# It only matters for small batches: from 64 sequences up every choice gives the two-partition floor.
# The sweep row two_launch_p2 (partitions twice as long) is about 2.
PROGRAMS_PER_SM = 4
# Batches of at most this many sequences are "small": a decode call is short (7-60 us at batch 1), so a
# second launch and the pipeline prologue weigh.
SMALL_BATCH_MAX_SEQS = 16
# (block_n, num_stages) of small batches; large ones keep (64, 3). Sweep row two_launch_s2 is (64, 2): H200 sweep
# at 1b86deb (2026-12-01), B=1 L=1k/8k/32k, 0.97 / 0.83 / 0.88 of SDPA against (64, 3)'s 0.95 / 0.81 / 0.88.
SMALL_BATCH_TILE = (64, 2)
# Small batches over long tables (dynamic partitions) take 3 stages: H200 sweep (2026-12-04, row auto_s3, with
# the one-chunk merge) at batch 1, L = 32k 0.93 -> 0.97 of SDPA, 8k / 32k in 128k tables 0.955 / 0.930 -> 0.975 /
# 0.953; fixed partitions of 2 tiles (8k tables) kept 2 stages (0.965 against 0.945).
SMALL_BATCH_DYNAMIC_STAGES = 3
LARGE_BATCH_TILE = (64, 3)  # 128 was faster at B=256 but slower at B=64 (one program per SM at 3 stages)
# THE other switch: partitions cut each sequence's own length (read on the device) into as many pieces as fill
# PROGRAMS_PER_SM programs per SM, instead of a length fixed by the block table's width. A CUDA graph is captured
# for the longest context, so with fixed partitions a 128k-token --max-model-len cut a 1k-token sequence's decode
# into 2048-token partitions: one program per KV head. H200 sweep (gpu_session.sh t, bdb22e2, 2026-12-03), ratio to
# SDPA, fixed default -> dyn4: batch 1 with 128k-token tables at L = 1k / 8k / 32k 0.238 / 0.250 / 0.555 -> 0.915 /
# 0.786 / 0.847; batch 1 with tables as long as the sequence 0.976 / 0.853 / 0.894 -> 0.907 / 0.786 / 0.858 (the
# fixed kernel's constant partition length wins there); batches of 64 / 256 at L = 1k 0.906 / 0.910 -> 0.994 /
# 0.976 (one partition: the batch fills the SMs), 0.96-0.99 either way at 8k and 32k. So: dynamic for batches past
# SMALL_BATCH_MAX_SEQS, and for small ones once the table is DYNAMIC_FROM_LEN tokens wide (a graph's, for a long
# --max-model-len); None in plan_decode's knob means this rule, True / False force it.
DYNAMIC_FROM_LEN = 16384
# Partitions the second launch's merge loads at once (one [chunk, head_dim] fp32 tile per head; 64 x 128 is 64
# registers a thread at 4 warps). H200 sweep (kernels_bench, 2026-12-04, rows auto_rc*): at batch 1 the merge of a
# head's 64 partitions in chunks of 16 was four dependent L2 round trips after the partitions' launch; in one chunk
# the call went from 0.83 to 1.00 of SDPA at L = 8k and 0.84 -> 0.92 at 32k (0.76 -> 0.93 at 8k in 128k tables).
MERGE_CHUNK = 64


def use_dynamic(num_seqs: int, max_len: int) -> bool:
    return num_seqs > SMALL_BATCH_MAX_SEQS or max_len >= DYNAMIC_FROM_LEN


@dataclass(frozen=True)
class DecodePlan:
    """The tile and partitions of one decode call. One partition: one launch; several: a second launch merges them
    (the one-launch merge, by each (seq, KV head)'s last program, lost at 1b86deb and was removed)."""

    block_n: int
    num_stages: int
    partition_size: int
    num_partitions: int
    # partition_size is then only the tile granularity: each sequence's own length is cut in num_partitions
    dynamic: bool = False


@lru_cache(maxsize=8)
def num_sms(device_index: int) -> int:
    if not torch.cuda.is_available():
        return 8  # interpreter on CPU: any small number
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def decode_partition_size(num_seqs: int, num_kv_heads: int, max_len: int, sms: int, min_partition: int) -> int:
    """Power-of-two partition length so that the grid (seqs x KV heads x partitions) holds about
    PROGRAMS_PER_SM programs per SM, with at least ``min_partition`` tokens (one KV tile: a short batch-1
    decode fills the SMs instead of stopping at 128-token partitions) and at least two partitions past 512
    tokens. At batch 1 there are at most PROGRAMS_PER_SM * sms / num_kv_heads partitions (66 on an H200 with
    8 KV heads), which bounds the merge."""
    parts_wanted = max(1, -(-PROGRAMS_PER_SM * sms // (num_seqs * num_kv_heads)))
    partition = max(min_partition, next_pow2(-(-max_len // parts_wanted)))
    return max(min_partition, min(partition, max(256, next_pow2(max_len) // 2)))


def fit_partition_size(
    num_seqs: int, num_kv_heads: int, max_len: int, sms: int, programs_per_sm: int, block_n: int
) -> int:
    """The shortest whole number of KV tiles that cuts each sequence into at most ``programs_per_sm * sms`` /
    (seqs x KV heads) partitions: the grid fills that many program slots in one wave, with no power-of-two
    rounding and no two-partition minimum (the sweep's "fit*" rows)."""
    parts = max(1, programs_per_sm * sms // (num_seqs * num_kv_heads))
    per_part = -(-max_len // parts)
    return -(-per_part // block_n) * block_n


def plan_decode(
    num_seqs: int,
    num_kv_heads: int,
    max_len: int,
    sms: int,
    *,
    block_n: int | None = None,
    num_stages: int | None = None,
    partition_size: int | None = None,
    dynamic: bool | None = None,
    programs_per_sm: int | None = None,
) -> DecodePlan:
    """The defaults above for every knob left None (tests and the benchmark set them)."""
    tile = SMALL_BATCH_TILE if num_seqs <= SMALL_BATCH_MAX_SEQS else LARGE_BATCH_TILE
    block_n = block_n or tile[0]
    if dynamic is None:
        dynamic = partition_size is None and use_dynamic(num_seqs, max_len)
    if dynamic:
        if partition_size is not None:
            raise ValueError("dynamic partitions take no partition_size")
        per_sm = programs_per_sm or PROGRAMS_PER_SM
        parts = max(1, min(per_sm * sms // (num_seqs * num_kv_heads), -(-max_len // block_n)))
        parts = 1 << (parts.bit_length() - 1)  # a power of two: batch 1's 66 -> 64 fits one MERGE_CHUNK
        stages = num_stages or (SMALL_BATCH_DYNAMIC_STAGES if num_seqs <= SMALL_BATCH_MAX_SEQS else tile[1])
        return DecodePlan(block_n, stages, block_n, parts, True)
    if partition_size is None:
        partition_size = decode_partition_size(num_seqs, num_kv_heads, max_len, sms, block_n)
    if partition_size % block_n or partition_size < block_n:
        raise ValueError(f"partition_size {partition_size} must be a multiple of block_n {block_n}")
    num_partitions = max(1, -(-max_len // partition_size))
    return DecodePlan(block_n, num_stages or tile[1], partition_size, num_partitions)
