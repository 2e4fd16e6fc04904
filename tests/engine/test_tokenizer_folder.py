"""``--tokenizer`` / ``LLM(tokenizer=...)``: a model folder without tokenizer files runs with a tokenizer folder
given apart, and gives what the complete folder gives."""

from __future__ import annotations

import shutil
from pathlib import Path

from engine import LLM, SamplingParams
from tests.helpers import build_tiny_model


def test_a_tokenizer_folder_apart_from_the_model(tmp_path: Path) -> None:
    full = build_tiny_model(tmp_path / "full", "llama", seed=3)
    weights, tokenizer = tmp_path / "weights", tmp_path / "tokenizer"
    shutil.copytree(full, weights)
    tokenizer.mkdir()
    for path in list(weights.iterdir()):
        if path.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.move(str(path), tokenizer / path.name)
    assert (tokenizer / "tokenizer.json").exists() and not (weights / "tokenizer.json").exists()
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(full), device="cpu") as llm:
        expected = llm.generate(["hello there"], greedy, use_tqdm=False)[0].outputs[0]
    with LLM(str(weights), tokenizer=str(tokenizer), device="cpu") as llm:
        got = llm.generate(["hello there"], greedy, use_tqdm=False)[0].outputs[0]
    assert (got.token_ids, got.text) == (expected.token_ids, expected.text)
