"""The worker front's handle on its engine core process: start it, send it commands, read its step outputs,
and notice at once when it dies."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.core import run_engine_core
from engine.core_messages import (
    AbortRequest,
    AddRequest,
    CoreFailed,
    CoreReady,
    Shutdown,
    StepOutputs,
    command_encoder,
    output_decoder,
)

logger = logging.getLogger(__name__)


class CoreDiedError(RuntimeError):
    """The engine core process exited while the front still needed it."""


class CoreClient:
    """One engine core process, spawned by ``start`` and watched until ``shutdown``; or, made by ``attach``, a
    handle of another front on a core that front 0 started (client ``k`` of ``num_clients``)."""

    def __init__(self, config: EngineConfig, log_level: str = "INFO", num_clients: int = 1) -> None:
        self.config = config
        self.log_level = log_level
        base = os.path.join(tempfile.gettempdir(), f"pagedserve-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.commands_addr = f"ipc://{base}-cmd"
        self.outputs_addrs = [f"ipc://{base}-out{k}" for k in range(num_clients)]
        self.client = 0
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()  # commands go out with plain non-blocking sends, from any coroutine
        self._commands = self._sync_ctx.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)  # never drop or block a command: the core drains them per step
        self._commands.setsockopt(zmq.LINGER, 0)
        self._outputs = self._ctx.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.RCVHWM, 0)
        self._outputs.setsockopt(zmq.LINGER, 0)
        self.process: Any = None
        self.ready: CoreReady | None = None
        self.closing = False

    @classmethod
    def attach(cls, config: EngineConfig, commands_addr: str, outputs_addr: str, ready: CoreReady, client: int):
        """Front ``client``'s handle on a running core (front 0 watches the core and stops it; this front dies
        with front 0)."""
        self = cls(config)
        self.commands_addr, self.outputs_addrs, self.client, self.ready = commands_addr, [outputs_addr], client, ready
        self._commands.connect(commands_addr)
        self._outputs.connect(outputs_addr)
        return self

    async def start(self, timeout_s: float = 1800.0) -> CoreReady:
        """Spawn the core and wait until its engine is loaded. Raises ``CoreDiedError`` if it fails."""
        ctx = mp.get_context("spawn")
        args = (self.config, self.commands_addr, self.outputs_addrs, self.log_level)
        # not a daemon: the core spawns tensor-parallel ranks of its own; it dies with us (PDEATHSIG)
        self.process = ctx.Process(target=run_engine_core, args=args, name="pagedserve-engine-core")
        self.process.start()
        self._commands.connect(self.commands_addr)
        self._outputs.connect(self.outputs_addrs[0])
        reader = asyncio.ensure_future(self._outputs.recv())
        died = asyncio.ensure_future(self._wait_exit())
        done, _ = await asyncio.wait({reader, died}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if reader not in done:
            reader.cancel()
            died.cancel()
            self.kill()
            raise CoreDiedError(f"the engine core exited with code {self.process.exitcode} while loading")
        died.cancel()
        message = output_decoder.decode(reader.result())
        if isinstance(message, CoreFailed):
            self.kill()
            raise CoreDiedError(f"the engine failed to start: {message.message}")
        assert isinstance(message, CoreReady)
        self.ready = message
        return message

    async def _wait_exit(self) -> None:
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()

        def on_exit() -> None:
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(self.process.sentinel, on_exit)
        try:
            await exited
        finally:
            loop.remove_reader(self.process.sentinel)

    def watch(self, on_death: Callable[[int | None], None]) -> asyncio.Task[None]:
        """Call ``on_death(exit code)`` as soon as the core exits, unless we are shutting it down."""

        async def watcher() -> None:
            if self.process is None:  # attached: front 0 watches the core, and this front dies with front 0
                await asyncio.Event().wait()
            await self._wait_exit()
            self.process.join(0.1)
            if not self.closing:
                on_death(self.process.exitcode)

        return asyncio.ensure_future(watcher())

    def add(self, request_id: str, prompt_token_ids: list[int], params: dict[str, Any], priority: int) -> None:
        self._send(AddRequest(request_id, prompt_token_ids, params, priority, self.client))

    def abort(self, request_id: str, sample_indices: list[int] | None = None) -> None:
        self._send(AbortRequest(request_id, sample_indices))

    def _send(self, command: AddRequest | AbortRequest | Shutdown) -> None:
        self._commands.send(command_encoder.encode(command), zmq.NOBLOCK)

    async def outputs(self) -> list[StepOutputs]:
        """Every step message that has arrived, oldest first (waits for at least one)."""
        frames = [await self._outputs.recv()]
        while True:
            try:
                frames.append(await self._outputs.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
        messages = [output_decoder.decode(f) for f in frames]
        return [m for m in messages if isinstance(m, StepOutputs)]

    def has_outputs(self) -> bool:
        """A step message is waiting to be taken."""
        return bool(int(self._outputs.get(zmq.EVENTS)) & zmq.POLLIN)

    def kill(self) -> None:
        self.closing = True
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Ask the core to stop, wait for it (the engine frees the GPU), kill it if it does not."""
        self.closing = True
        if self.process is not None and self.process.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self._send(Shutdown())
            await asyncio.to_thread(self.process.join, timeout_s)
            if self.process.is_alive():
                logger.warning("engine core did not stop in %.0f s: killing it", timeout_s)
                self.kill()
        self._commands.close(0)
        self._outputs.close(0)
        self._sync_ctx.term()
        self._ctx.term()
