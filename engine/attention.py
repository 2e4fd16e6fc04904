"""Attention metadata (built once per step by the ModelRunner) and the paged attention backends.

Every attention layer receives the same ``AttentionMetadata`` explicitly through ``forward``; there is no
module-level state. The backend is the only thing that differs between CPU and GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kernels.decode_plan import SMALL_BATCH_MAX_SEQS
from kernels.paged_attention import paged_decode_attention_ref
from kernels.prefill_attention import paged_prefill_attention_ref
from kernels.rope_cache import rope_and_cache_ref

BACKENDS = ("torch", "triton")

# The Triton backend's kernel for steps that are not decode-only (prefill, chunked prefill, mixed):
# "new_kv" (kernels.prefill_new_kv: this step's K/V from the contiguous rows write_kv returns, TMA loads on
# sm_90+, only the cached prefix through the block table) or "paged" (kernels.prefill_attention: everything
# through the block table). H200 sweep (loadtest/kernels_bench.py --sweep --only prefill, 2026-12-01, commit
# 08973e7; 8B heads, bf16), TFLOP/s at 4k causal / 8k causal / 2k new after 2k cached: new_kv 461 / 539 / 390,
# paged 335 / 377 / 323, SDPA 536 / 617 / 282. `bench throughput --workload mixed`, each kernel twice in one run,
# alternating (gpu_session.sh 5, 2026-12-02, 9aaade3): new_kv 22.6 s, paged 17.8 s, new_kv 15.3 s, paged 15.4 s; the
# first two include compiling each kernel (first token 2.5 and 1.1 s against 0.19 and 0.18 s once compiled), so warm
# they are even on `mixed` and new_kv is the faster prefill kernel: the default. The engine's GPU tests pass with it
# (be5eba5, 43 passed). PAGEDSERVE_PREFILL_KERNEL=paged picks the other one (an A/B: loadtest/gpu_session.sh 5).
PREFILL_KERNEL = os.environ.get("PAGEDSERVE_PREFILL_KERNEL", "new_kv")
if PREFILL_KERNEL not in ("paged", "new_kv"):
    raise ValueError(f"PAGEDSERVE_PREFILL_KERNEL={PREFILL_KERNEL!r}: expected 'paged' or 'new_kv'")
# A step that mixes prefill chunks with decodes (Triton backend): the decode rows through the decode kernel
# (kernels.paged_attention.paged_decode_rows: which rows read on the device, so a prefill graph serves any mix)
# and the prefill kernel on the rest, instead of the prefill kernel's 128-row tiles for each one-token query. H200,
# `mixed` under loadtest/run_profile.py: prefill attention 0.837 s off (eeac913) and 0.497 s on (ae1ca49), decode
# attention 2.956 and 3.135 s, the device busy 13.80 and 13.60 s (two device calls, so not a same-run A/B); its
# first run after the warm-up took 14.29 s against 13.76 profiled: the split decode kernel's variants compiled
# inside it. The same-run A/B (gpu_session.sh sa, b57ed6b, one process a run): warm, 14.072 / 14.006 s on against
# 14.118 / 14.121 s off (0.3-0.8 %), the first run with it 16.686 s (its compiles). Off: too small a gain for
# the compiles a server's first mixed steps would pay without a warm-up over every decode-row plan.
SPLIT_DECODE_ROWS = os.environ.get("PAGEDSERVE_SPLIT_DECODE_ROWS", "0") == "1"
# A decode-only step (Triton backend) of at most this many sequences: the decode kernel rotates q and k and stores
# the new K/V itself (kernels.decode_rope), so the step has no rope + cache-write launch per layer. Bit-equal to the
# two launches on the H200 (2026-12-04, ee11650: 62 GPU tests, the engine's with it on; 24 seeds of 64 sequences).
# Same-run A/Bs there: batch-1 TPOT 4.307 / 4.277 ms on against 4.322 / 4.321 off, and 4.308 / 4.311 against 4.329
# / 4.327 in the suite; `mixed` (batches of up to 512) 13.957 / 13.945 s on against 13.916 / 13.913 off: every
# program of a sequence's partitions rotates its query again, which big batches pay for. In the concurrency sweep
# (9706444, two runs each): TPOT at 1 / 4 / 16 streams 4.208 / 4.553 / 5.011 ms on against 4.246-4.39 / 4.613 / 5.066
# off. So small batches only (SMALL_BATCH_MAX_SEQS of the decode plan); PAGEDSERVE_DECODE_ROPE_MAX_SEQS sets it (0: never).
DECODE_ROPE_MAX_SEQS = int(os.environ.get("PAGEDSERVE_DECODE_ROPE_MAX_SEQS", str(SMALL_BATCH_MAX_SEQS)))

# A prefill step's fresh prompts at its end (engine.inputs.fresh_suffix: no cached prefix, more than one token)
# through the Gluon kernel for Hopper (kernels.prefill_gluon: warp-specialized, FlashAttention-3's MMA overlap),
# the sequences before them through prefill_new_kv, each launch on its own slice of one output (a kernel that
# skipped the other's rows on the device would still launch idle programs for them: ~6 us a wave of them on the
# H200). Where the Gluon kernel cannot run (not sm_90, a sliding window, fp32, other head sizes or groups) and in
# the prefill graphs (any mix of rows, so no host split) prefill_new_kv takes every row. H200 (8B heads, bf16,
# 965d186), 4k / 8k causal: this path 585 / 664 TFLOP/s against SDPA's 533 / 605 (cuDNN) and prefill_new_kv's
# 457 / 513; `mixed` 13.903 / 14.044 s on against 14.126 / 14.164 s off (566a56c, one process a run, alternating).
# PAGEDSERVE_PREFILL_GLUON=0 turns it off.
PREFILL_GLUON = os.environ.get("PAGEDSERVE_PREFILL_GLUON", "1") == "1"
# A prefill step's leading one-token sequences (engine.inputs.leading_decode_rows: the running requests' decodes
# come first in a step) through the decode kernel on their slice, when there are at least this many: from the decode
# plan's large batches on, whose kernel variants the decode graphs' warm-up compiled (with the tables' widths aligned,
# engine.inputs.TABLE_WIDTH_ALIGN), so no step compiles one mid-run. Fewer rows stay with the prefill kernels.
# H200, `mixed` (gpu_session.sh dx, one process a run, alternating): 13.983 / 14.029 / 13.866 s on against 14.191 /
# 14.271 / 13.943 s off (cbd99ed, 4398876), and loadtest.compile_census finds nothing compiled after the warm-up.
# It does for eager steps what SPLIT_DECODE_ROWS (above) does on the device, without idle programs on either side;
# the prefill graphs (any mix of rows in one capture) cannot split on the host. PAGEDSERVE_DECODE_ROWS_MIN=0 turns
# it off.
DECODE_ROWS_MIN = int(os.environ.get("PAGEDSERVE_DECODE_ROWS_MIN", str(SMALL_BATCH_MAX_SEQS + 1))) or 1 << 62


@dataclass
class AttentionMetadata:
    """The flat batch of one step: sequences back to back, each contributing ``q_len`` new tokens."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token, -1 for padding
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: prefix sums of q_len
    seq_lens: torch.Tensor  # [num_seqs] int32: cached + new tokens per sequence
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    max_query_len: int  # 1 = decode-only step (CUDA graphs, decode kernel)
    max_seq_len: int
    backend: str = "torch"
    fresh: tuple[int, int] | None = None  # engine.inputs.fresh_suffix: (first sequence, first token), or None
    decode_rows: int = 0  # engine.inputs.leading_decode_rows of a step that is not decode-only

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def reads_new_kv(meta: AttentionMetadata) -> bool:
    """Whether this step's attention reads the new tokens' K/V from ``write_kv``'s contiguous copy (else from
    the cache only). Host-side facts only (no device sync)."""
    return meta.backend == "triton" and not meta.is_decode_only and PREFILL_KERNEL == "new_kv"


