"""The gated W4A16 GEMM (``kernels.int4_gemm.int4_gemm_gated``): the MLP's down projection of gate_up's output
``x2 [M, 2K]``. Under the interpreter on CPU, tiny shapes: the gated GEMV is bit for bit the GEMV of the
Triton activation (the same casts, then the same arithmetic) on every path (factored mantissa and subnormal
codes, exact for g_idx, split-K with each reduction, strided x2), and meets ``int4_gemm`` of the torch
activation tightly in fp32 and fp16 (numpy's exp, the interpreter's, and torch's differ in an ulp of a few
silus). bf16 is compared with the Triton activation only: the interpreter truncates fp32 -> bf16 casts where
torch rounds (~1 % apart, as ``test_gemv.py`` says). Launches other than the GEMV run the activation first.
The kernel compiled for sm_90 (no GPU needed) and, on a GPU, the 8B down projection."""

from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.int4_config import Int4GemmConfig
from kernels.int4_gemm import int4_gemm, int4_gemm_gated, int4_gemm_gated_ref
from kernels.int4_split import zeroed_scratch
from tests.kernels.helpers import DEVICE, int4_weights, rel_err, tolerance, ttgir_sm90

K, N = 128, 48
Cfg = Int4GemmConfig
# int4_gemm(silu_and_mul_ref(x2)) against the gated GEMV: the activations differ in an ulp of a few silus, which
# the factored sums' cancellation (16 s sum (1 + c / 16) x - s (16 + z) sum x) magnifies most in a channel-wise
# group: fp32 7.7e-7 the worst of 1,800 seeds there, and a bound of 1e-6 failed once in a full run
TIGHT = {torch.float32: 1e-5, torch.float16: 1e-3}


def _x2(m: int, k: int, dtype: torch.dtype, gen: torch.Generator, strided: bool) -> torch.Tensor:
    """gate | up ``[M, 2K]`` over silu's curved range; ``strided``: every other column of a wider tensor."""
    wide = (2 * torch.randn(m, 4 * k, generator=gen)).to(dtype).to(DEVICE)
    return wide[:, ::2] if strided else wide[:, : 2 * k]


# M = 1 (one row) and M = 3 (a masked tile of 4 rows) each meet the atomic and the counter reduction, the exact
# path, subnormal codes and strided x2; a config runs the same code at M = 1 and 3 but for the row mask, so each
# case takes one M (both M for every case: 60 cases, twice the interpreter time for no other path).
GEMV_CASES = [
    # (m, k, group_size, act_order, config, strided x2)
    (1, K, 32, False, Cfg(kernel="gemv", subnormal=False), False),  # mantissa codes, split-K picked (atomic)
    (3, K, 32, False, Cfg(kernel="gemv", subnormal=True), False),  # subnormal codes
    (1, K, 32, True, Cfg(kernel="gemv"), False),  # g_idx: the exact path
    (3, K, 32, False, Cfg(kernel="gemv", factored=False, split_k=1), False),  # exact without g_idx, one group a tile
    (3, K, K, False, Cfg(kernel="gemv", block_k=32, split_k=4, split_reduce="counter"), False),  # channel-wise
    (1, K, K, False, Cfg(kernel="gemv", block_k=32, split_k=4, split_reduce="atomic", subnormal=True), False),
    (3, K, 32, False, Cfg(kernel="gemv", block_n=16, split_k=1), True),  # strided x2, 3 column tiles, no split
    (1, K, 32, True, Cfg(kernel="gemv", split_k=2, split_reduce="counter"), True),  # strided x2, exact
    (3, 192, 96, True, Cfg(kernel="gemv", block_k=64, split_k=2), False),  # g_idx tiles spanning groups
    (1, K, 32, False, Cfg(kernel="gemv", block_n=16, split_k=2), False),  # N = 48: every tile full, unmasked loads
]


def same_sums(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two launches of the same sums: equal bit for bit on CPU (one program after another); on a GPU split-K's
    fp32 atomics add the parts in whichever order they arrive, so the last bits may differ (8 of these tests on
    an H200 at aa2fea6, and Session 13's 8B down shape)."""
    if a.device.type == "cpu":
        return torch.equal(a, b)
    return rel_err(a, b) < (1e-6 if a.dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "k", "group_size", "act_order", "config", "strided"), GEMV_CASES)
def test_gated_gemv_is_the_gemv_of_the_activation(
    dtype: torch.dtype,
    m: int,
    k: int,
    group_size: int,
    act_order: bool,
    config: Int4GemmConfig,
    strided: bool,
    gen: torch.Generator,
) -> None:
    _, qweight, scales, zeros, g_idx = int4_weights(k, N, group_size, act_order, dtype, gen)
    weights = (qweight.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), group_size)
    g = g_idx.to(DEVICE) if g_idx is not None else None
    x2 = _x2(m, k, dtype, gen, strided)
    out = int4_gemm_gated(x2, *weights, g, config=config)
    assert out.dtype == dtype and out.shape == (m, N)
    seed = f"seed {gen.initial_seed()}"
    act = silu_and_mul(x2.contiguous())  # the same silu_mul as the GEMV's loads
    assert same_sums(out, int4_gemm(act, *weights, g, config=config)), seed
    if dtype == torch.float16:  # rounded as the reference: the silu, then the product (not the fp32 product)
        assert int((act != silu_and_mul_ref(x2)).sum()) <= 2, seed
    if dtype != torch.bfloat16:
        assert rel_err(out, int4_gemm(silu_and_mul_ref(x2), *weights, g, config=config)) < TIGHT[dtype], seed
        assert rel_err(out, int4_gemm_gated_ref(x2, *weights, g)) < tolerance(dtype), seed
    assert not zeroed_scratch(x2.device, torch.int32, 1).any() and not zeroed_scratch(x2.device, torch.float32, 1).any()


