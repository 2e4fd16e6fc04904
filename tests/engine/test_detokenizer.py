"""IncrementalDetokenizer against the real SmolLM2 tokenizer (byte-level BPE)."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

import engine.detokenizer
import modelfiles
from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    files = modelfiles.resolve(None)
    return AutoTokenizer.from_pretrained(files.folder)


@pytest.fixture(autouse=True, params=["decode_stream", "window"])
def decoding(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs on both paths: the tokenizers library's DecodeStream, and the Python window fallback."""
    if request.param == "window":
        monkeypatch.setattr(engine.detokenizer, "USE_DECODE_STREAM", False)
    return str(request.param)


def stream(
    tokenizer: PreTrainedTokenizerBase,
    output_ids: list[int],
    params: SamplingParams,
    prompt_ids: list[int] | None = None,
    chunk_sizes: list[int] | None = None,
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed ``output_ids`` in chunks; return the detokenizer, output_text after each call, the stop."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids or tokenizer.encode("Say something:"), params)
    seen: list[str] = []
    stop = None
    i = 0
    sizes = iter(chunk_sizes or [])
    while i < len(output_ids) and stop is None:
        size = next(sizes, 1)
        stop = detok.add_tokens(output_ids[i : i + size])
        i += size
        seen.append(detok.output_text)
    if stop is None:
        detok.finish()
        seen.append(detok.output_text)
    return detok, seen, stop


def assert_only_grows(seen: list[str]) -> None:
    for before, after in zip(seen, seen[1:], strict=False):
        assert after.startswith(before), (before, after)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_tokens_match_full_decode(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> None:
    rng = random.Random(0)
    vocab_size = len(tokenizer)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(30):
        output_ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 60))]
        prompt_ids = [rng.randrange(vocab_size) for _ in range(rng.randint(0, 8))]
        chunks = [rng.randint(1, 4) for _ in output_ids]
        detok, seen, _ = stream(tokenizer, output_ids, params, prompt_ids, chunks)
        assert_only_grows(seen)
        want = tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
        assert detok.output_text == want


def test_shuffled_byte_tokens_match_full_decode(tokenizer: PreTrainedTokenizerBase) -> None:
    """Random orders of tokens that split characters: invalid byte runs must decode as a whole would."""
    pool = sorted(set(tokenizer.encode("東京 🙂🎉 Привет ü é ß 日本語 한국어 ✓ — a b")) | {0, 1, 2})
    rng = random.Random(1)
    for _ in range(60):
        output_ids = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        chunks = [rng.randint(1, 3) for _ in output_ids]
        detok, seen, _ = stream(tokenizer, output_ids, SamplingParams(), None, chunks)
        assert_only_grows(seen)
        assert detok.output_text == tokenizer.decode(output_ids, skip_special_tokens=True)


def test_multibyte_text_never_shows_partial_characters(tokenizer: PreTrainedTokenizerBase) -> None:
    text = "Grüße aus 東京 🙂🎉, naïve café — ok. Привет мир!"
    output_ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([t]) for t in output_ids)  # some tokens split characters
    detok, seen, _ = stream(tokenizer, output_ids, SamplingParams())
    assert all("\ufffd" not in s for s in seen)
    assert_only_grows(seen)
    assert detok.output_text == text


def test_take_new_text_concatenates_to_output(tokenizer: PreTrainedTokenizerBase) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["zzz"]))
    pieces = []
    for token in tokenizer.encode(" hello there, 日本 friend zz"):
        detok.add_tokens([token])
        pieces.append(detok.take_new_text())
    detok.finish()
    pieces.append(detok.take_new_text())
    assert "".join(pieces) == detok.output_text == " hello there, 日本 friend zz"
    assert pieces[-1] == "zz"  # held back as a possible start of "zzz" until finish


