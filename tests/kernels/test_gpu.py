"""The kernels at real sizes on a GPU (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref
from kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from tests.kernels.helpers import paged_cache, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("lens", [[1, 1000, 4097, 8192], [131072]])
@pytest.mark.parametrize("sliding_window", [None, 4096])
@pytest.mark.parametrize("fused_reduce", [False, True])
def test_decode_real_sizes(
    lens: list[int], sliding_window: int | None, fused_reduce: bool, gen: torch.Generator
) -> None:
    from kernels.paged_attention import _paged_decode_attention

    cache, tables = paged_cache(lens, 16, 8, 128, torch.bfloat16, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    query = torch.randn(len(lens), 32, 128, generator=gen).to(torch.bfloat16).cuda()
    ref = paged_decode_attention_ref(query, cache, tables, seq_lens, 128**-0.5, sliding_window)
    for _ in range(3):  # repeated calls: the fused variant's arrival counters must come back to zero
        out = _paged_decode_attention(
            query, cache, tables, seq_lens, 128**-0.5, sliding_window, fused_reduce=fused_reduce
        )
        assert rel_err(out, ref) < 1e-2, f"seed {gen.initial_seed()}"
    assert paged_decode_attention(query, cache, tables, seq_lens, 128**-0.5, sliding_window).shape == out.shape


@pytest.mark.parametrize("sliding_window", [None, 700])
def test_prefill_real_sizes(sliding_window: int | None, gen: torch.Generator) -> None:
    rows = [(0, 2048), (1000, 517), (3000, 1), (0, 1)]  # (cached prefix, new tokens)
    lens = [c + q for c, q in rows]
    cache, tables = paged_cache(lens, 16, 8, 128, torch.bfloat16, gen)
    q_lens = torch.tensor([q for _, q in rows])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32).cuda()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    query = torch.randn(int(q_lens.sum()), 32, 128, generator=gen).to(torch.bfloat16).cuda()
    out = paged_prefill_attention(query, cache, tables, query_start_loc, seq_lens, 128**-0.5, sliding_window)
    ref = paged_prefill_attention_ref(query, cache, tables, query_start_loc, seq_lens, 128**-0.5, sliding_window)
    assert rel_err(out, ref) < 1e-2, f"seed {gen.initial_seed()}"


def test_silu_and_mul_real_size(gen: torch.Generator) -> None:
    from kernels.activation import silu_and_mul, silu_and_mul_ref

    x = torch.randn(4096, 2 * 14336, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    assert rel_err(silu_and_mul(x), silu_and_mul_ref(x)) < 1e-2
