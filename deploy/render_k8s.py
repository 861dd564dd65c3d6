"""The Kubernetes manifests under deploy/k8s/, rendered from the same gateway config as the lab (deploy/render.py
calls `k8s_files()`; `python -m deploy.render` rewrites them, `--check` compares).

    kubectl create namespace tokenweir
    kubectl -n tokenweir create secret generic tokenweir-secrets \\
        --from-literal=admin-key=tw-$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))') \\
        --from-literal=engine-api-key=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))') \\
        --from-literal=postgres-password=$(python3 -c 'import secrets; print(secrets.token_urlsafe(24))')
    kubectl apply -k deploy/k8s/cpu            # or deploy/k8s/gpu: the engines on one NVIDIA GPU each

The images are the Dockerfile's targets (tokenweir-gateway, tokenweir-engine; the GPU engine built with
`--build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t tokenweir-engine:cuda`), pushed where the cluster
pulls from (set the image names with a kustomize `images:` entry).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from deploy import render

K8S = render.DEPLOY / "k8s"
HEAD = "# Rendered by deploy/render_k8s.py (python -m deploy.render); do not edit by hand.\n"
NAMESPACE = "tokenweir"
ENGINE_REPLICAS = 2
ENGINE_PORT, GATEWAY_PORT = 8100, 8000
SECRET = "tokenweir-secrets"  # made by the operator (above): admin-key, engine-api-key, postgres-password
GATEWAY_LABELS = {"app.kubernetes.io/name": "tokenweir-gateway", "app.kubernetes.io/part-of": "tokenweir"}
ENGINE_LABELS = {"app.kubernetes.io/name": "tokenweir-engine", "app.kubernetes.io/part-of": "tokenweir"}
# The engines' headless Service: its name resolves to every ready engine pod, which the gateways discover (one pool
# member per address, re-resolved every DISCOVERY_INTERVAL_S): scaling the engines needs no config change.
ENGINE_SERVICE_HOST = f"engine.{NAMESPACE}.svc.cluster.local"
DISCOVERY_INTERVAL_S = 5
STORE_URL = f"postgresql://tokenweir@postgres.{NAMESPACE}.svc.cluster.local:5432/tokenweir"
STATE_URL = f"redis://redis.{NAMESPACE}.svc.cluster.local:6379/0"
PG_PASSWORD_ENV = "PGPASSWORD"  # libpq (psycopg) reads it: the store URL carries no password


def _secret_env(name: str, key: str) -> dict:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": SECRET, "key": key}}}


def _probe(path: str, port: int, period: int, failures: int, initial: int = 0) -> dict:
    probe = {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures}
    return probe | ({"initialDelaySeconds": initial} if initial else {})


def _hardened() -> dict:
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def gateway_configmap() -> dict:
    members = [("engine", f"http://{ENGINE_SERVICE_HOST}:{ENGINE_PORT}")]
    cfg = render.gateway_config(
        members, store_url=STORE_URL, state_url=STATE_URL, events_path="/data/events.jsonl", port=GATEWAY_PORT
    )
    for upstream in cfg["pools"][0]["upstreams"]:
        upstream["discover"] = True  # one member per engine pod: engine-<pod IP>
    # through the pod's resolver (cluster DNS); a pod that goes drains for drain_s, then leaves the routing table
    cfg["discovery"] = {"interval_s": DISCOVERY_INTERVAL_S, "drain_s": 30}
    text = yaml.safe_dump(cfg, sort_keys=False)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "gateway-config"},
        "data": {"gateway.yaml": text},
    }


def gateway_deployment() -> dict:
    container = {
        "name": "gateway",
        "image": "tokenweir-gateway:latest",
        "args": [
            "tokenweir",
            "serve",
            "--no-engine",
            "--config",
            "/etc/tokenweir/gateway.yaml",
            "--host",
            "0.0.0.0",
            "--port",
            str(GATEWAY_PORT),
        ],  # fmt: skip
        "ports": [{"name": "http", "containerPort": GATEWAY_PORT}],
        "env": [
            _secret_env(render.ADMIN_KEY_ENV, "admin-key"),
            _secret_env(render.ENGINE_KEY_ENV, "engine-api-key"),
            _secret_env(PG_PASSWORD_ENV, "postgres-password"),
            # each replica's own event file: its pod name (the usage watermark is per writer)
            {"name": "TOKENWEIR_EVENTS__WRITER_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        # ready: its shared state seeded and its store open; alive: its event loop answers
        "readinessProbe": _probe("/health", GATEWAY_PORT, 5, 3),
        "livenessProbe": _probe("/livez", GATEWAY_PORT, 10, 6, initial=10),
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": _hardened(),
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/tokenweir", "readOnly": True},
            {"name": "events", "mountPath": "/data"},
        ],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "gateway", "labels": GATEWAY_LABELS},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": GATEWAY_LABELS},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": GATEWAY_LABELS},
                "spec": {
                    # SIGTERM: in-flight requests get shutdown_grace_s (10 s in the config) before they are cut
                    "terminationGracePeriodSeconds": 30,
                    "containers": [container],
                    "volumes": [
                        {"name": "config", "configMap": {"name": "gateway-config"}},
                        # the events (JSONL) and the in-flight journal: a restarted pod replays them; a pod
                        # replaced elsewhere starts empty (its predecessor's usage reached the store on SIGTERM)
                        {"name": "events", "emptyDir": {}},
                    ],
                },
            },
        },
    }


def gateway_service() -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "gateway", "labels": GATEWAY_LABELS},
        "spec": {"selector": GATEWAY_LABELS, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
    }


def gateway_pdb() -> dict:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "gateway"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": GATEWAY_LABELS}},
    }


def engine_statefulset(gpu: bool) -> dict:
    args = ["tokenweir", "engine", "--host", "0.0.0.0", "--port", str(ENGINE_PORT), *render.ENGINE_ARGS]
    resources: dict = {"requests": {"cpu": "2", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}
    if gpu:
        args = [a for a in args if a not in ("--kv-cache-memory", "256MiB")] + ["--gpu-memory-utilization", "0.85"]
        resources = {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "16Gi", "nvidia.com/gpu": 1}}
    container = {
        "name": "engine",
        "image": "tokenweir-engine:cuda" if gpu else "tokenweir-engine:latest",
        "args": args,
        "ports": [{"name": "http", "containerPort": ENGINE_PORT}],
        "env": [_secret_env(render.ENGINE_KEY_ENV, "engine-api-key")],
        # the model loads (and on CPU its kernels compile) before /health answers: a startup probe allows for it
        "startupProbe": _probe("/health", ENGINE_PORT, 5, 120),
        "readinessProbe": _probe("/health", ENGINE_PORT, 5, 3),
        "livenessProbe": _probe("/health", ENGINE_PORT, 10, 6),
        "resources": resources,
        "securityContext": _hardened() | {"readOnlyRootFilesystem": False},  # torch's kernel cache
    }
    pod: dict = {"containers": [container], "terminationGracePeriodSeconds": 30}
    if gpu:
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "engine", "labels": ENGINE_LABELS},
        "spec": {
            "serviceName": "engine",  # the headless Service, whose name the gateways resolve to find the pods
            "replicas": ENGINE_REPLICAS,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": ENGINE_LABELS},
            "template": {"metadata": {"labels": ENGINE_LABELS}, "spec": pod},
        },
    }


def engine_service() -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "engine", "labels": ENGINE_LABELS},
        "spec": {
            # headless: its name resolves to each ready pod's address (the gateways' discovery), no load balancing
            # in the way of the gateway's
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": ENGINE_LABELS,
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http"}],
        },
    }


def engine_network_policy() -> dict:
    """Only the gateways (and Prometheus, for /metrics) reach the engines."""
    prometheus = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "engines-from-gateways-only"},
        "spec": {
            "podSelector": {"matchLabels": ENGINE_LABELS},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": GATEWAY_LABELS}}, prometheus],
                    "ports": [{"protocol": "TCP", "port": ENGINE_PORT}],
                }
            ],
        },
    }


def _simple_statefulset(name: str, image: str, port: int, env: list[dict], mount: str, args: list[str]) -> list[dict]:
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "tokenweir"}
    container = {
        "name": name,
        "image": image,
        "ports": [{"name": "tcp", "containerPort": port}],
        "env": env,
        "volumeMounts": [{"name": "data", "mountPath": mount}],
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}},
    } | ({"args": args} if args else {})
    claim = {
        "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "5Gi"}}},
    }
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "serviceName": name,
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
                "volumeClaimTemplates": [claim],
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "labels": labels},
            "spec": {"selector": labels, "ports": [{"name": "tcp", "port": port, "targetPort": "tcp"}]},
        },
    ]


def backing_services() -> list[dict]:
    """PostgreSQL and Redis in the cluster, one pod each (a lab's; production points STORE_URL/STATE_URL at managed
    ones and drops this file from the kustomization)."""
    pg_env = [
        {"name": "POSTGRES_USER", "value": "tokenweir"},
        {"name": "POSTGRES_DB", "value": "tokenweir"},
        _secret_env("POSTGRES_PASSWORD", "postgres-password"),
        {"name": "PGDATA", "value": "/var/lib/postgresql/data/pgdata"},
    ]
    postgres = _simple_statefulset("postgres", "postgres:16.4-bookworm", 5432, pg_env, "/var/lib/postgresql/data", [])
    redis = _simple_statefulset("redis", "redis:7.4.1-bookworm", 6379, [], "/data", ["--appendonly", "yes"])
    return postgres + redis


def service_monitor() -> dict:
    """prometheus-operator's scrape config for the gateways and the engines (a CRD: monitoring.coreos.com/v1)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": "tokenweir", "labels": {"app.kubernetes.io/part-of": "tokenweir"}},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/part-of": "tokenweir"}},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
        },
    }


