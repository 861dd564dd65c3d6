"""One source for the lab's config files, rendered for docker compose (service names) or local processes.

    python -m deploy.render            # rewrite deploy/{gateway.yaml,nginx.conf,prometheus.yml} and deploy/k8s/
    python -m deploy.render --check    # exit 1 when the committed files differ from what this renders

deploy/lab_topology.py calls the same functions with 127.0.0.1 ports and a temp dir; deploy/alerts.yml and the Grafana
files are static and used as they are by both.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parent
MODEL = "smollm2-135m"
CANARY_MODEL = "smollm2-135m-canary"
ADMIN_KEY_ENV = "TOKENWEIR_ADMIN_KEY"
# The engines' API key, in the env of the engines (engine/flags.py reads it) and of the gateways (`api_key_env`).
ENGINE_KEY_ENV = "TOKENWEIR_ENGINE_API_KEY"
# The key a disaggregated pool's engines share: the prefill engine signs its answers, the decode engine checks them.
KV_TRANSFER_KEY_ENV = "TOKENWEIR_KV_TRANSFER_KEY"

# docker compose: service name -> port inside the network
COMPOSE_ENGINES = [("engine-1", "http://engine-1:8100"), ("engine-2", "http://engine-2:8100")]
COMPOSE_GATEWAYS = ["gateway-1:8000", "gateway-2:8000"]
COMPOSE_STORE = "postgresql://tokenweir:tokenweir@postgres:5432/tokenweir"
COMPOSE_STATE = "redis://redis:6379/0"

ENGINE_ARGS = ["--served-model-name", MODEL, "--kv-cache-memory", "256MiB", "--max-num-seqs", "8"]
# Disaggregated prefill: the first engine prefills and hands the prompt's KV to the second, which decodes.
DISAGGREGATED_ROLES = ("prefill", "decode")
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


def engine_role_args(role: str, kv_ip: str = "127.0.0.1") -> list[str]:
    """An engine's flags for its role in a disaggregated pool: the KV server's address, as the decode engine reaches
    it (any free port: the prefill hop's answer names it)."""
    config = {"kv_role": KV_ROLES[role], "kv_ip": kv_ip, "kv_port": 0}
    return ["--kv-transfer-config", json.dumps(config)]


def gateway_config(
    engines: list[tuple[str, str]],
    *,
    store_url: str,
    state_url: str,
    events_path: str,
    host: str = "0.0.0.0",
    port: int = 8000,
    canary_url: str | None = None,
    roles: tuple[str, ...] | None = None,
) -> dict:
    """The gateway's YAML config: one pool over every engine, exact token counts, shared Redis state.

    roles: each engine's role in a disaggregated pool (DISAGGREGATED_ROLES), in `engines` order; None: colocated.

    canary_url: also a pool CANARY_MODEL on that one upstream, falling back to the main pool (the local lab points
    it at a port nothing listens on: instance failures, an open circuit and fallbacks to watch).
    """
    pools = [
        {
            "model": MODEL,
            "tokenizer": "default",  # the bundled SmolLM2's GGUF: exact prompt counts
            "max_context": 2048,
            "capacity": 16,
            "max_queued": 256,
            # what a hosted model of its size might cost: the dashboard's cost panels have something to show
            "price_input_per_1m": 0.05,
            "price_output_per_1m": 0.2,
            "upstreams": [{"base_url": url, "name": name, "api_key_env": ENGINE_KEY_ENV} for name, url in engines],
        }
    ]
    if roles is not None:
        for upstream, role in zip(pools[0]["upstreams"], roles, strict=True):
            upstream["role"] = role
    if canary_url:
        pools.append(
            {
                "model": CANARY_MODEL,
                "tokenizer": "default",
                "max_context": 2048,
                "fallbacks": [MODEL],
                "upstreams": [{"base_url": canary_url, "name": "canary"}],
            }
        )
    return {
        "host": host,
        "port": port,
        "store_url": store_url,
        "state_url": state_url,
        "state": {"on_unavailable": "fail_closed"},
        "engine": {"enabled": False},
        "pools": pools,
        "timeouts": {"queue_s": 30, "ttft_s": 60, "total_s": 300, "connect_s": 2},
        "breaker": {"failures": 3, "cooldown_s": 5},
        "events": {"path": events_path},
        "load_poll_interval_s": 0.5,
        "usage_flush_interval_s": 1.0,
        "shutdown_grace_s": 10,
        "log_level": "info",
    }


def nginx_conf(gateways: list[str], listen: str, *, prefix: str | None = None) -> str:
    """nginx in front of the gateway replicas. prefix: a writable dir for pid/logs/temp (local processes)."""
    local = ""
    if prefix:
        local = f"pid {prefix}/nginx.pid;\nerror_log {prefix}/error.log warn;\n"
        http_local = (
            f"    access_log {prefix}/access.log;\n"
            f"    client_body_temp_path {prefix}/client_body;\n"
            f"    proxy_temp_path {prefix}/proxy;\n"
            f"    fastcgi_temp_path {prefix}/fastcgi;\n"
            f"    uwsgi_temp_path {prefix}/uwsgi;\n"
            f"    scgi_temp_path {prefix}/scgi;\n"
        )
    else:
        http_local = "    access_log /dev/stdout;\n"
    servers = "".join(f"        server {g} max_fails=0;\n" for g in gateways)
    return f"""# Rendered by deploy/render.py: the public entry point, round-robin over the gateway replicas.
worker_processes 1;
{local}events {{
    worker_connections 1024;
}}
http {{
{http_local}    upstream tokenweir_gateways {{
{servers}        keepalive 32;
    }}
    server {{
        listen {listen};
        client_max_body_size 4m;
        # /metrics lists teams and budgets: Prometheus scrapes each replica directly, never through here.
        location = /metrics {{
            return 404;
        }}
        location / {{
            proxy_pass http://tokenweir_gateways;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            # Server-sent events: pass every chunk at once, and let long generations run.
            proxy_buffering off;
            proxy_cache off;
            proxy_read_timeout 600s;
            proxy_send_timeout 600s;
            # A replica that refuses connections (restarting) passes the request to the other, never a half-sent one.
            proxy_next_upstream error timeout;
        }}
    }}
}}
"""


def prometheus_config(gateways: list[str], engines: list[str], *, interval: str = "5s") -> dict:
    """Scrape every gateway replica and every engine; alert rules from alerts.yml next to this file."""
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": ["alerts.yml"],
        "scrape_configs": [
            {"job_name": "tokenweir-gateway", "static_configs": [{"targets": gateways}]},
            {"job_name": "tokenweir-engine", "static_configs": [{"targets": engines}]},
        ],
    }


