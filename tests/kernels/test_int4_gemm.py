"""The W4A16 GEMM: the torch reference equals dequantize-then-matmul exactly (fp32), and both Triton kernels
(under the interpreter on CPU) equal the reference on tiny shapes: the GEMV (M <= 16: factored or exact
dequantization) and the tl.dot path, each split-K reduced in the kernel (counter, atomic) or not split;
groups (one or several tiles per group, a group that is not a power of two), channel-wise scales, GPTQ
act-order g_idx, asymmetric zeros, strided activations, N not a multiple of the tile. The atomic
reduction's GPU race (the interpreter runs programs one by one) is checked in the code compiled for sm_90.
On a GPU, the large-M path (``kernels.int4_dequant``, tested on CPU in ``test_int4_dequant.py``) at the 8B
shapes: the dequantization bit for bit, dequant + F.linear against the reference, replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import int4_plan
from kernels.int4_config import Int4GemmConfig
from kernels.int4_dequant import (
    DequantScratch,
    dequantize_int4,
    int4_dequant,
    int4_dequant_linear,
    pack_int4,
    unpack_int4,
)
from kernels.int4_gemm import int4_gemm, int4_gemm_ref
from kernels.int4_plan import GEMV_MAX_M, MMA_M, WGMMA_M, pick_config
from kernels.int4_split import SPLIT_MODES, zeroed_scratch
from tests.kernels.helpers import DEVICE, int4_weights, rel_err, tolerance, ttgir_sm90

K, N = 128, 48


def test_pack_unpack_round_trip(gen: torch.Generator) -> None:
    codes = torch.randint(0, 16, (64, 24), generator=gen)
    qweight = pack_int4(codes)
    assert qweight.dtype == torch.int32 and qweight.shape == (8, 24)
    assert torch.equal(unpack_int4(qweight).long(), codes)
    # nibble j of word i is row 8 i + j
    assert int(qweight[1, 3]) & 0xFFFFFFFF == sum(int(codes[8 + j, 3]) << (4 * j) for j in range(8))


@pytest.mark.parametrize(
    ("group_size", "act_order"), [(32, False), (K, False), (32, True)], ids=["g32", "channel", "g_idx"]
)
def test_reference_equals_dequantize_then_matmul_exactly(
    group_size: int, act_order: bool, gen: torch.Generator
) -> None:
    codes, qweight, scales, zeros, g_idx = int4_weights(K, N, group_size, act_order, torch.float32, gen)
    groups = g_idx.long() if g_idx is not None else torch.arange(K) // group_size
    # written out element by element: w[n, k] = (code[k, n] - zero[g(k), n]) * scale[g(k), n]
    w = torch.empty(N, K)
    for k in range(K):
        g = int(groups[k])
        w[:, k] = (codes[k] - zeros[g].long()).float() * scales[g]
    assert torch.equal(dequantize_int4(qweight, scales, zeros, group_size, g_idx), w)
    x = torch.randn(7, K, generator=gen)
    assert torch.equal(int4_gemm_ref(x, qweight, scales, zeros, group_size, g_idx), F.linear(x, w))


Cfg = Int4GemmConfig
CASES = [
    # (m, k, n, group_size, act_order, config): the tl.dot path
    (5, K, N, 32, False, None),  # above GEMV_MAX_M: split-K picked, atomic reduction
    (5, K, N, 32, False, Cfg(split_reduce="counter")),
    (3, K, N, 32, False, Cfg(kernel="dot", split_k=1)),
    (16, K, N, K, False, Cfg(split_k=4, block_k=32, split_reduce="counter")),  # channel-wise, split over groups
    (33, K, N, 64, False, Cfg(kernel="dot", block_k=16, unpack_in_registers=False)),  # 4 tiles a group, per-row loads
    (70, K, N, 32, False, None),  # per-row loads, counter reduction
    (256, K, 160, 32, False, Cfg(block_m=128, block_n=128, split_reduce="atomic")),  # a tile of the H200 failure
    (1024, K, N, 32, False, None),  # prefill: 256-row tiles, no split
    (1, K, N, 32, False, Cfg(kernel="dot", unpack_in_registers=False)),
    (40, K, N, 32, True, Cfg(split_k=3, block_k=16)),
    # the GEMV
    (1, K, N, 32, False, None),  # default: factored, split-K picked, atomic reduction
    (1, K, N, 32, False, Cfg(split_reduce="counter")),
    (1, 2 * K, 40, K, False, None),  # channel-wise
    (2, K, N, 32, True, None),  # g_idx: exact dequantization
    (3, K, N, K, False, Cfg(split_k=1)),  # no split
    (4, K, N, 32, False, Cfg(factored=False, split_reduce="counter")),
    (4, K, 300, 32, False, Cfg(block_k=32, split_k=4)),  # the tile of the H200 failure (4 x 256, 32 deep)
    (8, K, N, 64, False, Cfg(kernel="gemv", block_n=16, block_k=16, split_k=2)),  # 3 column tiles, 4 per group
    (16, K, N, 32, False, Cfg(kernel="gemv", split_reduce="atomic")),
    (3, 192, N, 96, False, None),  # group 96: 32-wide tiles, 3 per group
    (1, 192, N, 96, True, Cfg(block_k=64, split_k=2)),  # g_idx tile spanning groups
    (2, K, N, 4, False, None),  # groups narrower than a word: exact, scales gathered per feature
    (1, K, 256, 32, False, Cfg(split_k=2)),  # every tile full: the unmasked loads
    # the GEMV's codes as subnormals
    (1, K, N, 32, False, Cfg(kernel="gemv", subnormal=True)),
    (3, 2 * K, 40, K, False, Cfg(kernel="gemv", subnormal=True, split_reduce="counter")),  # channel-wise
    (2, K, 256, 64, False, Cfg(kernel="gemv", subnormal=True, split_k=2)),  # unmasked loads
    (2, K, N, 32, True, Cfg(kernel="gemv", subnormal=True)),  # g_idx: exact, subnormal ignored
]


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# Each case at one dtype, DTYPES[i % 3] down the list: every kernel (tl.dot, the GEMV, its subnormal codes) meets
# every dtype in at least one of its cases; a config's tiling, split and reduction are the same code at each dtype
# (the full product: 3x the interpreter time for no path these miss).
@pytest.mark.parametrize(
    ("dtype", "m", "k", "n", "group_size", "act_order", "config"),
    [(DTYPES[i % 3], *case) for i, case in enumerate(CASES)],
)
def test_triton_matches_reference(
    dtype: torch.dtype,
    m: int,
    k: int,
    n: int,
    group_size: int,
    act_order: bool,
    config: Int4GemmConfig | None,
    gen: torch.Generator,
) -> None:
    _, qweight, scales, zeros, g_idx = int4_weights(k, n, group_size, act_order, dtype, gen)
    x_wide = torch.randn(m, 2 * k, generator=gen).to(dtype)
    x = x_wide[:, ::2]  # strided along K
    x, qweight, scales, zeros = (t.to(DEVICE) for t in (x, qweight, scales, zeros))
    g = g_idx.to(DEVICE) if g_idx is not None else None
    out = int4_gemm(x, qweight, scales, zeros, group_size, g, config=config)
    ref = int4_gemm_ref(x, qweight, scales, zeros, group_size, g)
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out, ref) < tolerance(dtype)


@pytest.mark.parametrize("split_reduce", ["counter", "atomic"])
@pytest.mark.parametrize("kernel", ["gemv", "dot"])
def test_in_kernel_split_leaves_its_scratch_zeroed(kernel: str, split_reduce: str, gen: torch.Generator) -> None:
    """The arrival counters (and the atomic accumulator) are shared by every call and every captured graph:
    each launch must hand them back zeroed, and a second call gives the same result."""
    _, qweight, scales, zeros, _ = int4_weights(K, N, 32, False, torch.float32, gen)
    x = torch.randn(4, K, generator=gen)
    x, qweight, scales, zeros = (t.to(DEVICE) for t in (x, qweight, scales, zeros))
    cfg = Int4GemmConfig(kernel=kernel, split_k=4, split_reduce=split_reduce)  # type: ignore[arg-type]
    first = int4_gemm(x, qweight, scales, zeros, 32, config=cfg)
    second = int4_gemm(x, qweight, scales, zeros, 32, config=cfg)
    if split_reduce == "counter":  # partials summed in split order, whatever order the programs finish in
        assert torch.equal(second, first)
    for dtype in (torch.int32, torch.float32):
        assert not zeroed_scratch(x.device, dtype, 1).any()
    assert rel_err(first, int4_gemm_ref(x, qweight, scales, zeros, 32)) < tolerance(torch.float32)


_GEMV_ATOMIC = {
    "GROUP_SIZE": 128, "HAS_G_IDX": False, "FACTORED": True, "ONE_GROUP_PER_TILE": True, "SUBNORMAL": False, "BLOCK_M": 4,
    "BLOCK_N": 256, "BLOCK_K": 32, "NUM_STAGES": 2, "SPLIT_MODE": 2, "SPLIT_CHUNK": 1, "EVEN": True, "GATED": False,
}  # fmt: skip
_DOT_ATOMIC = {
    "GROUP_SIZE": 128, "HAS_G_IDX": False, "ONE_GROUP_PER_TILE": True, "BLOCK_M": 128, "BLOCK_N": 128,
    "BLOCK_K": 64, "UPCAST": False, "DOT_PRECISION": "tf32", "UNPACK_IN_REGISTERS": False, "SPLIT_MODE": 2,
    "SPLIT_CHUNK": 1,
}  # fmt: skip


@pytest.mark.parametrize(
    ("kernel", "constexprs", "num_warps"),
    [("gemv", _GEMV_ATOMIC, 4), ("dot", _DOT_ATOMIC, 8)],
    ids=["gemv-4x256", "dot-128x128"],
)
def test_atomic_split_reads_every_sum_before_zeroing_it(
    kernel: str, constexprs: dict[str, object], num_warps: int
) -> None:
    """The H200 run at 7f8955d got wrong results from the atomic reduction at exactly these tiles (GEMV
    M = 4, gate_up; tl.dot M = 256): Triton gives the last program's load of the accumulator and its
    zeroing store different thread layouts, so without a barrier between them one warp zeroes sums that
    another has yet to read. The interpreter cannot show it (programs run one by one, each op on the
    whole tile); the compiled code must have the barrier."""
    assert SPLIT_MODES["atomic"] == constexprs["SPLIT_MODE"]
    ir = ttgir_sm90(kernel, constexprs, num_warps).splitlines()
    load = next(i for i, line in enumerate(ir) if "tt.load" in line and "cacheModifier = cg" in line)
    zeroing = next(i for i in range(load, len(ir)) if "tt.store" in ir[i])
    assert any("barrier" in line for line in ir[load:zeroing]), "\n".join(ir[load : zeroing + 1])


def test_pick_config_routes_small_m_to_the_gemv() -> None:
    """M = 1: the GEMV; M = 2-16 (MMA_M): the tensor-core GEMV, where it can run (act-order: the GEMV); 17-128
    (WGMMA_M) the wgmma GEMM; above: tl.dot. kernel="gemv" keeps the GEMV up to its limit."""
    auto = Int4GemmConfig()
    assert pick_config(1, 4096, 4096, 128, 132, auto).kernel == "gemv"
    mma_rows = range(MMA_M[0], MMA_M[1] + 1)
    assert [pick_config(m, 4096, 4096, 128, 132, auto).kernel for m in mma_rows] == ["mma"] * len(mma_rows)
    assert pick_config(GEMV_MAX_M, 4096, 4096, 128, 132, auto, has_g_idx=True).kernel == "gemv"
    assert pick_config(GEMV_MAX_M, 4096, 4096, 128, 132, Int4GemmConfig(kernel="gemv")).kernel == "gemv"
    assert pick_config(MMA_M[1] + 1, 4096, 4096, 128, 132, auto).kernel == "wgmma"
    assert pick_config(WGMMA_M[1] + 1, 4096, 4096, 128, 132, auto).kernel == "dot"
    gemv = pick_config(1, 4096, 4096, 128, 132, auto)
    assert gemv.factored and gemv.block_k <= 128 and 4096 // gemv.block_n * gemv.split_k >= 132
    assert not pick_config(1, 4096, 4096, 128, 132, auto, has_g_idx=True).factored
    assert pick_config(1, 4096, 4096, 96, 132, auto).block_k == 32  # tiles inside a group of 96
    assert pick_config(8, 4096, 4096, 128, 132, Int4GemmConfig(kernel="gemv")).block_m == 8
    with pytest.raises(ValueError, match="holds all M rows"):
        pick_config(17, 4096, 4096, 128, 132, Int4GemmConfig(kernel="gemv"))


def test_pick_config_defaults_are_the_h200_winners() -> None:
    """The winners of the H200 runs at 7f8955d, b066a95 and Session 14's on the 8B shapes (pick_config's
    docstrings): the MMA kernel to 16 rows, the wgmma GEMM to 128, then the 128-column tl.dot tile."""
    auto = Int4GemmConfig()

    def pick(m: int, n: int = 6144, k: int = 4096) -> tuple[object, ...]:
        c = pick_config(m, n, k, 128, 132, auto)
        return c.kernel, c.block_m, c.block_k, c.split_reduce, c.unpack_in_registers, c.split_k > 1

    assert pick(1) == ("gemv", 1, 64, "atomic", False, True)
    assert pick(2) == ("mma", 8, 128, "atomic", False, True)  # the MMA takes x 8 rows at a time
    assert pick(8) == ("mma", 8, 128, "atomic", False, True)
    assert (
        pick(16) == ("mma", 16, 128, "atomic", False, True) and not pick_config(16, 6144, 4096, 128, 132, auto).factored
    )
    # Session 25's H200 runs (int4_plan.MMA_M, WGMMA_M): the wgmma GEMM at 17-128 rows, whole groups a tile
    assert pick(17) == ("wgmma", 32, 128, "atomic", False, True)
    assert pick(128, 4096) == ("wgmma", 64, 128, "atomic", False, True)
    assert pick_config(129, 6144, 4096, 128, 132, auto).kernel == "dot"  # where the linear layer dequantizes
    assert pick_config(256, 6144, 4096, 128, 132, auto).block_n == 128
    assert pick(256) == ("dot", 128, 64, "counter", False, True)
    assert pick(512) == ("dot", 128, 64, "counter", False, False)
    assert pick(4096) == ("dot", 256, 64, "counter", False, False)
    prefill = pick_config(4096, 6144, 4096, 128, 132, auto)
    assert (prefill.block_n, prefill.num_warps, prefill.num_stages) == (128, 8, 3)  # what the bench timed
    # the user's reduction wins; nothing split is described as the counter
    assert pick_config(1, 6144, 4096, 128, 132, Int4GemmConfig(split_reduce="counter")).split_reduce == "counter"
    assert pick_config(1, 6144, 4096, 128, 132, Int4GemmConfig(split_k=1)).split_reduce == "counter"


def test_pick_config_wide_layers_at_m1_take_the_subnormal_one_warp_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    """H200 at 5da38c4: gate_up (28672 columns) at M = 1 ran 23.5 us with subnormal codes, 1 warp and 16
    programs per SM against 28.7 with the default tile, which stays on the narrower layers and at M > 1. That is the
    split grid's tile; by default gate_up is stream-K since Session 37 (test_int4_gemv_stream checks its tile)."""
    auto = Int4GemmConfig()
    assert pick_config(1, 28672, 4096, 128, 132, auto).stream_programs  # the default
    monkeypatch.setattr(int4_plan, "GEMV_STREAM", False)
    wide = pick_config(1, 28672, 4096, 128, 132, auto)
    assert (wide.kernel, wide.subnormal, wide.block_n, wide.num_warps, wide.split_k) == ("gemv", True, 256, 1, 32)
    assert pick_config(2, 28672, 4096, 128, 132, auto).kernel == "mma"  # M = 2-8: the tensor-core GEMV
    for m, n, k in [(1, 6144, 4096), (1, 4096, 4096), (1, 4096, 14336), (2, 28672, 4096)]:
        narrow = pick_config(m, n, k, 128, 132, Int4GemmConfig(kernel="gemv") if m > 1 else auto)
        assert (narrow.subnormal, narrow.block_n, narrow.num_warps) == (False, 256, 4), (m, n, k)
    # the user's choices win over the wide-layer defaults; g_idx (no factored path) has no subnormal codes
    user = pick_config(1, 28672, 4096, 128, 132, Int4GemmConfig(subnormal=False, num_warps=4))
    assert (user.subnormal, user.num_warps) == (False, 4)
    assert not pick_config(1, 28672, 4096, 128, 132, auto, has_g_idx=True).subnormal


