"""Does the engine's decode step depend on what else the host runs? One engine, one process, the same waves
with and without busy processes beside it, synchronous and asynchronous scheduling alternating.

The stack's engine core shares the host with the worker front, the API processes, Redis and the clients; its
decode step came out up to 7 % slower than the engine alone's in some runs (docs/benchmarks.md, session 8).
This separates the two readings: if the step slows when ``--burners`` processes load the host's CPUs and
memory, the host part of the step is what the stack pays; if it does not, the spread is per process.

    python -m loadtest.contention --shape 8b --max-model-len 4096 --max-num-seqs 512 --burners 0 6

Per configuration (scheduling × burners × level): the median decode step after the wave's prefills and, for
synchronous steps, the median of the device's span of a step (CUDA events from the first launch to the
sampler's result), so host time = step - span; and the GPU's SM clock and power, sampled during the waves.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from engine.step_trace import StepRecord
from loadtest.stack_bench import build_engine, engine_wave, make_prompts
from loadtest.step_stats import decode_step_p50_ms, wave_windows
from loadtest.throughput import close_engine


def _burn(stop: Any) -> None:
    """Half memory traffic (16 MiB copies: past the caches), half interpreter work, until ``stop`` is set."""
    src, dst = np.ones(1 << 21), np.empty(1 << 21)
    table: dict[int, int] = {}
    while not stop.is_set():
        np.copyto(dst, src)
        for i in range(20_000):
            table[i & 1023] = i


@contextmanager
def burners(count: int) -> Iterator[None]:
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_burn, args=(stop,), daemon=True) for _ in range(count)]
    for p in procs:
        p.start()
    time.sleep(1.0 if count else 0.0)  # spawned and busy
    try:
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(10)


class GpuSampler:
    """SM clock (MHz) and power (W) once a second from ``nvidia-smi`` while running."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                line = subprocess.run(
                    ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                    check=True,
                ).stdout.splitlines()[0]
                sm, power = (float(x) for x in line.split(","))
                self.samples.append((sm, power))
            except (OSError, subprocess.SubprocessError, ValueError, IndexError):
                return

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, float | None]:
        if not self.samples:
            return {"sm_mhz": None, "power_w": None}
        return {
            "sm_mhz": statistics.median(s for s, _ in self.samples),
            "power_w": statistics.median(p for _, p in self.samples),
        }


class DeviceSpans:
    """Per synchronous step, the device's time from the step's first launch to its sampled ids on the host:
    events recorded when ``execute_model`` is entered and when the scheduler advances (after the sampler's
    copy to the host, so the device is idle at both ends)."""

    def __init__(self, engine: Any) -> None:
        import torch

        self.torch = torch
        self.pairs: list[tuple[Any, Any]] = []
        self._start: Any = None
        self.enabled = engine.executor.device.type == "cuda"
        if not self.enabled:  # CPU: no device clock to read, steps only
            return
        self._wrap(engine.executor, "execute_model", self._begin)
        self._wrap(engine.scheduler, "advance", self._end)

    @staticmethod
    def _wrap(obj: Any, name: str, before: Callable[[], None]) -> None:
        inner = getattr(obj, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            before()
            return inner(*args, **kwargs)

        setattr(obj, name, wrapped)

    def _event(self) -> Any:
        event = self.torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _begin(self) -> None:
        self._start = self._event()

    def _end(self) -> None:
        if self._start is not None:
            self.pairs.append((self._start, self._event()))
            self._start = None

    def take_p50_ms(self) -> float | None:
        if not self.enabled:
            return None
        self.torch.cuda.synchronize()
        spans = sorted(a.elapsed_time(b) for a, b in self.pairs)
        self.pairs = []
        return round(spans[len(spans) // 2], 3) if spans else None


def run_config(engine: Any, spans: DeviceSpans, args: argparse.Namespace, level: int, wave: int) -> dict[str, Any]:
    steps: list[StepRecord] = []
    prompts = make_prompts(engine.vocab_size, level, wave, args.prompt_len, args.seed)
    output_len = args.output_len if level > 1 else args.output_len // 2
    spans.pairs = []
    with GpuSampler() as gpu:
        records, _, _ = engine_wave(engine, prompts, output_len, wave, steps)
    row: dict[str, Any] = {"step_p50_ms": decode_step_p50_ms(steps, wave_windows(records))}
    row["device_span_p50_ms"] = spans.take_p50_ms() if not engine.async_scheduling else None
    return row | gpu.summary()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="8b")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--levels", type=int, nargs="+", default=[1, 256, 512])
    p.add_argument("--burners", type=int, nargs="+", default=[0, 6])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=20)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-folder", default=None, help="default: SmolLM2's, as bench stack")
    p.add_argument("--out", default=None)
    cli = p.parse_args(argv)
    args = _engine_namespace(cli)
    engine = build_engine(args)
    spans = DeviceSpans(engine)
    for level in sorted(set(cli.levels)):  # warm-up: graphs, kernels
        engine_wave(engine, make_prompts(engine.vocab_size, level, -1, cli.prompt_len, cli.seed), 8, -1)
    rows = []
    wave = 0
    for rep in range(cli.repeats):
        for count in cli.burners:
            with burners(count):
                for mode in (False, True):
                    engine.async_scheduling = mode
                    for level in cli.levels:
                        row = {"rep": rep, "burners": count, "async": mode, "level": level}
                        row |= run_config(engine, spans, cli, level, wave)
                        wave += 1
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    close_engine(engine)
    if cli.out:
        with open(cli.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _engine_namespace(cli: argparse.Namespace) -> argparse.Namespace:
    """``stack_bench``'s engine arguments for a random-weight shape (both scheduling modes are toggled later)."""
    from loadtest.shapes import shape_folder_with_tokenizer

    folder = shape_folder_with_tokenizer(cli.shape, cli.max_model_len, tokenizer_folder=cli.tokenizer_folder)
    return argparse.Namespace(
        model=str(folder),
        dtype="auto",
        max_model_len=cli.max_model_len,
        load_format="dummy",
        block_size=16,
        gpu_memory_utilization=0.9,
        cpu_kv_cache_gib=1.0,
        enable_prefix_caching=True,
        max_num_seqs=cli.max_num_seqs,
        max_num_batched_tokens=2048,
        device="auto",
        enforce_eager=False,
        async_scheduling=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())
