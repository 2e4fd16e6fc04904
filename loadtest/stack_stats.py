"""The numbers of ``pagedserve bench stack`` (``loadtest.stack_bench``): one side's summary per level, the
worker's own start-time means scraped from its metrics, the side-by-side rows and their table."""

from __future__ import annotations

import math
import statistics
from typing import Any

import httpx

from loadtest.stream_client import Record


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[max(0, math.ceil(q * len(values)) - 1)]  # nearest rank


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 3)


def gaps_after_ramp(records: list[Record]) -> list[float]:
    """The gaps that end after every request of their wave had its first token: ITL without the admission
    ramp (requests still arriving add prefill work to the steps), to tell ramp stalls from steady ones."""
    ramp_end: dict[int, float] = {}
    for r in records:
        if r.ttft_s is not None:
            ramp_end[r.wave] = max(ramp_end.get(r.wave, 0.0), r.start_s + r.ttft_s)
    out = []
    for r in records:
        if r.ttft_s is None:
            continue
        t = r.start_s + r.ttft_s
        for gap in r.gaps_s:
            t += gap
            if t > ramp_end[r.wave]:
                out.append(gap)
    return out


def relay_numbers(records: list[Record]) -> dict[str, float | None]:
    """Where the stack's gaps arise, from the API's stamps (``relay_s``): the p99 of the gaps between the relay's
    receipts of a stream's tokens (front, Redis and pub/sub before it), between its writes (plus the API's own
    scheduling), and the time from a write to the client's read (socket and client)."""
    received, written, to_client = [], [], []
    for r in records:
        if not r.relay_s or r.ttft_s is None or len(r.relay_s) != len(r.gaps_s) + 1:
            continue
        arrival = r.start_s + r.ttft_s
        for i, (pushed, wrote) in enumerate(r.relay_s):
            if i:
                arrival += r.gaps_s[i - 1]
                received.append(pushed - r.relay_s[i - 1][0])
                written.append(wrote - r.relay_s[i - 1][1])
            to_client.append(arrival - wrote)
    return {
        "itl_p99_relay_in_ms": _ms(_pct(received, 0.99)),
        "itl_p99_relay_out_ms": _ms(_pct(written, 0.99)),
        "relay_to_client_p50_ms": _ms(_pct(to_client, 0.5)),
        "relay_to_client_p99_ms": _ms(_pct(to_client, 0.99)),
    }


def summarize(level: int, records: list[Record], walls_s: list[float]) -> dict[str, Any]:
    """One side's numbers at one level; failed requests listed with their reason."""
    ok = [r for r in records if r.reason is None]
    gaps = [g for r in ok for g in r.gaps_s]
    wall_s = sum(walls_s)
    wave_tokens = [0] * len(walls_s)  # record.wave counts the level's waves from 0, in the order of walls_s
    for r in ok:
        wave_tokens[r.wave] += r.num_tokens
    return {
        "concurrency": level,
        "requests": len(records),
        "ok": len(ok),
        "failed": len(records) - len(ok),
        "wall_s": round(wall_s, 4),
        "output_tokens": sum(r.num_tokens for r in ok),
        "output_tok_s": round(sum(r.num_tokens for r in ok) / wall_s, 1) if wall_s > 0 else 0.0,
        "wave_tok_s": [round(n / w, 1) if w > 0 else 0.0 for n, w in zip(wave_tokens, walls_s, strict=True)],
        "wave_tokens": wave_tokens,
        "wave_wall_s": [round(w, 4) for w in walls_s],
        "ttft_p50_ms": _ms(_pct([r.ttft_s for r in ok if r.ttft_s is not None], 0.5)),
        "ttft_p99_ms": _ms(_pct([r.ttft_s for r in ok if r.ttft_s is not None], 0.99)),
        "tpot_p50_ms": _ms(_pct([r.tpot_s for r in ok if r.tpot_s is not None], 0.5)),
        "itl_p50_ms": _ms(_pct(gaps, 0.5)),
        "itl_p99_ms": _ms(_pct(gaps, 0.99)),
        "itl_p99_after_ramp_ms": _ms(_pct(gaps_after_ramp(ok), 0.99)),
        "arrivals_per_request": round(statistics.fmean(len(r.gaps_s) + 1 for r in ok), 2) if ok else None,
        "failures": [{"wave": r.wave, "index": r.index, "reason": r.reason} for r in records if r.reason],
    } | relay_numbers(ok)


# ---- the engine alone (run in a subprocess: python -m loadtest.stack_bench --engine-only ...) ----------------
# the worker's own view of a request's start (its --metrics-port): enqueue -> taken, enqueue -> first token
_WORKER_TIMES = {
    "worker_queue_mean_ms": "pagedserve:worker_queue_time_seconds",
    "worker_ttft_mean_ms": "pagedserve:worker_time_to_first_token_seconds",
}