def dump_yaml(data: dict, header: str) -> str:
    return header + yaml.safe_dump(data, sort_keys=False)


def compose_files() -> dict[Path, str]:
    head = "# Rendered by deploy/render.py for docker-compose.yml (python -m deploy.render); do not edit by hand.\n"
    gw = gateway_config(
        COMPOSE_ENGINES, store_url=COMPOSE_STORE, state_url=COMPOSE_STATE, events_path="/data/events.jsonl"
    )
    prom = prometheus_config(COMPOSE_GATEWAYS, [u.removeprefix("http://") for _, u in COMPOSE_ENGINES])
    return {
        DEPLOY / "gateway.yaml": dump_yaml(
            gw,
            head + "# Each replica sets its own TOKENWEIR_EVENTS__PATH; TOKENWEIR_ADMIN_KEY seeds the admin key;\n"
            "# TOKENWEIR_ENGINE_API_KEY is the key the engines were started with (sent on every call to them).\n",
        ),
        DEPLOY / "nginx.conf": nginx_conf(COMPOSE_GATEWAYS, "8080"),
        DEPLOY / "prometheus.yml": dump_yaml(prom, head),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.render", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only compare with the committed files")
    args = p.parse_args(argv)
    stale = []
    from deploy.render_k8s import k8s_files

    for path, text in (compose_files() | k8s_files()).items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)} (run python -m deploy.render)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
