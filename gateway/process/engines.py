"""The bundled engine children of `tokenweir serve`: their command line, one child (`start_engine` /
`stop_engine`), or N supervised as one pool (`EngineReplicas`). Started once, by the process that runs `serve`;
gateway workers (`serve --workers N`) only point their pools at them. Torch-free: `serve` must not import it.

Each start makes one random API key for its children (`engine_key`; TOKENWEIR_ENGINE_API_KEY in `serve`'s env
chooses it instead): they get it in their env, not on their command line (`ps` shows argv to every local user), and
the pool members that point at them send it. So a local process cannot be served by an engine directly, around
admission and billing, nor abort another tenant's request. Likewise one random KV transfer key per start
(TOKENWEIR_KV_TRANSFER_KEY in `serve`'s env chooses it instead), in every child's env: the prefill engines sign their
answers with it, and the decode engines fetch KV only from answers signed with it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from tokenweir.common.engine_flags import (
    API_KEY_ENV,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    KV_TRANSFER_KEY_ENV,
    parse_size,
)
from tokenweir.common.text.model_files import default_model_path
from tokenweir.gateway.config import BundledEngineConfig, GatewayConfig, PoolConfig, UpstreamConfig

if TYPE_CHECKING:
    from tokenweir.gateway.accounting.metrics import Metrics
    from tokenweir.gateway.upstream.instance import Instance
    from tokenweir.gateway.upstream.pools import Upstreams


def model_path_of(ec: BundledEngineConfig) -> str:
    try:
        return ec.model_path or default_model_path()
    except FileNotFoundError as e:
        sys.exit(f"tokenweir: {e} (or pass --model, or --no-engine with pools of your own)")


def engine_cmd(ec: BundledEngineConfig, model_path: str, port: int, index: int = 0) -> list[str]:
    """The engine child's command line; engine.num_threads and engine.kv_cache_memory shared out between the
    replicas (with replicas > 1 the threads default to the CPUs split evenly), the KV transfer role of replica
    `index` in a disaggregated pool; extra_args last, so they win."""
    n = ec.replicas
    cmd = [sys.executable, "-m", "tokenweir.engine.server", "--port", str(port), "--served-model-name", ec.model_name]
    cmd += ["--log-level", "warning"]  # its access log would print every /load poll
    if model_path:
        cmd += ["--model", model_path]
    threads = ec.num_threads or (_cpus() if n > 1 else None)
    if threads:
        cmd += ["--num-threads", str(max(1, threads // n))]
    if ec.kv_cache_memory:
        try:
            total = parse_size(ec.kv_cache_memory)
        except argparse.ArgumentTypeError as e:
            sys.exit(f"tokenweir: engine.kv_cache_memory: {e}")
        cmd += ["--kv-cache-memory", str(total // n)]
    if n > 1 or ec.gpu_memory_utilization is not None:  # each engine reads it as its own share of the GPU
        share = ec.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        cmd += ["--gpu-memory-utilization", f"{share / n:.4f}"]
    role = ec.role(index)
    if role != "both":
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
        cmd += ["--kv-transfer-config", json.dumps({"kv_role": kv_role})]
    return cmd + ec.extra_args


def engine_key(ec: BundledEngineConfig) -> str:
    """The children's API key: an `--api-key` in engine.extra_args (it would win over the env), else the one in
    `serve`'s own env (an operator who wants to call the engines directly), else a fresh one for this start."""
    args = ec.extra_args
    for i, arg in enumerate(args):
        if arg == "--api-key" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--api-key="):
            return arg.split("=", 1)[1]
    return os.environ.get(API_KEY_ENV) or secrets.token_urlsafe(32)


def engine_env(key: str) -> dict[str, str]:
    """The children's env, made once per start: their API key, and the KV transfer key they share."""
    kv_key = os.environ.get(KV_TRANSFER_KEY_ENV) or secrets.token_hex(32)
    return {**os.environ, API_KEY_ENV: key, KV_TRANSFER_KEY_ENV: kv_key}


