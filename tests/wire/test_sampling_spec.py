"""The typed wire contract: SamplingSpec (checked once, strict from_dict, same fields and messages as the
engine's SamplingParams), JobPayload and JobMeta round trips. Fast: no Redis, no torch."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from engine.sampling_params import SamplingParams
from wire.messages import JobMeta, JobPayload, dumps, loads
from wire.sampling import SamplingSpec, SamplingSpecError

FULL = SamplingSpec(
    n=2,
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    presence_penalty=0.5,
    frequency_penalty=-0.5,
    repetition_penalty=1.1,
    seed=1234,
    max_tokens=64,
    min_tokens=3,
    stop=["\n\n", "END"],
    stop_token_ids=[2, 7],
    ignore_eos=True,
    logprobs=5,
    skip_special_tokens=False,
    include_stop_str_in_output=True,
    logit_bias={10: 5.0, 9: -1.5},
)


def _shape(cls: type[Any]) -> list[tuple[str, Any, Any, Any]]:
    return [(f.name, f.type, f.default, f.default_factory) for f in dataclasses.fields(cls)]


def test_fields_names_types_and_defaults_are_the_engines() -> None:
    assert _shape(SamplingSpec) == _shape(SamplingParams)
    assert SamplingSpec().to_dict() == SamplingParams().to_dict()


def test_every_field_is_set_in_the_full_example() -> None:
    defaults = SamplingSpec()
    assert all(getattr(FULL, f.name) != getattr(defaults, f.name) for f in dataclasses.fields(SamplingSpec))


@pytest.mark.parametrize("spec", [SamplingSpec(), FULL], ids=["defaults", "full"])
def test_round_trips(spec: SamplingSpec) -> None:
    assert SamplingSpec.from_dict(spec.to_dict()) == spec
    assert SamplingSpec.from_dict(loads(dumps(spec.to_dict()))) == spec  # JSON makes logit_bias keys strings
    payload = JobPayload("r-1", "m", [1, 2, 3], spec, 100.0, 130.0, reply_channel="api:1")
    back = JobPayload.from_dict(loads(dumps(payload.to_dict())))
    assert back == payload and isinstance(back.params, SamplingSpec)


@pytest.mark.parametrize("spec", [SamplingSpec(), FULL], ids=["defaults", "full"])
def test_engine_reads_to_dict(spec: SamplingSpec) -> None:
    """The worker builds ``SamplingParams.from_dict(payload.params.to_dict())``: nothing lost or changed."""
    assert SamplingParams.from_dict(spec.to_dict()).to_dict() == spec.to_dict()
    assert SamplingParams.from_dict(loads(dumps(spec.to_dict()))).to_dict() == spec.to_dict()


def test_to_dict_is_a_copy() -> None:
    data = FULL.to_dict()
    data["stop"].append("x")
    data["logit_bias"][1] = 1.0
    assert FULL.stop == ["\n\n", "END"] and 1 not in (FULL.logit_bias or {})


def test_from_dict_refuses_unknown_keys_naming_them() -> None:
    with pytest.raises(ValueError, match="unknown SamplingSpec keys: best_of, temprature"):
        SamplingSpec.from_dict({"temprature": 0.0, "best_of": 2, "n": 1})
    with pytest.raises(ValueError, match="must be a JSON object"):
        SamplingSpec.from_dict([1, 2])  # type: ignore[arg-type]
    assert SamplingSpec.from_dict({}) == SamplingSpec()  # missing keys take the defaults


def test_job_payload_refuses_unknown_and_missing_keys() -> None:
    data = JobPayload("r", "m", [1], SamplingSpec(), 1.0, 2.0).to_dict()
    with pytest.raises(ValueError, match="unknown JobPayload keys: lora"):
        JobPayload.from_dict({**data, "lora": "x"})
    with pytest.raises(ValueError, match="unknown SamplingSpec keys: guided_json"):
        JobPayload.from_dict({**data, "params": {**data["params"], "guided_json": {}}})
    with pytest.raises(ValueError, match="missing keys: deadline"):
        JobPayload.from_dict({k: v for k, v in data.items() if k != "deadline"})
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        JobPayload.from_dict({**data, "params": {"temperature": -1.0}})


RANGE_CASES: list[tuple[dict[str, Any], str]] = [
    ({"n": 0}, "n"),
    ({"n": "2"}, "n"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"seed": 1.5}, "seed"),
    ({"logit_bias": {"blue": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
]


@pytest.mark.parametrize(("kwargs", "param"), RANGE_CASES, ids=[str(c[0]) for c in RANGE_CASES])
def test_range_checks_match_the_engines(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(ValueError) as engine_err:
        SamplingParams(**kwargs)
    with pytest.raises(SamplingSpecError) as spec_err:
        SamplingSpec(**kwargs)
    assert str(spec_err.value) == str(engine_err.value)
    assert spec_err.value.param == param
    with pytest.raises(SamplingSpecError):
        SamplingSpec.from_dict(kwargs)


def test_normalisation_matches_the_engines() -> None:
    kwargs: dict[str, Any] = {"stop": "x", "top_k": -1, "logit_bias": {"3": 2}, "stop_token_ids": (1,)}
    assert SamplingSpec(**kwargs).to_dict() == SamplingParams(**kwargs).to_dict()
    assert SamplingSpec(logit_bias={}).logit_bias is None


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": True}, "top_p"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"top_k": None}, "top_k"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
    ],
)
def test_wrong_types_are_value_errors(kwargs: dict[str, Any], param: str) -> None:
    """Untyped JSON off the wire: never a TypeError half way through the checks."""
    with pytest.raises(SamplingSpecError) as err:
        SamplingSpec.from_dict(kwargs)
    assert err.value.param == param and isinstance(err.value, ValueError)


def test_job_meta_round_trip_and_strictness() -> None:
    meta = JobMeta("completion", "m", 1_700_000_000, 2, True, "Once upon")
    assert JobMeta.from_json(meta.to_json()) == meta
    assert JobMeta.from_json(meta.to_json().encode()) == meta
    chat = JobMeta("chat", "m", 1, 1, False)
    assert JobMeta.from_json(chat.to_json()).echo is None
    legacy = '{"kind": "chat", "model": "m", "created": 1, "n": 1, "include_usage": false, "echo": null}'
    assert JobMeta.from_json(legacy) == chat  # what the API stored before JobMeta (plain json.dumps)
    with pytest.raises(ValueError, match="unknown JobMeta keys: extra"):
        JobMeta.from_json('{"kind": "chat", "model": "m", "created": 1, "n": 1, "include_usage": false, "extra": 1}')
    with pytest.raises(ValueError, match="missing keys: include_usage"):
        JobMeta.from_json('{"kind": "chat", "model": "m", "created": 1, "n": 1}')
    with pytest.raises(ValueError, match="kind"):
        JobMeta("embedding", "m", 1, 1, False)  # type: ignore[arg-type]


def test_fast_delta_encoding_is_the_generic_json() -> None:
    import json

    from wire.messages import ChoiceDelta, DeltaEvent, decode_event, encode_event

    event = DeltaEvent(7, [ChoiceDelta(0, 'a "q" \\ é\n☃', [1, 22, 333]), ChoiceDelta(2, "", [])])
    fast = encode_event(event)
    generic = json.dumps(
        {"kind": "delta", "seq": 7, "choices": [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                                                  "logprobs": None} for c in event.choices]},
        separators=(",", ":"),
    )  # fmt: skip
    assert json.loads(fast) == json.loads(generic)
    assert decode_event(fast) == event


@pytest.mark.parametrize("stop_reason", [None, 7, "END"])
def test_fast_final_encoding_is_the_generic_json(stop_reason: int | str | None) -> None:
    import json

    from wire.messages import ChoiceResult, FinalEvent, JobResult, TokenLogprob, decode_event, encode_event

    choices = [
        ChoiceResult(0, 'a "q" \\ é\n☃', [1, 22, 333], "stop", None, stop_reason),
        ChoiceResult(1, "", [], "length"),
    ]
    event = FinalEvent(4, JobResult("job-1", "m", choices, 5, 3, 2, 0.125, None, 1e-7))
    for streamed in (False, True):
        event.streamed = streamed
        fast = encode_event(event)
        generic = json.dumps(
            {"kind": "final", "seq": 4, "result": event.result.to_json(), "streamed": streamed}, separators=(",", ":")
        )
        assert fast == generic and fast.isascii()  # byte for byte: the batch stays one ASCII string
        assert decode_event(fast) == event and decode_event(fast.encode()) == event
    # with logprobs (the generic encoder: -inf stays a float)
    choices[0].logprobs = [TokenLogprob(1, float("-inf"), [(1, float("-inf"))])] * 3
    assert decode_event(encode_event(event)) == event
