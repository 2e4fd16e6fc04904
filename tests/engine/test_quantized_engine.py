"""4-bit checkpoints end to end on CPU: greedy tokens equal the reference in ONE continuous batch (chunked
prefill, mixed steps) and under preemption. The reference is transformers running the checkpoint itself where it
can on CPU (compressed-tensors, symmetric: its own decompression), else transformers on the checkpoint
dequantized to fp32 (``dense/``). TP=2 equals TP=1 on quantized checkpoints (gloo, one process per rank). On the
layers' CUDA path (the Triton kernels, through the interpreter), the down projection applying the activation as
it loads x gives the tokens of the activation launched first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.layers import linear
from engine.models import llama
from engine.quantization import int4_linear
from engine.quantization.int4_linear import Int4LinearMethod
from kernels import gemv as dense_gemv
from kernels import int4_gemm, int4_plan
from tests.engine.quantized_checkpoints import build_quantized_model
from tests.engine.test_engine_parity import MAX_TOKENS, hf_greedy, make_prompts, run_engine
from tests.engine.test_tp_engine import greedy_tokens

FORMATS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # id: (format, model family, options); group 32 divides every layer's input features, also at TP=2
    "ct-asym-g32": ("compressed-tensors", "llama", {"group_size": 32}),
    "ct-sym-channel": ("compressed-tensors", "qwen2", {"group_size": None, "symmetric": True}),
    "awq-g32": ("awq", "qwen2", {"group_size": 32}),
    "gptq-g32-act-order": ("gptq", "llama", {"group_size": 32, "act_order": True}),
    "gptq-sym-g64": ("gptq", "qwen2", {"group_size": 64, "symmetric": True}),
}
HF_RUNS_CHECKPOINT = {"ct-sym-channel"}  # transformers 5.24 + compressed-tensors 0.20 reject packed zero points


@pytest.fixture(scope="module", params=list(FORMATS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list, list]:
    fmt, family, options = FORMATS[request.param]
    folder, dense = build_quantized_model(tmp_path_factory.mktemp(request.param), fmt, family, seed=3, **options)
    prompts = make_prompts(seed=4, n=8)
    reference = folder if request.param in HF_RUNS_CHECKPOINT else dense
    return folder, prompts, hf_greedy(reference, prompts, MAX_TOKENS)


def test_greedy_equals_reference_in_one_continuous_batch(checkpoint: tuple[Path, list, list]) -> None:
    folder, prompts, expected = checkpoint
    got, _ = run_engine(folder, prompts, max_num_batched_tokens=24, max_num_seqs=6)
    assert got == expected


def test_greedy_equals_reference_under_preemption(checkpoint: tuple[Path, list, list]) -> None:
    folder, prompts, expected = checkpoint
    got, llm = run_engine(
        folder, prompts, block_size=8, num_gpu_blocks_override=10, max_model_len=80, max_num_batched_tokens=64
    )
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected


def test_quantization_flag_must_match_the_checkpoint(tmp_path: Path) -> None:
    folder, dense = build_quantized_model(tmp_path, "awq", "llama", group_size=32)
    with pytest.raises(ValueError, match="quantization_config says 'awq'"):
        LLM(str(folder), device="cpu", quantization="gptq")
    with pytest.raises(ValueError, match="quantization_config says 'awq'"):
        LLM(str(folder), device="cpu", quantization="gptq_marlin")
    with pytest.raises(ValueError, match="no quantization_config"):
        LLM(str(dense), device="cpu", quantization="awq")
    with pytest.raises(ValueError, match="quantization must be one of auto, awq, gptq, .*got 'marlin'"):
        LLM(str(folder), device="cpu", quantization="marlin")
    # the named method loads, and so does vLLM's name of its AWQ kernel: the same layers, the same tokens
    kwargs = {"quantization": "awq", "max_model_len": 64, "block_size": 8, "num_gpu_blocks_override": 10}
    assert greedy_tokens(folder, 1, **kwargs) == greedy_tokens(folder, 1, **{**kwargs, "quantization": "awq_marlin"})


@pytest.mark.parametrize("name", ["ct-asym-g32", "gptq-g32-act-order"])
def test_tp2_equals_tp1(tmp_path: Path, name: str) -> None:
    fmt, family, options = FORMATS[name]
    folder, _ = build_quantized_model(tmp_path, fmt, family, seed=5, **options)
    kwargs = {"block_size": 8, "num_gpu_blocks_override": 10, "max_model_len": 64, "max_num_batched_tokens": 32}
    expected, preempted_1 = greedy_tokens(folder, 1, **kwargs)
    got, preempted_2 = greedy_tokens(folder, 2, **kwargs)
    assert preempted_1 > 0 and preempted_2 > 0
    assert got == expected


@pytest.mark.slow  # ~3 s each: the interpreter runs every projection of two engines
@pytest.mark.parametrize("name", ["ct-asym-g32", "gptq-g32-act-order"])  # the GEMV's factored and exact paths
def test_gated_down_projection_keeps_the_greedy_tokens(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The quantized layers on their CUDA path (``apply_triton``, ``apply_gated_triton``: the Triton kernels,
    run here by the interpreter on CPU, where ``apply`` would take the torch reference): greedy tokens with the
    down projection's gated GEMM (``int4_gemm_gated``) equal those with the activation launched first
    (PAGEDSERVE_GEMV_GATED=0, read at import: its module constant is switched here). Two sequences at most, so
    decode steps of 2 and 1 rows run the gated GEMV; prefill chunks run it up to GEMV_MAX_M rows, the activation
    and tl.dot above."""
    fmt, family, options = FORMATS[name]
    # one decoder layer: every layer's MLP runs the same gated down projection (two: twice the interpreter time)
    folder, _ = build_quantized_model(tmp_path, fmt, family, seed=6, num_hidden_layers=1, **options)
    monkeypatch.setattr(Int4LinearMethod, "apply", Int4LinearMethod.apply_triton)
    monkeypatch.setattr(Int4LinearMethod, "apply_gated", Int4LinearMethod.apply_gated_triton)
    gated_rows: list[int] = []
    gated_gemm = int4_linear.int4_gemm_gated

    def counted(x2: Any, *weights: Any) -> Any:
        gated_rows.append(x2.shape[0])
        return gated_gemm(x2, *weights)

    monkeypatch.setattr(int4_linear, "int4_gemm_gated", counted)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(seed=7, n=3)]
    # by GEMV_GATED: the greedy tokens, the row counts int4_gemm_gated was called with
    tokens: dict[bool, list[list[int]]] = {}
    rows: dict[bool, list[int]] = {}
    for gated in (True, False):
        monkeypatch.setattr(dense_gemv, "GEMV_GATED", gated)
        llm = LLM(str(folder), device="cpu", max_num_seqs=2, max_model_len=64)
        # 3 tokens: each engine still runs both prefills, two decode steps of 2 rows and two of 1 (6 tokens: 12
        # interpreted steps an engine, not 6)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
        tokens[gated], rows[gated] = [o.outputs[0].token_ids for o in outs], sorted(set(gated_rows))
        gated_rows.clear()
    assert tokens[True] == tokens[False]
    assert {1, 2} <= set(rows[True]) and rows[False] == []  # (prefill chunks pass through it too)