def give_key(config: GatewayConfig, urls: set[str], key: str) -> None:
    """Configured pool members that point at our children and have no key of their own send the children's."""
    for pool in config.pools:
        for upstream in pool.upstreams:
            if upstream.base_url in urls and not upstream.api_key:
                upstream.api_key = key


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _bundled_pool(ec: BundledEngineConfig, model_path: str, upstreams: list[UpstreamConfig], models: dict):
    tokenizer = model_path if model_path and model_path.endswith(".gguf") else None
    pool = PoolConfig(
        model=ec.model_name,
        upstreams=upstreams,
        tokenizer=tokenizer,
        route=ec.route,
        cache_scope=ec.cache_scope,
        capacity=ec.capacity,
        fairness=ec.fairness,
    )
    # The engine knows its context window (model and KV pool): the gateway enforces it before dispatch.
    pool.max_context = ((models.get("data") or [{}])[0]).get("max_model_len")
    return pool


def start_engine(config: GatewayConfig) -> subprocess.Popen:
    import httpx

    ec = config.engine
    model_path = model_path_of(ec)
    from tokenweir.gateway.process.supervisor import die_with_parent

    key = engine_key(ec)
    proc = subprocess.Popen(engine_cmd(ec, model_path, ec.port), preexec_fn=die_with_parent(), env=engine_env(key))
    url = f"http://127.0.0.1:{ec.port}"
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            sys.exit(f"tokenweir: the engine exited with status {proc.returncode} while starting")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        waited = time.monotonic() - t0
        if waited > ec.startup_timeout_s:
            stop_engine(proc)
            sys.exit(f"tokenweir: the engine did not become healthy in {ec.startup_timeout_s:g}s")
        print(f"\rtokenweir: waiting for the engine on {url} ... {waited:4.0f}s", end="", flush=True)
        time.sleep(0.5)
    print(f"\rtokenweir: engine ready on {url} ({time.monotonic() - t0:.1f}s)          ", flush=True)
    give_key(config, {url}, key)
    if config.pool(ec.model_name) is None:
        models = httpx.get(url + "/v1/models", timeout=5.0, headers={"authorization": f"Bearer {key}"}).json()
        upstream = UpstreamConfig(url, name="engine-0", api_key=key)
        config.pools.insert(0, _bundled_pool(ec, model_path, [upstream], models))
    return proc


