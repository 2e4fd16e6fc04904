"""CPU cost of the scheduler and of input preparation per step, with no model: 256 running decodes, and the
same decodes with a prompt prefilled in each step. Every measure runs twice, identically (fixed seeds): with
the engine's ``InputBatch`` and with the reference ``build_step_inputs`` (which rebuilds every row every
step), each in its own run so that neither's garbage is collected in the other's timings."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from cache.kv import KVCacheManager
from engine.config import SchedulerConfig
from engine.input_batch import InputBatch
from engine.inputs import StepInputs, build_step_inputs
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput

Builder = Callable[[SchedulerOutput], StepInputs]


def measure_overhead(num_running: int = 256, num_steps: int = 200, block_size: int = 16) -> dict[str, Any]:
    """``schedule()`` + input preparation + ``update()`` per decode step (everything but the model and the
    sampler), then input preparation of mixed steps; ``reference_*`` keys: the same with the reference."""
    schedule_s, inputs_s, update_s = _decode_steps(
        _batch_builder(block_size, num_running), num_running, num_steps, block_size
    )
    _, reference_s, _ = _decode_steps(
        lambda out: build_step_inputs(out, block_size), num_running, num_steps, block_size
    )
    per = 1e3 / num_steps
    return {
        "num_running": num_running,
        "schedule_ms": round(schedule_s * per, 3),
        "build_inputs_ms": round(inputs_s * per, 3),
        "reference_build_inputs_ms": round(reference_s * per, 3),
        "update_ms": round(update_s * per, 3),
        "total_ms": round((schedule_s + inputs_s + update_s) * per, 3),
        "mixed_build_inputs_ms": _mixed_steps(_batch_builder(block_size, num_running), num_running, block_size),
        "mixed_reference_build_inputs_ms": _mixed_steps(
            lambda out: build_step_inputs(out, block_size), num_running, block_size
        ),
    }


def _batch_builder(block_size: int, num_running: int) -> Builder:
    return InputBatch(block_size, num_running, 4096 // block_size).build


def _decode_steps(build: Builder, num_running: int, num_steps: int, block_size: int) -> tuple[float, float, float]:
    """Requests of 32..1024 prompt tokens are prefilled, then every step decodes all of them: seconds of
    ``schedule()``, ``build`` and ``update()`` over ``num_steps`` steps."""
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=num_running * (1024 + num_steps + 64) // block_size, block_size=block_size)
    config = SchedulerConfig(max_num_seqs=num_running, max_num_batched_tokens=1 << 20)
    sched = Scheduler(config, kv, max_model_len=4096)
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 10, ignore_eos=True)
    for i in range(num_running):
        prompt = [rng.randrange(32000) for _ in range(rng.randint(32, 1024))]
        sched.add_request(Request(f"r{i}", prompt, params))
    out = sched.schedule()  # prefill everything in one step (not timed)
    build(out)
    sched.update(out, {c.request.request_id: (1, None) for c in out.chunks if c.samples})
    schedule_s = inputs_s = update_s = 0.0
    for step in range(num_steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        build(out)
        t2 = time.perf_counter()
        sampled = {c.request.request_id: (step % 30000, None) for c in out.chunks}
        t3 = time.perf_counter()
        sched.update(out, sampled)
        t4 = time.perf_counter()
        schedule_s += t1 - t0
        inputs_s += t2 - t1
        update_s += t4 - t3
        assert len(out.chunks) == num_running
    return schedule_s, inputs_s, update_s


def _mixed_steps(build: Builder, num_running: int, block_size: int, num_steps: int = 50) -> float:
    """Milliseconds of ``build`` per mixed step: the ``num_running`` decodes (prefilled first, in chunks of an
    8192-token budget, untimed) plus one 2048-token prompt that joins and is prefilled in each timed step."""
    rng = random.Random(1)
    num_tokens = num_running * (1024 + 2 * num_steps) + 2048 * num_steps
    kv = KVCacheManager(num_blocks=num_tokens // block_size + num_running + num_steps, block_size=block_size)
    config = SchedulerConfig(max_num_seqs=num_running + num_steps, max_num_batched_tokens=8192)
    sched = Scheduler(config, kv, max_model_len=4096)
    params = SamplingParams(temperature=0.0, max_tokens=2 * num_steps + 10, ignore_eos=True)
    for i in range(num_running):
        sched.add_request(Request(f"r{i}", [rng.randrange(32000) for _ in range(rng.randint(32, 1024))], params))
    inputs_s = 0.0
    num_timed = 0
    while num_timed < num_steps:
        if not sched.waiting:  # the decodes are all running: from here on each step mixes in a prompt
            sched.add_request(Request(f"p{num_timed}", [rng.randrange(32000) for _ in range(2048)], params))
            num_timed += 1
        out = sched.schedule()
        t0 = time.perf_counter()
        build(out)
        if num_timed:
            inputs_s += time.perf_counter() - t0
        sched.update(out, {c.request.request_id: (1, None) for c in out.chunks if c.samples})
    return round(inputs_s * 1e3 / num_steps, 3)
