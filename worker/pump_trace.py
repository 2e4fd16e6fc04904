"""A record of the worker front's pump for benchmarks: when each batch of the core's step messages was taken off
the socket, how many steps it held, how many events it became and when their Redis pipeline returned, and the
front's garbage-collector pauses. With the core's step trace (``engine.step_trace``) and the API's relay stamps
(``api.streams.SSE_TIMES``) it splits a token's trip from the engine to the client into its hops: core -> front,
front -> Redis, Redis -> API, API -> client.

``pagedserve bench stack`` turns it on (``PAGEDSERVE_PUMP_TRACE=path``: front 0 writes ``path``, front i
``path`` with ``.f<i>`` before the suffix). Off by default: ``PumpTrace.from_env()`` is None and the pump does
nothing extra. On, the records stay in memory (one tuple per pipeline) and are written as JSON lines at exit.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

ENV_VAR = "PAGEDSERVE_PUMP_TRACE"


class PumpRecord(NamedTuple):
    received: float  # time.perf_counter() (CLOCK_MONOTONIC on Linux: comparable with the core's step trace)
    steps: int  # step messages taken together (more than one: the front fell behind the core)
    oldest_sent: float  # when the core sent the oldest of them (StepOutputs.sent_at)
    events: int  # events written in the pipeline
    written: float  # the pipeline returned
    built: float = 0.0  # its events were built: received -> built is the front's CPU
    sent: float = 0.0  # its pipeline went out (after the one before it returned): sent -> written is Redis


def sent_at(record: PumpRecord) -> float:
    """When the record's pipeline went out (traces from before ``sent`` was recorded: when it was built)."""
    return record.sent or record.built


class GcPause(NamedTuple):
    start: float  # time.perf_counter()
    duration_s: float
    generation: int


class PumpTrace:
    """The pump's records and the process's collector pauses, written to ``path`` by ``write``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.records: list[PumpRecord] = []
        self.gc_pauses: list[GcPause] = []
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)

    @classmethod
    def from_env(cls, front_index: int = 0) -> PumpTrace | None:
        path = os.environ.get(ENV_VAR, "")
        if not path:
            return None
        return cls(path if front_index == 0 else str(front_path(Path(path), front_index)))

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            now = time.perf_counter()
            self.gc_pauses.append(GcPause(self._gc_start, now - self._gc_start, int(info["generation"])))

    def record(
        self, received: float, steps: int, oldest_sent: float, events: int, built: float, sent: float = 0.0
    ) -> None:
        self.records.append(PumpRecord(received, steps, oldest_sent, events, time.perf_counter(), built, sent))

    def write(self) -> None:
        """One JSON line per pipeline (``{"pump": [...]}``), then one per collector pause (``{"gc": [...]}``)."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        try:
            with open(self.path, "w", encoding="utf-8") as f:
                for record in self.records:
                    f.write(json.dumps({"pump": list(record)}) + "\n")
                for pause in self.gc_pauses:
                    f.write(json.dumps({"gc": list(pause)}) + "\n")
        except OSError as exc:
            logger.error("could not write the pump trace to %s: %s", self.path, exc)


def front_path(path: Path, index: int) -> Path:
    return path.with_suffix(f".f{index}{path.suffix}")


def read_pump_trace(path: str) -> tuple[list[PumpRecord], list[GcPause]]:
    """What ``PumpTrace.write`` wrote (nothing if the file is missing)."""
    records: list[PumpRecord] = []
    pauses: list[GcPause] = []
    if not os.path.exists(path):
        return records, pauses
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if "pump" in row:
                records.append(PumpRecord(*row["pump"]))
            else:
                pauses.append(GcPause(*row["gc"]))
    return records, pauses
