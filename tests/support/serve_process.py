"""`tokenweir serve` as a real child process for tests: start it, read the keys it prints, wait for /health."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class ServeProcess:
    proc: subprocess.Popen
    url: str
    output: str
    admin_key: str | None
    demo_key: str | None


@contextmanager
def serve_process(args: list[str], env: dict[str, str | None] | None = None, timeout_s: float = 60):
    """Run `python -m gateway.process.cli serve ARGS` until the block ends (killed if still alive then). `env` adds to
    this process's environment; a None value removes that variable."""
    port = int(args[args.index("--port") + 1])
    child_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenweir.gateway.process.cli", "serve", *args],
        cwd=ROOT,
        env={k: v for k, v in child_env.items() if v is not None},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, deadline = "", time.monotonic() + timeout_s
        while "gateway on" not in out and time.monotonic() < deadline and proc.poll() is None:
            out += proc.stdout.readline()
        assert "gateway on" in out, out
        url = f"http://127.0.0.1:{port}"
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        admin = re.search(r"ADMIN key .*: (tw-\S+)", out)
        demo = re.search(r"demo team key .*: (tw-\S+)", out)
        yield ServeProcess(proc, url, out, admin and admin.group(1), demo and demo.group(1))
    finally:
        if proc.poll() is None:
            proc.kill()
