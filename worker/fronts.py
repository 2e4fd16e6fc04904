"""More than one worker front on one engine core: the per-token work (detokenization, events, Redis writes) of a
big batch is more than one Python process keeps up with (on the H200 one front was 90 % busy at 256 streams of
the 8B shape and 512 streams got 0.7x the engine), so a worker node can run several fronts, as vLLM runs several
API servers on one engine core. Front 0 (the ``pagedserve worker`` process) starts the core with one output
socket per front, then starts fronts 1..N-1 here; each takes its share of the jobs from the queue (its own arq
worker, heartbeats and leases) and gets only its own requests' outputs from the core.

The node lives and dies as one: the extra fronts die with front 0 (PDEATHSIG), and front 0 exits with
``EXIT_FRONT_DIED`` when one of them dies, so all of the node's jobs run again elsewhere, as for a lost worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from typing import Any

from engine.config import EngineConfig
from engine.core import die_with_parent
from engine.core_messages import CoreReady
from worker.core_client import CoreClient
from worker.settings import WorkerSettings

logger = logging.getLogger(__name__)

EXIT_FRONT_DIED = 5


def num_fronts(settings: WorkerSettings) -> int:
    """How many fronts the node runs (``--worker-fronts``). The default is one: on the H200 (8B shape, one wave
    of 256-token streams) four fronts gave 0.65x the engine at 256 streams against one front's 0.92x, and 0.77x
    against 0.75x at 512 (docs/benchmarks.md): admission, not the per-token work, is what more fronts slow."""
    return settings.fronts


def share(total: int, parts: int, index: int) -> int:
    """Part ``index`` of ``total`` split into ``parts`` as evenly as integers go (they sum to ``total``)."""
    return total // parts + (1 if index < total % parts else 0)


def front_settings(settings: WorkerSettings, capacity: int, count: int, index: int) -> WorkerSettings:
    """Front ``index``'s settings: its share of the jobs, its own worker id; metrics and the stats line only on
    front 0."""
    total = settings.max_jobs or capacity
    if count == 1:
        return dataclasses.replace(settings, max_jobs=total)
    worker_id = settings.worker_id if index == 0 else f"{settings.worker_id}-f{index}"
    return dataclasses.replace(
        settings,
        max_jobs=max(1, share(total, count, index)),
        worker_id=worker_id,
        metrics_port=settings.metrics_port if index == 0 else None,
        log_stats=settings.log_stats and index == 0,
    )


class ExtraFronts:
    """Fronts 1..N-1 of a node, as child processes of front 0."""

    def __init__(self) -> None:
        self.processes: list[Any] = []
        self.closing = False

    def start(
        self,
        core: CoreClient,
        config: EngineConfig,
        settings: WorkerSettings,
        model_name: str,
        log_level: str,
    ) -> None:
        assert core.ready is not None
        ctx = mp.get_context("spawn")
        count = len(core.outputs_addrs)
        for k in range(1, count):
            mine = front_settings(settings, core.ready.capacity, count, k)
            args = (config, mine, model_name, log_level, core.commands_addr, core.outputs_addrs[k], core.ready, k)
            process = ctx.Process(target=run_extra_front, args=args, name=f"pagedserve-front-{k}")
            process.start()
            self.processes.append(process)

    def watch(self, on_death: Callable[[int, int | None], None]) -> asyncio.Task[None]:
        """Call ``on_death(front index, exit code)`` when an extra front exits while not being stopped."""

        async def watcher() -> None:
            loop = asyncio.get_running_loop()
            exited: asyncio.Future[int] = loop.create_future()

            def on_exit(k: int) -> None:
                if not exited.done():
                    exited.set_result(k)

            for k, process in enumerate(self.processes, start=1):
                loop.add_reader(process.sentinel, on_exit, k)
            try:
                k = await exited
            finally:
                for process in self.processes:
                    loop.remove_reader(process.sentinel)
            process = self.processes[k - 1]
            process.join(0.1)
            if not self.closing:
                on_death(k, process.exitcode)

        return asyncio.ensure_future(watcher())

    async def drain_with(self, front: Any, timeout_s: float, poll_s: float = 0.1) -> None:
        """Once front 0 starts draining (its SIGTERM or Ctrl-C), the others drain too. (They are in their own
        session, so a terminal's Ctrl-C reaches front 0 alone and none of them gets a signal twice.)"""
        while not front.draining:
            await asyncio.sleep(poll_s)
        await self.stop(timeout_s)

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM each (they drain their jobs like front 0), wait, kill what is left."""
        self.closing = True
        for process in self.processes:
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
        for process in self.processes:
            await asyncio.to_thread(process.join, timeout_s)
            if process.is_alive():
                logger.warning("front %s did not stop in %.0f s: killing it", process.name, timeout_s)
                process.kill()
                process.join(5)


def exit_on_front_death(index: int, exit_code: int | None) -> None:
    """One front of the node died: the node is lost, so front 0 exits now (its core and the other fronts
    with it), its jobs' leases lapse and they run again elsewhere."""
    logger.error("worker front %d exited (code %s): the node exits so its jobs run again elsewhere", index, exit_code)
    logging.shutdown()
    os._exit(EXIT_FRONT_DIED)


def run_extra_front(
    config: EngineConfig,
    settings: WorkerSettings,
    model_name: str,
    log_level: str,
    commands_addr: str,
    outputs_addr: str,
    ready: CoreReady,
    index: int,
) -> None:
    """Entry point of front ``index`` > 0 (``multiprocessing`` spawn target)."""
    die_with_parent()
    os.setsid()  # signals come from front 0 only (see ExtraFronts.drain_with)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s[front {index}]: %(message)s")
    from worker.main import serve_front

    core = CoreClient.attach(config, commands_addr, outputs_addr, ready, index)
    asyncio.run(serve_front(core, config, settings, model_name))
