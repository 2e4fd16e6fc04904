"""The int4 MLP in one launch (``kernels.int4_mlp``). Under the interpreter on CPU, tiny shapes: bit for bit the
two GEMV launches it replaces when they run the same tiles (gate_up unsplit with the same K tile, the down
projection split into the same ``block_i`` pieces with atomics: the interpreter runs programs in order, so the
fp32 sums meet in the same order), close to the dequantize-then-matmul reference in fp32 and fp16, the
accumulators left at zero. Its refusals; the kernel compiled for sm_90; on a GPU the 8B shapes against the two
GEMVs, eager and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from kernels.int4_config import Int4GemmConfig
from kernels.int4_gemm import int4_gemm, int4_gemm_gated
from kernels.int4_mlp import Int4Weights, MlpTile, fused_mlp_fits, int4_mlp, int4_mlp_ref
from kernels.int4_split import zeroed_scratch
from tests.kernels.helpers import DEVICE, capture_graph, int4_weights, rel_err, tolerance, ttgir_sm90

HIDDEN, INTER = 128, 64


def _mlp(
    hidden: int, inter: int, groups: tuple[int, int], dtype: torch.dtype, gen: torch.Generator
) -> tuple[Int4Weights, Int4Weights]:
    """gate_up ``[H // 8, 2I]`` and down ``[I // 8, H]`` with random codes, scales and zeros, on DEVICE."""
    ws = []
    for (k, n), group in zip(((hidden, 2 * inter), (inter, hidden)), groups, strict=True):
        _, qweight, scales, zeros, _ = int4_weights(k, n, group, False, dtype, gen)
        ws.append(Int4Weights(qweight.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), group))
    return ws[0], ws[1]


def _two_launches(x: torch.Tensor, gate_up: Int4Weights, down: Int4Weights, tile: MlpTile) -> torch.Tensor:
    """The GEMVs the fused kernel replaces, on its tiles: gate_up unsplit, down split by block_i (atomic)."""
    inter = down.qweight.shape[0] * 8
    gu_cfg = Int4GemmConfig(kernel="gemv", block_k=tile.block_k, split_k=1, subnormal=tile.subnormal)
    dn_cfg = Int4GemmConfig(
        kernel="gemv", block_n=tile.block_n, block_k=tile.block_i, split_k=inter // tile.block_i,
        split_reduce="atomic", subnormal=tile.subnormal,
    )  # fmt: skip
    x2 = int4_gemm(x, gate_up.qweight, gate_up.scales, gate_up.zeros, gate_up.group_size, config=gu_cfg)
    return int4_gemm_gated(x2, down.qweight, down.scales, down.zeros, down.group_size, config=dn_cfg)


CASES = [
    # (groups (gate_up, down), tile)
    ((32, 32), MlpTile(block_i=16, block_k=32, block_n=64, subnormal=True)),
    ((32, 32), MlpTile(block_i=16, block_k=32, block_n=64, subnormal=False)),
    ((HIDDEN, INTER), MlpTile(block_i=32, block_k=64, block_n=128, subnormal=True)),  # channel-wise groups
    ((64, 16), MlpTile(block_i=8, block_k=16, block_n=32, subnormal=True)),  # one word row of down a program
    ((32, INTER), MlpTile(block_i=INTER, block_k=32, block_n=128, subnormal=False)),  # one program: no split
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("groups", "tile"), CASES)
def test_fused_mlp_is_the_two_gemvs(
    dtype: torch.dtype, groups: tuple[int, int], tile: MlpTile, gen: torch.Generator
) -> None:
    gate_up, down = _mlp(HIDDEN, INTER, groups, dtype, gen)
    x = torch.randn(1, HIDDEN, generator=gen).to(dtype).to(DEVICE)
    out = int4_mlp(x, gate_up, down, tile)
    seed = f"seed {gen.initial_seed()}"
    assert out.dtype == dtype and out.shape == (1, HIDDEN)
    assert torch.equal(out, _two_launches(x, gate_up, down, tile)), seed
    if dtype != torch.bfloat16:  # the interpreter truncates fp32 -> bf16 where torch rounds (test_gemv.py)
        assert rel_err(out, int4_mlp_ref(x, gate_up, down)) < 4 * tolerance(dtype), seed
    assert not zeroed_scratch(x.device, torch.int32, 1).any() and not zeroed_scratch(x.device, torch.float32, 1).any()


def test_fused_mlp_refuses_what_it_does_not_fit(gen: torch.Generator) -> None:
    gate_up, down = _mlp(HIDDEN, INTER, (32, 32), torch.float32, gen)
    x = torch.randn(1, HIDDEN, generator=gen).to(DEVICE)
    tile = MlpTile(block_i=16, block_k=32, block_n=64)
    assert fused_mlp_fits(x, gate_up, down, tile)
    act_order = Int4Weights(down.qweight, down.scales, down.zeros, 32, torch.zeros(INTER, dtype=torch.int32).to(DEVICE))
    refused = {
        "two rows": (torch.randn(2, HIDDEN).to(DEVICE), gate_up, down, tile),
        "K tile past a group": (x, gate_up, down, MlpTile(block_i=16, block_k=64, block_n=64)),
        "block_i past down's group": (x, gate_up, down, MlpTile(block_i=64, block_k=32, block_n=64)),
        "block_n past H": (x, gate_up, down, MlpTile(block_i=16, block_k=32, block_n=256)),
        "gate_up not [H // 8, 2I]": (x, down, down, tile),
        "act-order": (x, gate_up, act_order, tile),
    }
    for why, (xx, gu, dn, t) in refused.items():
        assert not fused_mlp_fits(xx, gu, dn, t), why
        with pytest.raises(ValueError):
            int4_mlp(xx, gu, dn, t)


def test_fused_mlp_compiles_for_sm90() -> None:
    """The interpreter runs Python on numpy and checks no types: the kernel must also compile (bf16)."""
    constexprs: dict[str, object] = {
        "GATE_GROUP": 128, "DOWN_GROUP": 128, "BLOCK_I": 32, "BLOCK_K": 64, "BLOCK_N": 512, "NUM_STAGES": 3,
        "SUBNORMAL": True, "SPLIT_MODE": 2,
    }  # fmt: skip
    ttgir = ttgir_sm90("mlp", constexprs, 4)
    assert "math.exp" in ttgir and "tt.atomic_rmw" in ttgir


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "tile", [MlpTile(), MlpTile(block_i=16, num_warps=2), MlpTile(block_i=64, block_k=128, subnormal=False)]
)
def test_fused_mlp_at_8b_shapes_on_gpu(tile: MlpTile, gen: torch.Generator) -> None:
    gate_up, down = _mlp(4096, 14336, (128, 128), torch.bfloat16, gen)
    x = torch.randn(1, 4096, generator=gen).to(torch.bfloat16).to(DEVICE)
    ref = _two_launches(x, gate_up, down, tile)
    out = int4_mlp(x, gate_up, down, tile)
    seed = f"seed {gen.initial_seed()}"
    assert rel_err(out, ref) < 2e-2, seed  # bf16 outputs; only the fp32 atomics' order differs
    assert rel_err(out, int4_mlp_ref(x, gate_up, down)) < 3e-2, seed
    graph, replayed = capture_graph(lambda: int4_mlp(x, gate_up, down, tile))
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(replayed, out) < 2e-2, seed
    assert not zeroed_scratch(x.device, torch.int32, 1).any() and not zeroed_scratch(x.device, torch.float32, 1).any()
