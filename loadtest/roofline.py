"""How fast could a workload run under the engine's FCFS schedule? ``python -m loadtest.roofline [--workload mixed]
[--matmul-tflops 800.9] [--copy-tbs 4.229]`` (CPU, seconds).

Replays the scheduler's rule on the workload's lengths (each step: every running request's next token, then prompt
chunks in arrival order up to the token budget and ``--max-num-seqs``; a request samples its first token in the
step that ends its prompt) and prices every step at the measured ceilings, with two bounds:

- ``serial``: the step's GEMMs at max(FLOPs / matmul rate, weight bytes / copy bandwidth), then its attention at
  max(FLOPs / matmul rate, KV bytes / copy bandwidth): kernels at their rooflines, one after the other, as the
  engine runs them;
- ``overlapped``: max(all FLOPs / rate, all bytes / bandwidth) per step: compute and memory fully overlapped
  inside a step (what nano-batching aims at).

The MFU of each bound uses the suite's definition (total tokens x 2 x ``loadtest.shapes.num_params`` / elapsed /
matmul rate), so it is the highest MFU that schedule allows. The KV pool is taken as large enough (no preemption).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

from loadtest.shapes import SHAPES, num_params
from loadtest.workloads import make_workload


@dataclass
class Model:
    """What a step costs on one shape: per-token matmul FLOPs, weight bytes, KV bytes and attention FLOPs."""

    layer_params: int
    head_params: int
    kv_bytes_per_token: int
    attn_flops_per_pair: int  # QK^T and PV for one (query, key) pair over all layers and heads

    @classmethod
    def of(cls, shape: str) -> Model:
        s = SHAPES[shape]
        h, layers = int(s["hidden_size"]), int(s["num_hidden_layers"])  # type: ignore[call-overload]
        heads, kv = int(s["num_attention_heads"]), int(s["num_key_value_heads"])  # type: ignore[call-overload]
        head = h * int(s["vocab_size"])  # type: ignore[call-overload]
        d = h // heads
        return cls(num_params(shape) - head, head, layers * kv * d * 2 * 2, layers * heads * d * 4)


PARTS = ("gemm_prefill_steps", "gemm_decode_steps", "attention_decode_rows", "attention_prompt_rows")


@dataclass
class Totals:
    serial_s: float = 0.0
    overlapped_s: float = 0.0
    steps: int = 0
    tokens: int = 0
    # the serial bound by part: GEMMs of steps with / without prompt tokens, attention of decode / prompt rows
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))


@dataclass(eq=False)  # identity: two requests of the same lengths are still two requests
class Running:
    prompt: int
    output: int
    done: int = 0  # prompt tokens in the cache
    sampled: int = 0


def _attention(model: Model, rows: list[tuple[int, int]]) -> tuple[float, float]:
    """FLOPs and KV bytes of the attention of ``rows`` (tokens this step, tokens before them)."""
    flops = sum(model.attn_flops_per_pair * t * (before + (t + 1) / 2) for t, before in rows)
    return flops, sum(model.kv_bytes_per_token * (before + t) for t, before in rows)


def _step_cost(
    model: Model, rows: list[tuple[int, int]], sampled: int, rate: float, bw: float
) -> tuple[float, float, float, float]:
    """``rows``: (tokens this step, tokens before them) per request. Returns the serial bound's GEMM seconds,
    attention seconds of decode rows and of prompt rows, and the overlapped bound's seconds."""
    tokens = sum(t for t, _ in rows)
    gemm_flops = 2 * tokens * model.layer_params + 2 * sampled * model.head_params
    weight_bytes = 2 * (model.layer_params + model.head_params)
    dec_flops, dec_bytes = _attention(model, [r for r in rows if r[0] == 1])
    pre_flops, pre_bytes = _attention(model, [r for r in rows if r[0] > 1])
    gemm = max(gemm_flops / rate, weight_bytes / bw)
    overlapped = max((gemm_flops + dec_flops + pre_flops) / rate, (weight_bytes + dec_bytes + pre_bytes) / bw)
    return gemm, max(dec_flops / rate, dec_bytes / bw), max(pre_flops / rate, pre_bytes / bw), overlapped


def simulate(
    lengths: list[tuple[int, int]], model: Model, budget: int, max_seqs: int, rate: float, bw: float
) -> Totals:
    """The schedule over ``lengths`` (prompt, output) all arriving at once, priced step by step."""
    waiting = [Running(p, o) for p, o in lengths]
    running: list[Running] = []
    out = Totals()
    while waiting or running:
        rows: list[tuple[int, int]] = []
        sampled = 0
        for r in running:
            if r.done == r.prompt:  # decoding: one token after prompt + sampled - 1 cached tokens
                rows.append((1, r.prompt + r.sampled - 1))
        left = budget - len(rows)
        for r in running + waiting:
            if left <= 0:
                break
            if r.done < r.prompt and (r in running or len(running) < max_seqs):
                chunk = min(left, r.prompt - r.done)
                rows.append((chunk, r.done))
                r.done += chunk
                left -= chunk
                if r not in running:
                    waiting.remove(r)
                    running.append(r)
        for r in running:  # every request whose prompt is in the cache samples a token this step
            if r.done == r.prompt:
                r.sampled += 1
                sampled += 1
        running = [r for r in running if r.sampled < r.output]
        gemm, attn_dec, attn_pre, overlapped = _step_cost(model, rows, sampled, rate, bw)
        out.serial_s += gemm + attn_dec + attn_pre
        out.overlapped_s += overlapped
        out.parts["gemm_prefill_steps" if any(t > 1 for t, _ in rows) else "gemm_decode_steps"] += gemm
        out.parts["attention_decode_rows"] += attn_dec
        out.parts["attention_prompt_rows"] += attn_pre
        out.steps += 1
    out.tokens = sum(p + o for p, o in lengths)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.roofline", description=__doc__)
    parser.add_argument("--workload", nargs="+", default=["mixed", "mixed-128"])
    parser.add_argument("--shape", default="8b")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument(
        "--longest-first", action="store_true",
        help="requests ordered by output length, longest first (the engine's priority policy, priority = -max_tokens)",
    )  # fmt: skip
    parser.add_argument("--matmul-tflops", type=float, default=800.9, help="the suite's 8k x 8k rate (a060183 run)")
    parser.add_argument("--copy-tbs", type=float, default=4.229, help="the suite's copy bandwidth (a060183 run)")
    args = parser.parse_args(argv)
    model = Model.of(args.shape)
    rate, bw = args.matmul_tflops * 1e12, args.copy_tbs * 1e12
    vocab = int(SHAPES[args.shape]["vocab_size"])  # type: ignore[call-overload]
    for name in args.workload:
        lengths = [(len(r.prompt_token_ids), r.max_tokens) for r in make_workload(name, vocab)]
        if args.longest_first:
            lengths.sort(key=lambda pair: -pair[1])  # stable: arrival order among equal lengths
        t = simulate(lengths, model, args.max_num_batched_tokens, args.max_num_seqs, rate, bw)
        flops = t.tokens * 2 * num_params(args.shape)
        row = {
            "workload": name, "steps": t.steps, "serial_s": round(t.serial_s, 3),
            **{f"{k}_s": round(v, 3) for k, v in t.parts.items()},
            "overlapped_s": round(t.overlapped_s, 3), "mfu_serial": round(flops / t.serial_s / rate, 4),
            "mfu_overlapped": round(flops / t.overlapped_s / rate, 4),
        }  # fmt: skip
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
