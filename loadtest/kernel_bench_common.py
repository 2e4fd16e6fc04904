"""What the kernel benchmarks share: the 8B attention shape they time, CUDA-graph timing (``time_graph``), a
timer that also runs on CPU (the interpreter's smoke runs), and the relative error of an output."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
ROTATE_BYTES = 512 << 20  # inputs cycled per graph: ~10x the L2

Timer = Callable[[list[Callable[[], object]], int], float]


def time_graph(calls: Sequence[Callable[[], object]], reps: int) -> float:
    """Median seconds per call of ``calls`` captured back to back in one CUDA graph."""
    for fn in calls[:2]:  # compile and warm up outside the capture
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    del graph
    return statistics.median(times)


def device_timer(device: torch.device) -> Timer:
    """``time_graph`` on CUDA; elsewhere wall-clock seconds per call after one warm-up call (smoke runs)."""
    if device.type == "cuda":
        return time_graph

    def wall(calls: list[Callable[[], object]], reps: int) -> float:
        calls[0]()
        start = time.perf_counter()
        for _ in range(reps):
            for fn in calls:
                fn()
        return (time.perf_counter() - start) / (reps * len(calls))

    return wall


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return float("nan")
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def report_rows(report: dict[str, Any], rows: Iterable[dict[str, Any]], out: str | None) -> None:
    """Prints ``report`` and then each row as JSON as it comes (a long run shows its progress), collects the rows in
    ``report["rows"]`` and writes the whole report to ``out`` (a path) if given."""
    print(json.dumps(report), flush=True)
    report["rows"] = []
    for row in rows:
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