def fuses_rope(meta: AttentionMetadata) -> bool:
    """Whether this step's attention applies the rotary embedding and writes the new K/V itself
    (:func:`decode_with_rope`) instead of :func:`write_kv` + :func:`paged_attention`."""
    return meta.backend == "triton" and meta.is_decode_only and meta.num_seqs <= DECODE_ROPE_MAX_SEQS


def decode_with_rope(
    positions: torch.Tensor,  # [num_seqs] int64
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], not rotated
    key: torch.Tensor,  # [num_seqs, num_kv_heads, head_dim], not rotated
    value: torch.Tensor,  # [num_seqs, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """A decode step's rope, K/V write and attention in one kernel (``kernels.decode_rope``); the same bits
    as :func:`write_kv` then :func:`paged_attention`."""
    from kernels.decode_rope import DecodeRope, paged_decode_attention_rope

    rope = DecodeRope(positions, key, value, cos_sin_cache, meta.slot_mapping)
    return paged_decode_attention_rope(query, kv_cache, meta.block_tables, meta.seq_lens, scale, rope, sliding_window)


def write_kv(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rope on query and key, then this step's key and value into the cache at ``meta.slot_mapping``
    (one fused kernel on the Triton backend). Returns the rotated query and, where :func:`reads_new_kv`, the
    rotated key and the value as ``[2, num_tokens, num_kv_heads, head_dim]`` (written by the same kernel);
    otherwise ``None``: the rotated key lives only in the cache. Its inputs are read, never written."""
    if meta.backend == "triton":
        from kernels.rope_cache import rope_and_cache

        new_kv = None
        if reads_new_kv(meta):  # its size is the step's shape: nothing data-dependent for CUDA graphs
            new_kv = torch.empty((2, *key.shape), dtype=kv_cache.dtype, device=key.device)
        query = rope_and_cache(positions, query, key, value, cos_sin_cache, kv_cache, meta.slot_mapping, new_kv)
        return query, new_kv
    return rope_and_cache_ref(positions, query, key, value, cos_sin_cache, kv_cache, meta.slot_mapping), None


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], this step's K/V written
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    new_kv: torch.Tensor | None = None,  # [2, num_tokens, num_kv_heads, head_dim] from write_kv, or None
) -> torch.Tensor:
    """Attend through the block tables (this step's K/V from ``new_kv`` where given). Returns
    ``[num_tokens, num_heads, head_dim]``."""
    if meta.backend == "triton":
        from kernels.paged_attention import paged_decode_attention, paged_decode_rows
        from kernels.prefill_attention import paged_prefill_attention
        from kernels.prefill_gluon import engine_can_use
        from kernels.prefill_new_kv import prefill_attention_new_kv

        if meta.is_decode_only:
            return paged_decode_attention(query, kv_cache, meta.block_tables, meta.seq_lens, scale, sliding_window)
        tables, qsl, lens, split = meta.block_tables, meta.query_start_loc, meta.seq_lens, SPLIT_DECODE_ROWS
        gluon = (
            new_kv is not None
            and meta.fresh is not None
            and PREFILL_GLUON
            and engine_can_use(query, new_kv[0], sliding_window)
        )
        decode_rows = meta.decode_rows if meta.decode_rows >= DECODE_ROWS_MIN else 0
        if new_kv is not None and (gluon or decode_rows):
            out = _split_step(query, new_kv, kv_cache, meta, scale, sliding_window, decode_rows, gluon)
        elif new_kv is not None:
            out = prefill_attention_new_kv(
                query, new_kv[0], new_kv[1], kv_cache, tables, qsl, lens, scale, sliding_window, split
            )
        else:
            out = paged_prefill_attention(query, kv_cache, tables, qsl, lens, scale, sliding_window, split)
        if split:
            paged_decode_rows(query, kv_cache, tables, lens, qsl, scale, sliding_window, out)
        return out
    if meta.is_decode_only:
        return paged_decode_attention_ref(query, kv_cache, meta.block_tables, meta.seq_lens, scale, sliding_window)
    return paged_prefill_attention_ref(
        query, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, sliding_window
    )