@pytest.mark.parametrize(
    ("m", "config"),
    [
        (3, Cfg(kernel="dot")),
        (5, None),  # above GEMV_MAX_M: tl.dot by default
    ],
    ids=["dot", "default-m5"],
)
@pytest.mark.parametrize("strided", [False, True])
def test_other_kernels_run_the_activation_first(
    m: int, config: Int4GemmConfig | None, strided: bool, gen: torch.Generator
) -> None:
    """Only the GEMV is gated: the others get ``silu_and_mul`` (the reference off CUDA) and then ``int4_gemm``."""
    _, qweight, scales, zeros, _ = int4_weights(K, N, 32, False, torch.float32, gen)
    weights = (qweight.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), 32)
    x2 = _x2(m, K, torch.float32, gen, strided)
    out = int4_gemm_gated(x2, *weights, config=config)
    act = silu_and_mul(x2.contiguous()) if DEVICE.type == "cuda" else silu_and_mul_ref(x2)
    assert same_sums(out, int4_gemm(act, *weights, config=config))
    assert rel_err(out, int4_gemm_gated_ref(x2, *weights)) < tolerance(torch.float32)


def test_gated_wrapper_rejects_bad_inputs(gen: torch.Generator) -> None:
    _, qweight, scales, zeros, _ = int4_weights(K, N, 32, False, torch.float32, gen)
    x2 = torch.randn(2, 2 * K)
    with pytest.raises(ValueError, match=r"x2 must be \[M, 2K\] = \[M, 256\] \(gate \| up\) for qweight's K=128"):
        int4_gemm_gated(x2[:, :K], qweight, scales, zeros, 32)  # the activation's K columns, not 2K
    with pytest.raises(ValueError, match=r"x2 must be \[M, 2K\]"):
        int4_gemm_gated(torch.randn(2, 2 * K + 8), qweight, scales, zeros, 32)
    with pytest.raises(ValueError, match=r"x2 must be \[M, 2K\]"):
        int4_gemm_gated(x2[None], qweight, scales, zeros, 32)
    with pytest.raises(ValueError, match="x2 must be float16"):
        int4_gemm_gated(x2.to(torch.int32), qweight, scales, zeros, 32)
    with pytest.raises(ValueError, match="qweight must be int32"):
        int4_gemm_gated(x2, qweight[0], scales, zeros, 32)
    with pytest.raises(ValueError, match="zeros must be uint8"):  # the int4_gemm checks on the gate half
        int4_gemm_gated(x2, qweight, scales, zeros.to(torch.int32), 32)
    assert int4_gemm_gated(torch.randn(0, 2 * K), qweight, scales, zeros, 32).shape == (0, N)


@pytest.mark.parametrize(
    ("factored", "subnormal", "has_g_idx"), [(True, False, False), (True, True, False), (False, False, True)]
)
def test_gated_gemv_compiles_for_sm90(factored: bool, subnormal: bool, has_g_idx: bool) -> None:
    """The interpreter runs Python on numpy and checks no types: the gated kernel must also compile (bf16)."""
    constexprs: dict[str, object] = {
        "GROUP_SIZE": 128, "HAS_G_IDX": has_g_idx, "FACTORED": factored, "ONE_GROUP_PER_TILE": not has_g_idx,
        "SUBNORMAL": subnormal, "BLOCK_M": 1, "BLOCK_N": 256, "BLOCK_K": 64, "NUM_STAGES": 2, "SPLIT_MODE": 2,
        "SPLIT_CHUNK": 1, "EVEN": True, "GATED": True,
    }  # fmt: skip
    assert "math.exp" in ttgir_sm90("gemv", constexprs, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize(
    "config",
    [
        None,
        Cfg(split_reduce="counter"),
        Cfg(subnormal=True, split_reduce="counter"),
        Cfg(kernel="dot"),
        Cfg(kernel="dot", split_reduce="counter"),
    ],
    ids=["default", "counter", "sub-counter", "dot", "dot-counter"],
)
def test_gated_at_the_8b_down_shape(m: int, config: Int4GemmConfig | None, gen: torch.Generator) -> None:
    """down_proj (K = 14336, N = 4096, group 128, bf16) of gate_up's output ``x2 [M, 2 * 14336]``: the gated
    GEMV against the Triton activation + ``int4_gemm`` (bit for bit where the split-K sum is deterministic)
    and against the reference."""
    _, qweight, scales, zeros, _ = int4_weights(14336, 4096, 128, False, torch.bfloat16, gen)
    weights = (qweight.cuda(), scales.cuda(), zeros.cuda(), 128)
    for _ in range(3):
        x2 = (2 * torch.randn(m, 2 * 14336, generator=gen)).to(torch.bfloat16).cuda()
        out = int4_gemm_gated(x2, *weights, config=config)
        two_launches = int4_gemm(silu_and_mul(x2), *weights, config=config)
        if config is None or config.split_reduce is None:  # atomic split-K: the order varies from run to run
            # (tl.dot at M = 1 and 4 splits with atomics too: unequal in the last bits on an H200 at b8da056)
            assert rel_err(out, two_launches) < 1e-3, f"seed {gen.initial_seed()}"
        else:
            assert torch.equal(out, two_launches), f"seed {gen.initial_seed()}"
        assert rel_err(out, int4_gemm_gated_ref(x2, *weights)) < tolerance(torch.bfloat16)