def test_stream_gemv_keeps_the_greedy_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers' CUDA path (the interpreter on CPU, as above) with the stream-K GEMV (``kernels.int4_plan.
    GEMV_STREAM``, x as int32 pairs, 512-column tiles): the greedy tokens of the split-K GEMV, and the stream launch
    ran for the plain and the gated (down) projections at decode steps of 1 row and for the plain ones at 2."""
    fmt, family, options = FORMATS["ct-asym-g32"]
    folder, _ = build_quantized_model(tmp_path, fmt, family, seed=6, num_hidden_layers=1, **options)
    monkeypatch.setattr(Int4LinearMethod, "apply", Int4LinearMethod.apply_triton)
    monkeypatch.setattr(Int4LinearMethod, "apply_gated", Int4LinearMethod.apply_gated_triton)
    launches: list[tuple[int, bool]] = []
    stream_launch = int4_gemm.int4_gemv_stream_launch

    def counted(x: Any, *args: Any, **kwargs: Any) -> Any:
        launches.append((x.shape[0], kwargs["gated"]))
        return stream_launch(x, *args, **kwargs)

    monkeypatch.setattr(int4_gemm, "int4_gemv_stream_launch", counted)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(seed=7, n=3)]
    tokens = {}
    monkeypatch.setattr(int4_plan, "GEMV_STREAM_MIN_WEIGHTS", 0)  # the tiny model's layers stream too
    for stream in (False, True):
        monkeypatch.setattr(int4_plan, "GEMV_STREAM", stream)
        monkeypatch.setattr(int4_plan, "GEMV_X_WORDS", stream)
        monkeypatch.setattr(int4_plan, "GEMV_STREAM_BLOCK_N", 512 if stream else 0)
        llm = LLM(str(folder), device="cpu", max_num_seqs=2, max_model_len=64)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
        tokens[stream] = [o.outputs[0].token_ids for o in outs]
        assert bool(launches) == stream
    assert tokens[True] == tokens[False]
    # 1 row: plain and gated; 2 rows: the MMA kernel's fallback here (gated: the activation first, then the GEMV)
    assert {(1, False), (1, True), (2, False)} <= set(launches), sorted(set(launches))


def test_4bit_weights_never_carry_the_norm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """4-bit weights never carry an RMSNorm on the GEMVs around it (``engine.models.llama.FUSED_NORM``: it lost
    on the H200), even with the dense weights' switch on and its seam open on CPU: every norm is its own launch."""
    fmt, family, options = FORMATS["ct-asym-g32"]
    folder, _ = build_quantized_model(tmp_path, fmt, family, seed=8, **options)
    calls: list[str] = []
    for cls, name in ((linear._ParallelLinear, "forward_normed"), (linear.RowParallelLinear, "forward_residual")):
        monkeypatch.setattr(cls, name, _counted(getattr(cls, name), name, calls))
    monkeypatch.setattr(llama, "FUSED_NORM", True)
    monkeypatch.setattr(llama, "FUSED_NORM_DEVICES", ("cuda", "cpu"))
    llm = LLM(str(folder), device="cpu", max_num_seqs=1, max_model_len=64)
    model = llm.engine.executor.runner.model.model  # type: ignore[attr-defined]
    assert not model.fuse_norm and not any(layer.mlp.down_proj.carries_norm(1, gated=True) for layer in model.layers)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(seed=9, n=2)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)  # batch-1 decode steps
    assert calls == []


def _counted(fn: Any, name: Any, calls: list[Any]) -> Any:
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return fn(*args, **kwargs)

    return counted
