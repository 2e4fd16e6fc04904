"""The whole-run profile on a tiny random checkpoint on CPU: the workload runs to the end in both runs, the kernel
categories are named as the engine's kernels are, and nothing is counted busy without device kernels."""

from __future__ import annotations

import gc
from pathlib import Path

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import Engine
from loadtest.run_profile import GcPauses, category, idle_gaps, profile_run
from loadtest.workloads import BenchRequest
from tests.helpers import build_tiny_model


def test_categories_of_the_engines_kernels() -> None:
    assert category("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT") == "gemm"
    assert category("_gemv_kernel") == "gemm"
    assert category("_prefill_new_kv_kernel") == "prefill_attention"
    assert category("_decode_partition_kernel") == "decode_attention"
    assert category("_decode_reduce_kernel") == "decode_attention"
    assert category("_rms_norm_kernel") == "rms_norm"
    assert category("_silu_and_mul_kernel") == "silu_and_mul"
    assert category("_rope_and_cache_kernel") == "rope_and_cache"
    assert category("_argmax_chunks_kernel") == "sampling"
    assert category("Memcpy HtoD (Pageable -> Device)") == "copies"
    assert category("some_other_kernel") == "other"


def test_idle_gaps_are_charged_to_the_kernels_around_them() -> None:
    spans = [
        (0.0, 10.0, "a"),
        (2.0, 30.0, "b"),  # overlaps a: no gap, and the union now ends at 30
        (35.0, 40.0, "argmax"),  # 5 us after b
        (240.0, 250.0, "embed"),  # 200 us after argmax: a step boundary
        (250.0, 260.0, "a"),  # back to back
        (2260.0, 2261.0, "embed"),  # 2 ms after a
    ]
    gaps = idle_gaps(spans)
    assert gaps["gaps"] == 3 and gaps["gaps_over_1ms"] == 1 and gaps["idle_s"] == 0.002205
    assert gaps["by_length_s"] == {"<10us": 5e-06, "10-100us": 0.0, "100us-1ms": 0.0002, ">=1ms": 0.002}
    assert gaps["before_kernel_s"] == {"embed": 0.0022, "argmax": 5e-06}
    assert gaps["after_kernel_s"] == {"a": 0.002, "argmax": 0.0002, "b": 5e-06}
    assert gaps["longest"] == [{"us": 2000.0, "at_ms": 0.3}, {"us": 200.0, "at_ms": 0.0}, {"us": 5.0, "at_ms": 0.0}]
    assert idle_gaps([])["gaps"] == 0


def test_profile_run_on_cpu(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path, "llama", seed=3)
    config = EngineConfig(
        model=ModelConfig(model=str(folder), max_model_len=128, skip_tokenizer_init=True),
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=128),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
        device="cpu",
    )
    engine = Engine(config)
    try:
        reqs = [BenchRequest([5 + i, 7, 9, 11, 13], 4 + i) for i in range(3)]
        res = profile_run(engine, reqs, top=5)
    finally:
        engine.shutdown()
    assert res["steps"] >= 6 and res["elapsed_s"] > 0 and res["profiled_wall_s"] > 0
    assert res["device_busy_s"] == 0 and res["device_idle_s"] == res["profiled_wall_s"]  # no CUDA kernels on CPU
    assert res["top"] == [] and res["idle_gaps"]["gaps"] == 0


def test_gc_pauses_are_counted() -> None:
    with GcPauses() as pauses:
        gc.collect()
    assert pauses.summary()["gen2"]["count"] == 1
    assert pauses.summary()["gen2"]["max_s"] >= 0
