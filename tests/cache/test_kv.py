"""KVCacheManager: accounting, prefix caching, eviction, copy-on-write fork, and a randomized model check."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from cache.kv import KVCacheManager, KVRequest, default_block_hash
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 4  # block size used throughout: small so sequences stay short


@dataclass
class Seq:
    """A minimal KVRequest: the token list is kept directly rather than split into prompt and output."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def make(num_blocks: int = 10, **kwargs: object) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, **kwargs)  # type: ignore[arg-type]


def prefill(kv: KVCacheManager, seq: Seq, num_tokens: int | None = None) -> list[int] | None:
    """Schedule a new request the way the scheduler does: prefix lookup, allocate, compute, register."""
    hit_ids, num_hit = kv.get_computed_blocks(seq)
    num_new = (seq.num_tokens if num_tokens is None else num_tokens) - num_hit
    new_ids = kv.allocate_slots(seq, num_new, hit_ids)
    if new_ids is None:
        return None
    seq.num_computed_tokens = num_hit + num_new
    kv.cache_full_blocks(seq)
    return new_ids


def decode(kv: KVCacheManager, seq: Seq, token: int) -> list[int] | None:
    """Compute the last (sampled) token, then sample ``token``."""
    new_ids = kv.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens)
    if new_ids is None:
        return None
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)
    seq.token_ids.append(token)
    return new_ids


def test_allocate_and_free_accounting() -> None:
    kv = make(10)
    seq = Seq("a", list(range(10)))
    assert kv.allocate_slots(seq, 10) == [0, 1, 2]
    assert seq.block_ids == [0, 1, 2]
    assert kv.num_free_blocks == 7 and kv.can_allocate(7) and not kv.can_allocate(8)
    seq.num_computed_tokens = 10
    assert kv.allocate_slots(seq, 2) == []  # 12 tokens still fit in 3 blocks
    assert kv.allocate_slots(seq, 3) == [3]
    kv.free(seq)
    assert seq.block_ids == [] and kv.num_free_blocks == 10 and kv.usage() == 0.0


def test_not_enough_blocks_returns_none_without_side_effects() -> None:
    kv = make(3)
    a = Seq("a", list(range(8)))
    assert prefill(kv, a) == [0, 1]
    b = Seq("b", list(range(100, 108)))
    assert kv.allocate_slots(b, 8) is None
    assert b.block_ids == [] and kv.num_free_blocks == 1 and kv.usage() == pytest.approx(2 / 3)
    # A hit on a's blocks plus new blocks that do not fit must not take the hit's references either.
    c = Seq("c", list(range(8)) + list(range(200, 212)))
    hit_ids, num_hit = kv.get_computed_blocks(c)
    assert (hit_ids, num_hit) == ([0, 1], 8)
    assert kv.allocate_slots(c, 12, hit_ids) is None
    assert c.block_ids == [] and kv.ref_count(0) == 1 and kv.ref_count(1) == 1
    assert kv.take_pending_copies() == []


def test_prefix_hit_of_two_blocks_computes_only_new_tokens() -> None:
    kv = make(10)
    a = Seq("a", list(range(10)))
    prefill(kv, a)
    kv.free(a)
    b = Seq("b", list(range(8)) + [99, 98, 97])
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert hit_ids == [0, 1] and num_hit == 8
    new_ids = kv.allocate_slots(b, b.num_tokens - num_hit, hit_ids)
    assert new_ids is not None and len(new_ids) == 1 and new_ids[0] not in (0, 1)
    assert b.block_ids == [0, 1, *new_ids]
    assert kv.ref_count(0) == 1 and kv.ref_count(1) == 1
    assert kv.stats.num_query_tokens == 21 and kv.stats.num_hit_tokens == 8
    assert kv.stats.hit_rate == pytest.approx(8 / 21)


def test_full_sequence_hit_leaves_last_token_to_compute() -> None:
    kv = make(10)
    a = Seq("a", list(range(8)))
    prefill(kv, a)
    b = Seq("b", list(range(8)))
    assert kv.get_computed_blocks(b) == ([0], 4)  # both blocks cached; the last is dropped
    c = Seq("c", list(range(9)))
    assert kv.get_computed_blocks(c) == ([0, 1], 8)  # one token past the blocks: all of them hit
    assert kv.get_computed_blocks(Seq("d", [])) == ([], 0)


