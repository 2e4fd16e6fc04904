"""``pagedserve bench sweep``: output throughput and time per output token against the number of requests
decoding together (the latency ladder), all levels on one engine, and a PNG of both curves.

At each level ``c`` requests with distinct random prompts of ``prompt_len`` tokens ask for ``output_len``
tokens each, all at t=0. Time per output token is the mean step time once every request has its first
token (all decode from then on); throughput counts every requested token over the whole run.
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any

from engine.engine import Engine
from engine.sampling_params import SamplingParams


def _sync(engine: Engine) -> None:
    if engine.executor.device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def run_level(engine: Engine, concurrency: int, prompt_len: int, output_len: int, seed: int = 0) -> dict[str, Any]:
    if output_len < 2:
        raise ValueError("output_len must be at least 2 (time per output token needs two tokens)")
    if concurrency > engine.scheduler.config.max_num_seqs:
        raise ValueError(f"concurrency {concurrency} is over max_num_seqs {engine.scheduler.config.max_num_seqs}")
    rng = random.Random(seed * 100_003 + concurrency)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.kv.reset_prefix_cache()
    for i in range(concurrency):
        prompt = [rng.randrange(10, engine.vocab_size) for _ in range(prompt_len)]
        engine.add_request(f"sweep-{concurrency}-{i}", prompt, params)
    _sync(engine)
    start = time.perf_counter()
    all_started: float | None = None
    start_steps = decode_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        if all_started is not None:
            decode_steps += 1
            continue
        start_steps += 1
        if not engine.scheduler.waiting and all(r.num_output_tokens for r in engine.scheduler.running):
            _sync(engine)
            all_started = time.perf_counter()
    _sync(engine)
    end = time.perf_counter()
    assert all_started is not None
    return {
        "concurrency": concurrency,
        "elapsed_s": round(end - start, 6),  # to the microsecond: a tiny level takes a few ms
        "all_started_s": round(all_started - start, 6),
        "start_steps": start_steps,  # steps until every request had its first token (prefill under the budget)
        "tpot_ms": round((end - all_started) / max(1, decode_steps) * 1e3, 3),
        "output_tok_s": round(concurrency * output_len / (end - start), 1),
        "preemptions": engine.scheduler.num_preemptions,
    }


def run_sweep(engine: Engine, levels: list[int], prompt_len: int, output_len: int) -> list[dict[str, Any]]:
    run_level(engine, min(levels), prompt_len, min(output_len, 8))  # warm-up: first-use costs out of the numbers
    return [run_level(engine, c, prompt_len, output_len) for c in sorted(levels)]


def plot_sweep(points: list[dict[str, Any]], path: str, title: str, floor_ms: float | None = None) -> str:
    """Two panels: output tokens/s and time per output token against concurrency (log2 axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p["concurrency"] for p in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(xs, [p["output_tok_s"] for p in points], marker="o")
    left.set_ylabel("output tokens/s")
    right.plot(xs, [p["tpot_ms"] for p in points], marker="o", label="time per output token")
    if floor_ms is not None:
        right.axhline(floor_ms, linestyle="--", color="grey", label=f"weight-read floor {floor_ms:.2f} ms")
        right.legend()
    right.set_ylabel("ms per output token")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests decoding together")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m loadtest.sweep plot SWEEP.json OUT.png``: the plot of a sweep measured elsewhere."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "plot":
        print("usage: python -m loadtest.sweep plot SWEEP.json OUT.png", file=sys.stderr)
        return 2
    with open(args[1]) as f:
        res = json.load(f)
    title = f"{res['shape']} shape, {res['gpu']} ({res['commit']}, {res['date']})"
    plot_sweep(res["levels"], args[2], title, res.get("floor_ms"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
