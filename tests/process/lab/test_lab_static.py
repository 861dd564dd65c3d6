"""The lab's files, without running them: compose schema, CLI flags, rendered configs, Dockerfile rules."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest
import yaml

from deploy import lab_probe, lab_procs, lab_topology, render

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent


@cache
def help_flags(*module_args: str) -> frozenset[str]:
    """Every --flag a CLI's own argparse help lists (a subprocess: the engine's parser imports torch)."""
    out = subprocess.run(
        [sys.executable, "-m", *module_args, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**lab_procs.clean_env(), "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    return frozenset(re.findall(r"(--[a-z][a-z0-9-]*)", out.stdout))


def flags_of(cmd: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in cmd if a.startswith("--")}


def check_tokenweir_cmd(cmd: list[str], where: str) -> None:
    """`tokenweir engine ...` / `tokenweir serve ...` (or python -m engine.server / gateway.process.cli serve)."""
    if cmd[:2] == ["tokenweir", "engine"] or "tokenweir.engine.server" in cmd:
        known = help_flags("tokenweir.engine.server")
    elif cmd[:2] == ["tokenweir", "serve"] or "tokenweir.gateway.process.cli" in cmd:
        assert "serve" in cmd, f"{where}: {cmd}"
        known = help_flags("tokenweir.gateway.process.cli", "serve")
    else:
        raise AssertionError(f"{where}: not a tokenweir command: {cmd}")
    unknown = flags_of(cmd) - known
    assert not unknown, f"{where}: {sorted(unknown)} not in the CLI's flags {sorted(known)}"


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_file_matches_the_compose_spec_schema():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((HERE / "compose_spec.json").read_text())
    # its "$schema" is draft/2019-09 spelled with a trailing '#', which jsonschema does not look up: name it
    jsonschema.Draft201909Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft201909Validator(schema).iter_errors(compose()), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_compose_topology():
    services = compose()["services"]
    for name in (
        "postgres",
        "redis",
        "engine-1",
        "engine-2",
        "gateway-1",
        "gateway-2",
        "nginx",
        "prometheus",
        "grafana",
    ):
        assert name in services, name
    public = [n for n, s in services.items() if s.get("ports") and n != "grafana"]
    assert public == ["nginx"], f"only nginx is the public entry point: {public}"
    events = set()
    for name in ("gateway-1", "gateway-2"):
        env = services[name]["environment"]
        assert "TOKENWEIR_ADMIN_KEY" in env
        events.add(env["TOKENWEIR_EVENTS__PATH"])
        assert services[name]["build"]["target"] == "gateway"
    assert len(events) == 2, "each replica writes its own events file"
    for name in ("engine-1", "engine-2"):
        assert services[name]["build"]["target"] == "engine"
    config = yaml.safe_load((ROOT / "deploy" / "gateway.yaml").read_text())
    assert config["state_url"] == "redis://redis:6379/0"
    assert config["store_url"].startswith("postgresql://") and "@postgres:" in config["store_url"]
    assert config["pools"][0]["tokenizer"] == "default"
    assert {u["base_url"] for u in config["pools"][0]["upstreams"]} == {"http://engine-1:8100", "http://engine-2:8100"}


def networks_of(svc: dict) -> set[str]:
    nets = svc.get("networks") or ["default"]
    return set(nets if isinstance(nets, list) else nets)


def test_compose_keeps_the_backend_internal_and_publishes_only_nginx_and_a_read_only_grafana():
    spec = compose()
    services, networks = spec["services"], spec.get("networks") or {}
    internal = {n for n, net in networks.items() if (net or {}).get("internal") is True}
    assert internal, "an internal network (no published ports, no way out) for the backend"
    for name in ("postgres", "redis", "engine-1", "engine-2", "gateway-1", "gateway-2", "prometheus"):
        svc = services[name]
        assert networks_of(svc) <= internal, f"{name} must sit on internal networks only: {networks_of(svc)}"
        assert not svc.get("ports"), f"{name} must publish no port: {svc.get('ports')}"
    assert networks_of(services["nginx"]) & internal and networks_of(services["nginx"]) - internal
    assert services["nginx"]["ports"] == ["8080:8080"]
    grafana = services["grafana"]
    assert [str(p).rsplit(":", 2)[0] for p in grafana["ports"]] == ["127.0.0.1"], "Grafana on the loopback only"
    env = grafana["environment"]
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert env["GF_AUTH_DISABLE_LOGIN_FORM"] == "true" and env["GF_AUTH_BASIC_ENABLED"] == "false"
    prometheus = " ".join(services["prometheus"]["command"])
    assert "--web.enable-lifecycle" not in prometheus and "--web.enable-admin-api" not in prometheus


def test_compose_engines_need_an_api_key_that_the_gateways_send():
    services = compose()["services"]
    for name in ("engine-1", "engine-2", "gateway-1", "gateway-2"):
        value = services[name]["environment"][render.ENGINE_KEY_ENV]
        assert value.startswith(f"${{{render.ENGINE_KEY_ENV}:?"), f"{name}: the key is required, never defaulted"
    for name in ("engine-1", "engine-2"):
        assert "--api-key" not in services[name]["command"], "a key in argv is visible to `ps` and inspect"
    upstreams = yaml.safe_load((ROOT / "deploy" / "gateway.yaml").read_text())["pools"][0]["upstreams"]
    assert {u.get("api_key_env") for u in upstreams} == {render.ENGINE_KEY_ENV}
    assert "--api-key" in help_flags("tokenweir.engine.server")


def test_compose_commands_use_existing_cli_flags():
    checked = 0
    for name, svc in compose()["services"].items():
        cmd = svc.get("command")
        if isinstance(cmd, list) and cmd and cmd[0] == "tokenweir":
            check_tokenweir_cmd(cmd, f"docker-compose.yml {name}")
            checked += 1
    assert checked == 4


def test_dockerfile_cmds_and_rules():
    text = (ROOT / "Dockerfile").read_text()
    assert "ARG PYTHON_IMAGE=python:3.11-slim-bookworm" in text
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    by_target = {s.split()[2]: s for s in stages if " AS " in s.splitlines()[0]}
    assert {"base", "gateway", "engine"} <= set(by_target)
    for target in ("gateway", "engine"):
        stage = by_target[target]
        assert re.search(r"^USER (?!root)\S+", stage, re.M), f"{target}: runs as a non-root user"
        assert "HEALTHCHECK" in stage
        cmd = json.loads(re.search(r"^CMD (\[.*\])$", stage, re.M).group(1))
        check_tokenweir_cmd(cmd, f"Dockerfile {target}")
    assert "/livez" in by_target["gateway"] and "/health" in by_target["engine"]
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for folder in package_dirs.values():  # pip install . in the image needs every folder the package is made of
        assert f"COPY {folder} {folder}\n" in text, f"Dockerfile: COPY {folder}"
    assert "torch" not in by_target["gateway"], "the gateway image has no torch"
    assert (
        "TORCH_VERSION=2.13.0" in by_target["engine"] and "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in text
    )
    for pins in ("constraints-gateway.txt", "constraints-engine.txt"):
        lines = [ln for ln in (ROOT / "deploy" / pins).read_text().splitlines() if ln and not ln.startswith("#")]
        assert lines and all(re.fullmatch(r"[a-z0-9._-]+==[0-9][^ ]*", ln) for ln in lines), pins
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", ".git", "data", "loadtests/results", "**/*.pyc", ".pytest_cache"} <= ignored


def test_lab_commands_use_existing_cli_flags(tmp_path):
    check_tokenweir_cmd(lab_topology.engine_cmd(8100), "deploy/lab_topology.py engine")
    for role in render.DISAGGREGATED_ROLES:
        check_tokenweir_cmd(lab_topology.engine_cmd(8100, role), f"deploy/lab_topology.py {role} engine")
    check_tokenweir_cmd(lab_topology.gateway_cmd(tmp_path / "g.yaml", 8000), "deploy/lab_topology.py gateway")
    # scripts/lab.sh hands its arguments to deploy.lab: the flags it documents must be deploy.lab's
    sh = (ROOT / "scripts" / "lab.sh").read_text()
    assert "-m deploy.lab" in sh
    documented = set(re.findall(r"(--[a-z][a-z0-9-]*)", "\n".join(ln for ln in sh.splitlines() if ln.startswith("#"))))
    assert documented and documented <= help_flags("deploy.lab")
    locust = lab_procs.locust_binary()
    if locust:
        out = subprocess.run([locust, "--help"], capture_output=True, text=True, timeout=60).stdout
        unknown = {f for f in flags_of(lab_probe.locust_cmd(locust, "http://x", 5, 2, tmp_path / "c")) if f not in out}
        assert not unknown, unknown


def test_rendered_files_are_current_and_valid(tmp_path):
    from tokenweir.gateway.config import load_config

    assert render.main(["--check"]) == 0, "run python -m deploy.render"
    config = load_config(ROOT / "deploy" / "gateway.yaml", env={render.ENGINE_KEY_ENV: "k3y"})
    assert [u.name for u in config.pools[0].upstreams] == ["engine-1", "engine-2"]
    assert {u.api_key for u in config.pools[0].upstreams} == {"k3y"}
    with pytest.raises(ValueError, match=f"api_key_env names {render.ENGINE_KEY_ENV}, which is not set"):
        load_config(ROOT / "deploy" / "gateway.yaml", env={})
    local = render.gateway_config(
        [("e", "http://127.0.0.1:1")], store_url="sqlite:///x.db", state_url="redis://h/0", events_path="/tmp/e.jsonl"
    )
    (tmp_path / "g.yaml").write_text(yaml.safe_dump(local))
    load_config(tmp_path / "g.yaml", env={render.ENGINE_KEY_ENV: "k3y"})
    engines = [("e1", "http://127.0.0.1:1"), ("e2", "http://127.0.0.1:2")]
    stores = {"store_url": "sqlite:///x.db", "state_url": "redis://h/0", "events_path": "/tmp/e.jsonl"}
    disagg = render.gateway_config(engines, **stores, roles=render.DISAGGREGATED_ROLES)
    (tmp_path / "d.yaml").write_text(yaml.safe_dump(disagg))
    pool = load_config(tmp_path / "d.yaml", env={render.ENGINE_KEY_ENV: "k3y"}).pools[0]
    assert pool.disaggregated and [u.role for u in pool.upstreams] == ["prefill", "decode"]
    promtool = shutil.which("promtool")
    assert promtool or not os.environ.get("CI"), "promtool: scripts/setup.sh installs it (apt-get install prometheus)"
    if promtool:
        for args in (
            ["check", "rules", str(ROOT / "deploy" / "alerts.yml")],
            ["test", "rules", str(ROOT / "deploy" / "alerts_test.yml")],  # TTFT p99 and KV cache alerts fire
            ["check", "config", "--syntax-only", str(ROOT / "deploy" / "prometheus.yml")],
        ):
            out = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stdout + out.stderr
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if nginx:
        (tmp_path / "ngx").mkdir()
        conf = tmp_path / "ngx" / "nginx.conf"
        conf.write_text(
            render.nginx_conf(
                ["127.0.0.1:1", "127.0.0.1:2"], f"127.0.0.1:{lab_procs.free_port()}", prefix=str(tmp_path / "ngx")
            )
        )
        out = subprocess.run(
            [nginx, "-t", "-p", str(tmp_path / "ngx"), "-e", str(tmp_path / "ngx" / "e.log"), "-c", str(conf)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr


def test_dashboard_and_grafana_provisioning():
    exprs = lab_probe.dashboard_exprs()
    assert len(exprs) >= 19
    titles = " ".join(t for t, _ in exprs).lower()
    for word in (
        "ttft",
        "tpot",
        "queue",
        "end-to-end",
        "tokens/s",
        "prefix cache",
        "kv",
        "running",
        "rejections",
        "per team",
        "budget",
        "circuit",
        "fallbacks",
        "acceptance",
        "prompt length",
        "output length",
        "errors/s by class",
        "cost",
        "revision",
    ):
        assert word in titles, word
    [change] = json.loads((ROOT / "deploy/grafana/dashboards/tokenweir.json").read_text())["annotations"]["list"]
    assert "tokenweir_gateway_config_loaded_timestamp_seconds" in change["expr"]
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    dash = json.loads((ROOT / "deploy/grafana/dashboards/tokenweir.json").read_text())
    uid = ds["datasources"][0]["uid"]
    assert all(t["datasource"]["uid"] == uid for p in dash["panels"] for t in p["targets"])
