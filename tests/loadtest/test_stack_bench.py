"""``pagedserve bench stack`` on CPU with the default model: the engine reference and the real stack
(``pagedserve serve``: private redis-server, API, worker) both run every level to the last token, and a
request that cannot be served is reported with its reason instead of being dropped."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from deploy.redis_server import free_port
from loadtest.stack_bench import main
from loadtest.stack_stats import gaps_after_ramp, relay_numbers
from loadtest.stream_client import ChunkedBody, Record, SSEReader, StreamJob, finish_record, stream_one

LEVELS = [1, 4]
WAVES = {1: 2, 4: 1}  # with --min-requests 2
OUTPUT_LEN = 8


def test_stack_bench_engine_and_stack_side_by_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # engine, worker, API and client share two cores
    out = tmp_path / "stack.json"
    argv = ["--device", "cpu", "--cpu-kv-cache-gib", "0.25", "--concurrency", *map(str, LEVELS)]
    argv += ["--output-len", str(OUTPUT_LEN), "--client-procs", "1", "--commit", "test", "--out", str(out)]
    argv += ["--min-requests", "2", "--engine-again"]  # concurrency 1 runs two waves, 4 one; the engine twice
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["commit"] == "test" and res["stack"]["exit_status"] == 0, res["stack"]
    assert res["stack"]["ready"]["model"] == "SmolLM2-135M-Instruct"
    for side in ("engine", "stack"):
        levels = res[side]["levels"]
        assert [lv["concurrency"] for lv in levels] == LEVELS
        for lv in levels:
            assert lv["failed"] == 0 and lv["failures"] == [], lv["failures"]
            requests = lv["concurrency"] * WAVES[lv["concurrency"]]
            assert lv["ok"] == lv["requests"] == requests and lv["output_tokens"] == requests * OUTPUT_LEN
            assert len(lv["wave_tok_s"]) == WAVES[lv["concurrency"]]
            assert lv["output_tok_s"] == pytest.approx(lv["output_tokens"] / lv["wall_s"], rel=0.02)
            assert 0 < lv["ttft_p50_ms"] <= lv["wall_s"] * 1e3 and lv["tpot_p50_ms"] > 0 and lv["itl_p99_ms"] > 0
    assert [lv["concurrency"] for lv in res["engine_again"]["levels"]] == LEVELS  # the reference after the stack
    for e in res["engine"]["levels"] + res["engine_again"]["levels"]:  # the engine sees every token one step apart
        assert e["arrivals_per_request"] == OUTPUT_LEN and e["mean_step_ms"] > 0 and e["decode_step_p50_ms"] > 0
    for row, e, s in zip(res["levels"], res["engine"]["levels"], res["stack"]["levels"], strict=True):
        assert row["concurrency"] == e["concurrency"]
        rate = lambda side: side["output_tokens"] / side["wall_s"]  # noqa: E731
        assert row["tok_s_ratio"] == pytest.approx(rate(s) / rate(e), abs=1e-3)
        assert row["stack_itl_p99_over_step"] == pytest.approx(s["itl_p99_ms"] / e["mean_step_ms"], abs=1e-3)
        assert row["engine_failed"] == row["stack_failed"] == 0
        if WAVES[row["concurrency"]] > 1:  # the level's ratio (a ratio of sums) lies between its waves' ratios
            assert row["wave_ratio_min"] - 1e-3 <= row["tok_s_ratio"] <= row["wave_ratio_max"] + 1e-3, row
        else:
            assert row["wave_ratio_min"] is None and row["wave_ratio_max"] is None
    assert Path(res["stack"]["log"]).is_file()
    for s in res["stack"]["levels"]:  # the front's pump trace (PAGEDSERVE_PUMP_TRACE) covers every wave
        assert len(s["front"]) == WAVES[s["concurrency"]]
        for hop in s["front"]:
            assert hop["pumps"] > 0 and hop["steps"] >= hop["pumps"] and hop["max_steps_per_pump"] >= 1
            assert 0 <= hop["core_to_front_p50_ms"] <= hop["core_to_front_p99_ms"] < 1e4
            assert 0 < hop["front_p50_ms"] <= hop["front_p99_ms"] < 1e4
    for s in res["stack"]["levels"]:  # the API's relay stamps (PAGEDSERVE_SSE_TIMES) came with every token
        assert s["relay_to_client_p50_ms"] is not None and s["relay_to_client_p50_ms"] >= 0
        assert s["itl_p99_relay_in_ms"] is not None and s["itl_p99_relay_out_ms"] is not None
    for s in res["stack"]["levels"]:  # the host probes: some process was busy, Redis' monitor was read
        assert s["host_cpu"] and all("% of a core" in line for line in s["host_cpu"]), s["host_cpu"]
        assert set(s["redis_latency"]) >= {"events", "slow_commands", "aof_delayed_fsync", "latest_fork_ms"}


def test_relay_stamps_are_read_per_token_and_split_the_gaps() -> None:
    sse = SSEReader()
    chunk = b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n\n'
    sse.feed(b": t 10.0 10.5\n" + chunk, 11.0)
    sse.feed(b": t 12.0 12.25\n" + chunk + chunk, 13.0)  # one write, two tokens
    assert sse.times_s == [11.0, 13.0, 13.0] and sse.relay_s == [(10.0, 10.5), (12.0, 12.25), (12.0, 12.25)]
    rec = Record(0, 0, start_s=10.0, num_tokens=3)
    rec.relay_s = sse.relay_s
    finish_record(rec, sse.times_s, 3)
    nums = relay_numbers([rec])
    assert nums["itl_p99_relay_in_ms"] == 2000.0 and nums["itl_p99_relay_out_ms"] == 1750.0
    assert nums["relay_to_client_p50_ms"] == 750.0 and nums["relay_to_client_p99_ms"] == 750.0


def test_a_failed_stream_is_reported_with_its_reason() -> None:
    async def refused() -> str | None:
        base_url = f"http://127.0.0.1:{free_port()}"  # nothing listens
        rec = await stream_one(base_url, StreamJob(0, 3, {"prompt": [1, 2], "max_tokens": OUTPUT_LEN}))
        assert (rec.wave, rec.index, rec.num_tokens, rec.ttft_s) == (0, 3, 0, None)
        return rec.reason

    assert (asyncio.run(refused()) or "").startswith("ConnectionRefusedError")


def test_chunked_body_decodes_chunks_split_anywhere() -> None:
    """The client's chunked decoding: the payload comes out whole however the bytes are cut on the wire."""
    wire = b"5\r\nhello\r\n1a;ext=1\r\n" + b"x" * 26 + b"\r\n0\r\n\r\n"
    for cut in range(1, len(wire)):
        body = ChunkedBody()
        got = body.feed(wire[:cut]) + body.feed(wire[cut:])
        assert got == b"hello" + b"x" * 26 and body.done


