"""The attention layer on the Triton backend (under the interpreter on CPU: fused rotary + cache write, then
the paged kernels) equals the torch backend, for a prefill and the decode step after it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from engine.attention import AttentionMetadata
from engine.layers import Attention, RotaryEmbedding
from tests.helpers import one_seq_metadata, tiny_config

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 16, 16


def qkv_views(num_tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the model passes them: strided views of one fused projection output."""
    qkv = torch.randn(num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=gen)
    q, k, v = qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=-1)
    return (
        q.reshape(num_tokens, NUM_HEADS, HEAD_DIM),
        k.reshape(num_tokens, NUM_KV_HEADS, HEAD_DIM),
        v.reshape(num_tokens, NUM_KV_HEADS, HEAD_DIM),
    )


Step = tuple[torch.Tensor, AttentionMetadata, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def run_layer(backend: str, steps: Sequence[Step]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The layer's outputs for each step in turn, and its cache after them."""
    rotary = RotaryEmbedding(tiny_config("llama"), HEAD_DIM, 64)
    layer = Attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, rotary)
    layer.kv_cache = torch.zeros(2, 4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    outs = [layer(positions, *qkv, dataclasses.replace(meta, backend=backend)) for positions, meta, qkv in steps]
    return outs, layer.kv_cache


def test_triton_backend_equals_torch_backend() -> None:
    gen = torch.Generator().manual_seed(0)
    table = [3, 1]
    num_prompt = 21  # the prefill crosses a block boundary
    steps: list[Step] = [
        (torch.arange(num_prompt), one_seq_metadata(table, 0, num_prompt), qkv_views(num_prompt, gen)),
        (torch.tensor([num_prompt]), one_seq_metadata(table, num_prompt, 1), qkv_views(1, gen)),
    ]
    ref_outs, ref_cache = run_layer("torch", steps)
    outs, cache = run_layer("triton", steps)
    for out, ref in zip(outs, ref_outs, strict=True):
        assert out.shape == ref.shape
        assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache, ref_cache)  # fp32: the fused kernel writes the reference's bits
