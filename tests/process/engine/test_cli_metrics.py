"""The engine CLI (vLLM's flag names, help without torch, --version), vLLM-parity metrics on /metrics and the engine's
JSON logs."""

import json
import subprocess
import sys

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.support.tiny_llama import make_tiny_llama
from tokenweir.engine.api import build_app
from tokenweir.engine.config import EngineConfig, SpeculativeConfig
from tokenweir.engine.core.async_engine import AsyncEngine
from tokenweir.engine.core.llm_engine import LLMEngine
from tokenweir.engine.flags import build_parser, engine_config, parse_args


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def test_help_imports_no_torch_and_documents_every_flag():
    code = (
        "import sys\nimport tokenweir.engine.server as m\n"
        "try:\n    m.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith("NO-TORCH")
    _assert_documents_every_flag(done.stdout)


def test_tokenweir_engine_runs_the_engine_server_by_command():
    """`tokenweir engine` replaces itself with `python -m tokenweir.engine.server`: the gateway's CLI never imports
    the engine."""
    code = "from tokenweir.gateway.process.cli import main; main(['engine', '--help']); print('NOT REPLACED')"
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert "NOT REPLACED" not in done.stdout
    _assert_documents_every_flag(done.stdout)


def _assert_documents_every_flag(help_text: str) -> None:
    for action in build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help text"
        for flag in action.option_strings:
            assert flag in help_text
    assert "(default: 64)" in help_text  # defaults are shown


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("tokenweir engine ") and out.split()[-1][0].isdigit()


def test_vllm_flag_names_map_onto_the_config():
    args = ["--gpu-memory-utilization", "0.5", "--dtype", "float32", "--seed", "7", "--max-model-len", "300"]
    config = engine_config(parse_args([*args, "--no-enable-prefix-caching", "--num-gpu-blocks-override", "9"]))
    assert (config.gpu_memory_utilization, config.dtype, config.seed, config.max_model_len) == (0.5, "float32", 7, 300)
    assert config.enable_prefix_caching is False and config.num_kv_blocks == 9
    # The defaults are EngineConfig's; the older spellings still work.
    default = engine_config(parse_args([]))
    assert default == EngineConfig(model="")
    assert engine_config(parse_args(["--no-prefix-caching"])).enable_prefix_caching is False
    assert engine_config(parse_args(["--enable-prefix-caching"])).enable_prefix_caching is True
    assert engine_config(parse_args(["--dtype", "half"])).dtype == "float16"
    assert engine_config(parse_args(["--kv-cache-memory", "1GiB"])).kv_cache_memory == 2**30


def test_every_lever_switches_from_the_command_line():
    default = engine_config(parse_args([]))
    assert default.enable_chunked_prefill and default.enable_prefix_caching and default.speculative is None
    config = engine_config(parse_args(["--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096"]))
    assert config.enable_chunked_prefill is False and config.max_num_batched_tokens == 4096
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 5}'
    config = engine_config(parse_args(["--speculative-config", spec]))
    assert config.speculative == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=5)
    assert "ngram k=3 n=1..5" in config.speculative.describe()
    assert default.scheduling_policy == "fcfs"
    assert engine_config(parse_args(["--scheduling-policy", "shortest-prompt"])).scheduling_policy == "shortest-prompt"


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("{not json", "is not JSON"),
        ('["ngram"]', "a JSON object"),
        ('{"method": "ngram", "num_speculative_token": 3}', "unknown key(s) ['num_speculative_token']"),
        ('{"method": "eagle"}', "speculative method: one of ngram, ngram_cache"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens: 1 to 16"),
        ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min: 1 to prompt_lookup_max"),
    ],
)
def test_a_bad_speculative_config_is_a_clear_error(value, says, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--speculative-config", value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--speculative-config" in err and says in err, err


@pytest.mark.parametrize(
    "bad", [["--dtype", "int8"], ["--gpu-memory-utilization", "1.5"], ["--gpu-memory-utilization", "x"]]
)
def test_bad_values_are_clear_errors(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(bad)
    assert exc.value.code == 2 and bad[0] in capsys.readouterr().err


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-metrics")), seed=3)


def histogram(families: dict, name: str) -> tuple[float, float, dict[str, float]]:
    """(count, sum, {le: cumulative count}) of a histogram with one label set."""
    samples = families[name].samples
    count = next(s.value for s in samples if s.name == name + "_count")
    total = next(s.value for s in samples if s.name == name + "_sum")
    buckets = {s.labels["le"]: s.value for s in samples if s.name == name + "_bucket"}
    return count, total, buckets


async def test_metrics_have_vllms_token_histograms_and_process_metrics(model_dir):
    threads = torch.get_num_threads()
    engine = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=32, max_model_len=256, num_threads=1))
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        transport = httpx.ASGITransport(build_app(async_engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=60) as client:
            # One at a time, so each step holds one request: prompt + max_tokens - 1 tokens over max_tokens steps.
            for prompt, max_tokens in [([5, 17, 42, 99, 3, 250, 8], 2), ([9, 8, 7, 6, 5, 4, 3], 3), ([1, 2, 3], 4)]:
                body = {"model": engine.model_name, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
                r = await client.post("/v1/completions", json={**body, "temperature": 0})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == max_tokens
            text = (await client.get("/metrics")).text
    finally:
        async_engine.stop()
        torch.set_num_threads(threads)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    count, total, buckets = histogram(families, "tokenweir:request_prompt_tokens")
    assert (count, total) == (3, 17)
    assert list(buckets) == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "+Inf"]  # <= max_model_len
    assert (buckets["2.0"], buckets["5.0"], buckets["10.0"]) == (0, 1, 3)
    count, total, buckets = histogram(families, "tokenweir:request_generation_tokens")
    assert (count, total) == (3, 9) and (buckets["2.0"], buckets["5.0"]) == (1, 3)
    count, total, buckets = histogram(families, "tokenweir:iteration_tokens_total")
    assert (count, total) == (2 + 3 + 4, (7 + 1) + (7 + 2) + (3 + 3))
    assert buckets["1.0"] == 2 + 1 + 3  # the decode steps
    assert families["tokenweir:iteration_tokens_total"].samples[0].labels["model_name"] == engine.model_name
    if sys.platform.startswith("linux"):
        assert families["process_cpu_seconds"].samples[0].value > 0
        assert "process_resident_memory_bytes" in families
    assert "python_info" in families


def test_engine_logs_are_json(model_dir):
    """The engine's stdlib loggers, uvicorn's and structlog's all print one JSON object a line on stderr."""
    code = f"""
import logging
from tokenweir.common.logging import configure
configure("info")
from tokenweir.engine.config import EngineConfig
from tokenweir.engine.core.llm_engine import LLMEngine
from tokenweir.common.logging import get_logger
LLMEngine(EngineConfig(model={model_dir!r}, num_kv_blocks=8, num_threads=1))
logging.getLogger("uvicorn.error").info("Application startup complete.")
logging.getLogger("tokenweir.engine").debug("below the level: not printed")
try:
    1 / 0
except ZeroDivisionError:
    logging.getLogger("tokenweir.engine").exception("engine step loop died")
get_logger("tokenweir.gateway").info("from structlog", n=1)
"""
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.strip()]
    by_event = {line["event"].split(":")[0]: line for line in lines}
    ready = by_event["engine ready"]
    assert ready["logger"] == "tokenweir.engine" and ready["level"] == "info" and "timestamp" in ready
    assert by_event["levers"]["event"] == (
        "levers: prefix_caching=on, chunked_prefill=on (chunks of 1024), scheduling_policy=fcfs, speculative=off, "
        "structured_outputs=per request, kv_transfer=off"
    )
    assert by_event["Application startup complete."]["logger"] == "uvicorn.error"
    assert "ZeroDivisionError" in by_event["engine step loop died"]["exception"]
    assert by_event["from structlog"]["n"] == 1
    assert not any("below the level" in line["event"] for line in lines)
