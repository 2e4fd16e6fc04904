"""SwapKVCacheManager: the device and host pools together. No model, no torch: the copies are simulated on lists."""

from __future__ import annotations

import random

import pytest

from cache.swap import SwapKVCacheManager, SwapPlan
from tests.cache.test_kv import BS, Seq, decode, prefill


def make(num_blocks: int = 10, num_cpu_blocks: int = 10, **kwargs: object) -> SwapKVCacheManager:
    return SwapKVCacheManager(num_blocks, BS, num_cpu_blocks, **kwargs)  # type: ignore[arg-type]


class Memory:
    """Both pools' contents: per block, the token each slot holds (None = never written)."""

    def __init__(self, kv: SwapKVCacheManager) -> None:
        self.device: list[list[int | None]] = [[None] * BS for _ in range(kv.num_blocks)]
        self.host: list[list[int | None]] = [[None] * BS for _ in range(kv.host.num_blocks)]

    def run(self, kv: SwapKVCacheManager) -> SwapPlan:
        """What the model runner does before a forward pass, in its order."""
        plan = kv.take_swaps()
        for dev, host in plan.swap_out:
            self.host[host] = list(self.device[dev])
        for host, dev in plan.swap_in:
            self.device[dev] = list(self.host[host])
        for src, dst in kv.take_pending_copies():
            self.device[dst] = list(self.device[src])
        return plan

    def write(self, seq: Seq, start: int, end: int) -> None:
        for pos in range(start, end):
            self.device[seq.block_ids[pos // BS]][pos % BS] = seq.token_ids[pos]

    def check(self, seq: Seq) -> None:
        for pos in range(seq.num_computed_tokens):
            assert self.device[seq.block_ids[pos // BS]][pos % BS] == seq.token_ids[pos], (seq.request_id, pos)


def test_swap_out_and_in_round_trip() -> None:
    kv = make(6, 6)
    mem = Memory(kv)
    a = Seq("a", list(range(10)))
    prefill(kv, a)
    mem.run(kv)
    mem.write(a, 0, 10)
    assert kv.swap_out(a)
    assert a.block_ids == [] and a.num_computed_tokens == 10 and kv.is_swapped(a)
    assert kv.num_free_blocks == 6 and kv.host_usage() == pytest.approx(3 / 6)
    plan = mem.run(kv)
    assert [d for d, _ in plan.swap_out] == [0, 1, 2] and plan.swap_in == []
    # Overwrite a's partial block (freed to the fresh pool): its content must come back from the host.
    b = Seq("b", list(range(100, 112)))
    prefill(kv, b)
    assert 2 in b.block_ids
    mem.run(kv)
    mem.write(b, 0, 12)
    kv.free(b)
    kv.reset_prefix_cache()  # refused: a is swapped
    assert kv.can_swap_in(a, 1)
    kv.swap_in(a)
    assert not kv.is_swapped(a) and kv.host_usage() == pytest.approx(1 / 6)  # read this step: free after it
    plan = mem.run(kv)
    assert kv.host_usage() == 0.0
    assert len(plan.swap_in) == 1  # the two full blocks were still cached on the device: no copy
    assert kv.swap_stats.num_blocks_swapped_in == 1 and kv.swap_stats.num_blocks_deduplicated == 2
    mem.check(a)
    assert decode(kv, a, 5) == []
    kv.free(a)
    assert kv.num_free_blocks == 6 and kv.host.num_free == 6


def test_shared_blocks_are_swapped_once_and_ref_counts_hold() -> None:
    kv = make(10, 10)
    mem = Memory(kv)
    parent = Seq("p", list(range(6)))  # block 0 full, block 1 holds 2 tokens
    prefill(kv, parent)
    mem.run(kv)
    mem.write(parent, 0, 6)
    children = [Seq(f"c{i}", list(range(6)) + [200 + i]) for i in range(2)]
    for child in children:
        kv.fork(parent, child)
    parent.token_ids.append(100)
    assert [kv.ref_count(b) for b in parent.block_ids] == [3, 3]
    for seq in (parent, *children):  # all three preempted in one step
        assert kv.swap_out(seq)
    plan = mem.run(kv)
    assert len(plan.swap_out) == 2  # two device blocks, one host copy each
    assert kv.num_free_blocks == 10
    tables = [kv.host_block_ids(s) for s in (parent, *children)]
    assert tables[0] == tables[1] == tables[2]
    assert [kv.host.ref_counts[h] for h in tables[0]] == [3, 3]
    # Back in one step: one device copy of each host block, shared again by all three.
    for seq in (parent, *children):
        assert kv.can_swap_in(seq, 1)
        kv.swap_in(seq)
    plan = mem.run(kv)
    assert len(plan.swap_in) <= 2
    assert parent.block_ids == children[0].block_ids == children[1].block_ids
    assert [kv.ref_count(b) for b in parent.block_ids] == [3, 3]
    assert all(kv.host.ref_counts[h] == 0 for h in tables[0])
    # Each decodes into the shared partial block: copy-on-write, as before the swap.
    for seq, token in zip((parent, *children), (101, 201, 202), strict=True):
        decode(kv, seq, token)
        mem.run(kv)
        mem.write(seq, 6, 7)
    for seq in (parent, *children):
        mem.check(seq)
    assert len({s.block_ids[1] for s in (parent, *children)}) == 3
    for seq in (parent, *children):
        kv.free(seq)
    assert kv.num_free_blocks == 10 and kv.host.num_free == 10


def test_a_shared_block_swapped_at_different_steps_keeps_one_host_copy() -> None:
    kv = make(10, 10)
    mem = Memory(kv)
    a = Seq("a", list(range(9)))
    prefill(kv, a)
    mem.run(kv)
    mem.write(a, 0, 9)
    b = Seq("b", list(range(8)) + [50, 51])
    prefill(kv, b)  # hits a's two full blocks
    mem.run(kv)
    mem.write(b, 8, 10)
    assert kv.swap_out(a)
    assert len(mem.run(kv).swap_out) == 3
    assert kv.num_blocks_to_swap_out(b) == 1  # the two shared full blocks are on the host already
    assert kv.swap_out(b)
    assert len(mem.run(kv).swap_out) == 1
    shared = kv.host_block_ids(a)[:2]
    assert kv.host_block_ids(b)[:2] == shared and [kv.host.ref_counts[h] for h in shared] == [2, 2]
    kv.free(a)
    assert [kv.host.ref_counts[h] for h in shared] == [1, 1]
    kv.free(b)
    assert kv.host.num_free == 10 and kv.host_usage() == 0.0


def test_host_pool_full_refuses_without_side_effects() -> None:
    kv = make(10, 2)
    a = Seq("a", list(range(10)))  # 3 blocks computed: more than the host holds
    prefill(kv, a)
    blocks = list(a.block_ids)
    assert not kv.can_swap_out(a) and not kv.swap_out(a)
    assert a.block_ids == blocks and not kv.is_swapped(a) and kv.host.num_free == 2
    assert kv.take_swaps().swap_out == []
    small = Seq("s", list(range(50, 55)))
    prefill(kv, small)
    assert kv.swap_out(small) and kv.host.num_free == 0
    assert not kv.can_swap_out(Seq("none", []))  # nothing computed: nothing to keep


def test_prefix_hit_on_a_swapped_block_copies_it_back() -> None:
    kv = make(4, 8)
    mem = Memory(kv)
    a = Seq("a", list(range(9)))  # two full blocks, registered
    prefill(kv, a)
    mem.run(kv)
    mem.write(a, 0, 9)
    assert kv.swap_out(a)
    mem.run(kv)
    kv.free(a)  # finished while swapped: its host blocks stay cached
    filler = Seq("f", list(range(100, 116)))  # takes all 4 device blocks: a's device copies are evicted
    prefill(kv, filler)
    mem.run(kv)
    mem.write(filler, 0, 16)
    kv.free(filler)
    assert kv.stats.num_evictions >= 2
    b = Seq("b", list(range(8)) + [70])
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and len(hit_ids) == 2
    assert kv.swap_stats.num_host_hit_blocks == 2
    assert kv.allocate_slots(b, 1, hit_ids) is not None
    b.num_computed_tokens = 9
    plan = mem.run(kv)
    assert sorted(d for _, d in plan.swap_in) == sorted(hit_ids)
    mem.write(b, 8, 9)
    mem.check(b)
    # Now cached on the device again: a second lookup hits there, copying nothing.
    kv.free(b)
    assert kv.get_computed_blocks(Seq("c", list(range(8)) + [71])) == (hit_ids, 8)
    assert kv.take_swaps().swap_in == []


def test_host_hit_never_evicts_an_earlier_hit_of_the_same_lookup() -> None:
    kv = make(2, 8)
    a = Seq("a", list(range(8)))
    prefill(kv, a)  # two full blocks, registered
    assert kv.swap_out(a)
    kv.take_swaps()
    kv.free(a)  # device blocks 0 and 1 cached and evictable (1 first), host copies cached too
    assert kv.allocate_slots(Seq("x", [5]), 1) == [1]  # evicts block 1
    hit_ids, num_hit = kv.get_computed_blocks(Seq("b", list(range(8)) + [1]))
    # Block 1's content is on the host, but the only spare device block is block 0, this lookup's first hit.
    assert hit_ids == [0] and num_hit == 4 and kv.take_swaps().swap_in == []


def test_a_host_block_read_this_step_is_not_overwritten_by_a_swap_out_of_the_same_step() -> None:
    kv = make(10, 3)
    mem = Memory(kv)
    a = Seq("a", list(range(6)))  # block 0 full (cached), block 1 partial (not cached)
    w = Seq("w", list(range(50, 58)))
    for seq in (a, w):
        prefill(kv, seq)
        mem.run(kv)
        mem.write(seq, 0, seq.num_tokens)
    assert kv.swap_out(a)
    mem.run(kv)
    kv.swap_in(a)  # block 0 is still cached on the device; block 1 is copied back this step
    (read,) = [h for h, _ in kv._plan.swap_in]
    assert kv.swap_out(w)  # same step: takes the fresh host block and evicts a's cached one, never `read`
    assert read not in kv.host_block_ids(w)
    mem.run(kv)
    mem.check(a)
    assert kv.host.num_free == 1  # `read` is free again after the step


def test_swap_out_of_a_block_copied_on_write_this_step_reads_its_source() -> None:
    kv = make(10, 10)
    mem = Memory(kv)
    parent = Seq("p", list(range(6)))
    prefill(kv, parent)
    mem.run(kv)
    mem.write(parent, 0, 6)
    child = Seq("c", list(range(6)) + [200])
    kv.fork(parent, child)
    kv.allocate_slots(child, 1)  # copy-on-write of block 1, not run yet
    assert kv.swap_out(child)  # preempted in the same step
    plan = mem.run(kv)
    assert (1, kv.host_block_ids(child)[1]) in plan.swap_out
    assert mem.host[kv.host_block_ids(child)[1]][:2] == [4, 5]


@pytest.mark.parametrize("num_cpu_blocks", [6, 40])
def test_randomized_two_pools_against_simulated_memory(num_cpu_blocks: int) -> None:
    rng = random.Random(num_cpu_blocks)
    kv = make(16, num_cpu_blocks)
    mem = Memory(kv)
    live: list[Seq] = []
    swapped: list[Seq] = []
    prefixes = [[rng.randrange(3) for _ in range(rng.randrange(1, 12))] for _ in range(3)]

    def step(seq: Seq, num_new: int, hit_ids: list[int] | None = None) -> bool:
        start = len(hit_ids) * BS if hit_ids else seq.num_computed_tokens
        if kv.allocate_slots(seq, num_new, hit_ids) is None:
            return False
        mem.run(kv)
        mem.write(seq, start, start + num_new)
        seq.num_computed_tokens = start + num_new
        kv.cache_full_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(rng.randrange(3))
        return True

    for i in range(1500):
        op = rng.random()
        if op < 0.25 or not live:
            seq = Seq(f"r{i}", rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randrange(0, 10))])
            hit_ids, num_hit = kv.get_computed_blocks(seq)
            if step(seq, rng.randrange(1, seq.num_tokens - num_hit + 1), hit_ids):
                live.append(seq)
            else:
                mem.run(kv)  # a failed admission may have copied host hits in: they run with the step
        elif op < 0.55:
            seq = rng.choice(live)
            step(seq, rng.randrange(1, seq.num_tokens - seq.num_computed_tokens + 1))
        elif op < 0.65:
            parent = rng.choice(live)
            if parent.num_computed_tokens == parent.num_tokens - 1:
                child = Seq(f"f{i}", parent.token_ids[:-1] + [rng.randrange(3)])
                kv.fork(parent, child)
                live.append(child)
        elif op < 0.8:
            seq = rng.choice(live)
            if kv.swap_out(seq):
                live.remove(seq)
                swapped.append(seq)
                if rng.random() < 0.5:
                    mem.run(kv)
        elif op < 0.92 and swapped:
            seq = rng.choice(swapped)
            if kv.can_swap_in(seq, 1):
                kv.swap_in(seq)
                swapped.remove(seq)
                live.append(seq)
                if rng.random() < 0.5:  # else a swap-out may follow in the same step
                    mem.run(kv)
        else:
            pool = live if (rng.random() < 0.7 or not swapped) else swapped
            seq = pool.pop(rng.randrange(len(pool)))
            kv.free(seq)
            mem.run(kv)
        if i % 3 == 0:
            mem.run(kv)
            for seq in live:
                mem.check(seq)
            holders = [0] * kv.num_blocks
            for seq in live:
                for b in seq.block_ids:
                    holders[b] += 1
            assert [kv.ref_count(b) for b in range(kv.num_blocks)] == holders
            host_holders = [0] * kv.host.num_blocks
            for seq in swapped:
                for h in kv.host_block_ids(seq):
                    host_holders[h] += 1
            assert kv.host.ref_counts == host_holders
    assert kv.swap_stats.num_blocks_swapped_out > 0 and kv.swap_stats.num_blocks_swapped_in > 0
    assert kv.swap_stats.num_blocks_deduplicated > 0
    assert kv.swap_stats.num_host_hit_blocks > 0 or num_cpu_blocks < 10  # a small host pool rarely keeps one
    for seq in live + swapped:
        kv.free(seq)
    assert kv.num_free_blocks == kv.num_blocks and kv.host.num_free == kv.host.num_blocks
