"""The one-launch int4 decode step (``kernels.int4_decode_step``) against its reference, the engine's layer
arithmetic (``kernels.int4_decode_tasks.int4_decode_step_ref``): the residual stream after every layer and the KV
caches, on tiny random layers under the interpreter; its counters back at zero for the next step; its task table;
the kernel compiled for sm_90. On a GPU: the 8B shapes, and replays from a CUDA graph."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.int4_decode_plan import StepShape, StepTiles, fit_tiles
from kernels.int4_decode_tasks import Int4DecodeStep, Int4Proj, StepLayer, int4_decode_step_ref
from loadtest import decode_step_bench
from tests.kernels.helpers import DEVICE, PTXAS_REPORT, packed_int4, rel_err, run_without_interpreter

TINY = StepTiles(tn=16, bk=32, num_stages=1, parts=3, bt=16, splits=(2, 2, 1, 3))  # some partitions empty


def make_layers(
    num_layers: int, hidden: int, shape: StepShape, inter: int, num_blocks: int, block_size: int,
    dtype: torch.dtype, gen: torch.Generator,
) -> list[StepLayer]:  # fmt: skip
    """Random layers (scales sized so the stream neither vanishes nor explodes) and caches of random K/V."""
    hqd, kvd = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim

    def proj(k: int, n: int) -> Int4Proj:
        qweight, scales, zeros = packed_int4(k, n, shape.group_size, dtype, gen)
        return Int4Proj(qweight, (scales.float() * 4 / k**0.5).to(dtype), zeros)

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)

    cache = (num_blocks, block_size, shape.kv_heads, shape.head_dim)
    return [
        StepLayer(
            proj(hidden, hqd + 2 * kvd),
            proj(hqd, hidden),
            proj(hidden, 2 * inter),
            proj(inter, hidden),
            norm(),
            norm(),
            torch.randn(2, *cache, generator=gen).to(dtype).to(DEVICE),
        )  # fmt: skip
        for _ in range(num_layers)
    ]


def rope_cache(max_pos: int, head_dim: int) -> torch.Tensor:
    inv = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(max_pos).float()[:, None] * inv[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=1).to(DEVICE)


@pytest.mark.parametrize(
    ("seq_len", "dtype", "fine_deps"),
    [(1, torch.float32, False), (37, torch.float32, False), (64, torch.float32, False), (50, torch.bfloat16, False),
     (37, torch.float32, True)],
    ids=["first-token", "two-partitions", "full-table", "bf16", "fine-deps"],
)  # fmt: skip
def test_equals_the_layer_by_layer_reference(
    seq_len: int, dtype: torch.dtype, fine_deps: bool, gen: torch.Generator
) -> None:
    """Two layers, GQA (4 query heads on 2 KV heads), a shuffled block table; then the next position on the same
    step object (its counters reset by the last program out). ``fine_deps``: the table claimed in its order
    (``tests/kernels/test_int4_decode_plan.py`` checks its waits)."""
    shape = StepShape(heads=4, kv_heads=2, head_dim=16, group_size=32, eps=1e-5, scale=16**-0.5)
    layers = make_layers(2, 64, shape, 96, 6, 16, dtype, gen)
    ref_layers = [StepLayer(**{**vars(lr), "kv_cache": lr.kv_cache.clone()}) for lr in layers]
    block_table = torch.randperm(6, generator=gen)[:4].to(torch.int32).to(DEVICE)
    cs = rope_cache(128, 16)
    step = Int4DecodeStep(layers, shape, replace(TINY, fine_deps=fine_deps))
    hidden = torch.randn(64, generator=gen).to(dtype).to(DEVICE)
    # bf16: Triton 3.7's interpreter rounds fp32 -> bf16 by truncation (a GPU rounds to nearest even), at every
    # rounding of the engine's arithmetic: ~1.5 % from the exact result here, against ~0.5 % for torch's bf16
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for n in (seq_len, seq_len + 1) if seq_len < 64 else (seq_len,):
        want = int4_decode_step_ref(ref_layers, shape, hidden.clone(), n, block_table, cs)
        out = hidden.clone()
        step(out, torch.tensor([n], dtype=torch.int32, device=DEVICE), block_table, cs)
        assert rel_err(out, want) < tol, n
        for got, ref in zip(layers, ref_layers, strict=True):
            assert rel_err(got.kv_cache, ref.kv_cache) < tol, n
        assert not step.counters.any(), step.counters


@pytest.mark.parametrize(
    ("heads", "kv_heads", "hidden", "inter", "tiles"),
    [(4, 4, 64, 96, TINY), (8, 1, 96, 64, TINY), (4, 2, 64, 128, replace(TINY, splits=(1, 1, 2, 2)))],
    ids=["mha", "mqa-hidden96", "inter128"],
)
def test_other_head_layouts(
    heads: int, kv_heads: int, hidden: int, inter: int, tiles: StepTiles, gen: torch.Generator
) -> None:
    """One query head a KV head, and eight on one (a hidden size past its power of two); gate_up's and down_proj's K
    split in two even halves (the last half of a gate_up tile applies silu * up): three layers, fp32."""
    shape = StepShape(heads=heads, kv_heads=kv_heads, head_dim=16, group_size=32, eps=1e-5, scale=0.25)
    layers = make_layers(3, hidden, shape, inter, 8, 16, torch.float32, gen)
    ref_layers = [StepLayer(**{**vars(lr), "kv_cache": lr.kv_cache.clone()}) for lr in layers]
    block_table = torch.randperm(8, generator=gen)[:6].to(torch.int32).to(DEVICE)
    cs = rope_cache(128, 16)
    tiles = fit_tiles(shape, hidden, inter, tiles)
    step = Int4DecodeStep(layers, shape, tiles)
    hidden_in = torch.randn(hidden, generator=gen).to(DEVICE)
    want = int4_decode_step_ref(ref_layers, shape, hidden_in.clone(), 77, block_table, cs)
    out = hidden_in.clone()
    step(out, torch.tensor([77], dtype=torch.int32, device=DEVICE), block_table, cs)
    assert rel_err(out, want) < 1e-4


def test_fit_tiles() -> None:
    """The engine's tiles for a model: bk inside the group, each split at most its projection's K tiles."""
    small = StepShape(heads=4, kv_heads=2, head_dim=16, group_size=32, eps=1e-5, scale=0.25)
    assert fit_tiles(small, 64, 96) == StepTiles(bk=32, splits=(2, 2, 1, 3))
    big = StepShape(heads=32, kv_heads=8, head_dim=128, group_size=128, eps=1e-5, scale=0.25)
    assert fit_tiles(big, 4096, 14336) == StepTiles()


def test_refuses_tiles_that_do_not_divide() -> None:
    shape = StepShape(heads=4, kv_heads=2, head_dim=16, group_size=32, eps=1e-5, scale=0.25)
    layers = make_layers(1, 64, shape, 96, 2, 16, torch.float32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="bk"):
        Int4DecodeStep(layers, shape, StepTiles(tn=16, bk=64))  # past the group of 32
    with pytest.raises(ValueError, match="splits"):
        Int4DecodeStep(layers, shape, StepTiles(tn=16, bk=32, splits=(1, 1, 1, 4)))  # down: 96 k's, 3 tiles
    with pytest.raises(ValueError, match="powers of two"):  # 6 query heads a KV head (Qwen2-7B has 7)
        Int4DecodeStep(layers, StepShape(12, 2, 16, 32, 1e-5, 0.25), TINY)
    with pytest.raises(ValueError, match="MMA"):  # attention's tl.dot: keys and head dims of at least 16
        Int4DecodeStep(layers, shape, replace(TINY, bt=8))
    with pytest.raises(ValueError, match="head_dim 8"):
        Int4DecodeStep(layers, StepShape(8, 2, 8, 32, 1e-5, 0.25), TINY)
    with pytest.raises(ValueError, match="KV cache's dtype"):
        Int4DecodeStep([StepLayer(**{**vars(layers[0]), "kv_cache": layers[0].kv_cache.half()})], shape, TINY)
    with pytest.raises(ValueError, match="gate_up.qweight"):
        bad = StepLayer(**{**vars(layers[0]), "gate_up": layers[0].o})
        Int4DecodeStep([bad], shape, TINY)
    step = Int4DecodeStep(layers, shape, TINY)
    with pytest.raises(ValueError, match="trace"):  # its clock reads are inline PTX: not under the interpreter
        trace = torch.zeros(len(step.plan.rows), 5, dtype=torch.int64)
        step(torch.zeros(64), torch.tensor([1], dtype=torch.int32), torch.zeros(2, dtype=torch.int32), rope_cache(4, 16),
             trace=trace)  # fmt: skip


# Compiles the step kernel for sm_90 (argv: constexprs as JSON) with the launch's 16-aligned pointers and sizes, and
# prints ptxas's report and how many cp.async copies (LDGSTS: the GEMV loop's pipelined loads) the SASS has.
_COMPILE_SM90 = (
    """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.int4_decode_step import _int4_decode_step_kernel as kernel
