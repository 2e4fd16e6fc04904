"""Programmatic dependent launch (``kernels.pdl``) in the small-batch decode chain: the int4 GEMVs, the RMSNorm and
both decode-attention kernels launched with it (the defaults on sm_90+). On CPU: the plan's switch and the sm_90
compile (the interpreter cannot run ``griddepcontrol``). On a GPU, replayed from CUDA graphs with new inputs, equal to the torch
references at every replay (a program that read its input before its wait would read the replay before's): the
MLP's chain RMSNorm -> gate_up GEMV -> gated down GEMV -> RMSNorm (+ residual), and the attention's
query -> decode partitions -> merge -> o_proj GEMV."""

from __future__ import annotations

import pytest
import torch

import kernels.norm as norm_module
import kernels.paged_attention as paged_attention
from kernels.activation import silu_and_mul_ref
from kernels.int4_config import Int4GemmConfig
from kernels.int4_gemm import int4_gemm, int4_gemm_gated, int4_gemm_ref
from kernels.int4_plan import GEMV_PDL, pick_config
from kernels.norm import rms_norm, rms_norm_ref
from kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref
from kernels.pdl import pdl_supported
from tests.kernels.helpers import capture_graph, int4_weights, paged_cache, rel_err, tolerance, ttgir_sm90

# griddepcontrol needs an sm_90+ GPU
HOPPER = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs an sm_90+ GPU"
)


def test_plan_launches_the_gemvs_with_pdl_by_default() -> None:
    """The GEMV (M = 1) and the MMA GEMV (M = 2-32): GEMV_PDL (on), unless the caller says; tl.dot never."""
    assert GEMV_PDL
    for m in (1, 4, 16):
        assert pick_config(m, 4096, 4096, 128, 132, Int4GemmConfig()).pdl
        assert not pick_config(m, 4096, 4096, 128, 132, Int4GemmConfig(pdl=False)).pdl
    assert not pick_config(64, 4096, 4096, 128, 132, Int4GemmConfig(pdl=True)).pdl
    assert not pdl_supported(torch.zeros(1))  # CPU tensors never


@pytest.mark.parametrize("subnormal", [False, True])
def test_pdl_gemv_compiles_for_sm90(subnormal: bool) -> None:
    """The PDL GEMV waits, then lets the next kernel start after its K loop: both PTX instructions are in the
    sm_90 compile, in that order; without PDL neither is."""
    constexprs: dict[str, object] = {
        "GROUP_SIZE": 128, "HAS_G_IDX": False, "FACTORED": True, "ONE_GROUP_PER_TILE": True,
        "SUBNORMAL": subnormal, "BLOCK_M": 1, "BLOCK_N": 256, "BLOCK_K": 64, "NUM_STAGES": 2, "SPLIT_MODE": 2,
        "SPLIT_CHUNK": 1, "EVEN": True, "GATED": True, "PDL": True, "TRIGGER": True,
    }  # fmt: skip
    ttgir = ttgir_sm90("gemv", constexprs, 4)
    assert ttgir.index("tt.load") > ttgir.index("griddepcontrol.wait")
    assert ttgir.index("griddepcontrol.wait") < ttgir.index("griddepcontrol.launch_dependents")
    off = {**constexprs, "PDL": False, "TRIGGER": False}
    assert "griddepcontrol" not in ttgir_sm90("gemv", off, 4)


