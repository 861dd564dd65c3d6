"""deploy/k8s: what deploy/render_k8s.py renders is committed, every object validates against the Kubernetes API's
own schemas (kubernetes-validate, strict: an unknown field fails), and the pieces fit together: selectors select,
probes ask paths the apps serve, every secret and config map named exists or is the documented operator's secret,
the gateway config in the ConfigMap loads and finds the engines by their headless Service's name (discovery), the
network policy admits the gateways to the engines."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from deploy import render_k8s
from tokenweir.gateway.config import load_config
from tokenweir.gateway.server.probes import router as probes_router

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES = "1.31.0"
SECRET_KEYS = {"admin-key", "engine-api-key", "postgres-password"}  # the operator's secret (render_k8s docstring)


def objects(variant: str) -> list[dict]:
    """Everything `kubectl apply -k deploy/k8s/<variant>` would apply, following the kustomizations' resources."""

    def load(directory: Path) -> list[dict]:
        kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
        assert kustomization["kind"] == "Kustomization" and kustomization["namespace"] == render_k8s.NAMESPACE
        out = []
        for resource in kustomization["resources"]:
            path = (directory / resource).resolve()
            assert path.is_relative_to(K8S), resource
            out += load(path) if path.is_dir() else list(yaml.safe_load_all(path.read_text()))
        return out

    return load(K8S / variant)


def test_the_committed_manifests_are_what_render_k8s_renders():
    for path, text in render_k8s.k8s_files().items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale: run python -m deploy.render"


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_every_object_validates_against_the_kubernetes_schemas(variant):
    docs = objects(variant)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("StatefulSet") == 3 and kinds.count("Deployment") == 1  # engines, postgres, redis; gateway
    assert {"PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor", "ConfigMap"} <= set(kinds)
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":  # a CRD (prometheus-operator): not in the API's schemas
            assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["spec"]["endpoints"][0]["path"] == "/metrics"
            continue
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    broken = dict(docs[0], spec={"replicas": 1, "replicaz": 2})  # the validator can fail
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_the_pieces_fit(variant, tmp_path):
    docs = objects(variant)
    by_kind: dict[str, list[dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    workloads = by_kind["Deployment"] + by_kind["StatefulSet"]
    for w in workloads:
        assert w["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
    pods = [w["spec"]["template"]["metadata"]["labels"] for w in workloads]
    for svc in by_kind["Service"]:
        assert any(svc["spec"]["selector"].items() <= labels.items() for labels in pods), svc["metadata"]["name"]
    config_maps = {c["metadata"]["name"]: c for c in by_kind["ConfigMap"]}
    for w in workloads:
        spec = w["spec"]["template"]["spec"]
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps
        for container in spec["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == render_k8s.SECRET and ref["key"] in SECRET_KEYS
    # probes ask what the apps serve
    gateway = next(w for w in workloads if w["metadata"]["name"] == "gateway")["spec"]["template"]["spec"]
    served = {getattr(r, "path", None) for r in probes_router.routes}
    (container,) = gateway["containers"]
    assert {container["readinessProbe"]["httpGet"]["path"], container["livenessProbe"]["httpGet"]["path"]} <= served
    # the gateway's config loads as `serve` reads it, with the engines' key from the env the secret fills
    path = tmp_path / "gateway.yaml"
    path.write_text(config_maps["gateway-config"]["data"]["gateway.yaml"])
    cfg = load_config(path, env={"TOKENWEIR_ENGINE_API_KEY": "k"})
    engines = next(s for s in by_kind["Service"] if s["metadata"]["name"] == "engine")
    assert engines["spec"]["clusterIP"] == "None" and not engines["spec"]["publishNotReadyAddresses"]  # ready pods
    (port,) = engines["spec"]["ports"]
    service_host = f"{engines['metadata']['name']}.{render_k8s.NAMESPACE}.svc.cluster.local"
    members = [(u.base_url, u.discover) for p in cfg.pools for u in p.upstreams]
    assert members == [(f"http://{service_host}:{port['port']}", True)]  # the headless Service's name, discovered
    assert cfg.discovery.nameservers == []  # through the pod's resolver (cluster DNS)
    engine_set = next(w for w in workloads if w["metadata"]["name"] == "engine")
    assert engine_set["spec"]["serviceName"] == engines["metadata"]["name"]
    # only the gateways (and Prometheus) reach the engines
    (policy,) = by_kind["NetworkPolicy"]
    engine_labels = next(w for w in workloads if w["metadata"]["name"] == "engine")["spec"]["template"]["metadata"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= engine_labels["labels"].items()
    allowed = [f["podSelector"]["matchLabels"] for f in policy["spec"]["ingress"][0]["from"]]
    assert allowed[0].items() <= gateway_labels(workloads).items()
    engine_spec = next(w for w in workloads if w["metadata"]["name"] == "engine")["spec"]["template"]["spec"]
    gpus = engine_spec["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")
    assert gpus == (1 if variant == "gpu" else None)


def gateway_labels(workloads: list[dict]) -> dict:
    return next(w for w in workloads if w["metadata"]["name"] == "gateway")["spec"]["template"]["metadata"]["labels"]
