"""`serve --engines N` without a model: the config and flags, each engine's command line (its share of threads and
KV memory), and what an engine's exit and return do to its instance (circuit, prefix index, metrics, log)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import orjson
import pytest
import structlog.testing

from tokenweir.common.engine_flags import KV_TRANSFER_KEY_ENV
from tokenweir.gateway.accounting.metrics import Metrics
from tokenweir.gateway.config import (
    BreakerConfig,
    BundledEngineConfig,
    GatewayConfig,
    PoolConfig,
    UpstreamConfig,
    load_config,
)
from tokenweir.gateway.process import cli
from tokenweir.gateway.process import engines as serve_engines
from tokenweir.gateway.process.supervisor import Child
from tokenweir.gateway.upstream.instance import CLOSED, OPEN
from tokenweir.gateway.upstream.load_poll import poll_instance
from tokenweir.gateway.upstream.pools import Upstreams


def test_replicas_from_the_file_and_env_and_validated(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("engine:\n  replicas: 3\n  kv_cache_memory: 1GiB\n")
    config = load_config(f, env={})
    assert (config.engine.replicas, config.engine.kv_cache_memory) == (3, "1GiB")
    assert load_config(f, env={"TOKENWEIR_ENGINE__REPLICAS": "2"}).engine.replicas == 2
    assert load_config(None, env={}).engine.replicas == 1
    with pytest.raises(ValueError, match="replicas"):
        load_config(None, env={"TOKENWEIR_ENGINE__REPLICAS": "0"})


def test_one_engine_keeps_todays_command_line():
    ec = BundledEngineConfig(extra_args=["--max-num-seqs", "8"])
    cmd = serve_engines.engine_cmd(ec, "/m.gguf", 8100)
    assert cmd == [
        sys.executable,
        "-m",
        "tokenweir.engine.server",
        "--port",
        "8100",
        "--served-model-name",
        "smollm2-135m",
        "--log-level",
        "warning",
        "--model",
        "/m.gguf",
        "--max-num-seqs",
        "8",
    ]


def test_replicas_share_threads_and_kv_memory_and_extra_args_win(monkeypatch):
    ec = BundledEngineConfig(replicas=2, num_threads=5, kv_cache_memory="1GiB", extra_args=["--num-threads", "7"])
    cmd = serve_engines.engine_cmd(ec, "/m.gguf", 8101)
    assert cmd[cmd.index("--num-threads") + 1] == "2"  # 5 // 2
    assert cmd[cmd.index("--kv-cache-memory") + 1] == str(2**29)
    assert cmd[-2:] == ["--num-threads", "7"]  # the operator's own flag comes last: argparse keeps it
    monkeypatch.setattr(serve_engines, "_cpus", lambda: 2)
    cmd = serve_engines.engine_cmd(BundledEngineConfig(replicas=4), "", 8100)
    assert cmd[cmd.index("--num-threads") + 1] == "1" and "--model" not in cmd  # never 0 threads
    with pytest.raises(SystemExit, match="kv_cache_memory"):
        serve_engines.engine_cmd(BundledEngineConfig(replicas=2, kv_cache_memory="lots"), "", 8100)


def test_replicas_split_the_gpu_share_each_engine_reads_as_its_own():
    cmd = serve_engines.engine_cmd(BundledEngineConfig(replicas=2), "", 8100)
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.4250"  # the engine's 0.85 default, halved
    cmd = serve_engines.engine_cmd(BundledEngineConfig(replicas=4, gpu_memory_utilization=0.8), "", 8100)
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.2000"
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        BundledEngineConfig(gpu_memory_utilization=1.5)


def test_a_gpu_kv_budget_is_the_processs_own_share_so_engines_started_one_after_another_get_equal_pools():
    """Two engines at 0.425 each on an 80 GiB GPU, 1 GiB of weights and 2 GiB of activation peak each, about
    0.5 GiB of CUDA context each: the second sees the first's memory gone from `free` and still gets the same."""
    from tokenweir.engine.worker.kv_sizing import kv_budget_bytes

    gib = 2**30
    total, weights, peak, context = 80 * gib, 1 * gib, 2 * gib, gib // 2
    first = kv_budget_bytes(total, total - context - weights, 0.425, weights, peak)
    assert first == int(0.425 * total) - weights - peak
    free_for_second = total - (context + weights + first) - context - weights
    assert kv_budget_bytes(total, free_for_second, 0.425, weights, peak) == first
    assert context + weights + first + context + weights + first + peak <= 0.85 * total + peak
    # never more than is free: a GPU mostly taken by another process
    assert kv_budget_bytes(total, 10 * gib, 0.9, weights, peak) == 8 * gib


def test_engines_flag_sets_replicas(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "serve_forever", lambda config: seen.setdefault("config", config))
    cli.main(["serve", "--engines", "3", "--engine-port", "9300"])
    assert (seen["config"].engine.replicas, seen["config"].engine.port) == (3, 9300)
    with pytest.raises(SystemExit):
        cli.main(["serve", "--engines", "0"])


def _replicas(tmp_path):
    config = GatewayConfig()
    config.engine = BundledEngineConfig(replicas=2, model_path=str(tmp_path / "m.gguf"), port=41000)
    replicas = serve_engines.EngineReplicas(config)
    children = replicas.supervisor.children
    ups = [UpstreamConfig(replicas.url(c.port), name=replicas.name(c.index)) for c in children]
    config.pools = [PoolConfig("smollm2-135m", ups)]
    config.breaker = BreakerConfig(failures=3, cooldown_s=0.0)
    metrics = Metrics()
    upstreams = Upstreams(config, metrics)
    for child in children:
        child.proc = SimpleNamespace(pid=1000 + child.index, returncode=None)  # running
    replicas.attach(metrics, upstreams)
    return replicas, upstreams, metrics


