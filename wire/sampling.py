"""The sampling parameters of one job as they cross Redis: ``SamplingSpec``, checked once when it is built.

Its fields are exactly those of ``engine.sampling_params.SamplingParams`` (same names, types, defaults; a
test keeps them equal), and its range checks raise the same messages, so the API refuses a bad value with a
400 before queueing instead of the worker failing the job. The engine keeps its own class and checks: it is
also the offline ``LLM`` API, and the engine does not import ``wire``. A worker builds its engine params
with ``SamplingParams.from_dict(spec.to_dict())``.

Unlike the engine's ``from_dict``, ``SamplingSpec.from_dict`` refuses keys it does not know: a field one
side added and the other does not know yet is an error, never a setting silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INT_FIELDS = ("top_k", "min_tokens")
_OPTIONAL_INT_FIELDS = ("max_tokens", "logprobs")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")


class SamplingSpecError(ValueError):
    """A sampling setting a client must fix; ``param`` names it (the ``param`` of OpenAI's error JSON)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def check_fields(cls: type[Any], data: Any) -> None:
    """Raise ``ValueError`` unless ``data`` is a mapping with only fields of dataclass ``cls`` and all of
    its required ones (wire messages are strict: an unknown key is a version mismatch, not noise)."""
    name = cls.__name__
    if not isinstance(data, Mapping):
        raise ValueError(f"{name} must be a JSON object, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise ValueError(f"unknown {name} keys: {', '.join(unknown)}")
    missing = [k for k, f in known.items() if k not in data and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ValueError(f"{name} is missing keys: {', '.join(missing)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingSpec:
    """How to pick tokens for one job (the fields of ``SamplingParams``). Raises ``SamplingSpecError`` (a
    ``ValueError``) on construction for a wrong type or an out-of-range value."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut (vLLM also accepts -1 for that)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = until max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per output token (0 = only the chosen one's)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's range: -100..100)

    def __post_init__(self) -> None:
        self._check_types()
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:  # JSON object keys arrive as strings
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()} or None
            except (TypeError, ValueError, AttributeError):
                raise SamplingSpecError("logit_bias", "logit_bias must map token ids to numbers") from None
        self._check_ranges()

    def _check_types(self) -> None:
        """JSON off the wire is untyped: a wrong type is a ``SamplingSpecError`` too, never a ``TypeError``
        half way through the range checks."""
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not _is_number(value):
                raise SamplingSpecError(name, f"{name} must be a finite number, got {value!r}")
        for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
            value = getattr(self, name)
            if not (_is_int(value) or (value is None and name in _OPTIONAL_INT_FIELDS)):
                raise SamplingSpecError(name, f"{name} must be an integer, got {value!r}")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise SamplingSpecError(name, f"{name} must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list | tuple):
            raise SamplingSpecError("stop", "stop must be a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list | tuple):
            raise SamplingSpecError("stop_token_ids", "stop_token_ids must be non-negative integers")
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)

    def _check_ranges(self) -> None:
        """The checks of ``SamplingParams._validate``, in its order and with its messages."""
        if not isinstance(self.n, int) or self.n < 1:
            raise SamplingSpecError("n", f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0.0:
            raise SamplingSpecError("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingSpecError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingSpecError(
                "top_k", f"top_k must be 0 or -1 (disabled) or a positive integer, got {self.top_k}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingSpecError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingSpecError(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0.0:
            raise SamplingSpecError(
                "repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty}"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SamplingSpecError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise SamplingSpecError("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingSpecError(
                "min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise SamplingSpecError("stop", "stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise SamplingSpecError("stop_token_ids", "stop_token_ids must be non-negative integers")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SamplingSpecError("logprobs", f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise SamplingSpecError("seed", f"seed must be an integer, got {self.seed!r}")
        if self.logit_bias and any(t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()):
            raise SamplingSpecError("logit_bias", "logit_bias must map token ids >= 0 to values in [-100, 100]")

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe copy, every field present. ``logit_bias`` keys are ints (``json`` writes them as strings;
        ``from_dict`` and ``SamplingParams.from_dict`` read either)."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["stop"] = list(self.stop)
        data["stop_token_ids"] = list(self.stop_token_ids)
        data["logit_bias"] = None if self.logit_bias is None else dict(self.logit_bias)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingSpec:
        """Inverse of ``to_dict`` (also after a JSON round trip); missing keys take their defaults. Raises
        ``ValueError`` naming any key that is not a field."""
        check_fields(cls, data)
        return cls(**data)
