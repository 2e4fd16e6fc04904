"""deploy/k8s as shipped: every built-in resource passes ``kubernetes-validate --strict`` (unknown fields are
errors); the two custom resources (KEDA's ScaledObject, the Prometheus Operator's ServiceMonitor) are checked
against their CRDs' openAPIV3Schema (vendored in crd_schemas/, made strict the same way: no unknown fields);
and the pieces fit together: kustomize lists every file, probes and requests on every container, pinned
images, selectors that select, named ports that exist, container args the CLI accepts, and the KEDA trigger on
the queue key the API writes."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from deploy.cli import build_parser
from wire import keys

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
DOCKERFILE = K8S.parent / "Dockerfile"
SCHEMAS = Path(__file__).with_name("crd_schemas")


def _docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


DOCS = _docs()


def _by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in DOCS if d["kind"] == kind]


def _strict(schema: Any) -> Any:
    """An openAPIV3Schema that rejects unknown fields, as ``kubectl apply --validate=strict`` does."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    is_open = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and not is_open:
        out["additionalProperties"] = False
    return out


def _crd_validators() -> dict[tuple[str, str], jsonschema.Draft7Validator]:
    validators = {}
    for path in SCHEMAS.glob("*.json"):
        crd = json.loads(path.read_text())
        schema = _strict(crd["openAPIV3Schema"])
        schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: checked by the API server, not here
        validators[(f"{crd['group']}/{crd['version']}", crd["kind"])] = jsonschema.Draft7Validator(schema)
    return validators


CRDS = _crd_validators()


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_resource_is_valid_strictly(doc: dict[str, Any]) -> None:
    crd = CRDS.get((doc["apiVersion"], doc["kind"]))
    if crd is not None:
        errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in crd.iter_errors(doc)]
        assert errors == []
    else:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
    assert {i["name"] for i in kustomization["images"]} == {"pagedserve-api", "pagedserve-worker"}


def _workloads() -> list[dict[str, Any]]:
    return _by_kind("Deployment") + _by_kind("StatefulSet")


def _containers() -> list[dict[str, Any]]:
    return [c for w in _workloads() for c in w["spec"]["template"]["spec"]["containers"]]


def test_every_container_has_probes_requests_and_a_pinned_image() -> None:
    for c in _containers():
        assert {"readinessProbe", "livenessProbe"} <= c.keys(), c["name"]
        assert {"cpu", "memory"} <= c["resources"]["requests"].keys(), c["name"]
        assert "memory" in c["resources"]["limits"], c["name"]
        name, _, tag = c["image"].rpartition(":")
        assert name and tag and tag != "latest", c["image"]


def test_api_pods_are_ready_without_workers_and_workers_scale_on_the_queue() -> None:
    (api,) = [c for c in _containers() if c["name"] == "api"]
    assert api["readinessProbe"]["httpGet"]["path"] == "/ready/api"  # not /ready: that one needs a live worker
    (scaled,) = _by_kind("ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "pagedserve-worker"
    assert scaled["spec"]["minReplicaCount"] >= 1  # at 0 the API answers 503: the queue never grows
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "redis" and trigger["metadata"]["listName"] == keys.QUEUE
    (worker,) = [c for c in _containers() if c["name"] == "worker"]
    max_num_seqs = worker["args"][worker["args"].index("--max-num-seqs") + 1]
    assert trigger["metadata"]["listLength"] == max_num_seqs  # one worker per full batch of outstanding jobs
    config = _by_kind("ConfigMap")[0]["data"]
    assert trigger["metadata"]["addressFromEnv"] in config  # KEDA reads it from the worker's envFrom
    assert config["REDIS_ADDRESS"] == f"{config['REDIS_HOST']}:6379"
    assert not [
        h for h in _by_kind("HorizontalPodAutoscaler") if h["spec"]["scaleTargetRef"]["name"].endswith("worker")
    ]


def test_selectors_select_and_named_ports_exist() -> None:
    pods = [w["spec"]["template"] for w in _workloads()]

    def selected(selector: dict[str, str]) -> list[dict[str, Any]]:
        return [p for p in pods if selector.items() <= p["metadata"]["labels"].items()]

    for w in _workloads():
        assert selected(w["spec"]["selector"]["matchLabels"]), w["metadata"]["name"]
    for obj in _by_kind("Service") + _by_kind("PodDisruptionBudget"):
        spec = obj["spec"]
        assert selected(spec["selector"].get("matchLabels", spec["selector"])), obj["metadata"]["name"]
    port_names = {p["name"] for c in _containers() for p in c.get("ports", [])}
    for svc in _by_kind("Service"):
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names
    for c in _containers():
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            port = c.get(probe, {}).get("httpGet", c.get(probe, {}).get("tcpSocket", {})).get("port")
            assert port is None or port in {p["name"] for p in c["ports"]}, (c["name"], probe)
    (monitor,) = _by_kind("ServiceMonitor")
    (expression,) = monitor["spec"]["selector"]["matchExpressions"]
    services = [s for s in _by_kind("Service") if s["metadata"].get("labels", {}).get("app") in expression["values"]]
    service_ports = {p["name"] for s in services for p in s["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= service_ports


def _entrypoint(target: str) -> list[str]:
    """The ENTRYPOINT of a Dockerfile stage, less the ``pagedserve`` program."""
    stage = DOCKERFILE.read_text().split(f" AS {target}\n", 1)[1].split("\nFROM ", 1)[0]
    (line,) = [ln for ln in stage.splitlines() if ln.startswith("ENTRYPOINT")]
    return json.loads(line.removeprefix("ENTRYPOINT"))[1:]


KUBELET_VARIABLES = {"REDIS_HOST": "redis", "POD_NAME": "pod-0"}  # $(VAR) in args, as the kubelet expands them


def test_container_args_are_flags_the_cli_accepts() -> None:
    for c in _containers():
        if c["name"] not in ("api", "worker"):
            continue
        args = [re.sub(r"\$\((\w+)\)", lambda m: KUBELET_VARIABLES[m.group(1)], a) for a in c["args"]]
        parsed = build_parser().parse_args([*_entrypoint(c["name"]), *args])  # SystemExit on an unknown flag
        assert parsed.redis_url == "redis://redis:6379/0", shlex.join(args)
