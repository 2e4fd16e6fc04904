"""Two KV block pools: the device pool of ``cache.kv`` plus a host (CPU) pool that preempted requests swap to.

The scheduler decides who swaps; this module keeps the books of both pools and says which blocks move; the
model runner copies them (``take_swaps``, once per step, before that step's forward pass). Pure Python.

What moves, and what does not:
- Swap-out copies only the blocks holding computed tokens. A device block shared by several requests (n > 1
  samples, a prefix-cache hit) gets ONE host copy: within a step by device block id, across steps by prefix-cache
  entry (a registered full block is immutable). Host ref counts mirror device ones: one per swapped holder.
- The host pool is also a second prefix-cache tier: a registered block swapped out keeps its cache entry there,
  so a later prompt whose prefix sits on the host gets it copied back in (``_find_elsewhere``) instead of
  recomputing it, and a swap-in whose block is still cached on the device takes that block, copying nothing.
- Copy order within a step: swap-out, then swap-in, then copy-on-write. Device blocks freed by a swap-out may be
  reused as swap-in or copy-on-write targets in the same step, which is safe because the swap-out has read them
  first; a swap-out of a block with a pending copy-on-write (a victim preempted in the step that made the copy)
  reads the copy's source instead. The other way round, host blocks a swap-in reads this step are not handed
  to a swap-out of the same step (``HostBlockPool.mark_read``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from cache.kv import BlockHashFn, KVCacheManager, KVRequest, _CacheEntry, default_block_hash


@dataclass
class SwapStats:
    """Counters since start: blocks (not tokens) moved between the pools."""

    num_blocks_swapped_out: int = 0  # device -> host copies
    num_blocks_swapped_in: int = 0  # host -> device copies (prefix-cache hits on the host included)
    num_blocks_deduplicated: int = 0  # moves that found the content already on the other side
    num_host_hit_blocks: int = 0  # prefix-cache hits served from the host pool


@dataclass
class SwapPlan:
    """One step's copies, in the order the model runner must run them (see the module docstring)."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)