def test_an_exit_opens_the_circuit_forgets_the_prefix_index_counts_and_logs(tmp_path):
    replicas, upstreams, metrics = _replicas(tmp_path)
    pool = upstreams.get("smollm2-135m")
    e0, e1 = pool.instances
    pool.index.record("engine-0", [11, 12])
    pool.index.record("engine-1", [21])
    child: Child = replicas.supervisor.children[0]
    child.last_status, child.restarts, child.backoff_s = -9, 1, 0.5
    with structlog.testing.capture_logs() as logs:
        replicas.on_exit(child)

    assert e0.circuit == OPEN and not e0.available(1e12)  # no half-open probe while it is down, cooldown or not
    assert e1.circuit == CLOSED and e1.available(0)
    assert pool.index.match([11, 12]) == {} and pool.index.match([21]) == {"engine-1": 1}
    sample = metrics.registry.get_sample_value
    labels = {"model": "smollm2-135m", "upstream": "engine-0"}
    assert sample("tokenweir_gateway_engine_restarts_total", labels) == 1
    assert sample("tokenweir_gateway_upstream_circuit_state", labels) == OPEN
    hops, why, _ = upstreams.route("smollm2-135m")
    assert [h.instance.name for h in hops] == ["engine-1"]
    logged = next(x for x in logs if x["event"] == "engine_exited")
    assert (logged["log_level"], logged["upstream"], logged["status"], logged["restarts"]) == (
        "warning",
        "engine-0",
        -9,
        1,
    )


class _Answer:
    def __init__(self, status: int, body: dict) -> None:
        self.status_code, self.body = status, orjson.dumps(body)

    async def read(self) -> bytes:
        return self.body

    async def aclose(self) -> None:
        pass


class _Client:
    def __init__(self, answer) -> None:
        self.answer = answer

    async def request(self, method, url, body=b"", headers=None):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


async def test_the_circuit_closes_when_its_load_answers_again(tmp_path):
    from tokenweir.gateway.upstream.client import HTTPError

    replicas, upstreams, metrics = _replicas(tmp_path)
    e0 = upstreams.get("smollm2-135m").instances[0]
    replicas.on_exit(replicas.supervisor.children[0])
    await poll_instance(_Client(HTTPError("refused")), e0)  # still restarting
    assert e0.circuit == OPEN
    await poll_instance(_Client(_Answer(200, {"num_running": 0, "num_waiting": 0})), e0)
    assert e0.circuit == CLOSED and e0.available(0) and e0.failures == 0
    labels = {"model": "smollm2-135m", "upstream": "engine-0"}
    assert metrics.registry.get_sample_value("tokenweir_gateway_upstream_circuit_state", labels) == CLOSED


def test_prefill_engines_take_the_producer_role_and_the_rest_decode():
    ec = BundledEngineConfig(replicas=3, prefill_replicas=1)
    roles = [serve_engines.engine_cmd(ec, "", 8100 + i, i) for i in range(3)]
    kv = [orjson.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_role"] for cmd in roles]
    assert kv == ["kv_producer", "kv_consumer", "kv_consumer"]
    assert [ec.role(i) for i in range(3)] == ["prefill", "decode", "decode"]
    assert "--kv-transfer-config" not in serve_engines.engine_cmd(BundledEngineConfig(replicas=2), "", 8100, 1)
    with pytest.raises(ValueError, match="prefill_replicas"):
        BundledEngineConfig(replicas=2, prefill_replicas=2)
    with pytest.raises(ValueError, match="decode"):  # a pool of prefill members alone has no one to stream from
        PoolConfig(model="m", upstreams=[UpstreamConfig("http://127.0.0.1:1", role="prefill")])
    with pytest.raises(ValueError, match="our engines"):
        UpstreamConfig("http://127.0.0.1:1", role="decode", engine=False)


def test_the_engines_of_one_start_share_a_fresh_kv_transfer_key_in_their_env(monkeypatch, tmp_path):
    monkeypatch.delenv(KV_TRANSFER_KEY_ENV, raising=False)
    first, second = (_replicas(tmp_path)[0] for _ in range(2))
    key = first.supervisor.spawn_kwargs["env"][KV_TRANSFER_KEY_ENV]  # one env for every child, restarts included
    assert len(key) == 64 and key != second.supervisor.spawn_kwargs["env"][KV_TRANSFER_KEY_ENV]
    assert not any(key in arg for i in range(2) for arg in serve_engines.engine_cmd(first.ec, "", 8100, i))
    monkeypatch.setenv(KV_TRANSFER_KEY_ENV, "chosen-by-the-operator-0123456789")  # engines of its own share it
    assert serve_engines.engine_env("api")[KV_TRANSFER_KEY_ENV] == "chosen-by-the-operator-0123456789"


def test_prefill_engines_flag(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["tokenweir"])
    with pytest.raises(SystemExit):
        cli.main(["serve", "--engines", "2", "--prefill-engines", "2"])


def test_the_bundled_pools_cache_scope_comes_from_the_engine_section_and_is_validated(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("engine:\n  cache_scope: shared\n")
    config = load_config(f, env={})
    pool = serve_engines._bundled_pool(config.engine, "", [UpstreamConfig("http://127.0.0.1:1")], {})
    assert pool.cache_scope == "shared"
    default = load_config(None, env={}).engine
    assert serve_engines._bundled_pool(default, "", [UpstreamConfig("http://127.0.0.1:1")], {}).cache_scope == "team"
    with pytest.raises(ValueError, match="cache_scope"):
        serve_engines._bundled_pool(
            BundledEngineConfig(cache_scope="everyone"), "", [UpstreamConfig("http://127.0.0.1:1")], {}
        )