def dashboard_configmap() -> dict:
    """The lab's Grafana dashboard, for Grafana's sidecar (it loads ConfigMaps labelled grafana_dashboard)."""
    dashboard = json.loads((render.DEPLOY / "grafana" / "dashboards" / "tokenweir.json").read_text())
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "tokenweir-dashboard", "labels": {"grafana_dashboard": "1"}},
        "data": {"tokenweir.json": json.dumps(dashboard, indent=1)},
    }


class _Dumper(yaml.SafeDumper):
    """No YAML anchors: a label set shared by a selector and a template is written out at each place."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def _docs(*docs: dict) -> str:
    return HEAD + yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False)


def _kustomization(resources: list[str]) -> str:
    body = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": NAMESPACE}
    return HEAD + yaml.safe_dump(body | {"resources": resources}, sort_keys=False)


def k8s_files() -> dict[Path, str]:
    """base/ (gateways, PostgreSQL and Redis, monitoring) and two overlays that add the engines: cpu/ and gpu/."""
    files = {
        K8S / "base" / "gateway.yaml": _docs(
            gateway_configmap(), gateway_deployment(), gateway_service(), gateway_pdb()
        ),
        K8S / "base" / "backing-services.yaml": _docs(*backing_services()),
        K8S / "base" / "monitoring.yaml": _docs(service_monitor(), dashboard_configmap()),
        K8S / "base" / "kustomization.yaml": _kustomization(
            ["gateway.yaml", "backing-services.yaml", "monitoring.yaml"]
        ),
    }
    for variant, gpu in (("cpu", False), ("gpu", True)):
        files[K8S / variant / "engines.yaml"] = _docs(
            engine_statefulset(gpu), engine_service(), engine_network_policy()
        )
        files[K8S / variant / "kustomization.yaml"] = _kustomization(["../base", "engines.yaml"])
    return files
