"""``JobResult``'s JSON (the final event, the arq result, the response cache): every field, nested choices and
logprobs, round-tripped; built field by field it is the dict ``dataclasses.asdict`` gives, without the deep copy."""

from __future__ import annotations

import json
from dataclasses import asdict

from wire.messages import ChoiceResult, JobResult, TokenLogprob


def _result() -> JobResult:
    logprobs = [TokenLogprob(5, -0.25, [(5, -0.25), (9, -1.5)]), TokenLogprob(7, -0.5, [])]
    choices = [
        ChoiceResult(0, "ab", [5, 7], "length", logprobs, None),
        ChoiceResult(1, "c", [3], "stop", None, "</s>"),
        ChoiceResult(2, "", [], "stop", None, 2),
    ]
    return JobResult("r", "m", choices, 4, 3, 2, 0.125, 0.05, 1.5)


def test_json_has_every_field_and_round_trips() -> None:
    result = _result()
    data = result.to_json()
    expected = asdict(result)
    for choice in expected["choices"]:
        if choice["logprobs"] is not None:
            choice["logprobs"] = [
                [lp["token_id"], lp["logprob"], [list(t) for t in lp["top"]]] for lp in choice["logprobs"]
            ]
    assert data == expected
    assert JobResult.from_json(json.loads(json.dumps(data))) == result


def test_json_does_not_share_the_token_lists() -> None:
    result = _result()
    data = result.to_json()
    data["choices"][0]["token_ids"].append(99)
    assert result.choices[0].token_ids == [5, 7]
