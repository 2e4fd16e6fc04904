"""The FCFS roofline (``loadtest.roofline``): the schedule it replays (chunks, first token in the prompt's last step,
the running limit) and the price of each step at the ceilings, on numbers small enough to check by hand."""

from __future__ import annotations

import pytest

from loadtest.roofline import Model, simulate

# 1 FLOP a parameter-token, 1 byte of KV a token, no attention FLOPs: step costs are easy to add up by hand
TOY = Model(layer_params=1, head_params=1, kv_bytes_per_token=1, attn_flops_per_pair=0)


def test_one_request_prefills_then_decodes() -> None:
    # rate 2 FLOP/s, bandwidth 4 B/s. GEMMs: the weights' 2 * (1 + 1) = 4 bytes take 1 s; the prompt's step does
    # 2 * 10 + 2 * 1 (the sampled row's head) = 22 FLOPs = 11 s, a decode step 4 FLOPs = 2 s. Attention: the KV it
    # reads, (before + tokens) / 4: 10 / 4, 11 / 4, 12 / 4
    t = simulate([(10, 3)], TOY, budget=8192, max_seqs=4, rate=2.0, bw=4.0)
    assert t.steps == 3  # the prompt's step samples the first token, two decode steps the other two
    assert t.parts["gemm_prefill_steps"] == pytest.approx(11)
    assert t.parts["gemm_decode_steps"] == pytest.approx(2 + 2)
    assert t.parts["attention_prompt_rows"] == pytest.approx(10 / 4)
    assert t.parts["attention_decode_rows"] == pytest.approx((11 + 12) / 4)
    # overlapped: max(FLOPs / 2, (4 + KV) / 4) a step
    assert t.overlapped_s == pytest.approx(11 + max(2, 15 / 4) + max(2, 16 / 4))
    assert t.tokens == 13


def test_prompts_are_cut_by_the_budget_and_the_running_limit() -> None:
    chunks = simulate([(10, 1)], TOY, budget=4, max_seqs=4, rate=1e9, bw=1e9)
    assert chunks.steps == 3  # 4 + 4 + 2 prompt tokens, the token sampled in the third step
    serial = simulate([(4, 2), (4, 2)], TOY, budget=100, max_seqs=1, rate=1e9, bw=1e9)
    assert serial.steps == 4  # one request at a time: prompt + one decode step each
    together = simulate([(4, 2), (4, 2)], TOY, budget=100, max_seqs=2, rate=1e9, bw=1e9)
    assert together.steps == 2


def test_the_overlapped_bound_is_below_the_serial_one() -> None:
    lengths = [(32 + 7 * i % 500, 16 + 13 * i % 300) for i in range(64)]
    t = simulate(lengths, Model.of("8b"), budget=8192, max_seqs=64, rate=800e12, bw=4.2e12)
    assert 0 < t.overlapped_s <= t.serial_s
    assert t.serial_s == pytest.approx(sum(t.parts.values()))
