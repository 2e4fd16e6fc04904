"""On CUDA (skipped elsewhere): the Triton backend reproduces HF transformers, CUDA graphs (with the logits
inside them) change nothing, and the fused rotary + cache write equals its reference at the 8B shape."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.inputs import StepInputs
from engine.model_runner import ModelRunner
from tests.helpers import VOCAB_SIZE, build_tiny_model, load_hf_model, one_seq_metadata

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SHAPE: dict[str, Any] = dict(
    hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=32
)


def prompts(n: int = 12) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(1, 90))] for _ in range(n)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("gpu"), "llama", seed=4, num_hidden_layers=3, **SHAPE)


@pytest.fixture(scope="module")
def folder128(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """head_dim 128 and 4 query heads per KV head (the 8B's): bf16 prefill steps send their fresh prompts to the
    Gluon kernel on sm_90 (engine.attention.PREFILL_GLUON)."""
    shape = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=1, head_dim=128)
    return build_tiny_model(tmp_path_factory.mktemp("gpu128"), "llama", seed=5, num_hidden_layers=2, **shape)


def engine_tokens(folder: Path, **kwargs: object) -> list[list[int]]:
    llm = LLM(str(folder), device="cuda", max_model_len=256, gpu_memory_utilization=0.3, **kwargs)  # type: ignore[arg-type]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], SamplingParams(temperature=0, max_tokens=16))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    ("async_scheduling", "decode_rows_min"), [(False, None), (True, None), (False, 1)], ids=["sync", "async", "split"]
)
def test_fp32_greedy_equals_hf_on_gpu(
    folder: Path, async_scheduling: bool, decode_rows_min: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``split``: every prefill step's leading decode rows through the decode kernel (engine.attention.
    DECODE_ROWS_MIN, 17 by default, more rows than this test's 12 requests ever decode at once)."""
    if decode_rows_min is not None:
        import engine.attention

        monkeypatch.setattr(engine.attention, "DECODE_ROWS_MIN", decode_rows_min)
    hf = load_hf_model(folder).cuda()
    expected = []
    for ids in prompts():
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]).cuda(), max_new_tokens=16, do_sample=False, pad_token_id=0)
        expected.append(gen[0, len(ids) :].tolist())
    got = engine_tokens(folder, dtype="float32", max_num_batched_tokens=64, async_scheduling=async_scheduling)
    assert got == expected


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_async_scheduling_equals_sync_on_gpu(folder: Path, dtype: str) -> None:
    """The step in flight hands its sampled ids to the next step on the device (pinned copy, event): the same
    tokens as synchronous steps, with CUDA graphs, chunked prefill and a batch that changes every step."""
    sync = engine_tokens(folder, dtype=dtype, max_num_batched_tokens=64, async_scheduling=False)
    assert engine_tokens(folder, dtype=dtype, max_num_batched_tokens=64, async_scheduling=True) == sync


