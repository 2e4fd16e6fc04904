"""A tensor-parallel ``LLM``'s ranks live exactly as long as it does (issue #15): dropped and rebuilt in one
process, with ``with``, and at interpreter exit, on CPU (gloo) with a tiny random checkpoint. Each scenario
runs in its own interpreter under a timeout, since the bug this guards against is a hang. And an ``LLM``'s
start-up heap: frozen while it lives, thawed when it goes."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import psutil
import pytest

from engine import LLM
from engine.args import EngineArgs
from engine.engine import Engine
from tests.helpers import build_tiny_model

SCRIPT = textwrap.dedent(
    """
    import gc, json, sys
    import psutil
    from engine import LLM, SamplingParams

    folder = sys.argv[1]
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    params = SamplingParams(temperature=0.0, max_tokens=6)

    def build():
        return LLM(folder, device="cpu", tensor_parallel_size=2, num_gpu_blocks_override=16)

    def tokens(llm):
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids

    def running(pids):
        return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]

    expected = None
    for _ in range(2):  # dropped without shutdown(), then rebuilt
        llm = build()
        got = tokens(llm)
        expected = expected or got
        assert got == expected, (got, expected)
        pids = [p.pid for p in llm.engine.executor.procs]
        del llm
        gc.collect()
        assert not running(pids), "ranks outlived their LLM"

    with build() as llm:
        assert tokens(llm) == expected
        pids = [p.pid for p in llm.engine.executor.procs]
    assert not running(pids), "ranks outlived the with block"
    try:
        tokens(llm)
        raise AssertionError("generate() after shutdown() did not raise")
    except RuntimeError as exc:
        assert "shut down" in str(exc), exc

    alive = build()  # left running: a second one at the same time is refused, then the exit stops it
    try:
        build()
        raise AssertionError("a second TP engine beside a live one was built")
    except RuntimeError as exc:
        assert "already initialized" in str(exc), exc
    assert tokens(alive) == expected
    print(json.dumps([p.pid for p in alive.engine.executor.procs]))
    """
)


@pytest.mark.slow  # four TP=2 engines on CPU: ~40 s on an idle 2-core machine
def test_tp_engine_dropped_rebuilt_and_left_at_exit(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path / "model", "llama", seed=4)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(folder)], capture_output=True, text=True, timeout=420, cwd=Path.cwd()
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    left_pids = json.loads(proc.stdout.strip().splitlines()[-1])
    assert left_pids
    leftovers = [p for p in left_pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not leftovers, "ranks outlived the interpreter"
    assert "died" not in proc.stderr  # the watchdog did not take the exit for a crash


def test_llm_freezes_its_heap_and_thaws_it_when_dropped(tmp_path: Path) -> None:
    """``LLM`` moves its start-up heap out of the collector's reach (``deploy.gc_heap``: a full collection of an 8B
    engine's heap took 295 ms in the middle of `mixed`) and gives it back when it shuts down or is dropped, so a
    process that builds one engine after another still frees the cycles of the old ones."""
    folder = build_tiny_model(tmp_path / "model", "llama", seed=5)
    gc.unfreeze()
    try:
        llm = LLM(str(folder), device="cpu", num_gpu_blocks_override=16)
        assert gc.get_freeze_count() > 1000  # the modules, the engine and everything imported
        llm.shutdown()
        assert gc.get_freeze_count() == 0
        dropped = LLM(str(folder), device="cpu", num_gpu_blocks_override=16)
        engine = weakref.ref(dropped.engine)
        assert gc.get_freeze_count() > 1000
        del dropped  # no shutdown(): the finalizer thaws the heap, and the engine's cycles go at the next collection
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert engine() is None
    finally:
        gc.unfreeze()


def test_a_new_engine_loads_after_a_dropped_one_is_collected(tmp_path: Path) -> None:
    """A dropped ``LLM``'s engine held by a reference cycle waits for the collector with its weights and KV cache
    (thawed when it went); the next engine collects before it loads and profiles
    (``engine.model_runner.release_dropped_engines``), so on CUDA its memory profile does not count the old engine's
    tensors. Built here as ``LLM`` builds it, without the collection ``LLM`` runs after (``freeze_heap``)."""
    folder = build_tiny_model(tmp_path / "model", "llama", seed=6)
    gc.unfreeze()
    try:
        dropped = LLM(str(folder), device="cpu", num_gpu_blocks_override=16)
        dropped.engine.cycle = [dropped.engine]  # type: ignore[attr-defined]  # held by a cycle, as one may be on CUDA
        old = weakref.ref(dropped.engine)
        del dropped
        assert old() is not None  # shut down and thawed, waiting for the collector
        gc.disable()  # no automatic collection while the next engine builds: only its own may free the old one
        try:
            new = Engine(EngineArgs(model=str(folder), device="cpu", num_gpu_blocks_override=16).create_engine_config())
            assert old() is None, "the old engine was still there when the new one loaded"
            new.shutdown()
        finally:
            gc.enable()
    finally:
        gc.unfreeze()
