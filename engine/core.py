"""The engine core process: scheduler + executor + model runner in a busy loop, no asyncio, no Redis, no text.

It binds ZMQ sockets: commands (``AddRequest``, ``AbortRequest``, ``Shutdown``) from every front come in on one
PULL socket, and per step each front (client) gets one ``StepOutputs`` with its own requests' outputs on its own
PUSH socket (msgpack, ``engine.core_messages``; several fronts share the per-token work of one core, as vLLM's
API servers share its engine core). ZMQ queues the outputs, so a front that is slow to read never slows the steps. A malformed or oversized command is logged
and dropped. The core exits when its parent (the worker front) dies, so no orphan holds the GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import time
from typing import TYPE_CHECKING

import msgspec
import zmq

from deploy.gc_heap import freeze_startup_heap
from engine.config import EngineConfig
from engine.core_messages import (
    MAX_COMMAND_BYTES,
    AbortRequest,
    AddRequest,
    Command,
    CoreFailed,
    CoreReady,
    RequestError,
    SeqOutput,
    Shutdown,
    StepOutputs,
    command_decoder,
    output_encoder,
)
from engine.sampling_params import SamplingParams
from engine.step_trace import StepTrace

if TYPE_CHECKING:  # the module is imported by the front to name the spawn target: no torch there
    from engine.engine import Engine

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PARENT_CHECK_S = 0.5


def die_with_parent(sig: signal.Signals = signal.SIGKILL) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (a no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


class EngineCore:
    """Runs one ``Engine`` for the process behind ``commands``/``outputs``."""

    def __init__(self, engine: Engine, commands: zmq.Socket, outputs: list[zmq.Socket], parent_pid: int) -> None:
        self.engine = engine
        self.commands = commands
        self.outputs = outputs  # one per client (worker front)
        self.parent_pid = parent_pid
        self._clients: dict[str, int] = {}  # request id -> the client that added it (absent: client 0)
        self._pending: list[SeqOutput] = []  # finals of aborted samples, sent with the next step
        self._errors: list[RequestError] = []
        self._stopping = False
        self.trace = StepTrace.from_env()  # benchmarks only: per-step times and sizes

    def run(self) -> None:
        """Until ``Shutdown``, SIGTERM or the parent's death: take commands, step, send the step's outputs."""
        next_check = time.monotonic() + _PARENT_CHECK_S
        while not self._stopping:
            busy = self.engine.has_unfinished_requests() or self._pending or self._errors
            if self.commands.poll(0 if busy else int(_PARENT_CHECK_S * 1000)):
                self._take_commands()
            if self.engine.has_unfinished_requests():
                self._step()
            elif self._pending or self._errors:
                self._send([])
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + _PARENT_CHECK_S
                if os.getppid() != self.parent_pid:
                    logger.error("the worker front (pid %d) is gone: engine core exiting", self.parent_pid)
                    return

    def stop(self) -> None:
        self._stopping = True

    def _take_commands(self) -> None:
        while True:
            try:
                frame = self.commands.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frame) > MAX_COMMAND_BYTES:
                logger.error("dropped a %d-byte command (limit %d)", len(frame), MAX_COMMAND_BYTES)
                continue
            try:
                command: Command = command_decoder.decode(frame.buffer)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.error("dropped a malformed command: %s", exc)
                continue
            self._handle(command)

    def _handle(self, command: Command) -> None:
        if isinstance(command, AddRequest):
            if not 0 <= command.client < len(self.outputs):
                logger.error("dropped request %s of unknown client %d", command.request_id, command.client)
                return
            if command.client:
                self._clients[command.request_id] = command.client
            try:
                params = SamplingParams.from_dict(command.params)
                self.engine.add_request(command.request_id, command.prompt_token_ids, params, priority=command.priority)
                if self.trace is not None:
                    self.trace.added()
            except (ValueError, TypeError) as exc:
                self._errors.append(RequestError(command.request_id, str(exc), "invalid"))
        elif isinstance(command, AbortRequest):
            self._pending += self.engine.abort_request(command.request_id, command.sample_indices)
        elif isinstance(command, Shutdown):
            self._stopping = True

    def _step(self) -> None:
        if self.trace is not None:
            self.trace.begin(self.engine.computed_tokens_total)
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a broken step must not leave callers hanging
            logger.exception("engine step failed")
            for request_id in list(self.engine.scheduler.groups):
                self.engine.abort_request(request_id)
                self._errors.append(RequestError(request_id, f"engine step failed: {exc}", "engine"))
            outputs = []
        if self.trace is not None:
            scheduler = self.engine.scheduler
            self.trace.end(self.engine.computed_tokens_total, len(scheduler.running), len(scheduler.waiting))
        self._send(outputs)

    def _send(self, outputs: list[SeqOutput]) -> None:
        if self._pending:
            outputs, self._pending = self._pending + outputs, []
        errors, self._errors = self._errors, []
        stats = self.engine.stats()
        now = time.perf_counter()
        if len(self.outputs) == 1:
            self.outputs[0].send(output_encoder.encode(StepOutputs(outputs, stats, errors, now)), copy=False)
            return
        per_client: list[StepOutputs] = [StepOutputs([], stats, [], now) for _ in self.outputs]
        for out in outputs:
            per_client[self._clients.get(out.request_id, 0)].outputs.append(out)
        for error in errors:
            per_client[self._clients.get(error.request_id, 0)].errors.append(error)
        for socket, message in zip(self.outputs, per_client, strict=True):
            socket.send(output_encoder.encode(message), copy=False)  # (every client gets the step's stats)
        for request_id in [*(o.request_id for o in outputs if o.finish_reason), *(e.request_id for e in errors)]:
            if request_id not in self.engine.scheduler.groups:  # every sample ended: forget its client
                self._clients.pop(request_id, None)


def run_engine_core(
    config: EngineConfig, commands_addr: str, outputs_addrs: list[str], log_level: str = "INFO"
) -> None:
    """Entry point of the core process (``multiprocessing`` spawn target): one output address per client."""
    parent_pid = os.getppid()
    die_with_parent()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the front, which shuts the core down
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.bind(commands_addr)
    outputs = []
    for addr in outputs_addrs:
        socket = ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 2000)
        socket.bind(addr)
        outputs.append(socket)
    try:
        from engine.engine import Engine

        engine = Engine(config)
    except Exception as exc:  # noqa: BLE001 - the front must hear why, not wait for a ready that never comes
        logger.exception("engine failed to start")
        outputs[0].send(output_encoder.encode(CoreFailed(f"{type(exc).__name__}: {exc}")))
        for socket in outputs:
            socket.close()
        ctx.term()
        raise SystemExit(1) from exc
    ready = CoreReady(
        engine.max_model_len, engine.vocab_size, config.scheduler.max_num_seqs, list(engine.eos_token_ids)
    )
    outputs[0].send(output_encoder.encode(ready))  # to the front that started the core; it tells the others
    core = EngineCore(engine, commands, outputs, parent_pid)
    freeze_startup_heap()  # the loaded engine's objects out of the collector's reach (deploy.gc_heap)
    signal.signal(signal.SIGTERM, lambda *_: core.stop())
    try:
        core.run()
    finally:
        if core.trace is not None:
            core.trace.write()
        engine.shutdown()
        commands.close(linger=0)
        for socket in outputs:
            socket.close()
        ctx.term()
