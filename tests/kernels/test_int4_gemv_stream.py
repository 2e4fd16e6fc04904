"""The stream-K int4 GEMV (``kernels.int4_gemv_stream``, ``Int4GemmConfig.stream``): under the interpreter on CPU it
equals the reference and the split launch for grids from one program to more programs than units (runs that start
and end inside column tiles, tiles whose programs number one to several), gated and not, x loaded by value and as
int32 pairs, and leaves the shared accumulator and counters at zero; the plan takes it only where the tiles are
factored; the sm_90 compile keeps its K loop pipelined. On a GPU: the 8B shapes at M = 1 against the reference."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from kernels import int4_gemm as int4_gemm_module
from kernels import int4_plan
from kernels.int4_config import Int4GemmConfig
from kernels.int4_gemm import int4_gemm, int4_gemm_gated, int4_gemm_gated_ref, int4_gemm_ref
from kernels.int4_gemv_stream import int4_gemv_stream_launch, prepare_x
from kernels.int4_plan import pick_config
from kernels.int4_split import zeroed_scratch
from tests.kernels.helpers import DEVICE, int4_weights, rel_err, tolerance, ttgir_sm90


def _weights(k: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, qweight, scales, zeros, _ = int4_weights(k, n, 128, False, torch.bfloat16, gen)
    return qweight.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE)


def _scratch_is_zero() -> bool:
    device = torch.device(DEVICE)
    return not zeroed_scratch(device, torch.int32, 1).any() and not zeroed_scratch(device, torch.float32, 1).any()


# (n, k, block_n, programs, m, gated, x_words, subnormal): N = 320 leaves a partial column tile; K = 512 makes 8 K
# tiles a column tile, so 3 and 7 programs start and end runs inside tiles, 1 takes everything, 40 is more than the
# units
CASES = [
    (320, 512, 128, 1, 1, False, False, False),
    (320, 512, 128, 3, 1, False, True, True),
    (320, 512, 128, 7, 3, False, True, False),
    (320, 512, 128, 40, 1, False, False, True),
    (256, 256, 64, 5, 1, True, False, False),
    (256, 256, 64, 5, 2, True, True, True),  # gated: x_words does not apply, the loads stay
]


@pytest.mark.parametrize(("n", "k", "block_n", "programs", "m", "gated", "x_words", "subnormal"), CASES)
def test_stream_equals_the_reference_and_the_split_launch(
    n: int, k: int, block_n: int, programs: int, m: int, gated: bool, x_words: bool, subnormal: bool,
    gen: torch.Generator,
) -> None:  # fmt: skip
    qweight, scales, zeros = _weights(k, n, gen)
    x = torch.randn(m, 2 * k if gated else k, generator=gen).to(torch.bfloat16).to(DEVICE)
    out = torch.full((m, n), float("nan"), dtype=x.dtype, device=x.device)
    int4_gemv_stream_launch(
        x, qweight, scales, zeros, 128, out, block_n=block_n, block_k=64, programs=programs, num_warps=4,
        num_stages=2, subnormal=subnormal, gated=gated, x_words=x_words,
    )  # fmt: skip
    split = Int4GemmConfig(kernel="gemv", block_n=block_n, block_k=64, split_k=2, stream=False, subnormal=subnormal)
    if gated:
        ref, other = (
            int4_gemm_gated_ref(x, qweight, scales, zeros, 128),
            int4_gemm_gated(x, qweight, scales, zeros, 128, config=split),
        )
    else:
        ref, other = (
            int4_gemm_ref(x, qweight, scales, zeros, 128),
            int4_gemm(x, qweight, scales, zeros, 128, config=split),
        )
    assert not out.isnan().any()  # every column tile's last program wrote it
    assert rel_err(out, ref) < 2 * tolerance(x.dtype)
    assert rel_err(out, other) < 1e-3  # the same tile sums; only the split-K order (bf16 rounding) may differ
    assert _scratch_is_zero()  # each tile's counter saw exactly its programs


@pytest.mark.parametrize("m", [1, 3])
def test_a_prepared_x_gives_the_same_sums(m: int, gen: torch.Generator) -> None:
    """``prepare_x``'s fp32 activations (scaled for the subnormal codes) and word-row sums: the same output as the
    launch that scales and sums x itself (bit for bit under the interpreter, whose atomics keep program order), and
    refused where it does not apply."""
    qweight, scales, zeros = _weights(512, 320, gen)
    x = torch.randn(m, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    outs = []
    for prepared in (None, prepare_x(x)):
        out = torch.full((m, 320), float("nan"), dtype=x.dtype, device=x.device)
        int4_gemv_stream_launch(
            x, qweight, scales, zeros, 128, out, block_n=128, block_k=64, programs=7, num_warps=4, num_stages=2,
            subnormal=True, prepared=prepared,
        )  # fmt: skip
        outs.append(out)
    assert rel_err(outs[1], int4_gemm_ref(x, qweight, scales, zeros, 128)) < 2 * tolerance(x.dtype)
    if DEVICE == "cpu":
        assert torch.equal(outs[0], outs[1])
    else:
        assert rel_err(outs[0], outs[1]) < 1e-3  # the atomics' order may tip a bf16 rounding
    with pytest.raises(ValueError, match="prepared x"):
        int4_gemv_stream_launch(
            x, qweight, scales, zeros, 128, outs[0], block_n=128, block_k=64, programs=7, num_warps=4, num_stages=2,
            subnormal=False, prepared=prepare_x(x),
        )  # fmt: skip


def test_the_plan_streams_factored_tiles_only(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("GEMV_STREAM", False), ("GEMV_STREAM_BLOCK_N", 0)):  # stream-K only where asked; own tiles
        monkeypatch.setattr(int4_plan, name, value)
    on = Int4GemmConfig(stream=True)
    launch = pick_config(1, 4096, 4096, 128, 132, on, False)
    assert launch.kernel == "gemv" and launch.stream_programs == 4 * 132  # the default tile's programs per SM
    assert pick_config(1, 28672, 4096, 128, 132, on, False).stream_programs == 8 * 132  # the wide tile's one wave
    assert (
        pick_config(1, 4096, 4096, 128, 132, Int4GemmConfig(stream=True, programs_per_sm=2), False).stream_programs
        == 264
    )
    assert pick_config(1, 4096, 4096, 128, 132, on, True).stream_programs == 0  # g_idx: exact tiles, split launch
    assert pick_config(1, 4096, 4096, 128, 132, Int4GemmConfig(stream=True, factored=False), False).stream_programs == 0
    assert pick_config(1, 4096, 4064, 128, 132, on, False).stream_programs == 0  # a partial K tile
    assert pick_config(1, 4096, 4096, 128, 132, Int4GemmConfig(), False).stream_programs == 0  # not asked: split


def test_a_split_asked_for_keeps_the_split_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """With GEMV_STREAM on, a config that names split_k or the counter reduction gets the split grid it asked for;
    asking for both a stream and a split is refused."""
    monkeypatch.setattr(int4_plan, "GEMV_STREAM", True)
    monkeypatch.setattr(int4_plan, "GEMV_STREAM_MIN_WEIGHTS", 0)
    assert pick_config(1, 4096, 4096, 128, 132, Int4GemmConfig(), False).stream_programs == 4 * 132
    for asked in (Int4GemmConfig(split_k=4), Int4GemmConfig(split_reduce="counter")):
        launch = pick_config(1, 4096, 4096, 128, 132, asked, False)
        assert launch.stream_programs == 0 and (launch.split_k == 4 or launch.split_reduce == "counter")
    assert pick_config(1, 4096, 4096, 128, 132, Int4GemmConfig(split_reduce="atomic"), False).stream_programs
    with pytest.raises(ValueError, match="no split_k"):
        pick_config(1, 4096, 4096, 128, 132, Int4GemmConfig(stream=True, split_k=4), False)


def test_the_stream_tile_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """GEMV_STREAM_BLOCK_N: stream launches take that many columns with 4 warps on every layer, the wide one too, and
    GEMV_STREAM_PPS programs an SM; split launches keep their tiles."""
    monkeypatch.setattr(int4_plan, "GEMV_STREAM_BLOCK_N", 512)
    monkeypatch.setattr(int4_plan, "GEMV_STREAM_PPS", 4)
    for n in (4096, 28672):
        launch = pick_config(1, n, 4096, 128, 132, Int4GemmConfig(stream=True), False)
        assert (launch.block_n, launch.num_warps, launch.stream_programs) == (512, 4, 4 * 132)
    monkeypatch.setattr(int4_plan, "GEMV_STREAM_BLOCK_N", 1024)
    monkeypatch.setattr(int4_plan, "GEMV_STREAM_PPS", 3)  # int4_model's "bn1024": what its registers let an SM hold
    launch = pick_config(1, 28672, 4096, 128, 132, Int4GemmConfig(stream=True), False)
    assert (launch.block_n, launch.num_warps, launch.stream_programs) == (1024, 4, 3 * 132)
    assert pick_config(1, 28672, 4096, 128, 132, Int4GemmConfig(stream=False), False).block_n == 256
    monkeypatch.setattr(int4_plan, "GEMV_STREAM", True)
    assert pick_config(1, 4096, 4096, 128, 132, Int4GemmConfig(), True).block_n == 256  # g_idx: split, its own tile


def test_the_stream_size_threshold_and_its_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    """GEMV_STREAM_MIN_WEIGHTS: the plan streams only layers of at least that many weights (the 8B gate_up and down,
    not qkv or o); a user's stream=True still streams a small one. GEMV_STREAM_SUBNORMAL puts subnormal codes on the
    stream launches only."""
    monkeypatch.setattr(int4_plan, "GEMV_STREAM", True)
    monkeypatch.setattr(int4_plan, "GEMV_STREAM_MIN_WEIGHTS", 1 << 25)
    monkeypatch.setattr(int4_plan, "GEMV_STREAM_SUBNORMAL", True)
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    launches = {name: pick_config(1, n, k, 128, 132, Int4GemmConfig(), False) for name, (n, k) in shapes.items()}
    assert {name: bool(c.stream_programs) for name, c in launches.items()} == {
        "qkv": False, "o": False, "gate_up": True, "down": True
    }  # fmt: skip
    assert not launches["qkv"].subnormal and not launches["o"].subnormal
    assert launches["down"].subnormal and launches["gate_up"].subnormal
    assert pick_config(1, 4096, 4096, 128, 132, Int4GemmConfig(stream=True), False).stream_programs
    assert not pick_config(1, 4096, 14336, 128, 132, Int4GemmConfig(subnormal=False), False).subnormal


@pytest.mark.skipif(
    any(key.startswith("PAGEDSERVE_INT4_") for key in os.environ), reason="a PAGEDSERVE_INT4_* setting in the env"
)
def test_the_defaults_are_session_37s_winners() -> None:
    """At M = 1 on the 8B shapes (H100, Session 37): gate_up and down stream-K with 512-column tiles of 4 warps and
    subnormal codes; qkv and o the split grid of 256 columns; x as pairs where it can be (not the gated down)."""
    got = {
        name: pick_config(1, n, k, 128, 132, Int4GemmConfig(), False)
        for name, (n, k) in {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096)}.items()
    }
    for name in ("qkv", "o"):
        assert (got[name].stream_programs, got[name].block_n, got[name].subnormal) == (0, 256, False), name
    assert (got["gate_up"].stream_programs, got["gate_up"].block_n, got["gate_up"].num_warps) == (4 * 132, 512, 4)
    assert got["gate_up"].subnormal and all(c.x_words for c in got.values())
    assert int4_plan.GEMV_STREAM_MIN_WEIGHTS == 1 << 25 and int4_plan.GEMV_STREAM_SUBNORMAL


def test_wide_layers_can_keep_the_split_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """GEMV_STREAM_WIDE off (int4_model's "widesplit"): gate_up takes the one-warp wide split tile with pairs, down
    still streams, and a user's stream=True still streams gate_up."""
    monkeypatch.setattr(int4_plan, "GEMV_STREAM_WIDE", False)
    gate_up = pick_config(1, 28672, 4096, 128, 132, Int4GemmConfig(), False)
    assert (gate_up.stream_programs, gate_up.num_warps, gate_up.block_n, gate_up.x_words) == (0, 1, 256, True)
    assert pick_config(1, 4096, 14336, 128, 132, Int4GemmConfig(), False).stream_programs == 4 * 132
    assert pick_config(1, 28672, 4096, 128, 132, Int4GemmConfig(stream=True), False).stream_programs > 0


def test_int4_gemm_routes_the_stream_config(gen: torch.Generator) -> None:
    qweight, scales, zeros = _weights(256, 256, gen)
    x = torch.randn(1, 256, generator=gen).to(torch.bfloat16).to(DEVICE)
    cfg = Int4GemmConfig(kernel="gemv", block_n=64, block_k=64, stream=True, programs_per_sm=1)
    out = int4_gemm(x, qweight, scales, zeros, 128, config=cfg)
    assert rel_err(out, int4_gemm_ref(x, qweight, scales, zeros, 128)) < tolerance(x.dtype)
    assert _scratch_is_zero()


def test_stream_refuses_k_tiles_across_groups(gen: torch.Generator) -> None:
    qweight, scales, zeros = _weights(256, 64, gen)
    out = torch.empty(1, 64, dtype=torch.bfloat16, device=DEVICE)
    x = torch.zeros(1, 256, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="multiples of block_k"):
        int4_gemv_stream_launch(
            x, qweight, scales, zeros, 128, out, block_n=64, block_k=256, programs=4, num_warps=4, num_stages=2
        )


def test_sm90_compile_pipelines_the_stream_loop() -> None:
    constexprs: dict[str, object] = {
        "GROUP_SIZE": 128, "SUBNORMAL": False, "BLOCK_M": 1, "BLOCK_N": 256, "BLOCK_K": 64, "NUM_STAGES": 2,
        "EVEN": True, "GATED": False, "PDL": True, "TRIGGER": True, "X_WORDS": True,
    }  # fmt: skip
    ttgir = ttgir_sm90("stream", constexprs, 4)
    assert "scf.while" in ttgir  # the run's column tiles
    assert "async_copy_global_to_local" in ttgir  # the words (and the x pairs) through cp.async
    assert "tensor<1x8x4x!tt.ptr<i32>" in ttgir  # x as int32 pairs
    assert "griddepcontrol" in ttgir


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("n", "k", "gated"), [(6144, 4096, False), (4096, 4096, False), (28672, 4096, False), (4096, 14336, True)]
)
@pytest.mark.parametrize("x_words", [False, True])
def test_stream_at_the_8b_shapes(n: int, k: int, gated: bool, x_words: bool, gen: torch.Generator) -> None:
    """The plan's own M = 1 tiles as a stream, qkv, o, gate_up and the gated down, against the reference and the
    split launch; the shared scratch left at zero."""
    qweight, scales, zeros = _weights(k, n, gen)
    x = torch.randn(1, 2 * k if gated else k, generator=gen).to(torch.bfloat16).cuda()
    fn, ref_fn = (int4_gemm_gated, int4_gemm_gated_ref) if gated else (int4_gemm, int4_gemm_ref)
    stream = fn(x, qweight, scales, zeros, 128, config=Int4GemmConfig(stream=True, x_words=x_words))
    split = fn(x, qweight, scales, zeros, 128, config=Int4GemmConfig(stream=False, x_words=x_words))
    assert rel_err(stream, ref_fn(x, qweight, scales, zeros, 128)) < tolerance(torch.bfloat16)
    assert rel_err(stream, split) < 1e-3
    torch.cuda.synchronize()
    assert _scratch_is_zero()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_tokens_with_the_stream_gemv(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's tiny int4 model (random weights, GPTQ group 128) in fp32 on the GPU, batch-1 decode steps
    replayed from CUDA graphs: the same greedy tokens with the stream GEMV (and 512-column tiles) as with the split
    one."""
    from engine import LLM, SamplingParams
    from loadtest.int4_model import quantized_shape_folder

    launches: list[bool] = []
    stream_launch = int4_gemm_module.int4_gemv_stream_launch

    def counted(*args: Any, **kwargs: Any) -> None:
        launches.append(kwargs["gated"])
        stream_launch(*args, **kwargs)

    monkeypatch.setattr(int4_gemm_module, "int4_gemv_stream_launch", counted)
    folder = quantized_shape_folder("tiny", 128)
    prompts = [{"prompt_token_ids": list(range(5 + i, 30 + 3 * i))} for i in range(2)]
    tokens = {}
    for stream in (False, True):
        monkeypatch.setattr(int4_plan, "GEMV_STREAM", stream)
        monkeypatch.setattr(int4_plan, "GEMV_STREAM_BLOCK_N", 512 if stream else 0)
        monkeypatch.setattr(int4_plan, "GEMV_STREAM_MIN_WEIGHTS", 0)  # the tiny layers are far below the default
        with LLM(str(folder), load_format="dummy", skip_tokenizer_init=True, device="cuda", dtype="float32",
                 max_num_seqs=1, max_model_len=128, num_gpu_blocks_override=32) as llm:  # fmt: skip
            params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
            tokens[stream] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens[True] == tokens[False] and len(tokens[True][0]) == 24
    assert set(launches) == {False, True}  # plain and gated (down) projections went through the stream launch