c = json.loads(sys.argv[1])
types = {"tasks_ptr": "*i32", "cnt_ptr": "*i32", "ptrs_ptr": "*i64", "qw_base": "*i32", "s_base": "*bf16",
         "z_base": "*u8", "kv_base": "*bf16", "ws_o": "*fp32", "ws_m": "*fp32",
         "ws_l": "*fp32", "gws_ptr": "*fp32", "proj_ptr": "*i32", "bt_ptr": "*i32", "seq_len_ptr": "*i32", "cs_ptr": "*fp32", "trace_ptr": "*i64", "scale": "fp32", "eps": "fp32",
         "v_off": "i64"}
names = kernel.arg_names
signature = {a: "constexpr" if a in c else types.get(a, "*bf16" if a.endswith("_ptr") else "i32") for a in names}
aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
           if a.endswith(("_ptr", "_base")) or a in ("ws_o", "ws_m", "ws_l", "H", "INTER", "v_off")}
cap = {"maxnreg": int(sys.argv[2])} if len(sys.argv) > 2 else {}  # a register cap: a test of the spill check
compiled = triton.compile(ASTSource(kernel, signature, c, aligned), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, **cap})
"""
    + PTXAS_REPORT
    + r"""
print("LDGSTS" * sass.count("LDGSTS"))
print("GLOBALTIMER" * compiled.asm["ptx"].count("%globaltimer"))
print("COPY16" * sum("cp.async" in line and "0x10" in line for line in compiled.asm["ptx"].splitlines()))
import re
code = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,5})\*/\s+([^;]*);", sass)]
spans = [(int(m.group(1), 16), a) for a, op in code if (m := re.search(r"BRA 0x([0-9a-f]+)", op)) and int(m.group(1), 16) < a]
inner = [(lo, hi) for lo, hi in spans if not any(lo <= lo2 and hi2 <= hi and (lo2, hi2) != (lo, hi) for lo2, hi2 in spans)]
print("INNERSPILL" * sum(1 for a, op in code if ("LDL" in op or "STL" in op) and any(lo <= a <= hi for lo, hi in inner)))
print("INNERLOOPS" * len(inner))
# attention's key loop: the inner loop of mma.sync (HMMA), its length
print("ATTNLOOP", *[sum(lo <= a <= hi for a, _ in code) for lo, hi in inner
                    if any(lo <= a <= hi and op.split()[0].startswith("HMMA") for a, op in code)])
