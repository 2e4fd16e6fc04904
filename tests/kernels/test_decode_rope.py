"""Decode attention that rotates q / k and stores the new K/V itself (kernels.decode_rope) against the two
launches it replaces (rope_and_cache, then the decode kernel) and against the torch references."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from kernels.decode_rope import DecodeRope, paged_decode_attention_rope, paged_decode_attention_rope_ref
from kernels.paged_attention import _paged_decode_attention
from kernels.rope_cache import rope_and_cache
from tests.kernels.helpers import DEVICE, paged_cache, rel_err, run_without_interpreter, tolerance

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Compiles the decode kernel for sm_90 (no GPU needed) with the launcher's specialization of 16-aligned
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
_DECODE_8B = {
    "GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "BLOCK_SIZE": 16, "BLOCK_N": 64,
    "PARTITION_SIZE": 128, "SINGLE_PARTITION": False, "USE_WINDOW": False, "DOT_PRECISION": "tf32",
    "UPCAST": False, "DYNAMIC": False, "STEP_ROWS": False, "ROPE": False, "FENCE": False, "EARLY": False,
}  # fmt: skip


def _cos_sin(max_pos: int, head_dim: int) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)


def _step(
    lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    pad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecodeRope]:
    """A decode step as the engine makes it: a paged cache whose new-token slots hold NaN (so a read before
    the write shows), raw q / k / v as views of one QKV output, the new token's position and slot (with
    ``pad``, the last row is a graph's padding: slot -1)."""
    cache, tables = paged_cache(lens, 16, kv_heads, head_dim, dtype, gen)
    cache, tables = cache.to(DEVICE), tables.to(DEVICE)
    last = torch.tensor(lens) - 1
    blocks = tables.cpu()[torch.arange(len(lens)), last // 16].to(torch.long)
    slots = blocks * 16 + last % 16
    if pad:
        slots[-1] = -1
    for s in slots[: len(lens) - pad].tolist():
        cache[:, s // 16, s % 16] = float("nan")
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(len(lens), heads, head_dim)
    k, v = k.view(len(lens), kv_heads, head_dim), v.view(len(lens), kv_heads, head_dim)
    rope = DecodeRope(last.to(DEVICE), k, v, _cos_sin(max(lens) + 8, head_dim), slots.to(DEVICE))
    return cache, tables, q, rope


def _unfused(
    q: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    rope: DecodeRope,
    **knobs: Any,
) -> torch.Tensor:
    rotated = rope_and_cache(rope.positions, q, rope.key, rope.value, rope.cos_sin_cache, cache, rope.slot_mapping)
    return _paged_decode_attention(rotated, cache, tables, lens, scale, knobs.pop("sliding_window", None), **knobs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "knobs",
    [{}, {"partition_size": 32}, {"dynamic": True}, {"sliding_window": 24, "partition_size": 32},
     {"partition_size": 32, "early": True}],
    ids=["one", "p32", "dyn", "window", "p32-early"],
)  # fmt: skip
def test_decode_rope_equals_rope_and_cache_then_decode(
    dtype: torch.dtype, knobs: dict[str, Any], gen: torch.Generator
) -> None:
    """Bit for bit: the same output and the same cache as the two launches it replaces; within tolerance
    of the torch references."""
    lens = [1, 17, 100, 5]
    cache, tables, q, rope = _step(lens, 8, 2, 32, dtype, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    cache_unfused, cache_ref = cache.clone(), cache.clone()
    window = knobs.get("sliding_window")
    plan = {k: v for k, v in knobs.items() if k != "sliding_window"}
    out = paged_decode_attention_rope(q, cache, tables, seq_lens, 0.17, rope, window, block_n=16, **plan)
    expected = _unfused(q, cache_unfused, tables, seq_lens, 0.17, rope, block_n=16, **{**knobs, "early": False})
    assert torch.equal(out[:-1], expected[:-1]), f"seed {gen.initial_seed()}"
    assert torch.equal(cache.nan_to_num(7.0), cache_unfused.nan_to_num(7.0))  # the padding row wrote nothing
    ref = paged_decode_attention_rope_ref(q, cache_ref, tables, seq_lens, 0.17, rope, window)
    assert rel_err(out[:-1], ref[:-1]) < tolerance(dtype), f"seed {gen.initial_seed()}"


def test_decode_rope_refuses_mixed_steps_and_bad_inputs(gen: torch.Generator) -> None:
    lens = [3, 9]
    cache, tables, q, rope = _step(lens, 4, 2, 32, torch.float32, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="decode steps only"):
        _paged_decode_attention(q, cache, tables, seq_lens, 0.1, query_start_loc=qsl, out=q.clone(), rope=rope)
    bad = DecodeRope(rope.positions, rope.key, rope.value, rope.cos_sin_cache[:, :16], rope.slot_mapping)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        paged_decode_attention_rope(q, cache, tables, seq_lens, 0.1, bad)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("early", [None, True], ids=["default", "early"])
@pytest.mark.parametrize("lens", [[8192], [1, 300, 4095, 1024] * 16, [40000]], ids=["b1_8k", "b64", "b1_40k"])
def test_decode_rope_bit_equal_on_the_gpu_at_8b_heads(
    lens: list[int], early: bool | None, gen: torch.Generator
) -> None:
    """At the 8B shape's heads in bf16, default plans (fixed and dynamic partitions): the compiled kernel rotates
    as rope_and_cache does (fp32, the same contractions), so the outputs and the caches are equal bit for bit,
    and the new token's partition reads the key it stored (its slot held NaN before). b64 failed on the H200 for
    every seed (2026-12-04, loadtest.decode_rope_probe) by a bf16 ulp in 1-2 rows: ptxas contracted the rotation's
    products differently in the two kernels until kernels.rotary._rotate spelled out the fma. ``early``: the inputs
    loaded before the PDL wait (kernels.paged_attention.DECODE_EARLY_INPUTS); the reference path loads none."""
    cache, tables, q, rope = _step(lens, 32, 8, 128, torch.bfloat16, gen, pad=len(lens) > 1)
    n = len(lens) - (len(lens) > 1)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    cache_unfused = cache.clone()
    out = paged_decode_attention_rope(q, cache, tables, seq_lens, 0.088, rope, early=early)  # batch 1: PDL
    expected = _unfused(q, cache_unfused, tables, seq_lens, 0.088, rope, early=False)
    assert not out[:n].isnan().any() and torch.equal(out[:n], expected[:n])
    assert torch.equal(cache.nan_to_num(7.0), cache_unfused.nan_to_num(7.0))


@pytest.mark.parametrize("early", [False, True])
def test_new_kv_stores_come_before_the_tile_loads_in_the_sm90_code(early: bool) -> None:
    """The interpreter runs a program's ops one by one, so it cannot show a tile load that overtakes the new
    token's store. The kernel compiled for sm_90 (dynamic partitions, the pipelined loads of batch 1 over a long
    table) must store the key and value, then a CTA barrier, and only then start its first K / V copy."""
    c = {**_DECODE_8B, "ROPE": True, "DYNAMIC": True, "FENCE": True, "EARLY": early}
    ir = run_without_interpreter(_COMPILE_SM90, json.dumps(c)).splitlines()
    first_copy = next(i for i, line in enumerate(ir) if "async_copy_global_to_local" in line)
    stores = [i for i in range(first_copy) if "tt.store" in ir[i]]
    assert len(stores) == 2, "the rotated key and the value"
    between = ir[stores[-1] : first_copy]
    fence = next(i for i, line in enumerate(between) if "fence.acq_rel.gpu" in line)
    assert any("barrier" in line for line in between[fence:]), "\n".join(between)


def test_engine_fuses_rope_only_in_small_decode_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's switch (engine.attention.fuses_rope): decode-only steps of the Triton backend with at most
    DECODE_ROPE_MAX_SEQS sequences (a graph's padded batch counts), never a prefill or the torch backend."""
    from engine import attention

    def meta(num_seqs: int, max_query_len: int = 1, backend: str = "triton") -> attention.AttentionMetadata:
        lens = torch.full((num_seqs,), 5, dtype=torch.int32)
        return attention.AttentionMetadata(
            slot_mapping=torch.zeros(num_seqs, dtype=torch.int64),
            query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
            seq_lens=lens,
            block_tables=torch.zeros(num_seqs, 1, dtype=torch.int32),
            max_query_len=max_query_len,
            max_seq_len=5,
            backend=backend,
        )

    monkeypatch.setattr(attention, "DECODE_ROPE_MAX_SEQS", 16)
    assert attention.fuses_rope(meta(1)) and attention.fuses_rope(meta(16))
    assert not attention.fuses_rope(meta(17))
    assert not attention.fuses_rope(meta(4, max_query_len=3))
    assert not attention.fuses_rope(meta(4, backend="torch"))
    monkeypatch.setattr(attention, "DECODE_ROPE_MAX_SEQS", 0)
    assert not attention.fuses_rope(meta(1))
