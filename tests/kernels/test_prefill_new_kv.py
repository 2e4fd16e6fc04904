"""Prefill attention with this step's K/V from contiguous tensors (kernels/prefill_new_kv.py) against its
torch reference, as the engine wires it (engine.attention: the fused rotary + cache write hands it the rotated
key and the value), and the paged kernel's launch-order knob. Under the interpreter the TMA path runs too
(host tensor descriptors are emulated); tests/kernels/test_gpu.py checks both paths at real sizes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import engine.attention
from engine.attention import AttentionMetadata, paged_attention, write_kv
from kernels.prefill_attention import _paged_prefill_attention, paged_prefill_attention_ref
from kernels.prefill_new_kv import (
    _SMEM_BUDGET,
    NEW_KV_BLOCK_N,
    NEW_KV_NUM_STAGES,
    _prefill_attention_new_kv,
    can_use_tma,
    default_kv_tile,
    prefill_attention_new_kv,
    prefill_attention_new_kv_ref,
)
from tests.kernels.helpers import DEVICE, paged_cache, rel_err, run_without_interpreter, tolerance

HEAD_DIM = 32
NUM_KV_HEADS = 2
# (cached prefix, new tokens): a 1-token prompt, full prefills shorter and longer than a tile, chunked
# prefills whose prefix ends mid-tile, on a tile edge and past several tiles, and decode rows (q_len 1)
ROWS = [(0, 1), (0, 23), (17, 9), (32, 24), (70, 19), (40, 1), (5, 1), (0, 37)]


def _batch(
    rows: list[tuple[int, int]], group: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, ...]:
    """Query, new key and value, a cache holding the prefixes and NaN in every new token's slot (so a
    kernel that reads a new token through the block table fails), tables, query_start_loc, seq_lens."""
    lens = [c + q for c, q in rows]
    cache, tables = paged_cache(lens, 16, NUM_KV_HEADS, HEAD_DIM, dtype, gen)
    q_lens = torch.tensor([q for _, q in rows])
    num_tokens = int(q_lens.sum())
    for i, (c, n) in enumerate(rows):
        pos = torch.arange(c, c + n, device=DEVICE)
        cache[:, tables[i].long()[pos // 16], pos % 16] = float("nan")
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    query = torch.randn(num_tokens, NUM_KV_HEADS * group, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    # key and value as views of one fused projection output, as the attention layer has them
    qkv = torch.randn(num_tokens, 2 * NUM_KV_HEADS + 1, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    key, value = qkv[:, 1 : 1 + NUM_KV_HEADS], qkv[:, 1 + NUM_KV_HEADS :]
    return query, key, value, cache, tables, query_start_loc, seq_lens


# every dtype, GQA group, window and load path, each pair of them at least once (the full product: 36 slow
# interpreter runs)
CASES = [
    (torch.float32, 1, None, True), (torch.float32, 4, 10, False), (torch.float32, 8, 10, True),
    (torch.bfloat16, 8, None, False), (torch.bfloat16, 4, None, True), (torch.bfloat16, 1, 10, False),
    (torch.float16, 4, 10, True), (torch.float16, 8, None, True), (torch.float16, 1, None, False),
]  # fmt: skip


@pytest.mark.parametrize(("dtype", "group", "sliding_window", "use_tma"), CASES)
def test_new_kv_mixed_batch_matches_ref(
    dtype: torch.dtype, group: int, sliding_window: int | None, use_tma: bool, gen: torch.Generator
) -> None:
    query, key, value, cache, tables, qsl, seq_lens = _batch(ROWS, group, dtype, gen)
    assert can_use_tma(key, value, 16)
    # block_m 32, block_n 16: several query tiles per sequence and several KV tiles of each source
    out = _prefill_attention_new_kv(
        query, key, value, cache, tables, qsl, seq_lens, 0.17, sliding_window, block_m=32, block_n=16,
        use_tma=use_tma,
    )  # fmt: skip
    ref = prefill_attention_new_kv_ref(query, key, value, cache, tables, qsl, seq_lens, 0.17, sliding_window)
    assert rel_err(out, ref) < tolerance(dtype), f"seed {gen.initial_seed()}"


@pytest.mark.parametrize(
    ("block_m", "block_n", "largest_first", "head_major"), [(64, 32, True, False), (32, 64, False, False),
                                                            (32, 32, True, True)]
)  # fmt: skip
def test_new_kv_tiles_and_order(
    block_m: int, block_n: int, largest_first: bool, head_major: bool, gen: torch.Generator
) -> None:
    """Other tiles, a prefix longer than the KV tile (several whole cached tiles), the three launch orders."""
    rows = [(0, 70), (50, 30), (130, 7), (3, 1)]
    query, key, value, cache, tables, qsl, seq_lens = _batch(rows, 4, torch.float32, gen)
    out = _prefill_attention_new_kv(
        query, key, value, cache, tables, qsl, seq_lens, 0.2, None, block_m=block_m, block_n=block_n,
        largest_first=largest_first, head_major=head_major,
    )  # fmt: skip
    ref = prefill_attention_new_kv_ref(query, key, value, cache, tables, qsl, seq_lens, 0.2)
    assert rel_err(out, ref) < tolerance(torch.float32), f"seed {gen.initial_seed()}"


def test_new_kv_writes_a_given_output(gen: torch.Generator) -> None:
    """``out``: the result lands in it (the engine passes a slice of the step's output)."""
    query, key, value, cache, tables, qsl, seq_lens = _batch(ROWS, 4, torch.float32, gen)
    out = torch.full((query.shape[0] + 3, *query.shape[1:]), 7.0, device=DEVICE)
    got = prefill_attention_new_kv(query, key, value, cache, tables, qsl, seq_lens, 0.2, out=out[: query.shape[0]])
    assert got.data_ptr() == out.data_ptr() and bool((out[query.shape[0] :] == 7.0).all())
    ref = prefill_attention_new_kv_ref(query, key, value, cache, tables, qsl, seq_lens, 0.2)
    assert rel_err(got, ref) < tolerance(torch.float32), f"seed {gen.initial_seed()}"
    with pytest.raises(ValueError, match="out must be"):
        prefill_attention_new_kv(query, key, value, cache, tables, qsl, seq_lens, 0.2, out=out)


def test_new_kv_public_wrapper_odd_head_dim(gen: torch.Generator) -> None:
    """head_dim 24 (no power of two): no TMA, the pointer path with padded columns."""
    lens = [50]
    cache, tables = paged_cache(lens, 16, NUM_KV_HEADS, 24, torch.float16, gen)
    qsl = torch.tensor([0, 30], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    query = torch.randn(30, NUM_KV_HEADS * 4, 24, generator=gen).to(torch.float16).to(DEVICE)
    key = torch.randn(30, NUM_KV_HEADS, 24, generator=gen).to(torch.float16).to(DEVICE)
    value = torch.randn(30, NUM_KV_HEADS, 24, generator=gen).to(torch.float16).to(DEVICE)
    assert not can_use_tma(key, value, 64)
    out = prefill_attention_new_kv(query, key, value, cache, tables, qsl, seq_lens, 0.2)
    ref = prefill_attention_new_kv_ref(query, key, value, cache, tables, qsl, seq_lens, 0.2)
    assert rel_err(out, ref) < 1e-2, f"seed {gen.initial_seed()}"
    with pytest.raises(ValueError, match="use_tma"):
        _prefill_attention_new_kv(query, key, value, cache, tables, qsl, seq_lens, 0.2, use_tma=True)


def test_new_kv_rejects_bad_inputs(gen: torch.Generator) -> None:
    query, key, value, cache, tables, qsl, seq_lens = _batch([(0, 5)], 4, torch.bfloat16, gen)
    with pytest.raises(ValueError, match="key must be"):
        prefill_attention_new_kv(query, key[:4], value, cache, tables, qsl, seq_lens, 0.1)
    with pytest.raises(ValueError, match="same strides"):
        prefill_attention_new_kv(query, key.contiguous(), value, cache, tables, qsl, seq_lens, 0.1)
    with pytest.raises(ValueError, match="scale"):
        prefill_attention_new_kv(query, key, value, cache, tables, qsl, seq_lens, -0.1)
    with pytest.raises(ValueError, match="query_start_loc"):
        prefill_attention_new_kv(query, key, value, cache, tables, seq_lens, seq_lens, 0.1)


@pytest.mark.parametrize(("group", "fma_softmax"), [(1, True), (4, False)])
def test_paged_largest_first_matches_ref(group: int, fma_softmax: bool, gen: torch.Generator) -> None:
    """The paged kernel launched longest tiles first (grid (kv_head, tile)), windowed and not, with either
    softmax step below the diagonal."""
    rows = [(0, 1), (0, 40), (17, 9), (33, 1)]
    lens = [c + q for c, q in rows]
    cache, tables = paged_cache(lens, 16, NUM_KV_HEADS, HEAD_DIM, torch.float32, gen)
    q_lens = torch.tensor([q for _, q in rows])
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    query = torch.randn(int(q_lens.sum()), NUM_KV_HEADS * group, HEAD_DIM, generator=gen).to(DEVICE)
    for window in (None, 12):
        out = _paged_prefill_attention(
            query, cache, tables, qsl, seq_lens, 0.17, window, block_m=16, block_n=16, largest_first=True,
            fma_softmax=fma_softmax,
        )  # fmt: skip
        ref = paged_prefill_attention_ref(query, cache, tables, qsl, seq_lens, 0.17, window)
        assert rel_err(out, ref) < tolerance(torch.float32), f"seed {gen.initial_seed()}"


def test_default_tile_is_the_sweep_winner_where_it_fits() -> None:
    """128 keys x 3 stages at head_dim <= 128 in 16 bits (the H200 sweep's row); smaller where shared memory
    would not hold it (fp32 or head_dim 256, an A100's 163 KiB)."""
    assert default_kv_tile(128, 2) == (NEW_KV_BLOCK_N, NEW_KV_NUM_STAGES) == (128, 3)
    assert default_kv_tile(64, 4) == default_kv_tile(80, 2) == (128, 3)
    assert default_kv_tile(128, 4) == default_kv_tile(256, 2) == (64, 2)
    assert default_kv_tile(128, 2, smem_budget=163 * 1024) == (64, 3)
    for head_dim, size in ((32, 4), (128, 2), (128, 4), (256, 2)):
        block_n, stages = default_kv_tile(head_dim, size)
        assert (2 * stages * block_n + 128) * max(16, head_dim) * size <= _SMEM_BUDGET


QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _cos_sin_cache(max_positions: int, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(max_positions).float(), inv_freq)  # [max_positions, head_dim / 2]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(DEVICE)  # [max_positions, head_dim]


def _engine_step(
    rows: list[tuple[int, int]], group: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, QKV, torch.Tensor, AttentionMetadata]:
    """A step as the ModelRunner and the model hand it to the attention layer: positions, q / k / v as views
    of one QKV output (not yet rotated), a cache holding the prefixes (NaN elsewhere) and the metadata, with
    one padding token (slot -1) past the last sequence."""
    lens = [c + q for c, q in rows]
    cache, tables = paged_cache(lens, 16, NUM_KV_HEADS, HEAD_DIM, dtype, gen)
    num_heads = NUM_KV_HEADS * group
    pos = [torch.arange(c, c + q) for c, q in rows]
    slots = [tables[i].cpu().long()[p // 16] * 16 + p % 16 for i, p in enumerate(pos)]
    positions = torch.cat([*pos, torch.zeros(1, dtype=torch.long)]).to(DEVICE)
    slot_mapping = torch.cat([*slots, torch.full((1,), -1)]).to(DEVICE)
    num_tokens = positions.shape[0]
    qkv = torch.randn(num_tokens, num_heads + 2 * NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv.split([num_heads, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)  # [T, heads, D] views, row stride QKV
    q_lens = torch.tensor([q for _, q in rows])
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32).to(DEVICE),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables,
        max_query_len=max(q for _, q in rows),
        max_seq_len=max(lens),
    )
    return positions, (q, k, v), cache, meta


def _layer(
    backend: str, positions: torch.Tensor, qkv: QKV, cache: torch.Tensor,
    meta: AttentionMetadata, window: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """What engine.layers.Attention.forward does, on ``backend``."""
    meta = dataclasses.replace(meta, backend=backend)
    cos_sin = _cos_sin_cache(256, HEAD_DIM)
    q, k, v = qkv
    query, new_kv = write_kv(positions, q, k, v, cos_sin, cache, meta)
    return paged_attention(query, cache, meta, 0.2, window, new_kv), new_kv


@pytest.mark.parametrize(("dtype", "group", "window"), [(torch.float32, 4, None), (torch.bfloat16, 2, 12)])
def test_engine_prefill_step_takes_new_kv_kernel(
    dtype: torch.dtype, group: int, window: int | None, monkeypatch: pytest.MonkeyPatch, gen: torch.Generator
) -> None:
    """A mixed step (full prompts, chunks after cached prefixes, a decode row, a padding token) on the Triton
    backend: write_kv hands the new K/V to prefill_attention_new_kv; output and cache equal the torch
    backend's (the references), and the inputs are left as they were."""
    monkeypatch.setattr(engine.attention, "PREFILL_KERNEL", "new_kv")  # the default; kept if it is flipped back
    positions, qkv, cache, meta = _engine_step([(0, 23), (17, 9), (40, 1), (32, 24)], group, dtype, gen)
    before = [t.clone() for t in qkv]
    ref_cache = cache.clone()
    ref, ref_new_kv = _layer("torch", positions, qkv, ref_cache, meta, window)
    out, new_kv = _layer("triton", positions, qkv, cache, meta, window)
    assert ref_new_kv is None and new_kv is not None and new_kv.shape == (2, positions.shape[0], NUM_KV_HEADS, HEAD_DIM)
    assert all(torch.equal(t, b) for t, b in zip(qkv, before, strict=True))
    n = int(meta.query_start_loc[-1])  # the padding row belongs to no sequence: its output is not defined
    assert rel_err(out[:n], ref[:n]) < tolerance(dtype), f"seed {gen.initial_seed()}"
    assert torch.equal(cache.isnan(), ref_cache.isnan())
    written = ~cache.isnan()
    assert rel_err(cache[written], ref_cache[written]) <= (1e-6 if dtype == torch.float32 else tolerance(dtype))


def test_engine_paged_switch_and_decode_step(monkeypatch: pytest.MonkeyPatch, gen: torch.Generator) -> None:
    """PREFILL_KERNEL = "paged" turns the prefill step back to the paged kernel (no new_kv); a decode-only step
    never builds new_kv; both equal the references."""
    positions, qkv, cache, meta = _engine_step([(0, 20), (33, 4)], 4, torch.float32, gen)
    monkeypatch.setattr(engine.attention, "PREFILL_KERNEL", "paged")
    ref, _ = _layer("torch", positions, qkv, cache.clone(), meta, None)
    out, new_kv = _layer("triton", positions, qkv, cache.clone(), meta, None)
    n = int(meta.query_start_loc[-1])
    assert new_kv is None and rel_err(out[:n], ref[:n]) < tolerance(torch.float32)
    monkeypatch.undo()
    positions, qkv, cache, meta = _engine_step([(20, 1), (36, 1)], 4, torch.float32, gen)
    meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping[:2])  # decode steps pad no token here
    positions, qkv = positions[:2], (qkv[0][:2], qkv[1][:2], qkv[2][:2])
    ref, _ = _layer("torch", positions, qkv, cache.clone(), meta, None)
    out, new_kv = _layer("triton", positions, qkv, cache.clone(), meta, None)
    assert meta.is_decode_only and new_kv is None and rel_err(out, ref) < tolerance(torch.float32)


@pytest.mark.parametrize(
    ("kernel", "dtype", "window"), [("new_kv", torch.bfloat16, None), ("paged", torch.float32, 12)]
)
def test_engine_mixed_step_with_decode_rows_split(
    kernel: str, dtype: torch.dtype, window: int | None, monkeypatch: pytest.MonkeyPatch, gen: torch.Generator
) -> None:
    """SPLIT_DECODE_ROWS: a mixed step's decode rows through the decode kernel, the rest through the prefill kernel;
    output and cache equal the torch backend's."""
    monkeypatch.setattr(engine.attention, "PREFILL_KERNEL", kernel)
    monkeypatch.setattr(engine.attention, "SPLIT_DECODE_ROWS", True)
    positions, qkv, cache, meta = _engine_step([(40, 1), (0, 23), (17, 9), (5, 1), (32, 24), (60, 1)], 4, dtype, gen)
    ref_cache = cache.clone()
    ref, _ = _layer("torch", positions, qkv, ref_cache, meta, window)
    out, _ = _layer("triton", positions, qkv, cache, meta, window)
    n = int(meta.query_start_loc[-1])
    assert rel_err(out[:n], ref[:n]) < tolerance(dtype), f"seed {gen.initial_seed()}"
    written = ~cache.isnan()
    assert rel_err(cache[written], ref_cache[written]) <= (1e-6 if dtype == torch.float32 else tolerance(dtype))


def test_prefill_kernels_do_not_specialize_on_the_steps_shapes() -> None:
    """The sequence count, block-table width and window change from step to step: were Triton to specialize
    on them (1 / divisible by 16 / other), a step whose pattern the warm-up missed would compile inside a
    request (b88266f). Read from the compiled JITFunctions, so in a process without the interpreter."""
    code = (
        "from kernels.prefill_new_kv import _prefill_new_kv_kernel as a\n"
        "from kernels.prefill_attention import _prefill_kernel as b\n"
        "for k in (a, b): print(' '.join(sorted(p.name for p in k.params if p.do_not_specialize)))\n"
    )
    out = run_without_interpreter(code)
    assert out.split("\n")[:2] == ["num_seqs sliding_window stride_bt"] * 2