@pytest.mark.parametrize(
    ("model", "budget"), [("folder", 2048), ("folder", 8192), ("folder128", 64), ("folder128", 8192)]
)  # the step budget's two device defaults (8192 on an H200); folder128 with chunks (64): fresh and cached prefills
def test_cuda_graphs_equal_eager(model: str, budget: int, request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(model)
    eager = engine_tokens(folder, dtype="bfloat16", enforce_eager=True, max_num_batched_tokens=budget)
    graphs = engine_tokens(folder, dtype="bfloat16", enforce_eager=False, max_num_batched_tokens=budget)
    assert graphs == eager


class CountedGraph:
    """A captured graph that counts its replays (the real graph still replays)."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph, self.replays = graph, 0

    def replay(self) -> None:
        self.replays += 1
        self.graph.replay()


def test_decode_batches_routed_to_the_largest_graph_give_the_same_tokens(folder: Path) -> None:
    """``DecodeGraphs.route`` sends every batch to the largest graph (all padding rows but the batch's): the
    same tokens as the smallest graph that fits, and the largest graph is the one that replayed."""
    llm = LLM(str(folder), device="cuda", max_model_len=256, gpu_memory_utilization=0.3, dtype="bfloat16")
    graphs = llm.engine.executor.runner.graphs  # type: ignore[attr-defined]
    requests = [{"prompt_token_ids": p} for p in prompts()]
    largest = graphs.sizes[-1]
    assert largest > len(requests)  # so the smallest graph that fits is never the largest
    counted = graphs.graphs[largest] = CountedGraph(graphs.graphs[largest])

    def tokens() -> list[list[int]]:
        outs = llm.generate(requests, SamplingParams(temperature=0, max_tokens=16))  # type: ignore[arg-type]
        return [o.outputs[0].token_ids for o in outs]

    graphs.route = {s: s for s in graphs.sizes}
    own = tokens()
    assert counted.replays == 0
    graphs.route = {s: largest for s in graphs.sizes}
    assert tokens() == own
    assert counted.replays > 0


@pytest.mark.parametrize("model", ["folder", "folder128"])
def test_bf16_logits_close_to_hf(model: str, request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(model)
    from engine.loader import load_hf_config, load_model
    from engine.parallel import ParallelState
    from modelfiles import resolve

    files = resolve(str(folder))
    model = load_model(files, load_hf_config(files), ParallelState(), torch.bfloat16, torch.device("cuda"))
    for attn in model.attention_layers():
        attn.kv_cache = torch.zeros(2, 8, 16, attn.num_kv_heads, attn.head_dim, dtype=torch.bfloat16, device="cuda")
    ids = prompts()[3]
    meta = _cuda_meta(one_seq_metadata(list(range(8)), 0, len(ids)))
    with torch.no_grad():
        hidden = model(torch.tensor(ids).cuda(), torch.arange(len(ids)).cuda(), meta)
        ours = model.compute_logits(hidden)
        hf = load_hf_model(folder).cuda()
        ref = hf(torch.tensor([ids]).cuda()).logits[0].float()  # the exact (fp32) logits
        hf_bf16 = hf.to(torch.bfloat16)(torch.tensor([ids]).cuda()).logits[0].float()
    rel = ((ours - ref).norm() / ref.norm()).item()
    rel_hf = ((hf_bf16 - ref).norm() / ref.norm()).item()
    print(f"bf16 relative logits error vs fp32: ours {rel:.4f}, HF bf16 {rel_hf:.4f}")
    # 1e-2, or HF's own bf16 error where that is larger: bf16 rounding alone sets that floor
    assert rel < max(1e-2, 1.1 * rel_hf), (rel, rel_hf)


def test_tp1_process_per_rank_path_equals_in_process(folder: Path) -> None:
    """The tensor-parallel path (process group on NCCL, rank-0 driver) at TP=1 gives the same tokens."""
    uni = engine_tokens(folder, dtype="bfloat16", distributed_executor_backend="uni")
    mp = engine_tokens(folder, dtype="bfloat16", distributed_executor_backend="mp")
    assert mp == uni


def prefill_then_decode(lens: list[int], block_size: int, rng: random.Random) -> tuple[StepInputs, StepInputs]:
    """A prefill of sequences of ``lens`` random tokens over consecutive blocks, and the decode step after it."""
    tables: list[list[int]] = []
    for n in lens:
        first = sum(len(t) for t in tables)
        tables.append(list(range(first, first + -(-(n + 1) // block_size))))
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)

    def slot(table: list[int], pos: int) -> int:
        return table[pos // block_size] * block_size + pos % block_size

    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    prefill = StepInputs(
        input_ids=torch.tensor([rng.randrange(3, VOCAB_SIZE) for _ in range(sum(lens))]),
        positions=torch.cat([torch.arange(n) for n in lens]),
        slot_mapping=torch.tensor([slot(t, p) for t, n in zip(tables, lens, strict=True) for p in range(n)]),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=block_tables,
        logits_indices=torch.tensor(starts[1:]) - 1,
        max_query_len=max(lens),
        max_seq_len=max(lens),
        blocks_to_copy=[],
    )
    decode = StepInputs(
        input_ids=torch.tensor([rng.randrange(3, VOCAB_SIZE) for _ in lens]),
        positions=torch.tensor(lens),
        slot_mapping=torch.tensor([slot(t, n) for t, n in zip(tables, lens, strict=True)]),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32) + 1,
        block_tables=block_tables,
        logits_indices=torch.arange(len(lens)),
        max_query_len=1,
        max_seq_len=max(lens) + 1,
        blocks_to_copy=[],
    )
    return prefill, decode


@pytest.fixture(scope="module")
def runner(folder: Path) -> Iterator[ModelRunner]:
    """A float32 runner with decode graphs up to 32 rows and a fixed small cache (it leaves the other tests'
    memory budget alone)."""
    import modelfiles
    from engine.args import EngineArgs
    from engine.parallel import ParallelState

    args = EngineArgs(
        model=str(folder),
        device="cuda",
        dtype="float32",
        max_model_len=256,
        num_gpu_blocks_override=160,
        max_num_seqs=32,
    )
    yield ModelRunner(args.create_engine_config(), modelfiles.resolve(str(folder)), ParallelState())
    torch.cuda.empty_cache()


@pytest.mark.parametrize("batch_size", [1, 3, 17])
def test_graph_logits_equal_eager_logits(runner: ModelRunner, batch_size: int) -> None:
    """The decode graph returns the logits it computed inside the replay; the eager path computes them after
    the forward. Same numbers (up to the GEMM's batch-size dependent order: 3 and 17 replay padded graphs)."""
    rng = random.Random(batch_size)
    prefill, decode = prefill_then_decode([rng.randint(1, 90) for _ in range(batch_size)], 16, rng)
    graphs = runner.graphs
    assert graphs is not None and graphs.can_run(decode)
    runner.execute_model(prefill)  # eager (not decode-only): fills the cache
    runner.graphs = None
    try:
        eager = runner.execute_model(decode).clone()
    finally:
        runner.graphs = graphs
    graph = runner.execute_model(decode).clone()
    assert graph.shape == eager.shape == (batch_size, VOCAB_SIZE) and graph.dtype == torch.float32
    rel = ((graph - eager).norm() / eager.norm()).item()
    assert rel < 1e-5, rel
    assert torch.equal(graph.argmax(-1), eager.argmax(-1))
    # a decode-only step in which some rows do not sample gets the rows that do, from the same replay
    some = dataclasses.replace(decode, logits_indices=torch.arange(0, batch_size, 2))
    assert torch.allclose(runner.execute_model(some), graph[::2], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 300])
def test_rope_and_cache_equals_reference_at_8b_shape(dtype: torch.dtype, num_tokens: int) -> None:
    """Llama 3 8B's attention shape (32 q heads, 8 kv heads, head_dim 128) from views of the QKV output:
    the fused kernel equals the torch reference and the unfused Triton rotary + cache write it replaces."""
    from engine.layers.rotary import build_cos_sin_cache
    from kernels.cache_write import reshape_and_cache
    from kernels.rope_cache import rope_and_cache, rope_and_cache_ref
    from kernels.rotary import rotary_embedding
    from tests.helpers import LLAMA3_ROPE, tiny_config
    from tests.kernels.helpers import rel_err, tolerance

    heads, kv_heads, head_dim, block_size, num_blocks = 32, 8, 128, 16, 64
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    config = tiny_config("llama", rope_parameters={**LLAMA3_ROPE, "rope_theta": 5e5}, max_position_embeddings=8192)
    cos_sin_cache = build_cos_sin_cache(config, head_dim, 8192).cuda()
    positions = torch.randint(0, 8192, (num_tokens,), generator=gen, device="cuda")
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen, device="cuda").to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    query = q.reshape(num_tokens, heads, head_dim)  # [T, 32, 128], row stride 6144
    key, value = k.reshape(num_tokens, kv_heads, head_dim), v.reshape(num_tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device="cuda")[:num_tokens]
    slots[1::7] = -1  # padding rows (not the first: the single-token case writes)
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device="cuda")
    expected, unfused = cache.clone(), cache.clone()
    q_out = rope_and_cache(positions, query, key, value, cos_sin_cache, cache, slots)
    q_ref = rope_and_cache_ref(positions, query, key, value, cos_sin_cache, expected, slots)
    q_unfused, k_unfused = rotary_embedding(positions, query, key, cos_sin_cache)
    reshape_and_cache(k_unfused, value, unfused, slots)
    assert torch.equal(cache.isnan(), expected.isnan())  # slot -1 rows wrote nothing
    written = ~expected.isnan()
    assert rel_err(q_out, q_ref) < tolerance(dtype)
    assert rel_err(cache[written], expected[written]) < tolerance(dtype)
    # the same fp32 arithmetic and one cast as the two kernels it replaces: the model's numbers do not move
    # (bit for bit, unless the compiler contracts the two kernels' multiply-adds differently)
    same = 1e-5 if dtype == torch.float32 else 1e-3
    assert rel_err(q_out, q_unfused) < same
    assert rel_err(cache[written], unfused[written]) < same


