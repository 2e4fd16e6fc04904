"""The cyclic garbage collector in the long-lived role processes (engine core, worker front, API).

Once a process has started, everything alive (modules, tokenizer tables, the loaded engine) is moved out of the
collector's reach (``gc.freeze``): a full collection would walk all of it again and again while a burst of jobs
allocates long-lived objects (on the 2-core VM, 256 jobs at once spent ~45 % of the front's samples in
collections, and freezing took the jobs' mean enqueue -> start from 241 to 139 ms). vLLM freezes its API server's
start-up heap the same way.

The first generation's threshold is raised from Python's 700 net allocations to ``GEN0_THRESHOLD``. A front
step of 512 streams allocates a few thousand short-lived objects (decoded step message, updates, events), so at
700 the collector ran ~4 times per step and its older generations filled with the jobs' state: ``pagedserve bench
pump --jobs 512`` on the 2-core VM (300 steps) saw 9 full collections of up to 6.7-8.5 ms (the engine's step at 512
streams is ~20 ms on the H200); at 10,000 it saw none, and no pause over 2.3 ms. Reference counting frees almost
all of them anyway: only cyclic garbage waits for a collection, and 10,000 objects of it is a few MB at most.
It lives in ``deploy`` (how the roles run), not ``engine``: the API tier imports nothing of the engine.

The offline engines (``engine.LLM``, the benchmarks' engines) freeze their start-up heap too (``freeze_heap``: no
threshold change in a user's process) and thaw it when they shut down, so a process that builds engine after
engine can still collect the cycles of the ones it dropped. On the H200 one full collection of the 8B engine's
heap took 295 ms in the middle of `mixed` (docs/benchmarks.md, Session 22); frozen, none ran.

A young collection still takes 2-8 ms on the H200's host (the stack's front at 256 streams: ~100 per 1,000 steps,
median 1.8 ms, longest 7.8 ms), which is most of an engine step when it falls in the middle of one. So a process
with moments it would spend waiting anyway (the front, once a step's pipeline is out and no step is waiting) runs
the young collections itself there, with ``collect_young_if_due``, well before the automatic one would; the
automatic collector stays on behind it, for a process that never has such a moment.
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 10_000


def freeze_heap() -> None:
    """Collect, then freeze what survives: later collections skip it (``thaw_heap`` undoes it)."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Give every frozen object back to the collector (an offline engine's shutdown)."""
    gc.unfreeze()


def freeze_startup_heap() -> None:
    """Collect, freeze what survives, and raise the first generation's threshold (module docstring)."""
    freeze_heap()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)


def collect_young_if_due() -> int | None:
    """At an idle moment: the young collection that half the threshold's allocations make due (the generation
    the automatic collector would take next, but never a full one), or none. Returns the generation collected."""
    count0, count1, _ = gc.get_count()
    threshold0, threshold1, _ = gc.get_threshold()
    if count0 < threshold0 // 2:
        return None
    # gen 1 once gen 0 has been collected that often, as the automatic collector does
    generation = 1 if count1 >= threshold1 else 0
    gc.collect(generation)
    return generation
