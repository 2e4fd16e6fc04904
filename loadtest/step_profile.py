"""Where an engine step's time goes on the GPU: a short prompt's prefill step and a batch-1 decode step, each
timed alone (wall, with a device sync) and under ``torch.profiler`` (host ops and kernel launches by self CPU
time, device time), on the 8B shape with random weights.

    python -m loadtest.step_profile --shape 8b --prompt-len 20 --out step_profile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from engine.args import EngineArgs
from engine.sampling_params import SamplingParams


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _engine(args: argparse.Namespace) -> Any:
    from engine.engine import Engine
    from loadtest.shapes import shape_folder

    if args.int4:
        from loadtest.int4_model import quantized_shape_folder

        folder = quantized_shape_folder(args.shape, args.max_model_len)
    else:
        folder = shape_folder(args.shape, args.max_model_len)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine_args = EngineArgs(
        model=str(folder),
        load_format="dummy",
        max_model_len=args.max_model_len,
        device=device,
        skip_tokenizer_init=True,
    )
    return Engine(engine_args.create_engine_config())


def _prefill_step(engine: Any, prompt: list[int], rid: str) -> float:
    """One step that prefills ``prompt`` alone and samples its one token; seconds, synced."""
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    _sync()
    t0 = time.perf_counter()
    engine.step()
    _sync()
    elapsed = time.perf_counter() - t0
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


def _decode_steps(engine: Any, prompt: list[int], n: int) -> list[float]:
    engine.add_request("decode", prompt, SamplingParams(temperature=0.0, max_tokens=n + 1, ignore_eos=True))
    engine.step()  # the prefill
    times = []
    for _ in range(n):
        _sync()
        t0 = time.perf_counter()
        engine.step()
        _sync()
        times.append(time.perf_counter() - t0)
    return times


def _profile(fn: Any, top: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        fn()
        _sync()
    from torch.autograd import DeviceType

    events = prof.key_averages()
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    # the kernels themselves (an op's row repeats its kernels' device time: summing every row counted it twice)
    kernels = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA]
    by_device = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    return {
        "self_cpu_ms_total": round(sum(e.self_cpu_time_total for e in events) / 1e3, 2),
        "device_ms_total": round(sum(e.self_device_time_total for e in kernels) / 1e3, 2),
        "top_device": [
            {"name": e.key[:80], "calls": e.count, "device_ms": round(e.self_device_time_total / 1e3, 3)}
            for e in by_device
        ],
        "top_self_cpu": [
            {
                "name": e.key[:80],
                "calls": e.count,
                "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
                "device_ms": round(getattr(e, "self_device_time_total", 0) / 1e3, 3),
            }
            for e in rows
        ],
    }


_GEMM_NAMES = ("gemm", "gemv", "nvjet", "cutlass", "xmma", "sm90_", "splitk")


def _decode_kernels(engine: Any, prompt: list[int], steps: int, top: int) -> dict[str, Any]:
    """Batch-1 decode as the engine runs it (CUDA graph, its own scheduling mode): wall per step without the
    profiler, then every kernel's device time per step under it (CUPTI sees the graph's kernels), GEMMs apart."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    engine.add_request("dk", prompt, SamplingParams(temperature=0.0, max_tokens=3 * steps + 40, ignore_eos=True))
    for _ in range(20):
        engine.step()
    _sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync()
    wall_us = (time.perf_counter() - t0) / steps * 1e6
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        _sync()
    kernels = [e for e in prof.key_averages() if getattr(e, "device_type", None) == DeviceType.CUDA]
    spans = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if getattr(e, "device_type", None) == DeviceType.CUDA
    ]
    engine.abort_request("dk")
    while engine.has_unfinished_requests():
        engine.step()

    def per_step(events: list[Any]) -> float:
        return round(sum(e.self_device_time_total for e in events) / steps, 1)

    gemms = [e for e in kernels if any(n in e.key.lower() for n in _GEMM_NAMES)]
    rows = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    return {
        "wall_us_per_step": round(wall_us, 1),
        "kernel_us_per_step": per_step(kernels),
        "gemm_us_per_step": per_step(gemms),
        "kernels_per_step": round(sum(e.count for e in kernels) / steps, 1),
        **device_gaps(spans, steps),
        "top": [
            {"name": e.key[:90], "per_step": round(e.count / steps, 2), "us_per_step": per_step([e])} for e in rows
        ],
    }


