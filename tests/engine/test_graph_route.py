"""Which decode graph a batch replays (``engine.cuda_graphs.route_batches``): the fastest that fits, when it is
clearly faster than the smallest that fits. The GPU side (the route honored, the same tokens) is in test_gpu.py."""

from __future__ import annotations

from engine.cuda_graphs import batch_size_ladder, route_batches


def test_equal_times_keep_the_smallest_graph() -> None:
    sizes = batch_size_ladder(64)
    assert route_batches({s: 1.0 for s in sizes}) == {s: s for s in sizes}


def test_a_slow_size_replays_the_fastest_larger_one() -> None:
    # the H200's shape of the problem: 448 slow, 464 and 512 faster, 432 fastest of all from 400 up
    times = {384: 7.7, 400: 9.7, 416: 9.4, 432: 8.8, 448: 13.4, 464: 9.7, 480: 10.2, 496: 9.8, 512: 9.8}
    route = route_batches(times)
    assert route == {384: 384, 400: 432, 416: 432, 432: 432, 448: 464, 464: 464, 480: 496, 496: 496, 512: 512}


def test_gains_inside_the_margin_do_not_move_a_batch() -> None:
    times = {16: 4.00, 32: 3.95, 48: 3.90}  # 2.5 % at most: noise, not a slow kernel
    assert route_batches(times, margin=0.03) == {16: 16, 32: 32, 48: 48}
    assert route_batches(times, margin=0.0) == {16: 48, 32: 48, 48: 48}


def test_ties_go_to_the_smaller_graph() -> None:
    assert route_batches({8: 5.0, 16: 4.0, 32: 4.0}) == {8: 16, 16: 16, 32: 32}
