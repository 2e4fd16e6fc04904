"""The response-cache key of a SamplingSpec: deterministic, and the digest the plain-dict params gave before
(entries cached by the previous release stay hits)."""

from __future__ import annotations

from redis.asyncio import Redis

from cache.responses import ResponseCache, canonical_digest, is_cacheable
from wire.sampling import SamplingSpec

SEEDED = {"temperature": 0.0, "seed": 7, "max_tokens": 16, "stop": ["a", "b"], "stop_token_ids": [3], "logprobs": 2}
# computed with the former ``sampling_dict`` output (a dict with int logit_bias keys) and canonical_digest
SEEDED_DIGEST = "5ebb7bf1154a30bc6e9a031f63281774ef6767a53483a39146939cbdfc7bf507"
GREEDY_DIGEST = "de6636a709e9008c35e4cd0d7d10f61ed25145496f147ad06bb76f966613b512"


def test_key_is_the_former_digest_whatever_the_spelling() -> None:
    cache = ResponseCache(Redis(), "pfx:")  # no command is sent: key() only hashes
    spellings = [
        SamplingSpec(**SEEDED, logit_bias={10: 5.0, 9: -1.5}),
        SamplingSpec(**SEEDED, logit_bias={"9": -1.5, "10": 5}),  # type: ignore[dict-item]
        SamplingSpec.from_dict({**SEEDED, "logit_bias": {"10": 5, "9": -1.5}, "temperature": 0}),
    ]
    assert {cache.key("m", [1, 2, 3], s) for s in spellings} == {"pfx:" + SEEDED_DIGEST}
    assert canonical_digest("m", [5], SamplingSpec(temperature=0.0, max_tokens=32).to_dict()) == GREEDY_DIGEST


def test_key_changes_with_any_field() -> None:
    cache = ResponseCache(Redis(), "pfx:")
    base = SamplingSpec(temperature=0.0)
    variants = [SamplingSpec(temperature=0.0, **{k: v}) for k, v in [("top_k", 5), ("ignore_eos", True)]]
    keys = {cache.key("m", [1], s) for s in [base, *variants]}
    assert len(keys) == 3
    assert cache.key("m", [1], base) != cache.key("m", [2], base) != cache.key("other", [2], base)


def test_is_cacheable() -> None:
    assert is_cacheable(SamplingSpec(temperature=0.0))
    assert is_cacheable(SamplingSpec(seed=3))
    assert not is_cacheable(SamplingSpec())
    assert not is_cacheable(SamplingSpec(temperature=0.0, n=2))
