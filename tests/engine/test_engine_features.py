"""Engine behaviour on a tiny random Llama: prefix caching, n > 1 with shared blocks, seeded sampling,
bad input, the async front and chat."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.helpers import build_tiny_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=3)


@pytest.fixture(scope="module")
def llm(folder: Path) -> LLM:
    return LLM(str(folder), device="cpu", block_size=4, max_model_len=200, num_gpu_blocks_override=256)


def greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def test_prefix_cache_computes_only_new_tokens(llm: LLM) -> None:
    shared = list(range(10, 42))  # 32 tokens = 8 full blocks of 4
    first = llm.generate({"prompt_token_ids": shared + [50, 51]}, greedy(), use_tqdm=False)[0]
    alone = LLM(str(llm.engine.files.folder), device="cpu", block_size=4, enable_prefix_caching=False)
    prompt = shared + [60, 61, 62]
    expected = alone.generate({"prompt_token_ids": prompt}, greedy(), use_tqdm=False)[0]
    before = llm.engine.stats()
    computed_before = llm.engine.computed_tokens_total
    second = llm.generate({"prompt_token_ids": prompt}, greedy(), use_tqdm=False)[0]
    after = llm.engine.stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits == 32
    # 3 new prompt tokens + one token per decode step after the first output token
    assert llm.engine.computed_tokens_total - computed_before == 3 + (6 - 1)
    assert second.outputs[0].token_ids == expected.outputs[0].token_ids
    assert first.outputs[0].token_ids  # the first request ran normally


def test_n_samples_share_prompt_blocks_and_differ(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True)
    prompt = list(range(100, 118))  # 18 tokens: 4 full blocks + a partial one
    engine.add_request("fork", prompt, params)
    llm.processor.add("fork", prompt, params)
    assert llm.step() == []  # the first sample prefills; the others fork from it
    group = engine.scheduler.groups["fork"]
    leader_blocks = group[0].block_ids
    for sibling in group[1:]:
        assert sibling.block_ids[:4] == leader_blocks[:4]
    assert [engine.kv.ref_count(b) for b in leader_blocks[:4]] == [4, 4, 4, 4]
    outputs = None
    while engine.has_unfinished_requests():
        for out in llm.step():
            outputs = out
    assert outputs is not None and outputs.finished
    samples = [tuple(o.token_ids) for o in outputs.outputs]
    assert len(samples) == 4 and len(set(samples)) == 4 and all(len(t) == 8 for t in samples)
    assert engine.kv.usage() == 0.0


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm: LLM) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=8, seed=1234, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(20, 33))}
    alone = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": list(range(40 + i, 50 + 2 * i))} for i in range(5)]
    noisy = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    batch = llm.generate([*others, prompt], [noisy] * 5 + [params], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=8, seed=99, ignore_eos=True)
    assert llm.generate(prompt, other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


@pytest.mark.parametrize(
    "make",
    [
        lambda: ([], SamplingParams()),
        lambda: (list(range(3, 250)), SamplingParams()),  # longer than max_model_len=200
        lambda: ([5, 6], SamplingParams(stop_token_ids=[10**6])),
        lambda: ([5, 10**6], SamplingParams()),
        lambda: ([5, 6], SamplingParams(logit_bias={10**6: 1.0})),
    ],
    ids=["empty", "too-long", "unknown-stop-id", "token-out-of-vocab", "logit-bias-out-of-vocab"],
)
def test_bad_input_raises_and_engine_keeps_serving(llm: LLM, make) -> None:  # type: ignore[no-untyped-def]
    ids, params = make()
    with pytest.raises(ValueError):
        llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate({"prompt_token_ids": [7, 8, 9]}, greedy(3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 1


@pytest.mark.parametrize(
    "kwargs", [{"max_tokens": 0}, {"top_p": 0.0}, {"top_p": 1.5}, {"temperature": -1}, {"n": 0}, {"top_k": -2}]
)
def test_bad_sampling_params(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_text_prompts_and_chat(llm: LLM) -> None:
    out = llm.generate(["hello world", "abc"], greedy(4), use_tqdm=False)
    assert out[0].prompt == "hello world" and out[0].prompt_token_ids
    assert out[0].outputs[0].finish_reason in ("stop", "length")
    chat = llm.chat([{"role": "user", "content": "hi"}], greedy(4), use_tqdm=False)
    assert chat[0].prompt is not None and "assistant" in chat[0].prompt


def test_logprobs_returned(llm: LLM) -> None:
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, logprobs=2), use_tqdm=False)
    comp = out[0].outputs[0]
    assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids)
    for tok, lp in zip(comp.token_ids, comp.logprobs, strict=True):
        assert tok in lp and all(v <= 0.0 for v in lp.values())


def test_async_scheduling_gives_the_same_outputs_as_sync(folder: Path) -> None:
    """One step in flight (tokens resolved a step late, stops applied a step late) changes nothing visible:
    stop ids, stop strings, min_tokens, seeded n>1 samples, max_tokens and aborts all match the sync engine."""
    probe = LLM(str(folder), device="cpu", async_scheduling=False)
    first = probe.generate({"prompt_token_ids": [9, 8, 7]}, greedy(8), use_tqdm=False)[0].outputs[0]
    stop_id = first.token_ids[3]
    stop_text = first.text[2:4] if len(first.text) >= 4 else first.text[-1:]
    prompts = [{"prompt_token_ids": [9, 8, 7]}] * 3 + [
        {"prompt_token_ids": list(range(20, 20 + n))} for n in (5, 9, 30)
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0.0, max_tokens=8, stop=[stop_text]),
        SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_id], min_tokens=5),
        SamplingParams(temperature=0.8, top_k=20, max_tokens=9, seed=5, n=2),
        SamplingParams(temperature=1.0, top_p=0.8, max_tokens=3, seed=6),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]
    results = []
    for mode in (False, True):
        llm = LLM(str(folder), device="cpu", async_scheduling=mode, max_num_batched_tokens=16)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs])
        assert llm.engine.kv.usage() == 0.0 and not llm.engine.has_unfinished_requests()
    assert results[0] == results[1]
    assert results[0][0][0][2] == "stop" and len(results[0][0][0][0]) == 4


def test_async_abort_frees_blocks(folder: Path) -> None:
    llm = LLM(str(folder), device="cpu", async_scheduling=True)
    engine = llm.engine
    engine.add_request("a", list(range(10, 30)), SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    (final,) = engine.abort_request("a")
    assert final.finish_reason == "abort" and -1 not in final.new_token_ids
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.usage() == 0.0