def test_sse_reader_times_token_chunks_and_reads_usage() -> None:
    """A delta counts, also with "" (a token whose text is held back); a last chunk only with text."""
    sse = SSEReader()
    events = [
        {"choices": [{"text": "a", "finish_reason": None}]},
        {"choices": [{"text": "", "finish_reason": None}]},
        {"choices": [{"text": "", "finish_reason": "length"}]},
        {"choices": [], "usage": {"completion_tokens": 2}},
    ]
    wire = b"".join(b"data: " + json.dumps(e).encode() + b"\r\n\r\n" for e in events) + b"data: [DONE]\r\n\r\n"
    sse.feed(wire[:17], 1.0)
    sse.feed(wire[17:], 2.0)
    assert sse.times_s == [2.0, 2.0] and sse.num_tokens == 2 and sse.reason() is None


def test_gaps_after_ramp_keep_only_gaps_ending_after_the_waves_last_first_token() -> None:
    """Wave 0: the second request's first token comes at 2.0; only gaps ending after it count. Wave 1 has its
    own ramp, and a request without a token adds nothing."""
    early = Record(0, 0, start_s=0.0, ttft_s=1.0, gaps_s=[0.5, 0.5, 0.5])  # tokens at 1.0, 1.5, 2.0, 2.5
    late = Record(0, 1, start_s=1.0, ttft_s=1.0, gaps_s=[0.25])  # tokens at 2.0, 2.25
    other = Record(1, 0, start_s=10.0, ttft_s=0.5, gaps_s=[0.1, 0.2])
    assert gaps_after_ramp([early, late, other, Record(1, 1, reason="x")]) == [0.5, 0.25, 0.1, 0.2]