"""
)


@pytest.mark.parametrize("trace", [False, True], ids=["", "trace"])
def test_compiles_for_sm90(trace: bool) -> None:
    """The 8B shape's constexprs at the default tiles: no spills (none inside the inner loops, the GEMV's and
    attention's, nor outside them), and both loops' loads pipelined through 16-byte cp.async (the spin-waits, atomics
    and pointer table compile as the interpreter ran them); with TRACE (inline PTX, which the interpreter cannot run)
    the clock reads are in the code. Two programs an SM's worth of registers."""
    tiles = StepTiles()
    constexprs = {"GROUP": 128, "HP": 4096, "D": 128, "QG": 4, "BS": 16, "BT": tiles.bt, "PP": tiles.parts,
                  "BK": tiles.bk, "TN": tiles.tn, "NUM_STAGES": tiles.num_stages, "TRACE": trace,
                  "COMPILED": True}  # fmt: skip
    report = run_without_interpreter(_COMPILE_SM90, json.dumps(constexprs))
    assert "INNERLOOPS" in report and "INNERSPILL" not in report, report
    assert "0 bytes spill stores" in report, report
    assert "LDGSTS" in report, report
    assert report.count("GLOBALTIMER") == 4 * trace, report  # four clock reads a task
    # attention's products on the tensor cores: 233 SASS instructions a 16-key tile (Triton 3.7), against 2,058 on
    # the CUDA cores (348 shuffles, 14 barriers) before Session 30
    attn_loop = [int(n) for n in report.split("ATTNLOOP")[1].split("\n")[0].split()]
    assert len(attn_loop) == 1 and attn_loop[0] <= 300, report
    assert int(report.split("Used ")[1].split()[0]) <= 255, report
    # 16-byte copies a thread: the weights' (2 a stage, 8 in the PTX) and the keys' and values' (4 a stage, 8 in the
    # PTX: the tl.dot loop's pipeline), all addressed from kernel arguments, not loaded pointers (on the H200 at
    # 4c712e6 the words' were 4 bytes wide, and K and V were 32 scalar 2-byte loads a thread a tile, outside the
    # pipeline, until 98e2ab8)
    assert report.count("COPY16") >= 8 + 8, report