def _chain(x, res, weights, nw, pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """RMSNorm(x + res) -> gate_up -> silu * mul -> down -> RMSNorm(+ residual): the batch-1 MLP's kernels."""
    (gu, gu_s, gu_z), (dn, dn_s, dn_z) = weights
    cfg = Int4GemmConfig(pdl=pdl)
    h, res2 = rms_norm(x, nw, 1e-5, res)
    x2 = int4_gemm(h, gu, gu_s, gu_z, 128, config=cfg)
    down = int4_gemm_gated(x2, dn, dn_s, dn_z, 128, config=cfg)
    return rms_norm(down, nw, 1e-5, res2)  # type: ignore[return-value]


def _chain_ref(x, res, weights, nw) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    (gu, gu_s, gu_z), (dn, dn_s, dn_z) = weights
    h, res2 = rms_norm_ref(x, nw, 1e-5, res)
    x2 = int4_gemm_ref(h, gu, gu_s, gu_z, 128)
    out = int4_gemm_ref(silu_and_mul_ref(x2), dn, dn_s, dn_z, 128) + res2
    return rms_norm_ref(out, nw, 1e-5), out  # type: ignore[return-value]


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize(
    ("m", "gemv_pdl", "norm_pdl"), [(1, True, True), (1, True, False), (1, False, True), (4, True, True)]
)
def test_pdl_chain_replayed_from_a_cuda_graph(
    m: int, gemv_pdl: bool, norm_pdl: bool, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 8B MLP's shapes (gate_up 4096 -> 2 x 14336, down 14336 -> 4096), bf16, at M = 1 (the GEMV) and 4 (the
    MMA GEMV, the activation its own launch between them)."""
    monkeypatch.setattr(norm_module, "RMS_NORM_PDL", norm_pdl)
    hidden, inter = 4096, 14336
    weights = []
    for k, n in ((hidden, 2 * inter), (inter, hidden)):
        _, qw, s, z, _ = int4_weights(k, n, 128, False, torch.bfloat16, gen)
        weights.append((qw.cuda(), s.cuda(), z.cuda()))
    nw = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16).cuda()
    x = torch.zeros(m, hidden, dtype=torch.bfloat16, device="cuda")
    res = torch.zeros_like(x)
    graph, (normed, out) = capture_graph(lambda: _chain(x, res, weights, nw, pdl=gemv_pdl))  # type: ignore[arg-type]
    for _ in range(5):
        x.copy_(torch.randn(m, hidden, generator=gen).to(torch.bfloat16))
        res.copy_(torch.randn(m, hidden, generator=gen).to(torch.bfloat16))
        graph.replay()
        ref_normed, ref_out = _chain_ref(x, res, weights, nw)
        assert rel_err(out, ref_out) < tolerance(torch.bfloat16)
        assert rel_err(normed, ref_normed) < tolerance(torch.bfloat16)


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (4000, 4096)])
def test_pdl_gemv_at_the_8b_shapes(n: int, k: int, gen: torch.Generator) -> None:
    """Eager, PDL on and off (and the gated GEMV), against the reference; an N tail (4000) prefetches a short row."""
    _, qw, s, z, _ = int4_weights(k, n, 128, False, torch.bfloat16, gen)
    qw, s, z = qw.cuda(), s.cuda(), z.cuda()
    x2 = torch.randn(1, 2 * k, generator=gen).to(torch.bfloat16).cuda()
    x = x2[:, :k].contiguous()
    ref = int4_gemm_ref(x, qw, s, z, 128)
    assert rel_err(int4_gemm(x, qw, s, z, 128, config=Int4GemmConfig(pdl=True)), ref) < tolerance(torch.bfloat16)
    gated_ref = int4_gemm_ref(silu_and_mul_ref(x2), qw, s, z, 128)
    gated = int4_gemm_gated(x2, qw, s, z, 128, config=Int4GemmConfig(pdl=True))
    assert rel_err(gated, gated_ref) < tolerance(torch.bfloat16)


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("seq_len", [1000, 8192])
def test_pdl_attention_chain_replayed_from_a_cuda_graph(
    seq_len: int, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch 1, an 8B model's heads: a query written by a torch kernel, the two decode kernels and o_proj's GEMV,
    all three launched with PDL."""
    monkeypatch.setattr(paged_attention, "DECODE_PDL", True)
    cache, tables = paged_cache([seq_len], 16, 8, 128, torch.bfloat16, gen)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device="cuda")
    _, qw, s, z, _ = int4_weights(4096, 4096, 128, False, torch.bfloat16, gen)
    qw, s, z = qw.cuda(), s.cuda(), z.cuda()
    src = torch.zeros(1, 32, 128, dtype=torch.bfloat16, device="cuda")

    def step() -> torch.Tensor:
        attn = paged_decode_attention(src * 2, cache, tables, seq_lens, 128**-0.5)  # [1, 32, 128]
        return int4_gemm(attn.reshape(1, 4096), qw, s, z, 128, config=Int4GemmConfig(pdl=True))

    graph, out = capture_graph(step)
    for _ in range(4):
        src.copy_(torch.randn(1, 32, 128, generator=gen).to(torch.bfloat16))
        graph.replay()
        attn = paged_decode_attention_ref(src * 2, cache, tables, seq_lens, 128**-0.5)
        ref = int4_gemm_ref(attn.reshape(1, 4096), qw, s, z, 128)
        assert rel_err(out, ref) < tolerance(torch.bfloat16)