class HostBlockPool:
    """Host blocks: ref counts, never-used ones, and cached content kept (LRU) while no request holds it."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_cpu_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._fresh: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.cached: dict[int, _CacheEntry] = {}
        self._hash_to_block: dict[int, int] = {}
        # Blocks that this step's swap-ins read: the step's swap-outs run FIRST, so none may write into them.
        self._reading: set[int] = set()
        self._reading_evictable: set[int] = set()  # ... of them, those in the evictable list
        self._deferred: list[int] = []  # ... of them, those freed this step: free again at end_step

    @property
    def num_free(self) -> int:
        return len(self._fresh) + len(self._evictable) - len(self._reading_evictable)

    def mark_read(self, block_id: int) -> None:
        """``block_id`` is a swap-in source this step: it keeps its content until ``end_step``."""
        self._reading.add(block_id)
        if block_id in self._evictable:
            self._reading_evictable.add(block_id)

    def end_step(self) -> None:
        self._reading.clear()
        self._reading_evictable.clear()
        for block_id in self._deferred:
            if self.ref_counts[block_id] == 0:
                self._release(block_id)
        self._deferred.clear()

    def find(self, entry: _CacheEntry) -> int | None:
        """The host block holding exactly this cache entry's content."""
        block_id = self._hash_to_block.get(entry.block_hash)
        if block_id is not None and self.cached[block_id].entry_id == entry.entry_id:
            return block_id
        return None

    def lookup(self, block_hash: int, parent_entry_id: int | None, token_ids: tuple[int, ...]) -> int | None:
        block_id = self._hash_to_block.get(block_hash)
        if block_id is None:
            return None
        entry = self.cached[block_id]
        if entry.parent_entry_id != parent_entry_id or entry.token_ids != token_ids:
            return None
        return block_id

    def take(self, entry: _CacheEntry | None) -> int:
        """A free block with ref count 1 (evicting the LRU cached one if none is fresh), cached as ``entry``."""
        if self._fresh:
            block_id = self._fresh.pop()
        else:
            block_id = next(b for b in self._evictable if b not in self._reading_evictable)  # oldest first
            del self._evictable[block_id]
            old = self.cached.pop(block_id)
            if self._hash_to_block.get(old.block_hash) == block_id:
                del self._hash_to_block[old.block_hash]
        self.ref_counts[block_id] = 1
        if entry is not None and entry.block_hash not in self._hash_to_block:
            self.cached[block_id] = entry
            self._hash_to_block[entry.block_hash] = block_id
        return block_id

    def incref(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            if block_id in self._evictable:
                del self._evictable[block_id]
                self._reading_evictable.discard(block_id)
            else:
                self._deferred.remove(block_id)
        self.ref_counts[block_id] += 1

    def decref(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            if block_id in self._reading:
                self._deferred.append(block_id)
            else:
                self._release(block_id)

    def _release(self, block_id: int) -> None:
        if block_id in self.cached:
            self._evictable[block_id] = None
        else:
            self._fresh.append(block_id)

    def reset(self) -> None:
        self.end_step()
        self._fresh.extend(reversed(self._evictable))
        self._evictable.clear()
        self.cached.clear()
        self._hash_to_block.clear()


class SwapKVCacheManager(KVCacheManager):
    """``KVCacheManager`` with a host pool: ``swap_out`` / ``swap_in`` whole requests, ``take_swaps`` per step."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_cpu_blocks: int,
        enable_prefix_caching: bool = True,
        *,
        hash_fn: BlockHashFn = default_block_hash,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, hash_fn=hash_fn)
        self.host = HostBlockPool(num_cpu_blocks)
        self.swap_stats = SwapStats()
        self._host_tables: dict[str, list[int]] = {}  # swapped request id -> its host block ids, in order
        self._plan = SwapPlan()
        self._out_this_step: dict[int, int] = {}  # device block -> its host copy made this step
        self._in_this_step: dict[int, int] = {}  # host block -> its device copy made this step
        self._in_targets: dict[int, int] = {}  # ... the other way round: device block -> host block

    # ------------------------------------------------------------------ queries

    def is_swapped(self, request: KVRequest) -> bool:
        return request.request_id in self._host_tables

    def host_block_ids(self, request: KVRequest) -> list[int]:
        return list(self._host_tables.get(request.request_id, []))

    @property
    def num_swapped_requests(self) -> int:
        return len(self._host_tables)

    def host_usage(self) -> float:
        """Fraction of host blocks held by swapped requests (cached-but-free ones count as free)."""
        return 1.0 - self.host.num_free / self.host.num_blocks

    def num_shared_prefix_tokens(self, request: KVRequest) -> int:
        """Leading tokens in cached blocks another request also holds: a recompute would hit them."""
        n = 0
        for block_id in request.block_ids:
            if self._ref_counts[block_id] < 2 or block_id not in self._cached:
                break
            n += 1
        return min(n * self.block_size, request.num_computed_tokens)

    def _host_copy_of(self, block_id: int) -> int | None:
        # (a block swapped in this step whose copy has not run yet has its content on the host only)
        copy = self._out_this_step.get(block_id, self._in_targets.get(block_id))
        if copy is None and block_id in self._cached:
            copy = self.host.find(self._cached[block_id])
        return copy

    def num_blocks_to_swap_out(self, request: KVRequest) -> int:
        """Host blocks a swap-out of ``request`` would fill (content already on the host is shared)."""
        return sum(1 for b in self._blocks_to_keep(request) if self._host_copy_of(b) is None)

    def can_swap_out(self, request: KVRequest) -> bool:
        keep = self._blocks_to_keep(request)
        copies = [self._host_copy_of(b) for b in keep]
        num_revived = sum(1 for c in copies if c is not None and self.host.ref_counts[c] == 0)
        return bool(keep) and copies.count(None) + num_revived <= self.host.num_free

    def _blocks_to_keep(self, request: KVRequest) -> list[int]:
        return request.block_ids[: -(-request.num_computed_tokens // self.block_size)]

    # ------------------------------------------------------------------ moves

    def swap_out(self, request: KVRequest) -> bool:
        """Move the request's computed blocks to the host and free its device blocks; False (nothing changed)
        if the host pool is short. ``num_computed_tokens`` is kept: the request resumes where it stopped."""
        if not self.can_swap_out(request):
            return False
        keep = self._blocks_to_keep(request)
        table: list[int | None] = [self._host_copy_of(b) for b in keep]
        for host_id in table:  # take the shared copies first, so that new blocks cannot evict them
            if host_id is not None:
                self.host.incref(host_id)
                self.swap_stats.num_blocks_deduplicated += 1
        host_ids: list[int] = []
        for block_id, shared in zip(keep, table, strict=True):
            host_id = shared
            if host_id is None:
                host_id = self.host.take(self._cached.get(block_id))
                # a victim preempted in the step that copied-on-write this block: its content is still the source's
                src = self._pending_copies.get(block_id, block_id)
                self._plan.swap_out.append((src, host_id))
                self._out_this_step[block_id] = host_id
                self.swap_stats.num_blocks_swapped_out += 1
            host_ids.append(host_id)
        self._host_tables[request.request_id] = host_ids
        self._drop_refs(request.block_ids)
        request.block_ids = []
        return True

    def _device_copy_of(self, host_id: int) -> int | None:
        """A device block holding this host block's content now (copied in this step, or still cached there)."""
        entry = self.host.cached.get(host_id)
        block_id = self._in_this_step.get(host_id)
        if block_id is not None:  # (dropped from the map when its block is freed: ``_drop_refs``)
            return block_id
        if entry is None:
            return None
        block_id = self._hash_to_block.get(entry.block_hash)
        if block_id is not None and self._cached[block_id].entry_id == entry.entry_id:
            return block_id
        return None

    def can_swap_in(self, request: KVRequest, num_new_tokens: int) -> bool:
        """Room on the device for the request's blocks plus ``num_new_tokens`` more (and one copy-on-write)."""
        table = self._host_tables[request.request_id]
        copies = [self._device_copy_of(h) for h in table]
        num_revived = sum(1 for b in copies if b is not None and self._ref_counts[b] == 0)
        bs = self.block_size
        num_appended = max(0, -(-(request.num_computed_tokens + num_new_tokens) // bs) - len(table))
        return copies.count(None) + num_revived + num_appended + 1 <= self.num_free_blocks

    def swap_in(self, request: KVRequest) -> None:
        """Bring a swapped request's blocks back to the device (check ``can_swap_in`` first)."""
        table = self._host_tables.pop(request.request_id)
        copies = [self._device_copy_of(h) for h in table]
        for block_id in copies:  # hold the blocks already there first, so that new blocks cannot evict them
            if block_id is not None:
                self._hold(block_id)
                self.swap_stats.num_blocks_deduplicated += 1
        block_ids: list[int] = []
        for host_id, there in zip(table, copies, strict=True):
            block_id = there
            if block_id is None:
                block_id = self._take_free_block()
                self._adopt(block_id, host_id)
                self.host.mark_read(host_id)
                self.swap_stats.num_blocks_swapped_in += 1
            block_ids.append(block_id)
            self.host.decref(host_id)
        request.block_ids = block_ids

    def _hold(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self._ref_counts[block_id] += 1

    def _adopt(self, block_id: int, host_id: int) -> None:
        """Copy ``host_id`` into device block ``block_id`` this step, and cache it under the host entry."""
        self._plan.swap_in.append((host_id, block_id))
        self._in_this_step[host_id] = block_id
        self._in_targets[block_id] = host_id
        entry = self.host.cached.get(host_id)
        if entry is not None and entry.block_hash not in self._hash_to_block:
            self._cached[block_id] = entry
            self._hash_to_block[entry.block_hash] = block_id

    def _find_elsewhere(
        self, block_hash: int, parent_entry_id: int | None, token_ids: tuple[int, ...], hit_ids: list[int]
    ) -> int | None:
        """A prefix-cache miss on the device that the host has: copy it into a free device block now (ref count
        0, cached, like any evictable hit), never taking one of ``hit_ids``. None if no block can be spared."""
        host_id = self.host.lookup(block_hash, parent_entry_id, token_ids)
        if host_id is None:
            return None
        block_id = self._in_this_step.get(host_id)
        if block_id is not None and self._cached.get(block_id) is self.host.cached[host_id]:
            return block_id
        block_id = self._spare_block(hit_ids)
        if block_id is None:
            return None
        entry = self.host.cached[host_id]
        self.host.mark_read(host_id)
        self._plan.swap_in.append((host_id, block_id))
        self._in_this_step[host_id] = block_id
        self._in_targets[block_id] = host_id
        self._cached[block_id] = entry
        if block_hash not in self._hash_to_block:  # (taken: a collision with other content on the device)
            self._hash_to_block[block_hash] = block_id
        self._evictable[block_id] = None  # most recently used
        self.swap_stats.num_blocks_swapped_in += 1
        self.swap_stats.num_host_hit_blocks += 1
        return block_id

    def _spare_block(self, keep: list[int]) -> int | None:
        """A free device block that is none of ``keep``, its cached content (if any) evicted; ref count stays 0."""
        if self._fresh:
            return self._fresh.pop()
        for block_id in self._evictable:  # oldest first; ``keep`` is a handful of blocks
            if block_id not in keep:
                del self._evictable[block_id]
                self._evict(block_id)
                self._forget_copy_into(block_id)
                return block_id
        return None

    def _take_free_block(self) -> int:
        block_id = super()._take_free_block()
        self._forget_copy_into(block_id)  # (an evicted block brought in from the host this step)
        return block_id

    def _drop_refs(self, block_ids: list[int]) -> None:
        super()._drop_refs(block_ids)
        if self._in_targets:
            for block_id in block_ids:
                if self._ref_counts[block_id] == 0 and block_id not in self._cached:
                    self._forget_copy_into(block_id)

    def _forget_copy_into(self, block_id: int) -> None:
        """``block_id`` gets other content this step: it no longer stands for the host block copied into it
        (the copy still runs, before whatever the new owner writes)."""
        host_id = self._in_targets.pop(block_id, None)
        if host_id is not None and self._in_this_step.get(host_id) == block_id:
            del self._in_this_step[host_id]

    # ------------------------------------------------------------------ per step and release

    def take_swaps(self) -> SwapPlan:
        """This step's copies (run swap-out, then swap-in, then ``take_pending_copies``)."""
        plan, self._plan = self._plan, SwapPlan()
        self._out_this_step.clear()
        self._in_this_step.clear()
        self._in_targets.clear()
        self.host.end_step()
        return plan

    def free(self, request: KVRequest) -> None:
        table = self._host_tables.pop(request.request_id, None)
        if table is not None:
            for host_id in table:
                self.host.decref(host_id)
        super().free(request)

    def reset_prefix_cache(self) -> bool:
        if self._host_tables or not super().reset_prefix_cache():
            return False
        self.host.reset()
        self.swap_stats = SwapStats()
        return True