def _split_step(
    query: torch.Tensor,
    new_kv: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    decode_rows: int,
    gluon: bool,
) -> torch.Tensor:
    """A prefill step cut by sequences into one output: its first ``decode_rows`` sequences (one token each)
    through the decode kernel, its trailing fresh prompts (``meta.fresh``, when ``gluon``) through the Gluon
    kernel, the sequences between through prefill_new_kv (decode rows there left to ``paged_decode_rows`` with
    SPLIT_DECODE_ROWS)."""
    from kernels.paged_attention import paged_decode_attention
    from kernels.prefill_gluon import prefill_attention_gluon
    from kernels.prefill_new_kv import prefill_attention_new_kv

    d = decode_rows
    key, value = new_kv[0], new_kv[1]
    tables, qsl, lens = meta.block_tables, meta.query_start_loc, meta.seq_lens
    seq0, tok0 = meta.fresh if gluon and meta.fresh is not None else (meta.num_seqs, query.shape[0])
    out = torch.empty_like(query)
    if d > 0:  # one token each: sequence i is row i
        paged_decode_attention(query[:d], kv_cache, tables[:d], lens[:d], scale, sliding_window, out=out[:d])
    if seq0 > d:
        # new tensors for the offsets and lengths: a slice of seq_lens starts 16-byte aligned only when d % 4 == 0,
        # and Triton compiles a variant for an unaligned pointer (the H200's first `mixed` run did, mid-run)
        between = qsl[d : seq0 + 1] - d if d > 0 else qsl[: seq0 + 1]
        between_lens = lens[d:seq0].clone() if d > 0 else lens[:seq0]
        prefill_attention_new_kv(
            query[d:tok0], key[d:tok0], value[d:tok0], kv_cache, tables[d:seq0], between, between_lens, scale,
            sliding_window, SPLIT_DECODE_ROWS, out=out[d:tok0],
        )  # fmt: skip
    if gluon:
        prefill_attention_gluon(query, key, value, qsl, scale, out=out, first=(seq0, tok0))
    return out