def _graph_vs_eager(runner: ModelRunner, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's logits through the prefill graphs, and eagerly (the graphs set aside)."""
    graphs = runner.prefill_graphs
    assert graphs is not None and graphs.can_run(step)
    runner.prefill_graphs = None
    try:
        eager = runner.execute_model(step).clone()
    finally:
        runner.prefill_graphs = graphs
    return runner.execute_model(step).clone(), eager


@pytest.mark.parametrize("lens", [[5], [3, 17, 1, 40], [90, 90, 90, 90, 90]])
def test_prefill_graph_logits_equal_eager_logits(runner: ModelRunner, lens: list[int]) -> None:
    """A prefill step of up to 512 tokens replays a padded graph (tokens and sequences): same logits as eager."""
    prefill, _ = prefill_then_decode(lens, 16, random.Random(len(lens)))
    graph, eager = _graph_vs_eager(runner, prefill)
    assert graph.shape == eager.shape == (len(lens), VOCAB_SIZE)
    assert ((graph - eager).norm() / eager.norm()).item() < 1e-5
    assert torch.equal(graph.argmax(-1), eager.argmax(-1))


def test_prefill_graph_mixed_step_with_cached_prefix_and_decode_rows(runner: ModelRunner) -> None:
    """A chunk after a cached prefix, decode rows and a new prompt in one step; a sequence that does not sample
    (a chunk short of its prompt's end) leaves out its row."""
    rng = random.Random(7)
    prefill, _ = prefill_then_decode([30, 20], 16, rng)
    runner.execute_model(prefill)  # the prefixes into the cache (blocks 0-1 and 2)
    tables = torch.tensor([[0, 1, 3, 0], [2, 4, 0, 0], [5, 6, 7, 8]], dtype=torch.int32)
    q_lens, ctx = [12, 1, 33], [30, 20, 0]

    def slot(row: int, pos: int) -> int:
        return int(tables[row, pos // 16]) * 16 + pos % 16

    starts = [0, 12, 13, 46]
    step = StepInputs(
        input_ids=torch.tensor([rng.randrange(3, VOCAB_SIZE) for _ in range(46)]),
        positions=torch.cat([torch.arange(c, c + q) for c, q in zip(ctx, q_lens, strict=True)]),
        slot_mapping=torch.tensor([slot(i, p) for i in range(3) for p in range(ctx[i], ctx[i] + q_lens[i])]),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c + q for c, q in zip(ctx, q_lens, strict=True)], dtype=torch.int32),
        block_tables=tables,
        logits_indices=torch.tensor([12, 45]),  # the first sequence's chunk does not end its prompt
        max_query_len=33,
        max_seq_len=42,
        blocks_to_copy=[],
    )
    graph, eager = _graph_vs_eager(runner, step)
    assert graph.shape == eager.shape == (2, VOCAB_SIZE)
    assert ((graph - eager).norm() / eager.norm()).item() < 1e-5
    assert torch.equal(graph.argmax(-1), eager.argmax(-1))


def test_steps_past_the_largest_prefill_graph_run_eagerly(runner: ModelRunner) -> None:
    prefill, _ = prefill_then_decode([200, 200, 200], 16, random.Random(3))
    assert runner.prefill_graphs is not None and not runner.prefill_graphs.can_run(prefill)


def test_bf16_decode_with_fused_norms_matches_the_unfused_one(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch-1 decode steps with each input RMSNorm carried by the GEMVs (``kernels.fused_norm``, the default on CUDA)
    against the norms' own launches (``FUSED_NORM_DEVICES = ()``): the same logits up to bf16 rounding."""
    from engine.layers import linear
    from engine.loader import load_hf_config, load_model
    from engine.models import llama
    from engine.parallel import ParallelState
    from modelfiles import resolve

    files = resolve(str(folder))
    model = load_model(files, load_hf_config(files), ParallelState(), torch.bfloat16, torch.device("cuda"))
    ids = [random.Random(5).randrange(3, VOCAB_SIZE) for _ in range(40)]
    fused_steps = []
    normed = linear._ParallelLinear.forward_normed

    def counted(layer: Any, *args: Any) -> Any:
        fused_steps.append(1)
        return normed(layer, *args)

    monkeypatch.setattr(linear._ParallelLinear, "forward_normed", counted)
    monkeypatch.setattr(model.model, "fuse_norm", True)
    logits = {}
    for devices in (("cuda",), ()):
        monkeypatch.setattr(llama, "FUSED_NORM_DEVICES", devices)
        logits[devices] = _prefill_then_decode_logits(model, ids)
    assert len(fused_steps) == (len(ids) - 20) * (3 - 1)  # qkv, from the second layer on
    unfused = logits[()]
    assert ((logits[("cuda",)] - unfused).norm() / unfused.norm()).item() < 5e-3


def test_decode_with_rope_in_the_kernel_equals_the_two_launches(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps whose attention rotates q / k and stores the new K/V itself (``engine.attention.fuses_rope``,
    batches up to DECODE_ROPE_MAX_SEQS by default) against rope_and_cache + the decode kernel: the same logits,
    bit for bit."""
    from engine import attention
    from engine.loader import load_hf_config, load_model
    from engine.parallel import ParallelState
    from modelfiles import resolve

    files = resolve(str(folder))
    model = load_model(files, load_hf_config(files), ParallelState(), torch.bfloat16, torch.device("cuda"))
    ids = [random.Random(7).randrange(3, VOCAB_SIZE) for _ in range(40)]
    calls = []
    fused = attention.decode_with_rope

    def counted(*args: Any) -> Any:
        calls.append(1)
        return fused(*args)

    monkeypatch.setattr("engine.layers.attention.decode_with_rope", counted)
    logits = {}
    for on in (True, False):
        monkeypatch.setattr(attention, "DECODE_ROPE_MAX_SEQS", 1 << 30 if on else 0)
        logits[on] = _prefill_then_decode_logits(model, ids)
    assert len(calls) == (len(ids) - 20) * len(model.attention_layers())
    assert torch.equal(logits[True], logits[False])


def _prefill_then_decode_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """The logits of a 20-token prefill then one decode step per remaining token, in fresh zeroed bf16 caches."""
    for attn in model.attention_layers():
        attn.kv_cache = torch.zeros(2, 8, 16, attn.num_kv_heads, attn.head_dim, dtype=torch.bfloat16, device="cuda")
    got = []
    with torch.no_grad():
        for start, num_new in [(0, 20)] + [(p, 1) for p in range(20, len(ids))]:
            meta = _cuda_meta(one_seq_metadata(list(range(8)), start, num_new))
            pos = torch.arange(start, start + num_new).cuda()
            got.append(model.compute_logits(model(torch.tensor(ids[start : start + num_new]).cuda(), pos, meta)))
    return torch.cat(got)


def _cuda_meta(meta: Any) -> Any:
    return dataclasses.replace(
        meta,
        slot_mapping=meta.slot_mapping.cuda(),
        query_start_loc=meta.query_start_loc.cuda(),
        seq_lens=meta.seq_lens.cuda(),
        block_tables=meta.block_tables.cuda(),
        backend="triton",
    )
