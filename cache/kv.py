"""Paged KV block pool: reference counts, automatic prefix caching and copy-on-write fork.

Pure Python (no torch, no engine import): the scheduler calls this for every running request every step,
so each call does O(blocks touched) work, never O(num_blocks) or per-token Python loops.

Prefix cache: a FULL block is registered under ``hash_fn(parent_hash, block_token_ids)``. A hash alone never
decides a hit: each cached block keeps its token ids and the *entry id* of its parent block, and a lookup
walks the chain comparing both. Entry ids are never reused, so a child whose parent block was evicted (and
whose id may now hold other content) can no longer be reached; it simply ages out of the LRU list.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

BlockHashFn = Callable[[int | None, tuple[int, ...]], int]


def default_block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    # Python's tuple hash over ints is deterministic within a process, which is all we need: only the
    # scheduler's process ever computes these, and collisions are caught by the content check anyway.
    return hash((parent_hash, token_ids))


class KVRequest(Protocol):
    """What the manager needs from a request; ``engine.request.Request`` satisfies it."""

    request_id: str
    block_ids: list[int]  # the manager appends/replaces entries; the request owns the list
    num_computed_tokens: int  # tokens whose K/V are already in the cache

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...


@dataclass
class KVCacheStats:
    """Counters since start (or the last ``reset_prefix_cache``); tokens for the prefix-cache numbers."""

    num_queries: int = 0  # get_computed_blocks calls
    num_query_tokens: int = 0
    num_hit_tokens: int = 0
    num_cow_copies: int = 0
    num_evictions: int = 0  # cached blocks whose memory was taken for new content

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


@dataclass(slots=True)
class _CacheEntry:
    """Why a cached block may be reused: its hash plus the exact content behind it."""

    entry_id: int
    block_hash: int
    parent_entry_id: int | None  # None for the first block of a sequence
    token_ids: tuple[int, ...]


@dataclass(slots=True)
class _HashChain:
    """Per-request progress of prefix registration, so ``cache_full_blocks`` is O(new full blocks)."""

    num_blocks: int = 0  # leading blocks of the request already handled
    parent_hash: int | None = None
    parent_entry_id: int | None = None
    is_broken: bool = False  # a hash collision with other content: stop caching this request's blocks


class KVCacheManager:
    """Hands out fixed-size KV blocks to requests, shares full blocks by prefix, copies shared blocks on write.

    A block is in exactly one of three states: held (ref count > 0), fresh (free, no cached content) or
    evictable (free, cached content kept in LRU order until its memory is needed). New blocks come from
    the fresh pool first, then from the least recently freed evictable block.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        *,
        hash_fn: BlockHashFn = default_block_hash,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = KVCacheStats()
        self._hash_fn = hash_fn
        self._ref_counts = [0] * num_blocks
        # Popped from the end: reversed so that low block ids go out first (easier to read in tests and logs).
        self._fresh: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._cached: dict[int, _CacheEntry] = {}  # block id -> content, for held and evictable blocks
        self._hash_to_block: dict[int, int] = {}
        self._next_entry_id = 0
        self._chains: dict[str, _HashChain] = {}
        self._pending_copies: dict[int, int] = {}  # copy-on-write dst -> src, in the order they were made

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._fresh) + len(self._evictable)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks held by requests (ref count > 0); cached-but-free blocks count as free."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def get_computed_blocks(self, request: KVRequest) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks, leaving at least one token to compute. Takes no references.

        Call ``allocate_slots(request, n, computed_block_ids)`` before any other allocation, since that could
        evict the blocks returned here.
        """
        if not self.enable_prefix_caching:
            return [], 0
        token_ids = request.all_token_ids
        num_tokens = len(token_ids)
        self.stats.num_queries += 1
        self.stats.num_query_tokens += num_tokens
        bs = self.block_size
        # (num_tokens - 1) // bs full blocks at most: a hit on every token would leave nothing to produce logits.
        max_blocks = (num_tokens - 1) // bs if num_tokens else 0
        hit_ids: list[int] = []
        parent_hash: int | None = None
        parent_entry_id: int | None = None
        for i in range(max_blocks):
            block_tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            block_hash = self._hash_fn(parent_hash, block_tokens)
            block_id = self._hash_to_block.get(block_hash, -1)
            entry = self._cached.get(block_id)
            if entry is None or entry.parent_entry_id != parent_entry_id or entry.token_ids != block_tokens:
                # not on the device (or a hash collision: same hash, other content): another tier may have it
                elsewhere = self._find_elsewhere(block_hash, parent_entry_id, block_tokens, hit_ids)
                if elsewhere is None:
                    break
                block_id, entry = elsewhere, self._cached[elsewhere]
            hit_ids.append(block_id)
            parent_hash, parent_entry_id = block_hash, entry.entry_id
        num_hit_tokens = len(hit_ids) * bs
        self.stats.num_hit_tokens += num_hit_tokens
        return hit_ids, num_hit_tokens

    def _find_elsewhere(
        self, block_hash: int, parent_entry_id: int | None, token_ids: tuple[int, ...], hit_ids: list[int]
    ) -> int | None:
        """A device block holding this content brought back from another tier (``cache.swap``), or None."""
        return None

    # ------------------------------------------------------------------ allocation

    def allocate_slots(
        self, request: KVRequest, num_new_tokens: int, computed_block_ids: list[int] | None = None
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens; return the block ids appended, or None if short.

        With ``computed_block_ids`` (a prefix hit for a request holding no blocks) the new tokens start after
        the hit, whatever ``request.num_computed_tokens`` says. Shared blocks that the new tokens will write
        into are replaced in ``request.block_ids`` by private copies (see ``take_pending_copies``); those
        replacements are not in the returned list, which holds only the blocks appended at the end.
        On None nothing has changed.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        bs = self.block_size
        ref_counts = self._ref_counts
        block_ids = request.block_ids
        if computed_block_ids:
            if block_ids:
                raise ValueError(f"request {request.request_id} already holds blocks; a prefix hit needs none")
            start = len(computed_block_ids) * bs
            num_held = len(computed_block_ids)
            # Hit blocks nobody holds are sitting in the evictable pool: taking them shrinks what is free.
            num_revived = sum(1 for b in computed_block_ids if ref_counts[b] == 0)
            cow_indices: list[int] = []  # writes start past the hit, which is all full blocks
        else:
            start = request.num_computed_tokens
            num_held = len(block_ids)
            num_revived = 0
            cow_indices = []
            if num_new_tokens:
                for i in range(start // bs, min((start + num_new_tokens - 1) // bs + 1, num_held)):
                    if ref_counts[block_ids[i]] > 1:
                        cow_indices.append(i)
        num_appended = -(-(start + num_new_tokens) // bs) - num_held
        if num_appended < 0:
            num_appended = 0
        if num_appended + len(cow_indices) + num_revived > len(self._fresh) + len(self._evictable):
            return None

        if computed_block_ids:
            block_ids = self._claim_hit(request, computed_block_ids)
        elif request.request_id not in self._chains:
            self._chains[request.request_id] = _HashChain()

        if cow_indices:
            for i in cow_indices:
                src = block_ids[i]
                dst = self._take_free_block()
                ref_counts[src] -= 1  # stays > 0: another request still holds it
                block_ids[i] = dst
                self._pending_copies[dst] = src
            self.stats.num_cow_copies += len(cow_indices)
        if not num_appended:
            return []  # the common decode step: the new token fits in the last block
        new_ids = [self._take_free_block() for _ in range(num_appended)]
        block_ids.extend(new_ids)
        return new_ids

    def _claim_hit(self, request: KVRequest, computed_block_ids: list[int]) -> list[int]:
        """Give ``request`` the prefix hit's blocks (taking those nobody held out of the evictable pool) and the
        hit's hash chain; returns its new block list."""
        ref_counts = self._ref_counts
        for block_id in computed_block_ids:
            if block_id not in self._cached:
                raise RuntimeError(f"block {block_id} from get_computed_blocks was evicted before allocate_slots")
            if ref_counts[block_id] == 0:
                del self._evictable[block_id]
            ref_counts[block_id] += 1
        last = self._cached[computed_block_ids[-1]]
        self._chains[request.request_id] = _HashChain(len(computed_block_ids), last.block_hash, last.entry_id)
        request.block_ids = list(computed_block_ids)
        return request.block_ids

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block pairs the model runner must copy on device before the step that writes dst."""
        copies = [(src, dst) for dst, src in self._pending_copies.items()]
        self._pending_copies = {}
        return copies

    def _take_free_block(self) -> int:
        """A free block with ref count 1: never-cached memory first, else evict the LRU cached block."""
        if self._fresh:
            block_id = self._fresh.pop()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            self._evict(block_id)
        self._ref_counts[block_id] = 1
        return block_id

    def _evict(self, block_id: int) -> None:
        entry = self._cached.pop(block_id)
        # Another block may have taken the hash since; only drop the mapping if it is ours.
        if self._hash_to_block.get(entry.block_hash) == block_id:
            del self._hash_to_block[entry.block_hash]
        self.stats.num_evictions += 1

    # ------------------------------------------------------------------ prefix registration

    def cache_full_blocks(self, request: KVRequest) -> None:
        """Register the request's blocks that became full (by ``num_computed_tokens``) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        chain = self._chains.get(request.request_id)
        if chain is None:
            return  # holds no blocks
        bs = self.block_size
        block_ids = request.block_ids
        num_full = min(request.num_computed_tokens // bs, len(block_ids))
        if num_full <= chain.num_blocks:
            return  # the common decode step: no new full block, and no token list built
        if chain.is_broken:
            chain.num_blocks = num_full
            return
        token_ids = request.all_token_ids
        for i in range(chain.num_blocks, num_full):
            block_tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            block_hash = self._hash_fn(chain.parent_hash, block_tokens)
            entry = self._register(block_ids[i], block_hash, chain.parent_entry_id, block_tokens)
            if entry is None:
                chain.is_broken = True
                break
            chain.parent_hash, chain.parent_entry_id = block_hash, entry.entry_id
        chain.num_blocks = num_full

    def _register(
        self, block_id: int, block_hash: int, parent_entry_id: int | None, token_ids: tuple[int, ...]
    ) -> _CacheEntry | None:
        """The cache entry now describing this content, or None if the hash is taken by other content."""
        existing_id = self._hash_to_block.get(block_hash)
        if existing_id is not None:
            existing = self._cached[existing_id]
            if existing.parent_entry_id == parent_entry_id and existing.token_ids == token_ids:
                # Same content already cached (possibly this very block, shared by a fork). Our copy stays
                # private; the chain continues from the cached entry, which describes the same prefix.
                return existing
            return None
        if block_id in self._cached:
            return None  # already cached under another hash: content this request did not write
        entry = _CacheEntry(self._next_entry_id, block_hash, parent_entry_id, token_ids)
        self._next_entry_id += 1
        self._cached[block_id] = entry
        self._hash_to_block[block_hash] = block_id
        return entry

    # ------------------------------------------------------------------ release and sharing

    def free(self, request: KVRequest) -> None:
        """Drop the request's references; cached blocks stay reusable until their memory is needed."""
        self._drop_refs(request.block_ids)
        request.block_ids = []
        self._chains.pop(request.request_id, None)

    def _drop_refs(self, block_ids: list[int]) -> None:
        ref_counts = self._ref_counts
        # Reverse order: the tail of a sequence is the least likely to be shared, so it is evicted first.
        for block_id in reversed(block_ids):
            ref_counts[block_id] -= 1
            if ref_counts[block_id] == 0:
                # A copy-on-write into a block nobody holds any more would land on its next owner's content
                # (a swap-in copied before it): drop it. (Preempted in the step that made the copy.)
                self._pending_copies.pop(block_id, None)
                if block_id in self._cached:
                    self._evictable[block_id] = None
                else:
                    self._fresh.append(block_id)

    def fork(self, parent: KVRequest, child: KVRequest) -> None:
        """Share all of the parent's blocks with the child; a later write to a shared block copies it.

        The child's token ids must start with the parent's computed tokens.
        """
        if child.block_ids:
            raise ValueError(f"fork target {child.request_id} already holds blocks")
        for block_id in parent.block_ids:
            self._ref_counts[block_id] += 1
        child.block_ids = list(parent.block_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        chain = self._chains.get(parent.request_id)
        if chain is not None:
            self._chains[child.request_id] = _HashChain(
                chain.num_blocks, chain.parent_hash, chain.parent_entry_id, chain.is_broken
            )

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content. Only when no request holds a block (as vLLM); returns whether it did."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self._fresh.extend(reversed(self._evictable))
        self._evictable.clear()
        self._cached.clear()
        self._hash_to_block.clear()
        self._chains.clear()
        self.stats = KVCacheStats()
        return True
