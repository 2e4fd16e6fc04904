"""The monitoring files of deploy/: every metric the Grafana dashboards query is one the code exports (and so
are those vLLM's own dashboard queries), Grafana's provisioning finds its provider and data source where
docker-compose mounts them, Prometheus scrapes the compose services' ports; promtool checks the config and the
exposition where it is installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from api.metrics import ApiMetrics
from wire.messages import ChoiceResult, JobResult, WorkerHeartbeat
from worker.metrics import WorkerMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
METRIC = re.compile(r"\b(?:vllm|pagedserve):[A-Za-z0-9_:]+")
# what vLLM's Grafana dashboard (examples/observability/prometheus_grafana/grafana.json) queries, by model_name
VLLM_DASHBOARD = (
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)


def _registries() -> tuple[CollectorRegistry, CollectorRegistry]:
    """Both tiers' registries, with one finished request and one heartbeat in them."""
    api = ApiMetrics("m", 2048)
    beat = WorkerHeartbeat("w1", "m", 8, 2048, num_running=1, prompt_tokens_total=10)
    api.watch_workers(lambda: [beat], lambda: 0)
    result = JobResult("r", "m", [ChoiceResult(0, "hi", [1, 2], "stop")], 3, 2, queue_time_s=0.1, ttft_s=0.2, e2e_s=0.3)
    api.observe_final(result, 0.4, streamed=False)
    api.rejected.labels("queue_full").inc()  # labelled counters export a sample once a label value is used
    api.errors.labels("503").inc()
    worker_registry = CollectorRegistry()
    WorkerMetrics("m", "w1", registry=worker_registry).update(beat)
    return api.registry, worker_registry


def _samples() -> dict[str, list[dict[str, str]]]:
    """Exported sample name -> the label sets it has."""
    out: dict[str, list[dict[str, str]]] = {}
    for registry in _registries():
        for family in registry.collect():
            for sample in family.samples:
                out.setdefault(sample.name, []).append(sample.labels)
    return out


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_metric_a_dashboard_queries_is_exported(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    exported = _samples()
    queried = {name for expr in _exprs(dashboard) for name in METRIC.findall(expr)}
    assert queried, "the dashboard queries no metric"
    assert sorted(queried - exported.keys()) == []


def test_vllm_dashboard_metrics_are_exported_with_model_name() -> None:
    exported = _samples()
    for name in VLLM_DASHBOARD:
        assert name in exported, name
        assert all(labels.get("model_name") == "m" for labels in exported[name]), (name, exported[name])


def _compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> host path (relative to deploy/) of a compose service's bind mounts."""
    pairs = (v.split(":")[:2] for v in service.get("volumes", []))
    return {inside: host for host, inside in pairs}


def test_grafana_provisioning_is_mounted_where_grafana_reads_it() -> None:
    mounts = _mounts(_compose()["services"]["grafana"])
    providers_dir = DEPLOY / mounts["/etc/grafana/provisioning/dashboards"]
    providers = [p for f in providers_dir.glob("*.yml") for p in yaml.safe_load(f.read_text())["providers"]]
    assert providers, "no dashboard provider in the provisioning folder Grafana reads"
    for provider in providers:  # each provider's path is a mounted folder holding the dashboards
        assert (DEPLOY / mounts[provider["options"]["path"]]).resolve() == (DEPLOY / "grafana" / "dashboards")
    sources_dir = DEPLOY / mounts["/etc/grafana/provisioning/datasources"]
    sources = [s for f in sources_dir.glob("*.yml") for s in yaml.safe_load(f.read_text())["datasources"]]
    assert [s["type"] for s in sources] == ["prometheus"] and sources[0]["isDefault"]
    assert sources[0]["url"] == "http://prometheus:9090" and "prometheus" in _compose()["services"]
    for path in DASHBOARDS:  # the panels name the provisioned data source by its uid
        panels = json.loads(path.read_text())["panels"]
        assert {p["datasource"]["uid"] for p in panels} == {sources[0]["uid"]}


def test_prometheus_scrapes_the_api_and_worker_services() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = {
        job["job_name"]: [(name, sd["port"]) for sd in job["dns_sd_configs"] for name in sd["names"]]
        for job in config["scrape_configs"]
    }
    assert targets == {"pagedserve-api": [("api", 8000)], "pagedserve-worker": [("worker", 9100)]}
    dockerfile = (DEPLOY / "Dockerfile").read_text()  # the ports the images listen on
    assert '"--port", "8000"' in dockerfile and '"--metrics-port", "9100"' in dockerfile
    services = _compose()["services"]
    assert {"api", "worker"} <= services.keys()
    assert _mounts(services["prometheus"])["/etc/prometheus/prometheus.yml"] == "./prometheus.yml"


PROMTOOL = shutil.which("promtool")
# promtool's lint for recording-rule style names: vLLM's "vllm:" names (so ours) have the colon by design
COLON_LINT = "metric names should not contain ':'"


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus)")
def test_promtool_checks_the_config_and_the_exposition() -> None:
    assert PROMTOOL is not None
    checked = subprocess.run([PROMTOOL, "check", "config", str(DEPLOY / "prometheus.yml")], capture_output=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    for registry in _registries():
        linted = subprocess.run([PROMTOOL, "check", "metrics"], input=generate_latest(registry), capture_output=True)
        problems = [p for p in linted.stderr.decode().splitlines() if p and not p.endswith(COLON_LINT)]
        assert problems == [] and linted.stdout == b"", linted
