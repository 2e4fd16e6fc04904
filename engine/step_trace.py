"""A per-step record of the engine core for benchmarks: when each step began, how long it took, how many tokens
it computed and how many requests were running, waiting and newly added. ``pagedserve bench stack`` turns it on
(``PAGEDSERVE_STEP_TRACE=path``) to see what a burst's admission ramp does to the steps (their size and length
while requests still arrive), which the client's token gaps alone cannot tell apart from stalls elsewhere.

Off by default: then ``StepTrace.from_env()`` is None and the core does nothing extra. On, the records are kept
in memory (a few tuples per step) and written as JSON lines when the core exits.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import NamedTuple

logger = logging.getLogger(__name__)

ENV_VAR = "PAGEDSERVE_STEP_TRACE"


class StepRecord(NamedTuple):
    start: float  # time.perf_counter() (CLOCK_MONOTONIC on Linux: comparable across processes)
    duration_s: float
    num_tokens: int  # computed this step: prefill chunks + decodes
    num_running: int  # after the step
    num_waiting: int
    num_added: int  # requests added since the previous step


class StepTrace:
    """The core's step records, written to ``path`` (JSON lines) by ``write``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.records: list[StepRecord] = []
        self._added = 0
        self._start = 0.0
        self._tokens = 0

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get(ENV_VAR, "")
        return cls(path) if path else None

    def added(self) -> None:
        self._added += 1

    def begin(self, tokens_total: int) -> None:
        self._start, self._tokens = time.perf_counter(), tokens_total

    def end(self, tokens_total: int, num_running: int, num_waiting: int) -> None:
        duration = time.perf_counter() - self._start
        record = StepRecord(self._start, duration, tokens_total - self._tokens, num_running, num_waiting, self._added)
        self.records.append(record)
        self._added = 0

    def write(self) -> None:
        try:
            with open(self.path, "w", encoding="utf-8") as f:
                for record in self.records:
                    f.write(json.dumps(record._asdict()) + "\n")
        except OSError as exc:
            logger.error("could not write the step trace to %s: %s", self.path, exc)


def read_trace(path: str) -> list[StepRecord]:
    """The records ``StepTrace.write`` wrote (none if the file is missing)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [StepRecord(**json.loads(line)) for line in f if line.strip()]
