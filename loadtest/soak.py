"""``pagedserve bench soak``: Locust against the whole stack for a while, watching for memory growth.

Starts ``pagedserve serve`` as users start it (or uses ``--host``), runs Locust headless with
``loadtest/locustfile.py`` for ``--duration-s`` with ``--users``, and every ``--sample-s`` records the RSS of every
process of the stack by role (launcher, api, worker front, engine core, redis), Redis' own memory
(``INFO memory``), and Locust's running request counts, latency percentiles and failures (its CSV history).
Writes a JSON timeline, a PNG plot, and prints the RSS slope of each role after warm-up (MB per minute,
least squares over the samples after ``--warmup-s``) and the errors other than 429.

    pagedserve bench soak --users 200 --duration-s 600 --out soak.json       # this machine, default model
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import redis

import modelfiles
from loadtest.serve_process import stop_stack, wait_ready

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


def role(proc: psutil.Process) -> str | None:
    """Which part of the stack a process is, from its command line (None: not ours to watch)."""
    try:
        cmd = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None
    if "redis-server" in cmd:
        return "redis"
    if "resource_tracker" in cmd:
        return None
    if "spawn_main" in cmd or "multiprocessing" in cmd:
        try:
            parent = " ".join(proc.parent().cmdline()) if proc.parent() else ""
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            parent = ""
        return "engine-core" if " worker" in parent else "api"  # uvicorn's --workers children are API processes
    for name in ("serve", "api", "worker"):
        if f"deploy.cli {name}" in cmd or f"pagedserve {name}" in cmd:
            return {"serve": "launcher", "worker": "worker-front"}.get(name, name)
    return None


def sample_memory(root_pid: int, redis_client: redis.Redis | None) -> dict[str, Any]:
    """RSS (MB) of each process of the tree under ``root_pid``, keyed ``role:pid``; Redis' used memory (MB)."""
    root = psutil.Process(root_pid)
    rss: dict[str, float] = {}
    for proc in [root, *root.children(recursive=True)]:
        name = role(proc)
        if name is None:
            continue
        try:
            rss[f"{name}:{proc.pid}"] = proc.memory_info().rss / 2**20
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    used = None
    if redis_client is not None:
        try:
            info: dict[str, Any] = redis_client.info("memory")  # type: ignore[assignment]  # sync client
            used = int(info["used_memory"]) / 2**20
        except redis.RedisError:
            used = None
    return {"rss_mb": rss, "redis_used_mb": used}


def private_redis(root_pid: int) -> redis.Redis | None:
    """A client of the stack's private redis-server, if there is one: its port from the command line, which
    redis-server rewrites to its title (``redis-server 127.0.0.1:PORT``)."""
    for proc in psutil.Process(root_pid).children(recursive=True):
        if role(proc) == "redis":
            cmd = " ".join(proc.cmdline())
            found = re.search(r"--port (\d+)", cmd) or re.search(r"redis-server \S*:(\d+)", cmd)
            if found:
                return redis.Redis(port=int(found.group(1)))
    return None


def slope_mb_per_min(times_s: list[float], values: list[float]) -> float | None:
    """Least-squares slope of ``values`` over ``times_s``, in MB per minute (None with fewer than 3 points)."""
    n = len(values)
    if n < 3:
        return None
    mt, mv = sum(times_s) / n, sum(values) / n
    var = sum((t - mt) ** 2 for t in times_s)
    if var == 0:
        return None
    return 60 * sum((t - mt) * (v - mv) for t, v in zip(times_s, values, strict=True)) / var