def device_gaps(spans: list[tuple[float, float, str]], steps: int, top: int = 5) -> dict[str, Any]:
    """Where the device ran no kernel between the first kernel's start and the last one's end (``spans``: kernels'
    (start, end) in us and names, any order; kernels overlapping under PDL count once): idle us a step, the gaps of
    more than 5 us a step (such as one between two steps' graphs), the largest gaps, and the kernels on either side of
    the long gaps (us a step by pair, the largest first)."""
    gaps: list[float] = []
    pairs: dict[str, float] = {}
    covered, last = None, ""
    for start, end, name in sorted(spans):
        if covered is not None and start > covered:
            gaps.append(start - covered)
            if start - covered > 5.0:
                pair = f"{last[:40]} -> {name[:40]}"
                pairs[pair] = pairs.get(pair, 0.0) + start - covered
        if covered is None or end >= covered:
            covered, last = end, name
    return {
        "idle_us_per_step": round(sum(gaps) / steps, 1),
        "gaps_over_5us_per_step": round(sum(g > 5.0 for g in gaps) / steps, 2),
        "largest_gaps_us": [round(g, 1) for g in sorted(gaps, reverse=True)[:top]],
        "long_gaps_by_kernels": {k: round(v / steps, 1) for k, v in sorted(pairs.items(), key=lambda kv: -kv[1])[:top]},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="8b")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--int4", action="store_true", help="the shape with random 4-bit weights (loadtest.int4_model)")
    p.add_argument("--prompt-len", type=int, default=20)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default="")
    p.add_argument("--decode-kernels", type=int, default=0, help="profile this many batch-1 decode steps' kernels")
    args = p.parse_args(argv)
    engine = _engine(args)
    prompt = [(7 * i + 3) % 1000 + 1 for i in range(args.prompt_len)]
    if args.decode_kernels:
        _prefill_step(engine, prompt, "warm")
        dk = _decode_kernels(engine, prompt, args.decode_kernels, args.top)
        print(json.dumps({k: v for k, v in dk.items() if k != "top"}), flush=True)
        for row in dk["top"]:
            print(f"  {row['us_per_step']:8.1f} us {row['per_step']:6.2f}x {row['name']}")
    for i in range(3):  # warm-up: compiles, allocator
        _prefill_step(engine, prompt, f"warm{i}")
    prefill = [_prefill_step(engine, prompt, f"p{i}") for i in range(args.reps)]
    decode = _decode_steps(engine, prompt, args.reps * 5)
    res: dict[str, Any] = {
        "prompt_len": args.prompt_len,
        "prefill_step_ms": [round(t * 1e3, 2) for t in prefill],
        "prefill_step_ms_median": round(statistics.median(prefill) * 1e3, 2),
        "decode_step_ms_median": round(statistics.median(decode) * 1e3, 2),
    }
    print(json.dumps(res), flush=True)
    res["profile_prefill"] = _profile(lambda: _prefill_step(engine, prompt, "prof"), args.top)
    for row in res["profile_prefill"]["top_self_cpu"]:
        print(f"  {row['self_cpu_ms']:8.3f} ms cpu {row['device_ms']:8.3f} ms dev {row['calls']:6d}x {row['name']}")
    prof = res["profile_prefill"]
    print(f"prefill step: host ops {prof['self_cpu_ms_total']} ms, device {prof['device_ms_total']} ms", flush=True)
    engine.shutdown()
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