def test_the_spill_check_finds_spills_in_the_loops() -> None:
    """The check above, under a register cap of 64 a thread (at 96 ptxas still keeps the inner loops free): spills
    inside the inner loops, and it sees them."""
    constexprs = {"GROUP": 128, "HP": 4096, "D": 128, "QG": 4, "BS": 16, "BT": 16, "PP": 16, "BK": 128, "TN": 64,
                  "NUM_STAGES": 4, "TRACE": False, "COMPILED": True}  # fmt: skip
    report = run_without_interpreter(_COMPILE_SM90, json.dumps(constexprs), "64")
    assert "INNERSPILL" in report, report


def test_bench_checks_an_engine_model_on_cpu(tmp_path: Path) -> None:
    """``loadtest.decode_step_bench --tiny``: the engine's own tiny int4 model (2 layers, its KV cache and rope
    table) through the kernel and the reference."""
    out = tmp_path / "step.json"
    assert decode_step_bench.main(["--tiny", "--max-model-len", "256", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["context"] == 40 and row["rel_err"] < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tiles", [StepTiles(fine_deps=False), StepTiles()], ids=["phases", "fine"])
@pytest.mark.parametrize("seq_len", [1, 300, 2049])
def test_8b_shapes_on_the_gpu(seq_len: int, tiles: StepTiles, gen: torch.Generator) -> None:
    """Two layers of the 8B shape in bf16 (32 query heads on 8 KV heads, group 128) at the default tiles and the
    phase waits: within bf16's tolerance of the reference; twice, from a CUDA graph (the counters reset by the
    kernel); then traced."""
    shape = StepShape(heads=32, kv_heads=8, head_dim=128, group_size=128, eps=1e-5, scale=128**-0.5)
    layers = make_layers(2, 4096, shape, 14336, 160, 16, torch.bfloat16, gen)
    ref_layers = [StepLayer(**{**vars(lr), "kv_cache": lr.kv_cache.clone()}) for lr in layers]
    block_table = torch.randperm(160, generator=gen)[:130].to(torch.int32).to(DEVICE)
    cs = rope_cache(4096, 128)
    step = Int4DecodeStep(layers, shape, tiles)
    embedding = torch.randn(4096, generator=gen).to(torch.bfloat16).to(DEVICE)
    hidden = embedding.clone()
    seq = torch.tensor([seq_len], dtype=torch.int32, device=DEVICE)
    step(hidden, seq, block_table, cs)  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(hidden, seq, block_table, cs)
    for _ in range(2):
        want = int4_decode_step_ref(ref_layers, shape, embedding.clone(), seq_len, block_table, cs)
        hidden.copy_(embedding)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(hidden, want) < 1e-2
        for got, ref in zip(layers, ref_layers, strict=True):
            assert rel_err(got.kv_cache, ref.kv_cache) < 1e-2
        assert not step.counters.any()
    trace = torch.zeros(len(step.plan.rows), 5, dtype=torch.int64, device=DEVICE)
    hidden.copy_(embedding)
    step(hidden, seq, block_table, cs, trace=trace)  # traced: the same result, every task's row filled in order
    assert rel_err(hidden, want) < 1e-2
    top, claimed, ready, end, who = trace.T
    assert bool(((top > 0) & (claimed >= top) & (ready >= claimed) & (end >= ready)).all())
    assert int((who >> 16).max()) < step.grid


def engine_tokens_with_the_step(
    monkeypatch: pytest.MonkeyPatch, device: str, num_prompts: int, max_tokens: int
) -> dict[tuple[bool, bool], list[Any]]:
    """The engine's tiny int4 model (random weights, GPTQ group 128) in fp32 on ``device``, one sequence at a time:
    the greedy tokens layer by layer, and with every layer in one launch (phase waits, then fine waits)."""
    from engine import LLM, SamplingParams
    from engine.models import decode_step
    from loadtest.int4_model import quantized_shape_folder

    folder = quantized_shape_folder("tiny", 128)
    prompts = [{"prompt_token_ids": list(range(5 + i, 30 + 3 * i))} for i in range(num_prompts)]
    monkeypatch.setattr(decode_step, "DECODE_STEP_DEVICES", (device,))
    tokens = {}
    for on, fine in ((False, False), (True, False), (True, True)):
        monkeypatch.setattr(decode_step, "DECODE_STEP", on)
        monkeypatch.setattr(decode_step, "DECODE_STEP_TILES", StepTiles(fine_deps=fine))
        with LLM(str(folder), load_format="dummy", skip_tokenizer_init=True, device=device, dtype="float32",
                 max_num_seqs=1, max_model_len=128, num_gpu_blocks_override=32) as llm:  # fmt: skip
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens[on, fine] = [list(o.outputs[0].token_ids) for o in outs]
            path = llm.engine.executor.runner.model.model.decode_step  # type: ignore[attr-defined]
            assert (path.step is not None) == on
            assert path.step is None or path.step[1].tiles.fine_deps == fine
    return tokens


def test_engine_step_tokens_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU test below, under the interpreter (shorter): the same tokens whichever path a decode step takes."""
    tokens = engine_tokens_with_the_step(monkeypatch, "cpu", 1, 4)
    assert tokens[False, False] == tokens[True, False] == tokens[True, True] and len(tokens[False, False][0]) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_step_tokens_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU the batch-1 decode steps replay a CUDA graph captured with the one-launch kernel in it (its
    counters reset by the kernel between replays): the same greedy tokens as layer by layer, in fp32."""
    tokens = engine_tokens_with_the_step(monkeypatch, "cuda", 2, 24)
    assert tokens[False, False] == tokens[True, False] == tokens[True, True]
