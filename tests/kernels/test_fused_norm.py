"""RMSNorm carried by the GEMVs (``kernels.fused_norm``): a producer GEMV adds the residual and writes each
tile's sums of squares (the 4-bit one, asked, also ``g = h * weight``), a consumer GEMV normalizes from them
what it loads (dense) or its sums (4-bit, reading ``g``: late). Under the interpreter on CPU, tiny shapes, both
GEMV families (dense ``kernels.gemv``, 4-bit ``kernels.int4_gemv``), every split-K reduction:

- the producer's ``h`` is bit for bit the same kernel's output plus the residual (as ``rms_norm_ref`` adds
  them), its partial sums of squares match each tile's in fp32, its ``g`` is ``scaled_ref(h)`` bit for bit;
- the consumer equals the same GEMV of ``rms_norm_ref(h)``: the squares are summed in another order (and the
  late norm rounds ``h * weight`` instead), so fp16 activations may round an ulp apart (bound 1e-3), fp32 ones
  tightly;
- launches that cannot fuse (a tl.dot tile) fall back to the norm's own launch / a torch sum, same results.
fp16, not bf16: the interpreter truncates fp32 -> bf16 casts where torch rounds (``test_gemv.py``)."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_norm import MAX_PARTS, NormIn, materialize, normed_ref, residual_sum_ref, scaled_ref
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
from kernels.int4_config import Int4GemmConfig
from kernels.int4_gemm import int4_gemm, int4_gemm_gated, int4_gemm_normed, int4_gemm_residual
from tests.kernels.helpers import DEVICE, int4_weights, rel_err, ttgir_sm90

EPS = 1e-5
DENSE = [
    GemvConfig(kernel="fma", block_n=4, block_k=16, split_k=1),
    GemvConfig(kernel="fma", block_n=4, block_k=16, split_k=3, split_reduce="counter"),
    GemvConfig(kernel="dot", block_n=16, block_k=16, split_k=2, split_reduce="atomic"),
]
INT4 = [  # (group_size, act_order, config)
    (32, False, Int4GemmConfig(kernel="gemv", subnormal=False)),  # factored, split-K picked (atomic)
    (32, False, Int4GemmConfig(kernel="gemv", subnormal=True, block_n=16, split_k=2, split_reduce="counter")),
    (32, True, Int4GemmConfig(kernel="gemv")),  # g_idx: the exact path
    (128, False, Int4GemmConfig(kernel="gemv", block_k=32, split_k=1)),  # channel-wise, no split
]


def _norm_in(m: int, k: int, parts: int, dtype: torch.dtype, gen: torch.Generator) -> NormIn:
    """h as a producer leaves it: the sum of two activations, with its sums of squares over ``parts`` slices and
    ``g = h * weight``."""
    out, res = (torch.randn(m, k, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    h, sumsq = residual_sum_ref(out, res, parts)
    weight = (1 + 0.5 * torch.randn(k, generator=gen)).to(dtype).to(DEVICE)
    return NormIn(h, sumsq, weight, EPS, scaled_ref(h, weight))


def _int4(
    k: int, n: int, group_size: int, act_order: bool, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    _, qw, s, z, g_idx = int4_weights(k, n, group_size, act_order, dtype, gen)
    return qw.to(DEVICE), s.to(DEVICE), z.to(DEVICE), None if g_idx is None else g_idx.to(DEVICE)


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


@pytest.mark.parametrize(("group_size", "act_order", "config"), INT4)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3])
def test_int4_consumer(
    group_size: int, act_order: bool, config: Int4GemmConfig, dtype: torch.dtype, m: int, gen: torch.Generator
) -> None:
    k, n = 128, 48
    qw, s, z, g_idx = _int4(k, n, group_size, act_order, dtype, gen)
    norm = _norm_in(m, k, 3, dtype, gen)
    out = int4_gemm_normed(norm, qw, s, z, group_size, g_idx, config)
    ref = int4_gemm(normed_ref(norm), qw, s, z, group_size, g_idx, config)
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-3), f"seed {gen.initial_seed()}"
    assert not torch.equal(out, ref) or dtype == torch.float32  # the late norm rounds elsewhere: it ran
    # without g (a producer that could not write it) the norm's own launch comes first: the reference exactly
    without_g = NormIn(norm.h, norm.sumsq, norm.weight, EPS)
    assert torch.equal(int4_gemm_normed(without_g, qw, s, z, group_size, g_idx, config), ref)


@pytest.mark.parametrize(("group_size", "act_order", "config"), INT4)
@pytest.mark.parametrize("gated", [False, True])
def test_int4_producer(
    group_size: int, act_order: bool, config: Int4GemmConfig, gated: bool, gen: torch.Generator
) -> None:
    m, k, n, dtype = 2, 128, 48, torch.float16
    qw, s, z, g_idx = _int4(k, n, group_size, act_order, dtype, gen)
    x = torch.randn(m, 2 * k if gated else k, generator=gen).to(dtype).to(DEVICE)
    res = torch.randn(m, n, generator=gen).to(dtype).to(DEVICE)
    nw = (1 + 0.5 * torch.randn(n, generator=gen)).to(dtype).to(DEVICE)
    h, sumsq, g = int4_gemm_residual(x, qw, s, z, group_size, g_idx, res, gated, config, scale=nw)
    plain = (int4_gemm_gated if gated else int4_gemm)(x, qw, s, z, group_size, g_idx, config)
    assert rel_err(h, res + plain) < 1e-3  # atomic split-K may sum in another order than the call before
    width = n // sumsq.shape[1]
    assert torch.allclose(sumsq, _tiles_sumsq(h, width), rtol=1e-5), f"seed {gen.initial_seed()}"
    assert g is not None and torch.equal(g, scaled_ref(h, nw))
    assert int4_gemm_residual(x, qw, s, z, group_size, g_idx, res, gated, config)[2] is None  # not asked


def test_int4_other_kernels_fall_back(gen: torch.Generator) -> None:
    """A tl.dot launch cannot fuse: the consumer runs the norm first, the producer sums with torch."""
    k, n, dtype = 64, 32, torch.float32
    qw, s, z, g_idx = _int4(k, n, 32, False, dtype, gen)
    cfg = Int4GemmConfig(kernel="dot", block_m=16, block_n=16, block_k=32)
    norm = _norm_in(2, k, 2, dtype, gen)
    out = int4_gemm_normed(norm, qw, s, z, 32, g_idx, cfg)
    assert rel_err(out, int4_gemm(normed_ref(norm), qw, s, z, 32, g_idx, cfg)) < 1e-6
    res = torch.randn(2, n, generator=gen).to(dtype).to(DEVICE)
    h, sumsq, g = int4_gemm_residual(norm.h, qw, s, z, 32, g_idx, res, False, cfg, scale=res[0])
    assert sumsq.shape == (2, 1) and torch.equal(h, res + int4_gemm(norm.h, qw, s, z, 32, g_idx, cfg))
    assert g is None  # the consumer then normalizes h with its own launch


def test_bad_statistics_are_refused(gen: torch.Generator) -> None:
    norm = _norm_in(2, 32, 1, torch.float16, gen)
    w = torch.randn(8, 32, generator=gen).to(torch.float16).to(DEVICE)
    for bad in (
        NormIn(norm.h, norm.sumsq.double(), norm.weight, EPS),
        NormIn(norm.h, norm.sumsq[:1], norm.weight, EPS),
        NormIn(norm.h, torch.zeros(2, MAX_PARTS + 1, device=DEVICE), norm.weight, EPS),
        NormIn(norm.h, norm.sumsq, norm.weight.float(), EPS),
        NormIn(norm.h, norm.sumsq, norm.weight, EPS, norm.h[:1]),
    ):
        with pytest.raises(ValueError, match="fused norm"):
            gemv_normed(bad, w)


@pytest.mark.parametrize("kernel", ["gemv", "dense"])
@pytest.mark.parametrize("switch", ["NORMED", "ADD_RESIDUAL"])
def test_fused_kernels_compile_for_sm90(kernel: str, switch: str) -> None:
    """The interpreter checks no types: each GEMV with each switch on must also compile (bf16, sm_90)."""
    int4: dict[str, object] = {
        "GROUP_SIZE": 128, "HAS_G_IDX": False, "FACTORED": True, "ONE_GROUP_PER_TILE": True, "SUBNORMAL": False,
        "BLOCK_M": 1, "BLOCK_N": 256, "BLOCK_K": 64, "NUM_STAGES": 2, "SPLIT_MODE": 2, "SPLIT_CHUNK": 1, "EVEN": True,
        "GATED": switch == "ADD_RESIDUAL", "SCALED": switch == "ADD_RESIDUAL",
    }  # fmt: skip
    dense: dict[str, object] = {
        "HAS_BIAS": False, "USE_DOT": False, "BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 512, "NUM_STAGES": 3,
        "SPLIT_MODE": 0, "EVEN": True, "PDL": False, "GATED": switch == "ADD_RESIDUAL",
    }  # fmt: skip
    constexprs = {**(int4 if kernel == "gemv" else dense), switch: True, "PARTS": 1024}
    ir = ttgir_sm90(kernel, constexprs, 4 if kernel == "gemv" else 2)
    assert ("math.sqrt" in ir or "math.rsqrt" in ir) if switch == "NORMED" else "tt.reduce" in ir


# ---- on the GPU, the 8B shapes at batch 1 (bf16) ----

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
HIDDEN, QKV, INTER = 4096, 6144, 14336


def _gpu_norm_in(parts: int, gen: torch.Generator) -> NormIn:
    h = (4 * torch.randn(1, HIDDEN, generator=gen)).to(torch.bfloat16).cuda()
    weight = (1 + 0.3 * torch.randn(HIDDEN, generator=gen)).to(torch.bfloat16).cuda()
    _, sumsq = residual_sum_ref(torch.zeros_like(h), h, parts)
    return NormIn(h, sumsq, weight, EPS, scaled_ref(h, weight))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("n", "parts"), [(QKV, 1024), (2 * INTER, 16)])  # after a dense / an int4 producer
@pytest.mark.parametrize("int4", [False, True])
def test_consumers_at_8b_shapes(n: int, parts: int, int4: bool, gen: torch.Generator) -> None:
    norm = _gpu_norm_in(parts, gen)
    normed = materialize(norm)  # the Triton norm kernel
    if int4:
        qw, s, z, _ = _int4(HIDDEN, n, 128, False, torch.bfloat16, gen)
        out, ref = int4_gemm_normed(norm, qw, s, z, 128), int4_gemm(normed, qw, s, z, 128)
    else:
        w = (0.02 * torch.randn(n, HIDDEN, generator=gen)).to(torch.bfloat16).cuda()
        out, ref = linear_normed(norm, w), gemv(normed, w)
    # an ulp of a few activations apart (the 4-bit GEMV normalizes late: h * weight rounds, not h / rms)
    assert rel_err(out, ref) < 2e-3, f"seed {gen.initial_seed()}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("k", "gated"), [(HIDDEN, False), (INTER, True)])  # o_proj, down_proj
@pytest.mark.parametrize("int4", [False, True])
def test_producers_at_8b_shapes(k: int, gated: bool, int4: bool, gen: torch.Generator) -> None:
    x = torch.randn(1, 2 * k if gated else k, generator=gen).to(torch.bfloat16).cuda()
    res = (4 * torch.randn(1, HIDDEN, generator=gen)).to(torch.bfloat16).cuda()
    if int4:
        qw, s, z, _ = _int4(k, HIDDEN, 128, False, torch.bfloat16, gen)
        nw = (1 + 0.3 * torch.randn(HIDDEN, generator=gen)).to(torch.bfloat16).cuda()
        h, sumsq, g = int4_gemm_residual(x, qw, s, z, 128, None, res, gated, scale=nw)
        plain = (int4_gemm_gated if gated else int4_gemm)(x, qw, s, z, 128)
        assert rel_err(h, res + plain) < 1e-3  # atomic split-K: the order varies between calls
        assert g is not None and torch.equal(g, scaled_ref(h, nw))
    else:
        w = (0.02 * torch.randn(HIDDEN, k, generator=gen)).to(torch.bfloat16).cuda()
        h, sumsq = linear_residual(x, w, res, gated)
        assert torch.equal(h, res + (gemv_gated if gated else gemv)(x, w))
    width = -(-HIDDEN // sumsq.shape[1])
    assert sumsq.shape[1] > 1 and torch.allclose(sumsq, _tiles_sumsq(h, width), rtol=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_a_captured_layer_replays_its_eager_result(gen: torch.Generator) -> None:
    """o_proj (adds the residual, writes g) then gate_up (normalizes late) in one CUDA graph, as a 4-bit decode
    graph holds them."""
    wo, wo_s, wo_z, _ = _int4(HIDDEN, HIDDEN, 128, False, torch.bfloat16, gen)
    qw, s, z, _ = _int4(HIDDEN, 2 * INTER, 128, False, torch.bfloat16, gen)
    nw = (1 + 0.3 * torch.randn(HIDDEN, generator=gen)).to(torch.bfloat16).cuda()
    x = torch.randn(1, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
    res = (4 * torch.randn(1, HIDDEN, generator=gen)).to(torch.bfloat16).cuda()

    def layer() -> torch.Tensor:
        h, sumsq, g = int4_gemm_residual(x, wo, wo_s, wo_z, 128, None, res, scale=nw)
        return int4_gemm_normed(NormIn(h, sumsq, nw, EPS, g), qw, s, z, 128)

    eager = layer()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer()
    for _ in range(2):
        x.copy_(torch.randn(1, HIDDEN, generator=gen).to(torch.bfloat16))
        graph.replay()
        assert rel_err(out, layer()) < 1e-3
    assert not torch.equal(eager, out)  # replays computed with the new x


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