def summarize(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    """Per process: RSS at the first sample after warm-up, at the end, and the slope in between."""
    after = [s for s in samples if s["t_s"] >= warmup_s] or samples
    keys = sorted({k for s in after for k in s["rss_mb"]})
    per_process = {}
    for key in keys:
        pts = [(s["t_s"], s["rss_mb"][key]) for s in after if key in s["rss_mb"]]
        times, values = [t for t, _ in pts], [v for _, v in pts]
        per_process[key] = {
            "rss_start_mb": round(values[0], 1),
            "rss_end_mb": round(values[-1], 1),
            "slope_mb_per_min": None if (s := slope_mb_per_min(times, values)) is None else round(s, 3),
        }
    redis_pts = [(s["t_s"], s["redis_used_mb"]) for s in after if s["redis_used_mb"] is not None]
    redis_slope = slope_mb_per_min([t for t, _ in redis_pts], [v for _, v in redis_pts])
    return {"processes": per_process, "redis_slope_mb_per_min": None if redis_slope is None else round(redis_slope, 3)}


def read_locust(prefix: Path) -> dict[str, Any]:
    """Totals from Locust's CSVs: requests and failures per name, failures by error (429s apart)."""
    stats: dict[str, Any] = {}
    with open(f"{prefix}_stats.csv", newline="") as f:
        for row in csv.DictReader(f):
            stats[row["Name"]] = {
                "requests": int(row["Request Count"]),
                "failures": int(row["Failure Count"]),
                "p50_ms": _num(row.get("50%")),
                "p99_ms": _num(row.get("99%")),
            }
    failures: list[dict[str, Any]] = []
    failures_csv = Path(f"{prefix}_failures.csv")
    if failures_csv.exists():
        with failures_csv.open(newline="") as f:
            failures = [
                {"name": r["Name"], "error": r["Error"], "count": int(r["Occurrences"])} for r in csv.DictReader(f)
            ]
    rejected = stats.get("429", {}).get("requests", 0)
    errors = sum(f["count"] for f in failures)
    return {"stats": stats, "failures": failures, "errors_other_than_429": errors, "rejected_429": rejected}


def read_history(prefix: Path) -> list[dict[str, Any]]:
    """Locust's aggregated stats over time (one row per second): users, requests/s, p50/p99, failures."""
    path = Path(f"{prefix}_stats_history.csv")
    if not path.exists():
        return []
    rows = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            if row["Name"] != "Aggregated":
                continue
            rows.append(
                {
                    "timestamp": int(row["Timestamp"]),
                    "users": int(row["User Count"]),
                    "rps": _num(row["Requests/s"]),
                    "p50_ms": _num(row["50%"]),
                    "p99_ms": _num(row["99%"]),
                    "failures_total": int(row["Total Failure Count"]),
                }
            )
    return rows


def _num(value: str | None) -> float | None:
    try:
        return float(value) if value not in (None, "", "N/A") else None
    except ValueError:
        return None


def start_stack(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``pagedserve serve`` on a free port, waited for until ready; its process and base URL."""
    from deploy.redis_server import free_port

    port = free_port()
    argv = [sys.executable, "-m", "deploy.cli", "serve", "--port", str(port), "--log-level", "warning"]
    argv += shlex.split(args.serve_args)
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    wait_ready(proc, base_url, args.ready_timeout_s, log, modelfiles.resolve(None).name)
    return proc, base_url


def run_locust(args: argparse.Namespace, host: str, prefix: Path, model: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", host]
    argv += ["--users", str(args.users), "--spawn-rate", str(args.spawn_rate), "--run-time", f"{args.duration_s}s"]
    argv += ["--csv", str(prefix), "--csv-full-history", "--only-summary", "--stop-timeout", "30"]
    env = {**os.environ, "PAGEDSERVE_MODEL": model, "PAGEDSERVE_MAX_TOKENS": str(args.max_tokens)}
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def watch(root_pid: int, locust: subprocess.Popen[bytes], sample_s: float) -> list[dict[str, Any]]:
    """Memory samples every ``sample_s`` until Locust exits."""
    client = private_redis(root_pid)
    samples = []
    t0 = time.monotonic()
    while locust.poll() is None:
        samples.append({"t_s": round(time.monotonic() - t0, 1), **sample_memory(root_pid, client)})
        with contextlib.suppress(subprocess.TimeoutExpired):
            locust.wait(sample_s)
    return samples


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, history = result["samples"], result["history"]
    fig, (ax_mem, ax_lat) = plt.subplots(2, 1, figsize=(9, 7), sharex=False)
    for key in sorted({k for s in samples for k in s["rss_mb"]}):
        pts = [(s["t_s"], s["rss_mb"][key]) for s in samples if key in s["rss_mb"]]
        ax_mem.plot([t for t, _ in pts], [v for _, v in pts], label=key)
    redis_pts = [(s["t_s"], s["redis_used_mb"]) for s in samples if s["redis_used_mb"] is not None]
    if redis_pts:
        ax_mem.plot([t for t, _ in redis_pts], [v for _, v in redis_pts], "--", label="redis used_memory")
    ax_mem.set(xlabel="s", ylabel="MB", title=f"RSS per process, {result['users']} users")
    ax_mem.legend(fontsize=7)
    if history:
        t0 = history[0]["timestamp"]
        times = [h["timestamp"] - t0 for h in history]
        ax_lat.plot(times, [h["p50_ms"] for h in history], label="p50 ms")
        ax_lat.plot(times, [h["p99_ms"] for h in history], label="p99 ms")
        ax_lat.plot(times, [h["failures_total"] for h in history], label="failures (cumulative)")
        ax_lat.set(xlabel="s", title="Locust, all requests")
        ax_lat.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pagedserve bench soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--users", type=int, default=200)
    p.add_argument("--spawn-rate", type=float, default=20.0)
    p.add_argument("--duration-s", type=int, default=600)
    p.add_argument("--warmup-s", type=float, default=None, help="RSS slopes from here on (default: a fifth of the run)")
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--max-tokens", type=int, default=32, help="per request (the locustfile's PAGEDSERVE_MAX_TOKENS)")
    p.add_argument("--host", default="", help="a running server instead of starting pagedserve serve")
    p.add_argument("--serve-args", default="", help='flags for pagedserve serve: --serve-args="--max-num-seqs 64"')
    p.add_argument("--ready-timeout-s", type=float, default=600.0)
    p.add_argument("--out", default="", help="JSON result (the PNG, Locust CSVs and serve log go beside it)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    base = Path(args.out).resolve() if args.out else Path(tempfile.mkdtemp(prefix="pagedserve-soak-")) / "soak"
    base.parent.mkdir(parents=True, exist_ok=True)
    proc = None
    if args.host:
        host, root_pid = args.host, psutil.Process().pid
    else:
        proc, host = start_stack(args, base.with_suffix(".serve.log"))
        root_pid = proc.pid
    try:
        import httpx

        model = httpx.get(f"{host}/v1/models", timeout=10).json()["data"][0]["id"]
        prefix = base.parent / f"{base.stem}-locust"
        locust = run_locust(args, host, prefix, model)
        samples = watch(root_pid, locust, args.sample_s)
    finally:
        exit_status = stop_stack(proc) if proc is not None else None
    warmup = args.warmup_s if args.warmup_s is not None else args.duration_s / 5
    result = {
        "users": args.users,
        "duration_s": args.duration_s,
        "warmup_s": warmup,
        "host": host,
        "locust": read_locust(prefix),
        "summary": summarize(samples, warmup),
        "samples": samples,
        "history": read_history(prefix),
        "serve_exit_status": exit_status,
    }
    base.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, base.with_suffix(".png"))
    print(
        json.dumps(
            {"summary": result["summary"], "locust": {k: v for k, v in result["locust"].items() if k != "stats"}},
            indent=1,
        )
    )
    print(f"wrote {base.with_suffix('.json')} and {base.with_suffix('.png')}")
    return 0 if result["locust"]["errors_other_than_429"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
