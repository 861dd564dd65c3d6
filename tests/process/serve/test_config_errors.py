"""Configuration mistakes stop `tokenweir serve` (one process or --workers N) and `tokenweir engine` with one line
naming the setting and what it expects, a non-zero exit and no traceback; an operator's own strong admin secret, in
any format, works as the admin key."""

from __future__ import annotations

import base64
import os
import secrets
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from loadtests.fake_upstream import FakeUpstream, free_port
from tests.support.serve_process import ROOT, serve_process
from tests.support.serve_thread import ServerThread

WEAK = "changeme"


def run_cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TOKENWEIR_")}
    return subprocess.run(
        [sys.executable, "-m", "tokenweir.gateway.process.cli", *args],
        cwd=ROOT,
        env={**environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("tokenweir"), line
    for word in words:
        assert word in line, line
    return line


def pool_yaml(tmp_path: Path, extra: str = "") -> Path:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"pools:\n  - model: m\n{extra}    upstreams:\n      - base_url: http://127.0.0.1:9\n")
    return cfg


@pytest.mark.parametrize("workers", [[], ["--workers", "2"]], ids=["one_process", "workers"])
def test_a_weak_admin_key_stops_serve_with_one_line_naming_the_setting_before_anything_starts(tmp_path, workers):
    db = tmp_path / "tw.db"
    args = ["serve", "--no-engine", "--config", str(pool_yaml(tmp_path)), "--port", "0", "--store", f"sqlite:///{db}"]
    env = {"TOKENWEIR_STATE_URL": "redis://127.0.0.1:6379/15"} if workers else {}
    proc = run_cli(args + workers, env={**env, "TOKENWEIR_ADMIN_KEY": WEAK})
    line = assert_one_line_error(proc, "TOKENWEIR_ADMIN_KEY", "at least 128 bits", "got 8 characters")
    assert WEAK not in line, "the secret itself is never echoed"
    assert "gateway on" not in proc.stdout and not db.exists(), "refused before the store was even opened"


def test_an_infinite_price_stops_serve_with_one_line_naming_the_price(tmp_path):
    cfg = pool_yaml(tmp_path, "    price_input_per_1m: .inf\n")
    proc = run_cli(["serve", "--no-engine", "--config", str(cfg), "--port", "0", "--store", "sqlite:///:memory:"])
    assert_one_line_error(proc, "pool m: price_input_per_1m", "from 0 to 1000000", "got inf")


def test_a_bad_engine_setting_stops_the_engine_with_one_line_naming_it():
    proc = run_cli(["engine", "--max-num-seqs", "0"])
    assert_one_line_error(proc, "max_num_seqs: at least 1, got 0")


def test_a_vault_style_admin_secret_is_the_admin_key_of_a_running_gateway(tmp_path):
    # A vault's own format: a prefix of its own, then standard base64 ('+', '/', '='), nothing like our `tw-` keys.
    secret = "vault:v1:" + base64.b64encode(secrets.token_bytes(32)).decode()
    with ServerThread(FakeUpstream(model="m")) as upstream:
        cfg = tmp_path / "c.yaml"
        cfg.write_text(
            f"pools:\n  - model: m\n    upstreams:\n      - base_url: {upstream.url}\n"
            f"events: {{path: {tmp_path}/ev.jsonl}}\n"
        )
        args = [
            "--no-engine",
            "--config",
            str(cfg),
            "--port",
            str(free_port()),
            "--store",
            f"sqlite:///{tmp_path}/d.db",
        ]
        with serve_process(args, env={"TOKENWEIR_ADMIN_KEY": secret}) as served:
            assert served.admin_key is None, "no admin key generated: the operator has theirs"
            admin = {"Authorization": f"Bearer {secret}"}
            r = httpx.post(served.url + "/admin/teams", json={"name": "vaulted"}, headers=admin)
            assert r.status_code == 201, r.text
            (key,) = [k for k in httpx.get(served.url + "/admin/keys", headers=admin).json()["data"] if k["is_admin"]]
            assert key["name"] == "env-admin" and key["prefix"] == secret[:4], key
            # one character off: the whole string is hashed, so this is an unknown key
            wrong = {"Authorization": f"Bearer {secret[:-2]}{'A' if secret[-2] != 'A' else 'B'}="}
            r = httpx.get(served.url + "/admin/teams", headers=wrong)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
