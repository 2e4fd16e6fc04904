"""``loadtest.sass_census``: its count of a SASS listing (registers, the innermost loop's body) on a made-up listing,
and on real sm_90 compiles (Triton's wheel ptxas, no GPU) the two claims it backs in docs/benchmarks.md: x loaded
as int32 pairs shortens the default tile's K loop, and a 512-column stream tile spends fewer instructions a weight
than a 256-column one."""

from __future__ import annotations

import json

import pytest

from loadtest.sass_census import count
from tests.kernels.helpers import run_without_interpreter

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   FFMA R2, R3, R4, R2 ;
        /*0030*/                   LOP3.LUT R5, R6, 0xf, RZ, 0xc0, !PT ;
        /*0040*/               @P0 BRA 0x20 ;
        /*0050*/                   IADD3 R7, R7, 0x1, RZ ;
        /*0060*/               @P1 BRA 0x0 ;
        /*0070*/                   EXIT ;
        /*0080*/                   BRA 0x80;
"""


def test_count_takes_the_shortest_backward_branch() -> None:
    c = count("ptxas info    : Used 40 registers, 380 bytes cmem[0]", LISTING, weights=2)
    assert (c.registers, c.instructions, c.loop) == (40, 9, 3)  # 0x20..0x40; the BRA to itself is no loop
    assert c.row()["per_weight"] == 1.5


def test_count_refuses_a_listing_without_a_loop() -> None:
    with pytest.raises(ValueError, match="no loop"):
        count("Used 8 registers", "        /*0000*/                   EXIT ;\n", weights=1)


_RUN = "import sys; from loadtest.sass_census import main; main(sys.argv[1:])"


def test_the_sm90_claims() -> None:
    out = run_without_interpreter(_RUN, "--only", "split", "split_xw", "stream_xw", "stream_xw_bn512")
    rows = {r["variant"]: r for r in map(json.loads, out.splitlines())}
    assert 300 < rows["split"]["loop"] < 2000 and rows["split"]["weights"] == 128
    assert rows["split_xw"]["per_weight"] < rows["split"]["per_weight"]
    assert rows["stream_xw_bn512"]["per_weight"] < rows["stream_xw"]["per_weight"]