def worker_histograms(metrics_url: str | None) -> dict[str, tuple[float, float]]:
    """(sum, count) of the worker's start-time histograms, to split the stack's TTFT by where it went."""
    if metrics_url is None:
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(metrics_url, timeout=5).text
    except httpx.HTTPError:
        return {}
    found: dict[str, list[float]] = {name: [0.0, 0.0] for name in _WORKER_TIMES.values()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for name, acc in found.items():
                if sample.name == name + "_sum":
                    acc[0] += sample.value
                elif sample.name == name + "_count":
                    acc[1] += sample.value
    return {name: (acc[0], acc[1]) for name, acc in found.items()}


def worker_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Per-level means (ms) of the worker's histograms, from two scrapes."""
    out: dict[str, Any] = {}
    for key, name in _WORKER_TIMES.items():
        if name in before and name in after and after[name][1] > before[name][1]:
            out[key] = round(1e3 * (after[name][0] - before[name][0]) / (after[name][1] - before[name][1]), 2)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _rate(tokens: float, wall_s: float) -> float | None:
    """Tokens per second from the unrounded counts (the reported tok/s are rounded to 0.1)."""
    return tokens / wall_s if wall_s > 0 else None


def compare(engine: list[dict[str, Any]], stack: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per level: stack / engine throughput, both sides' latencies, the stack's ITL p99 in engine steps."""
    rows = []
    for e, s in zip(engine, stack, strict=True):
        row: dict[str, Any] = {"concurrency": e["concurrency"], "engine_step_ms": e["mean_step_ms"]}
        for key in ("output_tok_s", "ttft_p50_ms", "tpot_p50_ms", "itl_p99_ms", "itl_p99_after_ramp_ms", "failed"):
            row[f"engine_{key}"], row[f"stack_{key}"] = e[key], s[key]
        for key in (*_WORKER_TIMES, "itl_p99_relay_in_ms", "itl_p99_relay_out_ms", "relay_to_client_p99_ms"):
            row[key] = s.get(key)
        row["tok_s_ratio"] = _ratio(_rate(s["output_tokens"], s["wall_s"]), _rate(e["output_tokens"], e["wall_s"]))
        s_waves = zip(s.get("wave_tokens", []), s.get("wave_wall_s", []), strict=True)
        e_waves = zip(e.get("wave_tokens", []), e.get("wave_wall_s", []), strict=True)
        waves = [(_rate(*sw), _rate(*ew)) for sw, ew in zip(s_waves, e_waves, strict=False)]
        ratios = [r for r in (_ratio(a, b) for a, b in waves) if r is not None]
        row["wave_ratio_min"], row["wave_ratio_max"] = (min(ratios), max(ratios)) if len(ratios) > 1 else (None, None)
        row["stack_itl_p99_over_step"] = _ratio(s["itl_p99_ms"], e["mean_step_ms"])
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The side-by-side table of ``compare``'s rows."""
    cols = [("conc", "concurrency"), ("tok/s eng", "engine_output_tok_s"), ("tok/s stack", "stack_output_tok_s")]
    cols += [("ratio", "tok_s_ratio"), ("wave min", "wave_ratio_min"), ("wave max", "wave_ratio_max")]
    cols += [("TTFT50 eng", "engine_ttft_p50_ms"), ("TTFT50 stack", "stack_ttft_p50_ms")]
    cols += [("TPOT50 eng", "engine_tpot_p50_ms"), ("TPOT50 stack", "stack_tpot_p50_ms")]
    cols += [("ITL99 eng", "engine_itl_p99_ms"), ("ITL99 stack", "stack_itl_p99_ms"), ("step eng", "engine_step_ms")]
    cols += [("ITL99 ramped", "stack_itl_p99_after_ramp_ms")]
    cols += [("ITL99/step", "stack_itl_p99_over_step"), ("fail eng", "engine_failed"), ("fail stack", "stack_failed")]
    cols += [("queue mean", "worker_queue_mean_ms"), ("wTTFT mean", "worker_ttft_mean_ms")]
    cols += [("ITL99 API in", "itl_p99_relay_in_ms"), ("ITL99 API out", "itl_p99_relay_out_ms")]
    cols += [("API->client p99", "relay_to_client_p99_ms")]
    cell = lambda v: "-" if v is None else f"{v:.4g}" if isinstance(v, float) and abs(v) < 1e4 else f"{v:.0f}"  # noqa: E731
    widths = [max(len(title), *(len(cell(r[key])) for r in rows)) for title, key in cols]
    lines = ["  ".join(t.rjust(w) for (t, _), w in zip(cols, widths, strict=True))]
    lines += ["  ".join(cell(r[k]).rjust(w) for (_, k), w in zip(cols, widths, strict=True)) for r in rows]
    return "\n".join(lines) + (
        "\n(times in ms; ratio = stack / engine; wave min / max: the lowest and highest ratio of one wave (wave i of"
        " the stack against wave i of the engine) where a level ran several; ITL99/step = stack ITL p99 / engine step; ITL99 ramped: the"
        " stack's gaps after every request of the wave had its first token; queue / wTTFT mean: the"
        " worker's enqueue -> job start / -> first token, per level; ITL99 API in / out: the stack's gaps as the API"
        " relay received / wrote them, API->client: from its write to the client's read)"
    )


def format_engine_again(res: dict[str, Any]) -> str:
    """``--engine-again``: each level of the second engine run beside the first (empty without it)."""
    return "\n".join(
        f"engine again c={first['concurrency']}: {again['output_tok_s']} tok/s (first run {first['output_tok_s']}),"
        f" TPOT p50 {again['tpot_p50_ms']} ({first['tpot_p50_ms']}) ms, decode step p50"
        f" {again['decode_step_p50_ms']} ({first['decode_step_p50_ms']}) ms"
        for first, again in zip(res["engine"]["levels"], res.get("engine_again", {}).get("levels", []), strict=False)
    )
