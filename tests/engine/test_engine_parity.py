"""The engine's greedy output equals HF transformers' token for token (float32, CPU), with every prompt in
ONE continuous batch: chunked prefill, mixed prefill/decode steps and preemption all happen."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers import VOCAB_SIZE, build_tiny_model, load_hf_model

MAX_TOKENS = 12


def make_prompts(seed: int, n: int = 10) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 7, 16, 17, 29, 40, 5, 63, 11][:n]
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(length)] for length in lengths]


def hf_greedy(folder: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    model = load_hf_model(folder)
    outs = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        outs.append(gen[0, len(ids) :].tolist())
    return outs


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    folder = build_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=1)
    prompts = make_prompts(seed=2)
    return folder, [prompts, hf_greedy(folder, prompts, MAX_TOKENS)]


def run_engine(folder: Path, prompts: list[list[int]], **llm_kwargs: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(folder), device="cpu", **llm_kwargs)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_equals_hf_in_one_continuous_batch(checkpoint: tuple[Path, list], async_scheduling: bool) -> None:
    folder, (prompts, expected) = checkpoint
    # A small token budget: long prompts are chunked and share steps with other requests' decodes.
    got, llm = run_engine(folder, prompts, max_num_batched_tokens=24, max_num_seqs=6, async_scheduling=async_scheduling)
    assert got == expected
    assert llm.engine.async_scheduling == async_scheduling


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_equals_hf_under_preemption(checkpoint: tuple[Path, list], async_scheduling: bool) -> None:
    folder, (prompts, expected) = checkpoint
    # 12 blocks of 8 tokens for prompts of up to 63+12 tokens: requests must be preempted and recomputed.
    got, llm = run_engine(
        folder,
        prompts,
        block_size=8,
        num_gpu_blocks_override=12,
        max_model_len=96,
        max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
    )
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert llm.engine.kv.usage() == 0.0


def test_smollm2_greedy_equals_hf(hf_smollm2: Any) -> None:
    """The default model (SmolLM2-135M-Instruct, a Q4_1 GGUF, dequantized) against transformers' GGUF load."""
    from transformers import AutoTokenizer

    import modelfiles

    files = modelfiles.resolve(None)
    assert files.gguf_path is not None
    tok = AutoTokenizer.from_pretrained(files.folder)
    chats = ["What is the capital of France?", "Write a haiku about the sea.", "2+2="]
    texts = [
        tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
        for c in chats
    ]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    expected = []
    for ids in prompts:
        with torch.no_grad():
            gen = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)
        expected.append(gen[0, len(ids) :].tolist())
    llm = LLM("", device="cpu", max_model_len=512)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=10))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert outs[0].outputs[0].text.strip() != ""