def test_partial_blocks_are_not_cached() -> None:
    kv = make(10)
    a = Seq("a", list(range(7)))  # one full block, one partial
    prefill(kv, a)
    assert kv.get_computed_blocks(Seq("b", list(range(7)) + [50, 51])) == ([0], 4)


def test_cached_block_is_reused_after_free() -> None:
    kv = make(4)
    a = Seq("a", list(range(9)))
    prefill(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4 and kv.usage() == 0.0
    b = Seq("b", list(range(9)))
    prefill(kv, b)
    assert b.block_ids[:2] == [0, 1] and kv.stats.num_evictions == 0


def test_lru_eviction_order_and_stale_hash_removal() -> None:
    kv = make(4)
    a = Seq("a", list(range(9)))  # blocks 0, 1 full and cached; 2 partial
    prefill(kv, a)
    kv.free(a)  # freed in reverse: 2 goes back to the fresh pool, then 1, then 0 become evictable
    b = Seq("b", [50, 51, 52, 53, 54])
    assert prefill(kv, b) == [2, 3]  # fresh blocks first (2 was freed back to the fresh pool)
    assert kv.stats.num_evictions == 0
    c = Seq("c", list(range(100, 105)))
    assert prefill(kv, c) == [1, 0]  # then LRU: the tail (1) was freed first, so it goes first
    assert kv.stats.num_evictions == 2
    # Both old prefixes are gone from the hash map; the new content of blocks 1 and 0 is what hits now.
    assert kv.get_computed_blocks(Seq("d", list(range(9)))) == ([], 0)
    assert kv.get_computed_blocks(Seq("e", list(range(100, 105)))) == ([1], 4)


def test_touching_a_hit_moves_it_out_of_the_lru_list() -> None:
    kv = make(3)
    a = Seq("a", list(range(5)))
    prefill(kv, a)
    kv.free(a)  # block 0 evictable, 1 fresh again
    b = Seq("b", list(range(5)))
    prefill(kv, b)
    assert b.block_ids[0] == 0 and kv.num_free_blocks == 1
    c = Seq("c", list(range(100, 104)))
    assert prefill(kv, c) == [2]
    assert kv.allocate_slots(Seq("d", [1]), 1) is None  # block 0 is held by b, not evictable


def test_forced_hash_collision_never_returns_wrong_blocks() -> None:
    kv = make(10, hash_fn=lambda parent, tokens: 7)
    a = Seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefill(kv, a)
    # Same hash everywhere, different content: no hit.
    assert kv.get_computed_blocks(Seq("b", [9, 9, 9, 9, 9])) == ([], 0)
    # Same first block hits; the second block collides with the first block's entry but must not hit.
    assert kv.get_computed_blocks(Seq("c", [1, 2, 3, 4, 5, 6, 7, 8, 0])) == ([0], 4)
    # Content that collides is computed privately and never registered over the existing entry.
    d = Seq("d", [9, 9, 9, 9, 0])
    prefill(kv, d)
    assert kv.get_computed_blocks(Seq("e", [9, 9, 9, 9, 0])) == ([], 0)
    assert kv.get_computed_blocks(Seq("f", [1, 2, 3, 4, 0])) == ([0], 4)


def test_evicted_parent_orphans_its_children() -> None:
    # The hash ignores the parent, so only the parent-entry check can tell prefixes apart.
    kv = make(5, hash_fn=lambda parent, tokens: hash(tokens))
    a = Seq("a", [1, 1, 1, 1])
    b = Seq("b", [1, 1, 1, 1, 2, 2, 2, 2, 9])
    kv.allocate_slots(a, 4)  # block 0
    kv.allocate_slots(b, 9)  # blocks 1, 2, 3: computed alongside a, so no hit
    a.num_computed_tokens, b.num_computed_tokens = 4, 9
    kv.cache_full_blocks(a)  # block 0 cached as [1 1 1 1]
    kv.cache_full_blocks(b)  # block 1 duplicates it (stays private); block 2 cached with block 0's entry as parent
    kv.free(a)  # block 0 evictable while b still holds the child block 2
    kv.allocate_slots(Seq("filler", [0]), 1)  # takes the last fresh block
    c = Seq("c", [8, 8, 8, 8, 9])
    assert kv.allocate_slots(c, 4) == [0]  # evicts block 0 and reuses its id for new content
    c.num_computed_tokens = 4
    kv.cache_full_blocks(c)
    # Block 2's parent was block id 0, but not this content of block 0: no hit on it.
    assert kv.get_computed_blocks(Seq("d", [8, 8, 8, 8, 2, 2, 2, 2, 0])) == ([0], 4)
    assert kv.get_computed_blocks(Seq("e", [1, 1, 1, 1, 2, 2, 2, 2, 0])) == ([], 0)


def test_fork_shares_blocks_and_copies_on_write() -> None:
    kv = make(10)
    parent = Seq("p", list(range(6)))
    prefill(kv, parent)  # block 0 full, block 1 holds 2 tokens
    parent.token_ids.append(100)  # sampled, not computed
    child = Seq("c", list(range(6)) + [200])
    kv.fork(parent, child)
    assert child.block_ids == parent.block_ids == [0, 1]
    assert child.num_computed_tokens == 6
    assert kv.ref_count(0) == 2 and kv.ref_count(1) == 2
    assert kv.usage() == pytest.approx(0.2)

    assert decode(kv, child, 201) == []  # no block appended: the write lands in the shared partial block
    assert child.block_ids[0] == 0 and child.block_ids[1] not in (0, 1)
    assert kv.take_pending_copies() == [(1, child.block_ids[1])]
    assert kv.take_pending_copies() == []
    assert kv.ref_count(1) == 1 and kv.ref_count(child.block_ids[1]) == 1 and kv.ref_count(0) == 2
    assert kv.stats.num_cow_copies == 1

    assert decode(kv, parent, 101) == []  # the last holder writes in place
    assert parent.block_ids == [0, 1] and kv.take_pending_copies() == []
    # Both second blocks are now full and registered under their own content.
    decode(kv, child, 202)
    decode(kv, parent, 102)
    assert kv.get_computed_blocks(Seq("x", list(range(6)) + [200, 201, 0])) == ([0, child.block_ids[1]], 8)
    assert kv.get_computed_blocks(Seq("y", list(range(6)) + [100, 101, 0])) == ([0, 1], 8)
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 10


def test_cow_counts_against_free_blocks() -> None:
    kv = make(3)
    parent = Seq("p", list(range(6)))
    prefill(kv, parent)
    child = Seq("c", list(range(6)))
    kv.fork(parent, child)
    kv.allocate_slots(Seq("other", [0]), 1)  # the last free block
    assert kv.allocate_slots(child, 1) is None
    assert child.block_ids == [0, 1] and kv.ref_count(1) == 2 and kv.take_pending_copies() == []


def test_usage_numbers() -> None:
    kv = make(8)
    assert kv.usage() == 0.0
    a = Seq("a", list(range(8)))
    prefill(kv, a)
    assert kv.usage() == 0.25
    b = Seq("b", list(range(9)))
    prefill(kv, b)  # shares blocks 0 and 1, adds one for the 9th token
    assert kv.usage() == 0.375
    kv.free(a)
    kv.free(b)
    assert kv.usage() == 0.0 and kv.num_free_blocks == 8  # cached blocks still count as free


def test_reset_prefix_cache() -> None:
    kv = make(4)
    a = Seq("a", list(range(9)))
    prefill(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(Seq("b", list(range(9)))) == ([], 0)
    assert kv.num_free_blocks == 4


def test_prefix_caching_disabled() -> None:
    kv = make(4, enable_prefix_caching=False)
    a = Seq("a", list(range(9)))
    prefill(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(Seq("b", list(range(9)))) == ([], 0)


def test_engine_request_satisfies_protocol() -> None:
    kv = make(4)
    req: KVRequest = Request("r", list(range(6)), SamplingParams())
    assert prefill(kv, req) == [0, 1]  # type: ignore[arg-type]
    kv.free(req)
    assert req.block_ids == []


def _check_invariants(kv: KVCacheManager, live: list[Seq], device: dict[int, list[int | None]]) -> None:
    holders = [0] * kv.num_blocks
    for seq in live:
        assert len(set(seq.block_ids)) == len(seq.block_ids)
        for b in seq.block_ids:
            holders[b] += 1
    assert [kv.ref_count(b) for b in range(kv.num_blocks)] == holders
    fresh, evictable = set(kv._fresh), set(kv._evictable)
    assert len(fresh) == len(kv._fresh) and not fresh & evictable
    held = {b for b in range(kv.num_blocks) if holders[b]}
    assert not held & (fresh | evictable)
    assert len(held) + kv.num_free_blocks == kv.num_blocks
    assert evictable <= kv._cached.keys()
    for h, b in kv._hash_to_block.items():
        assert kv._cached[b].block_hash == h
    # The K/V each request reads back must be the K/V of its own tokens.
    for seq in live:
        for pos in range(seq.num_computed_tokens):
            assert device[seq.block_ids[pos // BS]][pos % BS] == seq.token_ids[pos]
    # Every block a prefix lookup returns holds exactly the looked-up tokens.
    for seq in live[:3]:
        hit_ids, num_hit = kv.get_computed_blocks(seq)
        assert num_hit < max(seq.num_tokens, 1)
        for pos in range(num_hit):
            assert device[hit_ids[pos // BS]][pos % BS] == seq.token_ids[pos]


@pytest.mark.parametrize(
    "hash_fn", [default_block_hash, lambda parent, tokens: hash(tokens) % 3], ids=["default", "colliding"]
)
def test_randomized_against_simulated_device(hash_fn: object) -> None:
    rng = random.Random(0)
    kv = make(24, hash_fn=hash_fn)
    device: dict[int, list[int | None]] = {b: [None] * BS for b in range(kv.num_blocks)}
    live: list[Seq] = []
    prefixes = [[rng.randrange(3) for _ in range(rng.randrange(1, 12))] for _ in range(4)]

    def run(seq: Seq, num_new: int, hit_ids: list[int] | None = None) -> bool:
        start = len(hit_ids) * BS if hit_ids else seq.num_computed_tokens
        if kv.allocate_slots(seq, num_new, hit_ids) is None:
            return False
        for src, dst in kv.take_pending_copies():
            device[dst] = list(device[src])
        for pos in range(start, start + num_new):  # the model writes K/V of the new tokens
            device[seq.block_ids[pos // BS]][pos % BS] = seq.token_ids[pos]
        seq.num_computed_tokens = start + num_new
        kv.cache_full_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(rng.randrange(3))  # sample
        return True

    for step in range(1500):
        op = rng.random()
        if op < 0.3 or not live:
            tokens = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randrange(0, 10))]
            seq = Seq(f"r{step}", tokens)
            hit_ids, num_hit = kv.get_computed_blocks(seq)
            num_new = rng.randrange(1, seq.num_tokens - num_hit + 1)  # chunked prefill
            if run(seq, num_new, hit_ids):
                live.append(seq)
            else:
                assert seq.block_ids == []
        elif op < 0.7:
            seq = rng.choice(live)
            run(seq, rng.randrange(1, seq.num_tokens - seq.num_computed_tokens + 1))
        elif op < 0.8:
            parent = rng.choice(live)
            if parent.num_computed_tokens == parent.num_tokens - 1:
                child = Seq(f"f{step}", parent.token_ids[:-1] + [rng.randrange(3)])
                kv.fork(parent, child)
                live.append(child)
        else:
            seq = live.pop(rng.randrange(len(live)))
            kv.free(seq)
        _check_invariants(kv, live, device)
    for seq in live:
        kv.free(seq)
    assert kv.num_free_blocks == kv.num_blocks and kv.usage() == 0.0
    assert kv.stats.num_hit_tokens > 0 and kv.stats.num_cow_copies > 0 and kv.stats.num_evictions > 0
