"""Executors run the model across tensor-parallel ranks: rank 0 lives in the engine's process, ranks
1..N-1 are spawned processes that receive each step's ``StepInputs`` as a typed message.

A rank that dies takes the engine down with a clear error (a watchdog in rank 0 exits the process),
so the job queue retries the work elsewhere instead of hanging in a collective.

The ranks live exactly as long as their executor: ``shutdown()``, the executor being garbage-collected
(``weakref.finalize``; nothing else holds it, the watchdog included) or the interpreter exiting stops them
and leaves this process's process group, so a later engine in the same process starts clean.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.multiprocessing as mp

import modelfiles
from engine.config import EngineConfig
from engine.inputs import StepInputs, TokenFill
from engine.model_runner import KVCacheSpec, ModelRunner, pick_device
from engine.parallel import ParallelState, init_distributed


class Executor(Protocol):
    kv_spec: KVCacheSpec
    hf_config: Any
    device: torch.device

    def execute_model(self, inputs: StepInputs, fill: TokenFill | None = None) -> torch.Tensor: ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class StepMessage:
    inputs: StepInputs


@dataclass(frozen=True)
class ShutdownMessage:
    pass


RankMessage = StepMessage | ShutdownMessage


class LocalExecutor:
    """Tensor-parallel size 1: the model runs in this process."""

    def __init__(self, config: EngineConfig, files: modelfiles.ModelFiles) -> None:
        self.runner = ModelRunner(config, files, ParallelState())
        self.kv_spec = self.runner.kv_spec
        self.hf_config = self.runner.hf_config
        self.device = self.runner.device

    def execute_model(self, inputs: StepInputs, fill: TokenFill | None = None) -> torch.Tensor:
        return self.runner.execute_model(inputs, fill)

    def shutdown(self) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    rank: int, world_size: int, init_method: str, config: EngineConfig, files: modelfiles.ModelFiles, inbox: Any
) -> None:
    """Body of ranks 1..N-1: run every step rank 0 sends until told to stop."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    device = pick_device(config)
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    parallel = init_distributed(rank, world_size, init_method, "nccl" if device.type == "cuda" else "gloo")
    runner = ModelRunner(config, files, parallel)
    while True:
        message: RankMessage = inbox.get()
        if isinstance(message, ShutdownMessage):
            break
        runner.execute_model(message.inputs)
    torch.distributed.destroy_process_group()


class MultiprocExecutor:
    """Tensor-parallel size N > 1: spawns ranks 1..N-1, rank 0 in this process."""

    def __init__(self, config: EngineConfig, files: modelfiles.ModelFiles) -> None:
        if torch.distributed.is_initialized():  # rank 0 would reuse that group, whose peers never answer: a hang
            raise RuntimeError(
                "torch.distributed is already initialized in this process (another tensor-parallel engine is "
                "alive?): call shutdown() on it (or use `with LLM(...) as llm:`) before building a new one"
            )
        world_size = config.parallel.tensor_parallel_size
        init_method = config.parallel.distributed_init_method or f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self.inboxes = [ctx.SimpleQueue() for _ in range(1, world_size)]
        self.procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, world_size, init_method, config, files, self.inboxes[rank - 1]),
                daemon=True,
                name=f"pagedserve-tp{rank}",
            )
            for rank in range(1, world_size)
        ]
        self._closing = threading.Event()
        # holds no reference to self: runs when the executor is collected, at exit, or on shutdown()
        self._finalizer = weakref.finalize(self, _stop_ranks, self.procs, self.inboxes, self._closing)
        # registered after multiprocessing's own exit hook, so it runs first (atexit is LIFO): the ranks are
        # told to stop before multiprocessing terminates them, which the watchdog would take for a crash
        atexit.register(self._finalizer)
        try:
            self._start(config, files, world_size, init_method)
        except BaseException:
            self._finalizer()
            raise

    def _start(self, config: EngineConfig, files: modelfiles.ModelFiles, world_size: int, init_method: str) -> None:
        for p in self.procs:
            p.start()
        watchdog = threading.Thread(target=_watchdog, args=(self.procs, self._closing), daemon=True, name="tp-watchdog")
        watchdog.start()
        device = pick_device(config)
        if device.type == "cuda":
            torch.cuda.set_device(0)
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.parallel = init_distributed(0, world_size, init_method, backend, force=True)
        self.runner = ModelRunner(config, files, self.parallel)
        self.kv_spec = self.runner.kv_spec
        self.hf_config = self.runner.hf_config
        self.device = self.runner.device

    def execute_model(self, inputs: StepInputs, fill: TokenFill | None = None) -> torch.Tensor:
        if fill is not None:
            raise ValueError("device-side input tokens need a single rank (asynchronous scheduling is off at TP > 1)")
        if not self._finalizer.alive:
            raise RuntimeError("this tensor-parallel executor was shut down")
        message = StepMessage(inputs)
        for inbox in self.inboxes:
            inbox.put(message)
        try:
            return self.runner.execute_model(inputs)
        except Exception as exc:  # a collective failed: name the rank that is gone, if one is
            for p in self.procs:
                p.join(timeout=1.0)
                if not p.is_alive():
                    raise RuntimeError(f"tensor-parallel rank {p.name} died (exit code {p.exitcode})") from exc
            raise

    def shutdown(self) -> None:
        """Stop the ranks and leave the process group (idempotent)."""
        self._finalizer()
        atexit.unregister(self._finalizer)


def _watchdog(procs: list[Any], closing: threading.Event) -> None:
    """Exit the process when a rank dies: a collective with a dead peer would hang; the queue retries the job."""
    while not closing.wait(0.2):
        for p in procs:
            if not p.is_alive() and not closing.is_set():
                message = f"tensor-parallel rank {p.name} died (exit code {p.exitcode}): stopping\n"
                os.write(2, message.encode())  # unbuffered: nothing may stand between this line and the exit
                os._exit(70)


def _stop_ranks(procs: list[Any], inboxes: list[Any], closing: threading.Event) -> None:
    """Tell every rank to stop, wait for it (kill it after 10 s), then leave the process group."""
    closing.set()  # first: the watchdog must not take the ranks' exit for a crash
    for inbox, p in zip(inboxes, procs, strict=True):
        if p.is_alive():
            with contextlib.suppress(OSError, ValueError):  # its end of the pipe may be gone with it
                inbox.put(ShutdownMessage())
    for p in procs:
        if p.pid is None:  # never started
            continue
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def make_executor(config: EngineConfig, files: modelfiles.ModelFiles) -> Executor:
    backend = config.parallel.distributed_executor_backend
    if backend == "uni" or (backend == "auto" and config.parallel.tensor_parallel_size == 1):
        return LocalExecutor(config, files)
    return MultiprocExecutor(config, files)
