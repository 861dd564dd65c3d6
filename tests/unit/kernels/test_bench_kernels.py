"""loadtests/bench_kernels.py: without CUDA it says so and exits 0; --smoke runs every row through the interpreted
kernels."""

import time

import pytest

from loadtests import bench_kernels as bench
from tests.support.kernel_cases import DEVICE

pytestmark = pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU run `python loadtests/bench_kernels.py` itself")


def test_without_cuda_it_points_to_smoke(capsys):
    assert bench.main([]) == 0
    assert "needs CUDA" in capsys.readouterr().out


def test_smoke_prints_a_row_per_kernel(capsys):
    assert bench.main(["--smoke"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("device: cpu") and lines[1].split()[0] == "kernel"
    rows = {line.split()[0]: line for line in lines[2:]}
    assert set(rows) == {"decode", "prefill", "store_kv"}
    assert "GB/s" in rows["decode"] and "TF/s" in rows["prefill"] and "x" in rows["store_kv"].split()[-1]


def test_tokens_per_second_counts_only_timed_steps():
    def step() -> int:
        time.sleep(0.01)  # at least 10 ms per 4 tokens: at most 400 tok/s, unless warm-up steps were counted
        return 4

    rate = bench.tokens_per_second(step, seconds=0.05, warmup_steps=3)
    assert 0 < rate <= 400
