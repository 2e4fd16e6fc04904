"""``loadtest.decode_step_trace`` on a hand-made trace of three tasks run by two programs."""

from __future__ import annotations

import pytest

from kernels.int4_decode_step import ATTN, QKV
from loadtest.decode_step_trace import lines, summarize

ROWS = [(QKV, 0, 0, 0, 0, 0), (QKV, 0, 1, 0, 0, 0), (ATTN, 0, 0, 0, 2, 1)]
TRACE = [  # top, claimed, ready, end (ns); program << 16 | SM
    [1000, 1100, 1100, 2100, 0 << 16 | 3],
    [1000, 1200, 1200, 2600, 1 << 16 | 4],
    [2100, 2200, 2600, 3000, 0 << 16 | 3],  # program 0's second task waits 400 ns for the first two
]


def test_shares_kinds_and_phases() -> None:
    got = summarize(TRACE, ROWS, grid=2, layer_bytes={QKV: 3000})
    assert got["span_us"] == 2.0 and (got["programs"], got["sms"]) == (2, 2)
    assert got["packed_us"] == pytest.approx(1.4)  # 2.8 us of work on 2 programs
    # of 2 programs x 2 us: claims 400 ns, waits 400, work 2800, program 1 idle after its task 400
    assert got["share"] == pytest.approx({"claim": 0.1, "wait": 0.1, "work": 0.7, "outside": 0.1})
    qkv, attn = got["kinds"]["qkv"], got["kinds"]["attn"]
    assert (qkv["tasks"], qkv["wait_us_median"], qkv["work_us_median"]) == (2, 0.0, 1.2)
    assert qkv["phase_us_mean"] == 1.5 and qkv["phase_gb_s"] == pytest.approx(2.0)  # 3000 bytes in 1.5 us
    assert (attn["wait_us_median"], attn["phase_us_mean"]) == (0.4, 0.4) and "phase_gb_s" not in attn
    # attn's wait ended as the second qkv task released (2600 ns); qkv waited for nothing
    assert attn["handoff_us_median"] == 0.0 and qkv["handoff_us_median"] is None
    text = lines(got)
    assert text[0] == "span 2.0 us (1.4 packed), 2 programs on 2 SMs: claim 10% wait 10% work 70% outside 10%"
    assert text[1].split()[:2] == ["qkv", "2"] and text[1].endswith("phase   1.50 us = 2 GB/s")
    assert "handoff  0.00 us" in text[2] and "handoff" not in text[1]


def test_a_handoff_counts_from_the_release_that_completed_the_wait() -> None:
    """Two producers release at 2100 and 2600 ns; a consumer waiting for both ends its wait at 3100 (500 ns after
    the second), one waiting for the first only at 2400 (300 after it); one that never waited has no handoff."""
    rows = [
        (QKV, 0, 0, 0, 0, 0),
        (QKV, 0, 1, 0, 0, 1),
        (ATTN, 0, 0, 0, 1, 2),  # waits for slot 0 (the first producer)
        (ATTN, 0, 1, 1, 1, 2),  # waits for slot 1 (the second)
        (ATTN, 0, 2, 0, 1, 2),  # claimed after slot 0 was full: no wait
    ]
    trace = [
        [1000, 1100, 1100, 2100, 0 << 16],
        [1000, 1100, 1100, 2600, 1 << 16],
        [1500, 1600, 2400, 2900, 2 << 16],
        [1500, 1600, 3100, 3500, 3 << 16],
        [2900, 3000, 3000, 3400, 2 << 16],
    ]
    attn = summarize(trace, rows, grid=4)["kinds"]["attn"]
    assert attn["handoff_us_median"] == pytest.approx(0.4)  # median of 0.3 and 0.5
