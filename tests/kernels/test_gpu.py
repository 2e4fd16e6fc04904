"""The kernels at real sizes on a GPU (skipped without CUDA)."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch

from kernels.decode_plan import num_sms, plan_decode
from kernels.paged_attention import _paged_decode_attention, paged_decode_attention, paged_decode_attention_ref
from kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from tests.kernels.helpers import capture_graph, paged_cache, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _step_inputs(
    rows: list[tuple[int, int]], gen: torch.Generator, device: str = "cuda"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step at the 8B heads (32 query, 8 KV, head_dim 128), bf16, from its ``(cached prefix, new tokens)``
    rows: the paged cache and its tables (16-token blocks), query_start_loc, seq_lens and a random query."""
    lens = [c + q for c, q in rows]
    cache, tables = paged_cache(lens, 16, 8, 128, torch.bfloat16, gen)
    q_lens = torch.tensor([q for _, q in rows])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    query = torch.randn(int(q_lens.sum()), 32, 128, generator=gen).to(torch.bfloat16).to(device)
    return cache, tables, query_start_loc, seq_lens, query


@pytest.mark.parametrize("lens", [[1, 1000, 4097, 8192], [131072]])
@pytest.mark.parametrize("sliding_window", [None, 4096])
def test_decode_real_sizes(lens: list[int], sliding_window: int | None, gen: torch.Generator) -> None:
    cache, tables = paged_cache(lens, 16, 8, 128, torch.bfloat16, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    query = torch.randn(len(lens), 32, 128, generator=gen).to(torch.bfloat16).cuda()
    ref = paged_decode_attention_ref(query, cache, tables, seq_lens, 128**-0.5, sliding_window)
    out = _paged_decode_attention(query, cache, tables, seq_lens, 128**-0.5, sliding_window)
    assert rel_err(out, ref) < 1e-2, f"seed {gen.initial_seed()}"
    assert paged_decode_attention(query, cache, tables, seq_lens, 128**-0.5, sliding_window).shape == out.shape


@pytest.mark.parametrize("sliding_window", [None, 1000])
def test_decode_batch1_in_cuda_graph(sliding_window: int | None, gen: torch.Generator) -> None:
    """Batch 1, 8k tokens (an 8B model's heads), many partitions: equal to the reference eagerly and in a
    CUDA graph replayed twice; the replays equal the eager call bit for bit."""
    cache, tables = paged_cache([8192], 16, 8, 128, torch.bfloat16, gen)
    seq_lens = torch.tensor([8192], dtype=torch.int32, device="cuda")
    query = torch.randn(1, 32, 128, generator=gen).to(torch.bfloat16).cuda()
    plan = plan_decode(1, 8, tables.shape[1] * 16, num_sms(query.device.index or 0))
    assert plan.num_partitions >= 8
    scale = 128**-0.5
    decode = partial(_paged_decode_attention, query, cache, tables, seq_lens, scale, sliding_window)
    eager = decode()
    assert rel_err(eager, paged_decode_attention_ref(query, cache, tables, seq_lens, scale, sliding_window)) < 1e-2
    graph, captured = capture_graph(decode)
    for _ in range(2):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
    query.copy_(torch.randn(1, 32, 128, generator=gen).to(torch.bfloat16))  # the graph reads the new query
    graph.replay()
    ref = paged_decode_attention_ref(query, cache, tables, seq_lens, scale, sliding_window)
    assert rel_err(captured, ref) < 1e-2, f"seed {gen.initial_seed()}"


@pytest.mark.parametrize("sliding_window", [None, 700])
def test_prefill_real_sizes(sliding_window: int | None, gen: torch.Generator) -> None:
    rows = [(0, 2048), (1000, 517), (3000, 1), (0, 1)]  # (cached prefix, new tokens)
    cache, tables, query_start_loc, seq_lens, query = _step_inputs(rows, gen)
    out = paged_prefill_attention(query, cache, tables, query_start_loc, seq_lens, 128**-0.5, sliding_window)
    ref = paged_prefill_attention_ref(query, cache, tables, query_start_loc, seq_lens, 128**-0.5, sliding_window)
    assert rel_err(out, ref) < 1e-2, f"seed {gen.initial_seed()}"


@pytest.mark.parametrize("rows", [1, 7, 256])
def test_argmax_real_vocab(rows: int, gen: torch.Generator) -> None:
    from kernels.argmax import argmax, argmax_ref

    x = torch.randn(rows, 128256, generator=gen).cuda()
    x[0, 70000:] = x[0].max() + 1  # the maximum repeated: the first one wins
    if rows > 1:
        x[1, 99999] = float("nan")
    assert torch.equal(argmax(x), argmax_ref(x))
    half = x.to(torch.bfloat16)
    assert torch.equal(argmax(half), argmax_ref(half))


def test_silu_and_mul_real_size(gen: torch.Generator) -> None:
    from kernels.activation import silu_and_mul, silu_and_mul_ref

    x = torch.randn(4096, 2 * 14336, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    assert rel_err(silu_and_mul(x), silu_and_mul_ref(x)) < 1e-2


@pytest.mark.parametrize("rows", [1, 8192])
def test_rms_norm_real_size(rows: int, gen: torch.Generator) -> None:
    from kernels.norm import rms_norm, rms_norm_ref

    x, residual = (torch.randn(rows, 4096, generator=gen).to(device="cuda", dtype=torch.bfloat16) for _ in range(2))
    weight = (1.0 + 0.1 * torch.randn(4096, generator=gen)).to(device="cuda", dtype=torch.bfloat16)
    out, res_out = rms_norm(x, weight, 1e-5, residual)
    ref, res_ref = rms_norm_ref(x, weight, 1e-5, residual)
    assert torch.equal(res_out, res_ref)
    assert rel_err(out, ref) < 1e-2


def test_mixed_step_split_real_sizes(gen: torch.Generator) -> None:
    """A mixed step at the 8B heads, bf16: 300 decode rows (contexts 1-4000) around two prefill chunks, the decode
    rows through paged_decode_rows (dynamic partitions: over 16 sequences), the rest through the new_kv kernel
    with skip_decode_rows; every row against the prefill reference."""
    from kernels.paged_attention import paged_decode_rows
    from kernels.prefill_new_kv import prefill_attention_new_kv
    from loadtest.prefill_bench import new_kv_from_cache

    lens_rng = torch.randint(1, 4000, (300,), generator=gen).tolist()
    rows = [(n - 1, 1) for n in lens_rng[:150]] + [(1000, 517)] + [(n - 1, 1) for n in lens_rng[150:]] + [(0, 700)]
    cache, tables, qsl, seq_lens, query = _step_inputs(rows, gen)
    key, value = new_kv_from_cache(cache, tables, rows)
    out = prefill_attention_new_kv(query, key, value, cache, tables, qsl, seq_lens, 0.088, skip_decode_rows=True)
    paged_decode_rows(query, cache, tables, seq_lens, qsl, 0.088, None, out)
    ref = paged_prefill_attention_ref(query, cache, tables, qsl, seq_lens, 0.088)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("sliding_window", [None, 700])
@pytest.mark.parametrize("use_tma", [True, False])
def test_prefill_new_kv_real_sizes(sliding_window: int | None, use_tma: bool, gen: torch.Generator) -> None:
    """This step's K/V from contiguous tensors (views of a fused projection output, as the layer has them):
    TMA on the GPU (host tensor descriptors) and the pointer path, a full prefill, a chunk after a prefix
    that ends mid-tile, decode rows; the cache's new-token slots hold NaN, so reading them fails."""
    from kernels.prefill_new_kv import _prefill_attention_new_kv, can_use_tma, prefill_attention_new_kv_ref

    rows = [(0, 2048), (1000, 517), (3000, 1), (0, 1)]  # (cached prefix, new tokens)
    lens = [c + q for c, q in rows]
    cache, tables = paged_cache(lens, 16, 8, 128, torch.bfloat16, gen)
    q_lens = torch.tensor([q for _, q in rows])
    for i, (c, n) in enumerate(rows):
        pos = torch.arange(c, c + n, device="cuda")
        cache[:, tables[i].long()[pos // 16], pos % 16] = float("nan")
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32).cuda()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    num_tokens = int(q_lens.sum())
    query = torch.randn(num_tokens, 32, 128, generator=gen).to(torch.bfloat16).cuda()
    qkv = torch.randn(num_tokens, 32 + 16, 128, generator=gen).to(torch.bfloat16).cuda()
    key, value = qkv[:, 32:40], qkv[:, 40:]
    assert can_use_tma(key, value, 64)
    args = (query, key, value, cache, tables, query_start_loc, seq_lens, 128**-0.5, sliding_window)
    ref = prefill_attention_new_kv_ref(*args)
    knob_sets: list[dict[str, Any]] = [{}, {"block_m": 64, "num_warps": 4}, {"block_n": 128, "num_stages": 2}]
    for knobs in knob_sets:
        out = _prefill_attention_new_kv(*args, use_tma=use_tma, **knobs)
        assert rel_err(out, ref) < 1e-2, f"{knobs} seed {gen.initial_seed()}"


def test_prefill_paged_largest_first_real_sizes(gen: torch.Generator) -> None:
    """The paged kernel's sweep knobs at real sizes: longest tiles first, 128 rows x 8 warps, 3 stages."""
    from kernels.prefill_attention import _paged_prefill_attention

    rows = [(0, 2048), (1000, 517), (3000, 1), (0, 1)]
    cache, tables, query_start_loc, seq_lens, query = _step_inputs(rows, gen)
    ref = paged_prefill_attention_ref(query, cache, tables, query_start_loc, seq_lens, 128**-0.5)
    knob_sets: list[dict[str, Any]] = [
        {"largest_first": True, "fma_softmax": True},
        {"block_m": 128, "num_warps": 8, "num_stages": 3, "largest_first": True},
    ]
    for knobs in knob_sets:
        out = _paged_prefill_attention(query, cache, tables, query_start_loc, seq_lens, 128**-0.5, **knobs)
        assert rel_err(out, ref) < 1e-2, f"{knobs} seed {gen.initial_seed()}"


# ---- kernels.gemv: the dense GEMV of a few rows ----

GEMV_SHAPES_8B = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # qkv, o, gate_up, down


def _cuda_randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    cuda_gen = torch.Generator(device="cuda").manual_seed(gen.initial_seed())
    return torch.randn(*shape, generator=cuda_gen, device="cuda").to(torch.bfloat16)


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_gemv_real_sizes(m: int, gen: torch.Generator) -> None:
    """The 8B projections in bf16: each kernel's default launch and each split reduction (bias on qkv)."""
    from kernels.gemv import GemvConfig, gemv, gemv_ref, scratch_is_zero

    configs = [
        GemvConfig(), GemvConfig(kernel="fma"), GemvConfig(kernel="dot"),
        GemvConfig(kernel="fma", split_k=4), GemvConfig(kernel="dot", split_k=4, split_reduce="atomic"),
        GemvConfig(kernel="dot", split_k=3, split_reduce="two_pass"), GemvConfig(kernel="fma", pdl=True),
        GemvConfig(kernel="dot", split_k=4, pdl=True),
    ]  # fmt: skip
    for n, k in GEMV_SHAPES_8B:
        w, x = _cuda_randn(gen, n, k), _cuda_randn(gen, m, k)
        b = _cuda_randn(gen, n) if n == 6144 else None
        ref = gemv_ref(x, w, b)
        for cfg in configs:
            assert rel_err(gemv(x, w, b, cfg), ref) < 1e-2, f"{n}x{k} {cfg} seed {gen.initial_seed()}"
        assert scratch_is_zero()


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("split_reduce", ["counter", "atomic", "two_pass", None])  # None: the default launch
@pytest.mark.parametrize("pdl", [False, True])
def test_gemv_in_cuda_graph(m: int, split_reduce: str | None, pdl: bool, gen: torch.Generator) -> None:
    """down_proj (K = 14336) with a bias, captured in a CUDA graph and replayed: equal to the eager call (bit
    for bit where the reduction is deterministic), the counters back at zero, then a new x read (with
    programmatic dependent launch: written by the kernel just before)."""
    from kernels.gemv import GemvConfig, gemv, gemv_ref, scratch_is_zero

    split = {"split_k": 4, "split_reduce": split_reduce} if split_reduce else {}
    cfg = GemvConfig(pdl=pdl, **split)  # type: ignore[arg-type]
    w, x, b = _cuda_randn(gen, 4096, 14336), _cuda_randn(gen, m, 14336), _cuda_randn(gen, 4096)
    eager = gemv(x, w, b, cfg)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemv(x, w, b, cfg)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gemv(x, w, b, cfg)
    for _ in range(2):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert scratch_is_zero()
        if split_reduce == "atomic":
            assert rel_err(captured, eager) < 1e-2
        else:
            assert torch.equal(captured, eager)
    x.copy_(_cuda_randn(gen, m, 14336) * 2)
    graph.replay()
    assert rel_err(captured, gemv_ref(x, w, b)) < 1e-2, f"seed {gen.initial_seed()}"
    x2 = torch.empty_like(x)
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph2):  # x2 written by the kernel right before the GEMV
        torch.mul(x, 3.0, out=x2)
        captured2 = gemv(x2, w, b, cfg)
    graph2.replay()
    assert rel_err(captured2, gemv_ref(x * 3.0, w, b)) < 1e-2, f"seed {gen.initial_seed()}"


def test_dense_linear_with_gemv_in_decode_graphs(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the dense layers call, with the GEMV switched on for M <= 8: one graph per batch size 8..1 in
    one memory pool (as engine.cuda_graphs captures them, each size run eagerly first), every replay equal
    to the reference for new inputs."""
    from kernels import gemv as gemv_mod
    from kernels import gemv_plan

    monkeypatch.setattr(gemv_plan, "GEMV_MAX_M", 8)
    w, b = _cuda_randn(gen, 4096, 14336), _cuda_randn(gen, 4096)
    x = torch.zeros(8, 14336, dtype=torch.bfloat16, device="cuda")
    graphs, outs, pool = {}, {}, None
    for bs in range(8, 0, -1):
        assert gemv_mod.plan_gemv(bs, 4096, 14336, num_sms(0)).use_gemv
        for _ in range(2):
            gemv_mod.linear(x[:bs], w, b)
        torch.cuda.synchronize()
        graphs[bs] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[bs], pool=pool):
            outs[bs] = gemv_mod.linear(x[:bs], w, b)
        pool = graphs[bs].pool()
    for bs in (1, 3, 8, 2):
        x.copy_(_cuda_randn(gen, 8, 14336))
        graphs[bs].replay()
        assert rel_err(outs[bs], gemv_mod.gemv_ref(x[:bs], w, b)) < 1e-2, f"bs {bs} seed {gen.initial_seed()}"
    assert gemv_mod.scratch_is_zero()


@pytest.mark.parametrize("m", [1, 8])
def test_gemv_gated_real_size(m: int, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """down_proj reading gate_up's output ``x2 [M, 2 * 14336]`` (bf16, bias): each kernel and reduction
    against the reference; bit-equal to ``gemv`` / ``linear`` of the Triton activation (same ops, same
    order); ``linear_gated`` is ``F.linear`` of the activation where ``linear`` would call cuBLAS."""
    from kernels import gemv as gemv_mod
    from kernels import gemv_plan
    from kernels.activation import silu_and_mul
    from kernels.gemv import GemvConfig, gemv, gemv_gated, gemv_gated_ref, linear_gated, scratch_is_zero

    w, x2, b = _cuda_randn(gen, 4096, 14336), _cuda_randn(gen, m, 2 * 14336), _cuda_randn(gen, 4096)
    ref = gemv_gated_ref(x2, w, b)
    configs = [
        GemvConfig(), GemvConfig(kernel="fma"), GemvConfig(kernel="dot"), GemvConfig(kernel="fma", split_k=4),
        GemvConfig(kernel="dot", split_k=4, split_reduce="atomic"),
        GemvConfig(kernel="dot", split_k=3, split_reduce="two_pass"),
    ]  # fmt: skip
    for cfg in configs:
        assert rel_err(gemv_gated(x2, w, b, cfg), ref) < 1e-2, f"{cfg} seed {gen.initial_seed()}"
    assert scratch_is_zero()
    fma = GemvConfig(kernel="fma", split_k=1)
    act = silu_and_mul(x2)
    assert torch.equal(gemv_gated(x2, w, b, fma), gemv(act, w, b, fma))
    monkeypatch.setattr(gemv_plan, "GEMV_MAX_M", 8)  # the GEMV (the default plan, deterministic)
    assert torch.equal(linear_gated(x2, w, b), gemv_mod.linear(act, w, b))
    monkeypatch.setattr(gemv_plan, "GEMV_MAX_M", 0)  # cuBLAS
    assert torch.equal(linear_gated(x2, w, b), torch.nn.functional.linear(act, w, b))


# ---- engine.attention: the fused rotary + cache write feeding prefill_attention_new_kv ----


def _prefill_step_8b(rows: list[tuple[int, int]], num_padding: int, gen: torch.Generator) -> tuple[Any, ...]:
    """A mixed step at Llama 3 8B's attention shape (32 q heads, 8 kv heads, head_dim 128, bf16) as the layer
    gets it: positions, q / k / v views of one QKV output (not yet rotated), a cache holding the prefixes (NaN
    elsewhere), a cos/sin cache and the metadata; ``num_padding`` tokens (slot -1) after the last sequence."""
    from engine.attention import AttentionMetadata

    lens = [c + q for c, q in rows]
    cache, tables = paged_cache(lens, 16, 8, 128, torch.bfloat16, gen)
    pos = [torch.arange(c, c + q) for c, q in rows]
    slots = [tables[i].cpu().long()[p // 16] * 16 + p % 16 for i, p in enumerate(pos)]
    positions = torch.cat([*pos, torch.zeros(num_padding, dtype=torch.long)]).cuda()
    slot_mapping = torch.cat([*slots, torch.full((num_padding,), -1)]).cuda()
    qkv = _cuda_randn(gen, positions.shape[0], 48, 128)  # [T, 32 + 8 + 8, 128]
    inv_freq = 1.0 / (5e5 ** (torch.arange(0, 128, 2).float() / 128))
    angles = torch.outer(torch.arange(max(lens)).float(), inv_freq)  # [max_len, 64]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).cuda()  # [max_len, 128]
    q_lens = torch.tensor([q for _, q in rows])
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32).cuda(),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
        block_tables=tables,
        max_query_len=max(q for _, q in rows),
        max_seq_len=max(lens),
        backend="triton",
    )
    return positions, qkv, cache, cos_sin, meta


def _attention_layer(positions: Any, qkv: Any, cache: Any, cos_sin: Any, meta: Any, window: int | None) -> Any:
    """What engine.layers.Attention.forward does (the model's q / k / v views of the QKV output)."""
    from engine.attention import paged_attention, write_kv

    q, k, v = qkv[:, :32], qkv[:, 32:40], qkv[:, 40:]
    query, new_kv = write_kv(positions, q, k, v, cos_sin, cache, meta)
    return paged_attention(query, cache, meta, 128**-0.5, window, new_kv), new_kv


@pytest.mark.parametrize("sliding_window", [None, 700])
def test_engine_prefill_new_kv_at_8b_shape(
    sliding_window: int | None, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """write_kv + paged_attention on the Triton backend (the rotated key and the value handed to
    prefill_attention_new_kv, TMA on sm_90+) for full prompts, chunks after cached prefixes (mid-tile and
    several tiles long), decode rows and padding tokens: equal to the torch backend (the references)."""
    import dataclasses

    import engine.attention
    from kernels.prefill_new_kv import can_use_tma

    monkeypatch.setattr(engine.attention, "PREFILL_KERNEL", "new_kv")
    rows = [(0, 1500), (1000, 517), (3000, 1), (0, 1), (37, 300), (2048, 256)]  # (cached prefix, new tokens)
    positions, qkv, cache, cos_sin, meta = _prefill_step_8b(rows, 5, gen)
    ref_cache = cache.clone()
    ref, _ = _attention_layer(
        positions, qkv, ref_cache, cos_sin, dataclasses.replace(meta, backend="torch"), sliding_window
    )
    out, new_kv = _attention_layer(positions, qkv, cache, cos_sin, meta, sliding_window)
    assert new_kv is not None and can_use_tma(new_kv[0], new_kv[1], 128) == (torch.cuda.get_device_capability()[0] >= 9)
    n = int(meta.query_start_loc[-1])  # padding rows belong to no sequence
    assert rel_err(out[:n], ref[:n]) < 1e-2, f"seed {gen.initial_seed()}"
    written = ~ref_cache.isnan()
    assert torch.equal(cache.isnan(), ref_cache.isnan())
    assert rel_err(cache[written], ref_cache[written]) < 1e-2


def test_engine_prefill_new_kv_in_cuda_graph(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same path captured in a CUDA graph (as engine.prefill_graphs captures a padded step) and replayed on
    new q / k / v: equal to the eager call on them, bit for bit (no host sync, nothing data-dependent)."""
    import engine.attention

    monkeypatch.setattr(engine.attention, "PREFILL_KERNEL", "new_kv")
    positions, qkv, cache, cos_sin, meta = _prefill_step_8b([(0, 200), (300, 40), (50, 1)], 16, gen)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _attention_layer(positions, qkv, cache, cos_sin, meta, None)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = _attention_layer(positions, qkv, cache, cos_sin, meta, None)
    qkv.copy_(torch.randn_like(qkv))  # new inputs in the captured buffer
    graph.replay()
    replayed = captured.clone()
    eager, _ = _attention_layer(positions, qkv, cache, cos_sin, meta, None)
    n = int(meta.query_start_loc[-1])
    assert torch.equal(replayed[:n], eager[:n])
