"""CPU cost of the scheduler and of input preparation per step, with no model: 256 running decodes, and the
same decodes mixed with chunked prefills. Input preparation is timed twice: the engine's ``InputBatch`` and
the reference ``build_step_inputs`` (which rebuilds every row, every step)."""

from __future__ import annotations

import random
import time
from typing import Any

from cache.kv import KVCacheManager
from engine.config import SchedulerConfig
from engine.input_batch import InputBatch
from engine.inputs import build_step_inputs
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


def measure_overhead(num_running: int = 256, num_steps: int = 200, block_size: int = 16) -> dict[str, Any]:
    """Requests of 32..1024 prompt tokens are prefilled, then every step decodes all of them; the timed part is
    ``schedule()`` + ``InputBatch.build()`` + ``update()`` (everything but the model and the sampler);
    ``reference_build_inputs_ms`` is ``build_step_inputs()`` on the same steps, timed apart."""
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=num_running * (1024 + num_steps + 64) // block_size, block_size=block_size)
    config = SchedulerConfig(max_num_seqs=num_running, max_num_batched_tokens=1 << 20)
    sched = Scheduler(config, kv, max_model_len=4096)
    batch = InputBatch(block_size, num_running, 4096 // block_size)
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 10, ignore_eos=True)
    for i in range(num_running):
        prompt = [rng.randrange(32000) for _ in range(rng.randint(32, 1024))]
        sched.add_request(Request(f"r{i}", prompt, params))
    out = sched.schedule()  # prefill everything in one step (not timed)
    batch.build(out)
    sched.update(out, {c.request.request_id: (1, None) for c in out.chunks if c.samples})
    schedule_s = inputs_s = reference_s = update_s = 0.0
    for step in range(num_steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        batch.build(out)
        t2 = time.perf_counter()
        build_step_inputs(out, block_size)
        reference_s += time.perf_counter() - t2
        sampled = {c.request.request_id: (step % 30000, None) for c in out.chunks}
        t3 = time.perf_counter()
        sched.update(out, sampled)
        t4 = time.perf_counter()
        schedule_s += t1 - t0
        inputs_s += t2 - t1
        update_s += t4 - t3
        assert len(out.chunks) == num_running
    per = 1e3 / num_steps
    return {
        "num_running": num_running,
        "schedule_ms": round(schedule_s * per, 3),
        "build_inputs_ms": round(inputs_s * per, 3),
        "reference_build_inputs_ms": round(reference_s * per, 3),
        "update_ms": round(update_s * per, 3),
        "total_ms": round((schedule_s + inputs_s + update_s) * per, 3),
        **measure_mixed_inputs(num_running, block_size=block_size),
    }


def measure_mixed_inputs(
    num_running: int = 256, num_steps: int = 50, block_size: int = 16, num_batched_tokens: int = 8192
) -> dict[str, float]:
    """Input preparation of mixed steps: the ``num_running`` decodes (prefilled first, in chunks, untimed) plus
    one 2048-token prompt that joins and is prefilled in each timed step. Per step, both builders."""
    rng = random.Random(1)
    num_tokens = num_running * (1024 + 2 * num_steps) + 2048 * num_steps
    kv = KVCacheManager(num_blocks=num_tokens // block_size + num_running + num_steps, block_size=block_size)
    config = SchedulerConfig(max_num_seqs=num_running + num_steps, max_num_batched_tokens=num_batched_tokens)
    sched = Scheduler(config, kv, max_model_len=4096)
    batch = InputBatch(block_size, num_running, 4096 // block_size)
    params = SamplingParams(temperature=0.0, max_tokens=2 * num_steps + 10, ignore_eos=True)
    for i in range(num_running):
        sched.add_request(Request(f"r{i}", [rng.randrange(32000) for _ in range(rng.randint(32, 1024))], params))
    inputs_s = reference_s = 0.0
    num_timed = 0
    while num_timed < num_steps:
        if not sched.waiting:  # the decodes are all running: from here on each step mixes in a prompt
            sched.add_request(Request(f"p{num_timed}", [rng.randrange(32000) for _ in range(2048)], params))
            num_timed += 1
        out = sched.schedule()
        t0 = time.perf_counter()
        batch.build(out)
        t1 = time.perf_counter()
        build_step_inputs(out, block_size)
        if num_timed:
            inputs_s += t1 - t0
            reference_s += time.perf_counter() - t1
        sched.update(out, {c.request.request_id: (1, None) for c in out.chunks if c.samples})
    per = 1e3 / num_steps
    return {
        "mixed_build_inputs_ms": round(inputs_s * per, 3),
        "mixed_reference_build_inputs_ms": round(reference_s * per, 3),
    }
