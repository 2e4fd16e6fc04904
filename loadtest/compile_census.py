"""Which Triton kernels a workload still compiles after the engine's warm-up, and for which specializations.

Triton compiles a kernel once per specialization of its arguments (constexprs, and integers specialized as
1 / divisible by 16 / other), so a shape the warm-up did not cover compiles inside a user's request. On the
H200 the suite's first `mixed-128` took 10.4 s against 5.4 s compiled (2026-12-02): this says which kernels and
which argument patterns did that.

    python -m loadtest.compile_census --shape 8b --workload mixed-128
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def compiled_variants() -> dict[str, list[str]]:
    """Every ``@triton.jit`` function of the ``kernels`` package: the keys of its compiled variants."""
    from triton.runtime.jit import JITFunction

    found: dict[str, list[str]] = {}
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "")
        if not name.startswith("kernels."):
            continue
        for attr, obj in vars(module).items():
            if isinstance(obj, JITFunction):
                found[f"{name}.{attr}"] = [str(k) for entry in obj.device_caches.values() for k in entry[0]]
    return found


def _new(before: dict[str, list[str]], after: dict[str, list[str]]) -> dict[str, list[str]]:
    return {k: [v for v in keys if v not in set(before.get(k, []))] for k, keys in after.items() if keys}


def main(argv: list[str] | None = None) -> int:
    from loadtest.throughput import BenchRequest, build_engine, close_engine, parse, run_engine
    from loadtest.workloads import make_workload

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="8b")
    p.add_argument("--workload", default="mixed-128")
    p.add_argument("--max-num-seqs", type=int, default=512)
    args = p.parse_args(argv)
    engine = build_engine(parse(["throughput", "--shape", args.shape, "--max-num-seqs", str(args.max_num_seqs)]))
    vocab = engine.vocab_size
    warm = [BenchRequest(r.prompt_token_ids[::-1], r.max_tokens) for r in make_workload("mixed", vocab, 16)]
    run_engine(engine, warm, "warm")  # the suite's warm-up
    runs: list[dict[str, Any]] = []
    for rep in range(2):
        before = compiled_variants()
        engine.kv.reset_prefix_cache()
        t0 = time.perf_counter()
        run_engine(engine, make_workload(args.workload, vocab), f"{args.workload}-{rep}")
        elapsed = time.perf_counter() - t0
        new = {k: v for k, v in _new(before, compiled_variants()).items() if v}
        runs.append({"run": rep, "elapsed_s": round(elapsed, 2), "new_variants": {k: len(v) for k, v in new.items()}})
        print(json.dumps(runs[-1]), flush=True)
        for kernel, keys in new.items():
            for key in keys[:6]:
                print(f"  {kernel}: {key[:400]}", flush=True)
    close_engine(engine)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