def test_stop_string_spanning_tokens_and_no_partial_leak(tokenizer: PreTrainedTokenizerBase) -> None:
    text = "The answer is forty-two. END OF STORY and more text"
    output_ids = tokenizer.encode(text)
    stop = "END OF STORY"
    assert not any(stop in tokenizer.decode([t]) for t in output_ids)  # it spans several tokens
    detok, seen, matched = stream(tokenizer, output_ids, SamplingParams(stop=[stop]))
    assert matched == stop and detok.stop_reason == stop
    assert detok.output_text == "The answer is forty-two. "
    assert_only_grows(seen)
    for s in seen:  # no prefix of the stop string ever shown ("E", "END", "END OF", ...)
        assert "E" not in s.removeprefix("The answer is forty-two. ")
    assert detok.add_tokens(tokenizer.encode(" more")) is None
    detok.finish()
    assert detok.output_text == "The answer is forty-two. "  # text after a stop is never shown


def test_held_prefix_released_when_it_stops_matching(tokenizer: PreTrainedTokenizerBase) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["<stop>"]))
    detok.add_tokens(tokenizer.encode("a <st"))
    assert detok.output_text == "a "
    detok.add_tokens(tokenizer.encode("ory"))
    assert detok.output_text == "a <story"
    assert detok.stop_reason is None


def test_stop_at_first_token(tokenizer: PreTrainedTokenizerBase) -> None:
    output_ids = tokenizer.encode("Hello world")
    detok, seen, matched = stream(tokenizer, output_ids, SamplingParams(stop=["Hello"]))
    assert matched == "Hello" and seen == [""] and detok.output_text == ""
    detok, _, matched = stream(tokenizer, output_ids, SamplingParams(stop=["Hello"], include_stop_str_in_output=True))
    assert matched == "Hello" and detok.output_text == "Hello"


def test_earliest_stop_wins(tokenizer: PreTrainedTokenizerBase) -> None:
    text = "one two three four"
    output_ids = tokenizer.encode(text)
    for chunks in ([1] * 10, [len(output_ids)]):  # token by token, or all at once
        detok, _, matched = stream(tokenizer, output_ids, SamplingParams(stop=["four", "two", "three"]), None, chunks)
        assert matched == "two" and detok.output_text == "one "
    # the stop that completes first wins, even when a longer one started earlier
    detok, _, matched = stream(
        tokenizer, output_ids, SamplingParams(stop=["one two three", "two"]), None, [len(output_ids)]
    )
    assert matched == "two" and detok.output_text == "one "


def test_include_stop_str_in_output(tokenizer: PreTrainedTokenizerBase) -> None:
    output_ids = tokenizer.encode("x = 1;\ny = 2;\n")
    params = SamplingParams(stop=[";\n"], include_stop_str_in_output=True)
    detok, seen, matched = stream(tokenizer, output_ids, params)
    assert matched == ";\n"
    assert detok.output_text == "x = 1;\n"
    assert_only_grows(seen)


def test_stop_inside_one_token_cuts_mid_token(tokenizer: PreTrainedTokenizerBase) -> None:
    output_ids = tokenizer.encode(" wonderful day")
    detok, _, matched = stream(tokenizer, output_ids, SamplingParams(stop=["der"]))
    assert matched == "der" and detok.output_text == " won"


def test_finish_releases_held_tail(tokenizer: PreTrainedTokenizerBase) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["###"]))
    detok.add_tokens(tokenizer.encode("header ##"))
    assert detok.output_text == "header "
    detok.finish()
    assert detok.output_text == "header ##" and detok.stop_reason is None


def test_work_per_call_is_bounded(tokenizer: PreTrainedTokenizerBase, decoding: str) -> None:
    """Each call decodes a small window, not the whole output so far."""
    decoded_lengths: list[int] = []
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    assert (detok._stream is not None) == (decoding == "decode_stream")
    real_decode = detok._decode

    def counting_decode(token_ids: list[int]) -> str:
        decoded_lengths.append(len(token_ids))
        return real_decode(token_ids)

    detok._decode = counting_decode  # type: ignore[method-assign]
    text = "word " * 400
    for token in tokenizer.encode(text):
        detok.add_tokens([token])
        decoded_lengths.append(detok._read_offset - detok._prefix_offset)  # the window the stream tracks
    assert max(decoded_lengths) <= 3
    assert detok.output_text == tokenizer.decode(tokenizer.encode(text))
