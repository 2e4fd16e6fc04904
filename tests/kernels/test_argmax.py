"""The Triton argmax against ``torch.argmax`` (exact: an index), under the interpreter on CPU: ties, NaNs,
-inf, a vocabulary that is not a multiple of the chunk, rows that span one chunk and several."""

from __future__ import annotations

import pytest
import torch

from kernels import argmax as argmax_mod
from kernels.argmax import argmax, argmax_ref
from tests.kernels.helpers import DEVICE


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 64 values: several chunks per row at interpreter-sized vocabularies."""
    monkeypatch.setattr(argmax_mod, "CHUNK", 64)


@pytest.mark.parametrize("vocab", [1, 5, 64, 200, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_equals_torch(vocab: int, dtype: torch.dtype, small_chunks: None, gen: torch.Generator) -> None:
    x = torch.randn(7, vocab, generator=gen).to(dtype)
    x[1] = x[1].round()  # many ties: the first maximum wins
    x[2, vocab // 2 :] = x[2].max() + 1  # the maximum repeated across chunks
    x[3] = float("-inf")  # nothing but -inf: index 0
    x[4, vocab // 3] = float("nan")  # a NaN: its index, whatever the values
    x[5, -1] = float("inf")
    x[6, :: max(1, vocab // 4)] = float("nan")  # several NaNs: the first
    x = x.to(DEVICE)
    assert torch.equal(argmax(x), argmax_ref(x))


def test_argmax_of_strided_rows_and_one_chunk(gen: torch.Generator) -> None:
    base = torch.randn(3, 300, generator=gen).to(DEVICE)
    rows = base[:, :250]  # rows contiguous, stride 300
    assert torch.equal(argmax(rows), argmax_ref(rows))
    assert argmax(base[:0]).shape == (0,)


def test_argmax_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="2-D float"):
        argmax(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous"):
        argmax(torch.zeros(4, 6).t())
