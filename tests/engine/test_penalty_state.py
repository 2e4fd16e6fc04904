"""The sampler's per-request penalty counts (``engine.penalty_state``) against counting every row's whole history
each step: equal penalised logits over many steps while requests join, grow, pause, leave and reuse ids."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine import LLM
from engine.penalty_state import PenaltyState
from engine.sampler import Sampler, SamplingBatch
from engine.sampling_params import SamplingParams
from tests.helpers import VOCAB_SIZE, build_tiny_model, load_hf_model

CPU = torch.device("cpu")
VOCAB = 50


@dataclass
class FakeRequest:
    request_id: str
    params: SamplingParams
    prompt: list[int]
    output: list[int] = field(default_factory=list)


def random_params(rng: random.Random) -> SamplingParams:
    kind = rng.randrange(4)
    return SamplingParams(
        temperature=0.0,
        repetition_penalty=1.5 if kind in (0, 3) else 1.0,
        frequency_penalty=0.4 if kind in (1, 3) else 0.0,
        presence_penalty=0.7 if kind == 2 else 0.0,
    )


def batch_of(requests: list[FakeRequest], with_ids: bool) -> SamplingBatch:
    return SamplingBatch(
        params=[r.params for r in requests],
        prompt_token_ids=[r.prompt for r in requests],
        output_token_ids=[r.output for r in requests],
        generators=[None] * len(requests),
        eos_token_ids=[() for _ in requests],
        request_ids=[r.request_id for r in requests] if with_ids else None,
    )


def test_kept_counts_equal_counting_every_step() -> None:
    rng = random.Random(0)
    kept, recount = Sampler(CPU), Sampler(CPU)
    live: list[FakeRequest] = []
    num_joined = 0
    for _step in range(120):
        if rng.random() < 0.3 or not live:  # an id comes back now and then: a new request, new lists
            rid = f"r{rng.randrange(num_joined + 1)}" if rng.random() < 0.2 else f"r{num_joined}"
            live = [r for r in live if r.request_id != rid]
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))]
            live.append(FakeRequest(rid, random_params(rng), prompt))
            num_joined += 1
        if rng.random() < 0.1:
            live.remove(rng.choice(live))
        rows = [r for r in live if rng.random() < 0.8]  # the others pause this step
        if not rows:
            continue
        logits = torch.randn(len(rows), VOCAB)
        got = kept._process(logits, batch_of(rows, with_ids=True))
        want = recount._process(logits, batch_of(rows, with_ids=False))
        assert torch.equal(got, want)
        for r, token in zip(rows, got.argmax(dim=-1).tolist(), strict=True):
            r.output.extend([token] * rng.choice([1, 1, 1, 2]))  # 2: a step that resolved late, say
    assert kept.penalty_state.num_rows <= num_joined


def test_rows_are_reclaimed_before_they_grow() -> None:
    state = PenaltyState()
    for step in range(10):
        ids = [f"s{step}-{i}" for i in range(3)]  # three new requests per step, the old ones gone
        counts, seen = state.counts(ids, [[1, 2]] * 3, [[3, 3]] * 3, VOCAB, CPU)
        assert counts[:, 3].tolist() == [2.0] * 3 and seen[:, 1].all() and not seen[:, 3].any()
    assert state.num_rows == 3 and state._output_counts.shape[0] == 4


def test_engine_greedy_with_repetition_penalty_equals_hf(tmp_path: Path) -> None:
    """End to end: the engine keeps each request's counts while requests are chunked, preempted and recomputed;
    HF's ``repetition_penalty`` is the same rule (divide a positive logit of a seen token, multiply a negative)."""
    folder = build_tiny_model(tmp_path, "llama", seed=1)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in (2, 9, 17, 30, 5, 41)]
    model = load_hf_model(folder)
    expected = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=10,
                do_sample=False,
                repetition_penalty=1.3,
                pad_token_id=0,
            )
        expected.append(gen[0, len(ids) :].tolist())
    llm = LLM(str(folder), device="cpu", block_size=8, num_gpu_blocks_override=10, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
