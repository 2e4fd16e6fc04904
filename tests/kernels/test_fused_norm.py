"""RMSNorm carried by the dense GEMVs (``kernels.fused_norm``): a producer GEMV adds the residual and writes each
tile's sums of squares, a consumer GEMV normalizes from them what it loads. Under the interpreter on CPU, tiny
shapes, ``kernels.gemv``'s every split-K reduction:

- the producer's ``h`` is bit for bit the same kernel's output plus the residual (as ``rms_norm_ref`` adds
  them), its partial sums of squares match each tile's in fp32;
- the consumer equals the same GEMV of ``rms_norm_ref(h)``: the squares are summed in another order, so fp16
  activations may round an ulp apart (bound 1e-3).
fp16, not bf16: the interpreter truncates fp32 -> bf16 casts where torch rounds (``test_gemv.py``)."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_norm import MAX_PARTS, NormIn, materialize, normed_ref, residual_sum_ref
from kernels.gemv import (
    GemvConfig,
    gemv,
    gemv_gated,
    gemv_normed,
    gemv_residual,
    linear_normed,
    linear_residual,
    scratch_is_zero,
    takes_gemv,
)
from tests.kernels.helpers import DEVICE, rel_err, ttgir_sm90

EPS = 1e-5
DENSE = [
    GemvConfig(kernel="fma", block_n=4, block_k=16, split_k=1),
    GemvConfig(kernel="fma", block_n=4, block_k=16, split_k=3, split_reduce="counter"),
    GemvConfig(kernel="dot", block_n=16, block_k=16, split_k=2, split_reduce="atomic"),
]


def _norm_in(m: int, k: int, parts: int, dtype: torch.dtype, gen: torch.Generator) -> NormIn:
    """h as a producer leaves it: the sum of two activations, with its sums of squares over ``parts`` slices."""
    out, res = (torch.randn(m, k, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    h, sumsq = residual_sum_ref(out, res, parts)
    weight = (1 + 0.5 * torch.randn(k, generator=gen)).to(dtype).to(DEVICE)
    return NormIn(h, sumsq, weight, EPS)


def _tiles_sumsq(h: torch.Tensor, block_n: int) -> torch.Tensor:
    """Sums of squares over each ``block_n`` columns (the last tile shorter)."""
    sq = h.float().pow(2)
    return torch.stack([sq[:, i : i + block_n].sum(-1) for i in range(0, h.shape[1], block_n)], dim=1)


@pytest.mark.parametrize("config", DENSE, ids=lambda c: f"{c.kernel}-split{c.split_k}")
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("parts", [1, 5])
def test_dense_consumer(config: GemvConfig, m: int, parts: int, gen: torch.Generator) -> None:
    k, n = 80, 37
    norm = _norm_in(m, k, parts, torch.float16, gen)
    w = torch.randn(n, k, generator=gen).to(torch.float16).to(DEVICE)
    out = gemv_normed(norm, w, None, config)
    assert rel_err(out, gemv(normed_ref(norm), w, None, config)) < 1e-3, f"seed {gen.initial_seed()}"
    assert scratch_is_zero()


@pytest.mark.parametrize("config", DENSE, ids=lambda c: f"{c.kernel}-split{c.split_k}")
@pytest.mark.parametrize("gated", [False, True])
def test_dense_producer(config: GemvConfig, gated: bool, gen: torch.Generator) -> None:
    m, k, n = 2, 48, 37
    x = torch.randn(m, 2 * k if gated else k, generator=gen).to(torch.float16).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(torch.float16).to(DEVICE)
    res = torch.randn(m, n, generator=gen).to(torch.float16).to(DEVICE)
    h, sumsq = gemv_residual(x, w, res, config, gated=gated)
    assert config.block_n is not None
    plain = (gemv_gated if gated else gemv)(x, w, None, config)
    if config.split_reduce != "atomic":
        assert torch.equal(h, res + plain)
    assert rel_err(h, res + plain) < 1e-3
    assert sumsq.shape == (m, -(-n // config.block_n))
    assert torch.allclose(sumsq, _tiles_sumsq(h, config.block_n), rtol=1e-5)
    assert scratch_is_zero()


def test_bad_statistics_are_refused(gen: torch.Generator) -> None:
    norm = _norm_in(2, 32, 1, torch.float16, gen)
    w = torch.randn(8, 32, generator=gen).to(torch.float16).to(DEVICE)
    for bad in (
        NormIn(norm.h, norm.sumsq.double(), norm.weight, EPS),
        NormIn(norm.h, norm.sumsq[:1], norm.weight, EPS),
        NormIn(norm.h, torch.zeros(2, MAX_PARTS + 1, device=DEVICE), norm.weight, EPS),
        NormIn(norm.h, norm.sumsq, norm.weight.float(), EPS),
    ):
        with pytest.raises(ValueError, match="fused norm"):
            gemv_normed(bad, w)


@pytest.mark.parametrize("switch", ["NORMED", "ADD_RESIDUAL"])
def test_fused_kernels_compile_for_sm90(switch: str) -> None:
    """The interpreter checks no types: the GEMV with each switch on must also compile (bf16, sm_90)."""
    dense: dict[str, object] = {
        "HAS_BIAS": False, "USE_DOT": False, "BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 512, "NUM_STAGES": 3,
        "SPLIT_MODE": 0, "EVEN": True, "PDL": False, "GATED": switch == "ADD_RESIDUAL",
    }  # fmt: skip
    ir = ttgir_sm90("dense", {**dense, switch: True, "PARTS": 1024}, 2)
    assert ("math.sqrt" in ir or "math.rsqrt" in ir) if switch == "NORMED" else "tt.reduce" in ir


# ---- on the GPU, the 8B shapes at batch 1 (bf16) ----

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
HIDDEN, QKV, INTER = 4096, 6144, 14336


def _gpu_norm_in(parts: int, gen: torch.Generator) -> NormIn:
    h = (4 * torch.randn(1, HIDDEN, generator=gen)).to(torch.bfloat16).cuda()
    weight = (1 + 0.3 * torch.randn(HIDDEN, generator=gen)).to(torch.bfloat16).cuda()
    _, sumsq = residual_sum_ref(torch.zeros_like(h), h, parts)
    return NormIn(h, sumsq, weight, EPS)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("n", "parts"), [(QKV, 1024), (2 * INTER, 16)])  # qkv; gate_up (the norm's own launch)
def test_consumers_at_8b_shapes(n: int, parts: int, gen: torch.Generator) -> None:
    norm = _gpu_norm_in(parts, gen)
    normed = materialize(norm)  # the Triton norm kernel
    w = (0.02 * torch.randn(n, HIDDEN, generator=gen)).to(torch.bfloat16).cuda()
    out, ref = linear_normed(norm, w), gemv(normed, w)
    assert rel_err(out, ref) < 2e-3, f"seed {gen.initial_seed()}"  # an ulp of a few activations apart


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("k", "gated"), [(HIDDEN, False), (INTER, True)])  # o_proj, down_proj
def test_producers_at_8b_shapes(k: int, gated: bool, gen: torch.Generator) -> None:
    x = torch.randn(1, 2 * k if gated else k, generator=gen).to(torch.bfloat16).cuda()
    res = (4 * torch.randn(1, HIDDEN, generator=gen)).to(torch.bfloat16).cuda()
    w = (0.02 * torch.randn(HIDDEN, k, generator=gen)).to(torch.bfloat16).cuda()
    h, sumsq = linear_residual(x, w, res, gated)
    assert torch.equal(h, res + (gemv_gated if gated else gemv)(x, w))
    width = -(-HIDDEN // sumsq.shape[1])
    assert sumsq.shape[1] > 1 and torch.allclose(sumsq, _tiles_sumsq(h, width), rtol=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_which_8b_layers_take_the_gemv() -> None:
    """The engine fuses a norm only where both GEMVs around it run (``engine.models.llama``): at batch 1 the 8B
    qkv and the gated down projection do, gate_up (cuBLAS) does not, nor 9 rows (above ``GEMV_MAX_M``)."""

    def weight(n: int, k: int) -> torch.Tensor:
        return torch.empty(n, k, dtype=torch.bfloat16, device="cuda")

    assert takes_gemv(1, weight(QKV, HIDDEN)) and takes_gemv(1, weight(HIDDEN, INTER), gated=True)
    assert not takes_gemv(1, weight(2 * INTER, HIDDEN)) and not takes_gemv(9, weight(QKV, HIDDEN))
    assert not takes_gemv(1, weight(QKV, HIDDEN).float())