def stop_engine(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class EngineReplicas:
    """`serve --engines N` (N > 1): N engine children on consecutive free ports from engine.port, one pool
    (`engine-0` .. `engine-{N-1}`, route `prefix` unless the pool is configured), under
    gateway/process/supervisor.py, in the event loop of the process that runs `serve` (`start`, then `attach` to the
    app when it runs in this
    process, then `stop`).

    A child that exits is restarted with doubling backoff. Meanwhile its instance is down (gateway/upstream/instance.py
    `Instance.mark_down`: circuit open, no probes, its prefix-index entries forgotten) until a /load poll answers
    again. Each exit is a warning log line (`engine_exited`: status, restart count, wait) and a count in
    `tokenweir_gateway_engine_restarts_total`. Its requests in flight lose their upstream connection: dispatch
    retries those that had sent nothing to the client on the next instance, and ends a stream already under way
    with an `upstream_broken` error event naming the instance."""

    def __init__(self, config: GatewayConfig) -> None:
        from tokenweir.gateway.process.supervisor import Supervisor, consecutive_free_ports

        self.config, ec = config, config.engine
        self.ec = ec
        self.model_path = model_path_of(ec)
        base = consecutive_free_ports(ec.replicas, start=ec.port)
        self.key = engine_key(ec)
        self.supervisor = Supervisor(
            lambda index, port: engine_cmd(ec, self.model_path, port, index),
            ec.replicas,
            base,
            backoff_s=ec.restart_backoff_s,
            max_backoff_s=ec.restart_max_backoff_s,
            stable_s=ec.restart_stable_s,
            on_exit=self.on_exit,
            on_start=self.on_start,
            spawn_kwargs={"env": engine_env(self.key)},
        )
        logging.getLogger("tokenweir.supervisor").setLevel(logging.ERROR)  # its exit warning: ours, in JSON
        self.instances: dict[int, Instance | None] = {}  # child index -> its pool instance, once the app started
        self.metrics: Metrics | None = None

    @staticmethod
    def url(port: int) -> str:
        return f"http://127.0.0.1:{port}"

    def name(self, index: int) -> str:
        return f"engine-{index}"

    async def stop(self) -> None:
        await self.supervisor.stop(grace_s=15)

    async def start(self) -> None:
        """Start the children and wait until each answers /health; one that exits meanwhile ends `serve`."""
        import httpx

        children = self.supervisor.children
        ports = f"{children[0].port}..{children[-1].port}"
        print(f"tokenweir: starting {len(children)} engines on ports {ports}", flush=True)
        await self.supervisor.start()
        t0, pending = time.monotonic(), list(children)
        async with httpx.AsyncClient(timeout=1.0) as client:
            while pending:
                for child in list(pending):
                    if child.restarts or not child.running:
                        sys.exit(
                            f"tokenweir: engine {child.index} exited with status {child.last_status} while starting"
                        )
                    try:
                        if (await client.get(self.url(child.port) + "/health")).status_code == 200:
                            pending.remove(child)
                            print(f"tokenweir: engine {child.index} ready on {self.url(child.port)}", flush=True)
                    except httpx.HTTPError:
                        pass
                if time.monotonic() - t0 > self.ec.startup_timeout_s:
                    sys.exit(f"tokenweir: the engines did not become healthy in {self.ec.startup_timeout_s:g}s")
                if pending:
                    await asyncio.sleep(0.5)
            print(f"tokenweir: {len(children)} engines ready ({time.monotonic() - t0:.1f}s)", flush=True)
            give_key(self.config, {self.url(c.port) for c in children}, self.key)
            if self.config.pool(self.ec.model_name) is None:
                auth = {"authorization": f"Bearer {self.key}"}
                models = (await client.get(self.url(children[0].port) + "/v1/models", headers=auth, timeout=5.0)).json()
                upstreams = [
                    UpstreamConfig(
                        self.url(c.port), name=self.name(c.index), api_key=self.key, role=self.ec.role(c.index)
                    )
                    for c in children
                ]
                self.config.pools.insert(0, _bundled_pool(self.ec, self.model_path, upstreams, models))

    def attach(self, metrics: Metrics, upstreams: Upstreams) -> None:
        """The hooks reach the app's upstreams and metrics from now on (a configured pool of the same name that
        does not list these engines: exits are logged and counted only). Never attached under `--workers N`: the
        app runs in the workers, whose instances find a dead engine through their /load polls and breakers."""
        self.metrics = metrics
        pool = upstreams.get(self.ec.model_name)
        by_url = {i.cfg.base_url: i for i in pool.instances} if pool is not None else {}
        now = time.monotonic()
        for child in self.supervisor.children:
            inst = self.instances[child.index] = by_url.get(self.url(child.port))
            if inst is not None and not child.running:  # exited between its health check and now
                inst.mark_down(now)

    def _label(self, index: int) -> str:
        inst = self.instances.get(index)
        return inst.name if inst is not None else self.name(index)

    def on_exit(self, child) -> None:
        from tokenweir.common.logging import get_logger

        name = self._label(child.index)
        get_logger("tokenweir.supervisor").warning(
            "engine_exited",
            model=self.ec.model_name,
            upstream=name,
            port=child.port,
            pid=getattr(child.proc, "pid", None),
            status=child.last_status,
            restarts=child.restarts,
            restart_in_s=child.backoff_s,
        )
        if self.metrics is not None:
            self.metrics.engine_restarts.labels(self.ec.model_name, name).inc()
        inst = self.instances.get(child.index)
        if inst is not None:
            inst.mark_down(time.monotonic())

    def on_start(self, child) -> None:
        print(
            f"tokenweir: engine {child.index} (pid {child.proc.pid}) starting on {self.url(child.port)}",
            flush=True,
        )
        if child.restarts:
            from tokenweir.common.logging import get_logger

            get_logger("tokenweir.supervisor").info(
                "engine_restarted", upstream=self._label(child.index), pid=child.proc.pid, restarts=child.restarts
            )

    def kill_leftovers(self) -> None:
        """Backstop after the event loop is gone (a SIGTERM or an error in startup): kill a child still running
        that `Supervisor.stop` did not reap. waitpid first, so only a pid that is still our child is signalled."""
        for child in self.supervisor.children:
            pid = getattr(child.proc, "pid", None)
            if pid is None:
                continue
            try:
                if os.waitpid(pid, os.WNOHANG) != (0, 0):
                    continue  # reaped just now: it had exited
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ChildProcessError, ProcessLookupError):
                pass  # reaped already by the event loop
