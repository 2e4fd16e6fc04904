"""A mixed step split between two kernels: its decode rows (sequences with one new token) through the decode kernel
(kernels.paged_attention.paged_decode_rows, which rows read on the device) and the rest through a prefill kernel that
skips them (skip_decode_rows), against the prefill reference on every row. The engine's switch for it is tested
with the new_kv kernel's engine tests (tests/kernels/test_prefill_new_kv.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.paged_attention import _paged_decode_attention, paged_decode_rows
from kernels.prefill_attention import _paged_prefill_attention, paged_prefill_attention_ref
from kernels.prefill_new_kv import _prefill_attention_new_kv
from loadtest.prefill_bench import new_kv_from_cache
from tests.kernels.helpers import DEVICE, paged_cache, rel_err, tolerance

HEAD_DIM = 32
NUM_KV_HEADS = 2
# (cached prefix, new tokens): decode rows first, between and last, a one-token prompt (a decode row too: one new
# token), full prefills and chunks after a cached prefix
ROWS = [(70, 1), (0, 23), (40, 1), (17, 9), (0, 1), (32, 24), (5, 1)]


def _step(group: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Query, the new tokens' key and value (as written in the cache), cache, tables, query_start_loc, seq_lens."""
    lens = [c + q for c, q in ROWS]
    cache, tables = paged_cache(lens, 16, NUM_KV_HEADS, HEAD_DIM, dtype, gen)
    q_lens = torch.tensor([q for _, q in ROWS])
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32).to(DEVICE)
    query = torch.randn(int(q_lens.sum()), NUM_KV_HEADS * group, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    key, value = new_kv_from_cache(cache, tables, ROWS)
    return query, key, value, cache, tables, qsl, torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def _decode_row_mask(qsl: torch.Tensor) -> torch.Tensor:
    q_lens = (qsl[1:] - qsl[:-1]).long()
    return torch.repeat_interleave(q_lens == 1, q_lens)  # [num_tokens]


# each prefill kernel, dtype, group and window, and the decode kernel's partitions: one, fixed (merged by a second
# launch), dynamic (each sequence's own length)
CASES = [
    ("new_kv", torch.bfloat16, 4, None, {}),
    ("new_kv", torch.float32, 1, 10, {"partition_size": 16}),
    ("paged", torch.bfloat16, 8, None, {"partition_size": 16}),
    ("paged", torch.float16, 4, 10, {"dynamic": True}),
    ("new_kv", torch.float32, 4, None, {"dynamic": True}),
    ("paged", torch.bfloat16, 4, None, {"partition_size": 32, "early": True}),  # inputs before the PDL wait
]


@pytest.mark.parametrize(("kernel", "dtype", "group", "window", "knobs"), CASES)
def test_split_step_equals_the_reference(
    kernel: str, dtype: torch.dtype, group: int, window: int | None, knobs: dict[str, Any], gen: torch.Generator
) -> None:
    query, key, value, cache, tables, qsl, seq_lens = _step(group, dtype, gen)
    if kernel == "new_kv":
        out = _prefill_attention_new_kv(
            query, key, value, cache, tables, qsl, seq_lens, 0.17, window, block_m=32, block_n=16,
            skip_decode_rows=True,
        )  # fmt: skip
    else:
        out = _paged_prefill_attention(
            query, cache, tables, qsl, seq_lens, 0.17, window, block_m=16, block_n=16, skip_decode_rows=True
        )
    ref = paged_prefill_attention_ref(query, cache, tables, qsl, seq_lens, 0.17, window)
    decode = _decode_row_mask(qsl)
    assert rel_err(out[~decode], ref[~decode]) < tolerance(dtype), f"seed {gen.initial_seed()}"
    prefill_rows = out[~decode].clone()
    _paged_decode_attention(query, cache, tables, seq_lens, 0.17, window, query_start_loc=qsl, out=out, block_n=16,
                            **knobs)  # fmt: skip
    assert torch.equal(out[~decode], prefill_rows)  # the prefill kernel's rows are left as they were
    assert rel_err(out[decode], ref[decode]) < tolerance(dtype), f"seed {gen.initial_seed()}"


@pytest.mark.parametrize("kernel", ["new_kv", "paged"])
def test_prefill_kernels_skip_decode_rows(kernel: str, monkeypatch: pytest.MonkeyPatch, gen: torch.Generator) -> None:
    """With skip_decode_rows a prefill kernel reads nothing of a one-token sequence and writes none of its rows:
    that sequence's cache is NaN, its rows stay as allocated (zeros here) and the other rows are finite."""
    query, key, value, cache, tables, qsl, seq_lens = _step(4, torch.float32, gen)
    for i, (c, q) in enumerate(ROWS):
        if q == 1:
            pos = torch.arange(c + q, device=DEVICE)
            cache[:, tables[i].long()[pos // 16], pos % 16] = float("nan")
    monkeypatch.setattr(torch, "empty_like", torch.zeros_like)  # the wrappers allocate the output with it
    if kernel == "new_kv":
        out = _prefill_attention_new_kv(query, key, value, cache, tables, qsl, seq_lens, 0.17, skip_decode_rows=True)
    else:
        out = _paged_prefill_attention(query, cache, tables, qsl, seq_lens, 0.17, skip_decode_rows=True)
    decode = _decode_row_mask(qsl)
    assert torch.equal(out[decode], torch.zeros_like(out[decode])) and out[~decode].isfinite().all()


def test_decode_rows_only_write_decode_rows(gen: torch.Generator) -> None:
    """The public wrapper writes the one-token sequences' rows and nothing else (NaN stays NaN elsewhere)."""
    query, _, _, cache, tables, qsl, seq_lens = _step(4, torch.float32, gen)
    out = torch.full_like(query, float("nan"))
    paged_decode_rows(query, cache, tables, seq_lens, qsl, 0.2, None, out)
    decode = _decode_row_mask(qsl)
    assert out[~decode].isnan().all() and not out[decode].isnan().any()
    ref = paged_prefill_attention_ref(query, cache, tables, qsl, seq_lens, 0.2)
    assert rel_err(out[decode], ref[decode]) < tolerance(torch.float32)


def test_decode_rows_reject_bad_inputs(gen: torch.Generator) -> None:
    query, _, _, cache, tables, qsl, seq_lens = _step(4, torch.bfloat16, gen)
    out = torch.empty_like(query)
    with pytest.raises(ValueError, match="num_seqs \\+ 1"):
        paged_decode_rows(query, cache, tables, seq_lens, qsl[:-1], 0.2, None, out)
    with pytest.raises(ValueError, match="shaped like query"):
        paged_decode_rows(query, cache, tables, seq_lens, qsl, 0.2, None, out[:3])
    with pytest.raises(ValueError, match="shaped like query"):
        paged_decode_rows(query, cache, tables, seq_lens, qsl, 0.2, None, out.float())


@pytest.mark.parametrize(("group", "rows_before"), [(4, []), (1, [(0, 9)])])
def test_engine_step_sends_its_leading_decode_rows_to_the_decode_kernel(
    group: int, rows_before: list[tuple[int, int]], gen: torch.Generator
) -> None:
    """engine.attention.paged_attention on a prefill step that starts with DECODE_ROWS_MIN one-token sequences
    (engine.inputs.leading_decode_rows): those through the decode kernel on their slice, the rest through
    prefill_new_kv on its own, into one output equal to the reference; the rest's rows bit-equal to a step
    without the split, and the decode rows to the decode kernel on them alone. ``rows_before``: a step that
    starts with a prompt has no leading decode rows, so nothing is split."""
    import dataclasses

    import numpy as np

    import engine.attention as attention
    from engine.inputs import leading_decode_rows

    d = attention.DECODE_ROWS_MIN
    rows = rows_before + [(3 + 7 * i, 1) for i in range(d)] + [(40, 9), (0, 1), (0, 23), (5, 1)]
    lens = [c + q for c, q in rows]
    cache, tables = paged_cache(lens, 16, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, gen)
    starts = np.concatenate([[0], np.cumsum([q for _, q in rows])]).astype(np.int32)
    found = leading_decode_rows(starts)
    assert found == (0 if rows_before else d)
    qsl = torch.from_numpy(starts).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    query = torch.randn(int(starts[-1]), NUM_KV_HEADS * group, HEAD_DIM, generator=gen).to(torch.bfloat16).to(DEVICE)
    new_kv = torch.stack(
        new_kv_from_cache(cache, tables, rows)
    )  # the cache holds this step's K/V, as write_kv leaves it
    meta = attention.AttentionMetadata(
        torch.zeros(0), qsl, seq_lens, tables, 23, max(lens), "triton", None, decode_rows=found
    )
    out = attention.paged_attention(query, cache, meta, 0.17, None, new_kv)
    ref = paged_prefill_attention_ref(query, cache, tables, qsl, seq_lens, 0.17, None)
    assert rel_err(out, ref) < tolerance(torch.bfloat16), f"seed {gen.initial_seed()}"
    whole = attention.paged_attention(query, cache, dataclasses.replace(meta, decode_rows=0), 0.17, None, new_kv)
    if rows_before:
        assert torch.equal(out, whole)
        return
    assert torch.equal(out[d:], whole[d:]), "the rows after the decode rows depend on the split"
    alone = _paged_decode_attention(query[:d], cache, tables[:d], seq_lens[:d], 0.17, None)
    assert torch.equal(out[:d], alone)


def test_engine_with_its_decode_rows_split_gives_the_torch_backends_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole engine on the Triton backend (the interpreter on CPU), fp32, prefill steps of 16 tokens that mix
    chunks with decode rows: with DECODE_ROWS_MIN at 2 the steps with two or more leading decode rows split (counted
    at engine.attention._split_step), and the greedy tokens equal the torch backend's (which equal HF's,
    tests/engine/test_engine_parity.py)."""
    import random

    import engine.attention as attention
    from engine import LLM, SamplingParams
    from tests.helpers import VOCAB_SIZE, build_tiny_model

    folder = build_tiny_model(tmp_path, "llama", seed=3, num_hidden_layers=1)
    rng = random.Random(0)
    requests = [
        {"prompt_token_ids": [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(2, 12))]} for _ in range(10)
    ]

    def tokens(backend: str) -> list[list[int]]:
        llm = LLM(str(folder), device="cpu", attention_backend=backend, dtype="float32", max_num_batched_tokens=16,
                  max_model_len=64, max_num_seqs=16)  # fmt: skip
        outs = llm.generate(requests, SamplingParams(temperature=0, max_tokens=5))  # type: ignore[arg-type]
        return [o.outputs[0].token_ids for o in outs]

    split_rows: list[int] = []
    real = attention._split_step

    def counted(*args: Any) -> torch.Tensor:
        split_rows.append(args[6])  # decode_rows
        return real(*args)

    monkeypatch.setattr(attention, "_split_step", counted)
    monkeypatch.setattr(attention, "DECODE_ROWS_MIN", 2)
    assert tokens("triton") == tokens("torch")
    assert split_rows and min(split_rows) >= 2