def test_config_rejects_bad_choices() -> None:
    with pytest.raises(ValueError, match="kernel must be"):
        Int4GemmConfig(kernel="gemm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="split_reduce must be"):
        Int4GemmConfig(split_reduce="torch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        Int4GemmConfig(block_n=96)
    with pytest.raises(ValueError, match="split_k must be at least 1"):
        Int4GemmConfig(split_k=0)
    with pytest.raises(ValueError, match="tl.dot needs"):
        pick_config(32, 64, 64, 32, 8, Int4GemmConfig(kernel="dot", block_k=8))


def test_wrapper_rejects_bad_inputs(gen: torch.Generator) -> None:
    _, qweight, scales, zeros, _ = int4_weights(K, N, 32, False, torch.float32, gen)
    x = torch.randn(2, K)
    with pytest.raises(ValueError, match="qweight must be int32"):
        int4_gemm(x, qweight.to(torch.int64), scales, zeros, 32)
    with pytest.raises(ValueError, match="qweight must be int32"):
        int4_gemm(torch.randn(2, K + 8), qweight, scales, zeros, 32)
    with pytest.raises(ValueError, match="zeros must be uint8"):
        int4_gemm(x, qweight, scales, zeros.to(torch.int32), 32)
    with pytest.raises(ValueError, match="group_size 64"):
        int4_gemm(x, qweight, scales, zeros, 64)
    with pytest.raises(ValueError, match="x must be float16"):
        int4_gemm(x.to(torch.int32), qweight, scales, zeros, 32)
    with pytest.raises(ValueError, match="contiguous along N"):
        int4_gemm(x, qweight, scales.t().contiguous().t(), zeros, 32)
    with pytest.raises(ValueError, match="g_idx must be int32"):
        int4_gemm(x, qweight, scales, zeros, 32, torch.zeros(K, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("kernel", "m", "n", "k"),
    [("gemv", 4, 28672, 4096), ("gemv", 8, 28672, 4096), ("dot", 256, 6144, 4096), ("dot", 256, 4096, 14336)],
)
def test_atomic_split_at_the_shapes_it_failed(kernel: str, m: int, n: int, k: int, gen: torch.Generator) -> None:
    """gate_up M = 4, 8 (GEMV) and qkv, down_proj M = 256 (tl.dot): wrong with the atomic reduction at
    7f8955d (a race inside the last program of a tile, so run each a few times)."""
    _, qweight, scales, zeros, _ = int4_weights(k, n, 128, False, torch.bfloat16, gen)
    qweight, scales, zeros = qweight.cuda(), scales.cuda(), zeros.cuda()
    cfg = Int4GemmConfig(kernel=kernel, split_reduce="atomic")  # type: ignore[arg-type]
    assert pick_config(m, n, k, 128, torch.cuda.get_device_properties(0).multi_processor_count, cfg).split_k > 1
    for _ in range(10):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
        out = int4_gemm(x, qweight, scales, zeros, 128, config=cfg)
        assert rel_err(out, int4_gemm_ref(x, qweight, scales, zeros, 128)) < tolerance(torch.bfloat16)


_SUB_TILES = [
    Cfg(kernel="gemv", subnormal=True),
    Cfg(kernel="gemv", subnormal=True, num_warps=1, programs_per_sm=8),
    Cfg(kernel="gemv", subnormal=True, block_n=1024),
    Cfg(kernel="gemv", subnormal=True, block_n=2048, num_warps=8),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config", _SUB_TILES, ids=["sub", "sub-w1", "sub-bn1024", "sub-bn2048-w8"])
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("x_scale", [1.0, 1e3, 1e-6])
def test_subnormal_codes_at_the_8b_shapes(
    n: int, k: int, m: int, config: Int4GemmConfig, x_scale: float, gen: torch.Generator
) -> None:
    """The GEMV reading its codes as fp32 subnormals equals the reference on the GPU (which must keep
    subnormals: flushed, every nibble but the top three would read as zero), for activations far from 1."""
    _, qweight, scales, zeros, _ = int4_weights(k, n, 128, False, torch.bfloat16, gen)
    qweight, scales, zeros = qweight.cuda(), scales.cuda(), zeros.cuda()
    x = (torch.randn(m, k, generator=gen) * x_scale).to(torch.bfloat16).cuda()
    out = int4_gemm(x, qweight, scales, zeros, 128, config=config)
    ref = int4_gemm_ref(x, qweight, scales, zeros, 128)
    assert rel_err(out, ref) < tolerance(torch.bfloat16)
    assert rel_err(out, int4_gemm(x, qweight, scales, zeros, 128, config=Cfg(kernel="gemv", subnormal=False))) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split_reduce", [None, "counter"])
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("subnormal", [False, True])
def test_real_size_replayed_from_a_cuda_graph(
    m: int, split_reduce: str | None, subnormal: bool, gen: torch.Generator
) -> None:
    """8B down_proj (K = 14336, split-K) captured in a CUDA graph after one eager call and replayed with new
    activations: the in-kernel reductions must hand their counters back zeroed for every replay."""
    _, qweight, scales, zeros, _ = int4_weights(14336, 4096, 128, False, torch.bfloat16, gen)
    qweight, scales, zeros = qweight.cuda(), scales.cuda(), zeros.cuda()
    cfg = Int4GemmConfig(split_reduce=split_reduce, subnormal=subnormal)  # type: ignore[arg-type]
    x = torch.zeros(m, 14336, dtype=torch.bfloat16, device="cuda")
    int4_gemm(x, qweight, scales, zeros, 128, config=cfg)  # compiles, grows the shared scratch
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_gemm(x, qweight, scales, zeros, 128, config=cfg)
    for _ in range(5):
        x.copy_(torch.randn(m, 14336, generator=gen).to(torch.bfloat16))
        graph.replay()
        assert rel_err(out, int4_gemm_ref(x, qweight, scales, zeros, 128)) < tolerance(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("n", "k", "group_size", "act_order", "dtype"),
    [
        (28672, 4096, 128, False, torch.bfloat16),
        (4096, 14336, 128, False, torch.bfloat16),
        (6144, 4096, 4096, False, torch.float16),
        (4096, 14336, 128, True, torch.bfloat16),
    ],
    ids=["gate_up", "down", "qkv-channel-fp16", "down-g_idx"],
)
def test_dequant_path_at_the_8b_shapes(
    n: int, k: int, group_size: int, act_order: bool, dtype: torch.dtype, gen: torch.Generator
) -> None:
    """The compiled dequantization equals ``dequantize_int4`` bit for bit at the 8B projection shapes, and
    dequant + F.linear at M = 128 (DEQUANT_MIN_M), 256 and 4096 the GEMM reference."""
    _, qweight, scales, zeros, g_idx = int4_weights(k, n, group_size, act_order, dtype, gen)
    qweight, scales, zeros = qweight.cuda(), scales.cuda(), zeros.cuda()
    g = g_idx.cuda() if g_idx is not None else None
    assert torch.equal(
        int4_dequant(qweight, scales, zeros, group_size, g), dequantize_int4(qweight, scales, zeros, group_size, g)
    )
    scratch = DequantScratch()
    scratch.reserve(n, k)
    for m in (128, 256, 4096):
        x = torch.randn(m, k, generator=gen).to(dtype).cuda()
        out = int4_dequant_linear(x, qweight, scales, zeros, group_size, g, scratch=scratch)
        assert rel_err(out, int4_gemm_ref(x, qweight, scales, zeros, group_size, g)) < 1e-3
    assert scratch.num_bytes() == n * k * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dequant_path_replayed_from_a_cuda_graph(gen: torch.Generator) -> None:
    """down_proj at M = 256 captured after one eager call (which allocates the scratch) and replayed with new
    activations; capturing before the scratch exists is an error, not an allocation from the graph's pool."""
    _, qweight, scales, zeros, _ = int4_weights(14336, 4096, 128, False, torch.bfloat16, gen)
    weights = (qweight.cuda(), scales.cuda(), zeros.cuda(), 128)
    scratch = DequantScratch()
    x = torch.zeros(256, 14336, dtype=torch.bfloat16, device="cuda")
    int4_dequant_linear(x, *weights, scratch=scratch)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_dequant_linear(x, *weights, scratch=scratch)
    for _ in range(3):
        x.copy_(torch.randn(256, 14336, generator=gen).to(torch.bfloat16))
        graph.replay()
        assert rel_err(out, int4_gemm_ref(x, *weights)) < 1e-3
    with pytest.raises(RuntimeError, match="before capturing"), torch.cuda.graph(torch.cuda.CUDAGraph()):
        int4_dequant_linear(x, *weights, scratch=DequantScratch())
