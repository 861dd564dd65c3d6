"""Kernel benchmark: Triton paged attention / KV write vs the torch reference, against copy bandwidth.

    .venv/bin/python loadtests/bench_kernels.py                      # CUDA: full table (fp16)
    .venv/bin/python loadtests/bench_kernels.py --dtype bf16 --quick
    .venv/bin/python loadtests/bench_kernels.py --smoke              # no GPU: tiny shapes through the Triton
                                                                     # interpreter, checks the plumbing

Decode is memory bound, so it is scored in GB/s of K/V (+ q and out) moved, next to the device's measured
device-to-device copy bandwidth (read + write of one large tensor); prefill is scored in causal TFLOP/s.
Times are medians of triton.testing.do_bench. Without CUDA and without --smoke it says so and exits 0.
`tokens_per_second(step)` is the hook for end-to-end engine throughput per backend.
"""

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

MODELS = {"smollm2-135m": (9, 3, 64), "llama-8b": (32, 8, 128)}  # name -> (Hq, Hkv, head_dim)
BLOCK_SIZE = 16


@dataclass
class Row:
    kernel: str
    model: str
    batch: int
    context: int
    detail: str  # splits for decode, q_len for prefill, tokens for store
    triton_ms: float
    torch_ms: float
    work: float  # bytes (decode, store) or flops (prefill)

    def format(self, copy_gbps: float) -> str:
        speedup = self.torch_ms / self.triton_ms
        if self.kernel == "prefill":
            rate = f"{self.work / self.triton_ms / 1e9:8.1f} TF/s  {'':>6}"
        else:
            gbps = self.work / self.triton_ms / 1e6
            rate = f"{gbps:8.0f} GB/s  {100 * gbps / copy_gbps:5.0f}%"
        return (
            f"{self.kernel:8} {self.model:13} {self.batch:>4} {self.context:>6} {self.detail:>8} "
            f"{self.triton_ms * 1e3:>10.1f} {rate} {self.torch_ms * 1e3:>10.1f} {speedup:>7.1f}x"
        )


HEADER = (
    f"{'kernel':8} {'model':13} {'B':>4} {'ctx':>6} {'detail':>8} {'triton_us':>10} {'rate':>14} {'of copy':>6} "
    f"{'torch_us':>10} {'speedup':>8}"
)


def cuda_timer(fn: Callable[[], object]) -> float:
    """Median milliseconds of fn on the current CUDA device."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def wall_timer(fn: Callable[[], object], reps: int = 3) -> float:
    """Median wall-clock milliseconds (the --smoke path, where there is no GPU to time)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbps(device: torch.device, timer: Callable, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy of one large tensor: (read + write) bytes / median time."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def make_cache(batch: int, context: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
    """A filled cache holding `batch` sequences of `context` tokens in shuffled blocks, plus their block tables."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    block_tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return k_cache, v_cache, block_tables, context_lens


def bench_decode(tp, ref, model: str, batch: int, context: int, dtype, device, timer) -> Row:
    num_heads, num_kv_heads, head_dim = MODELS[model]
    k_cache, v_cache, block_tables, context_lens = make_cache(batch, context, num_kv_heads, head_dim, dtype, device)
    q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=device)
    args = (q, k_cache, v_cache, block_tables, context_lens, head_dim**-0.5)
    splits = tp.pick_num_splits(batch, num_kv_heads, block_tables.shape[1] * BLOCK_SIZE, tp._num_sms(device))
    elem = q.element_size()
    moved = 2 * batch * context * num_kv_heads * head_dim * elem + 2 * q.numel() * elem  # K, V, q in, out
    return Row(
        "decode",
        model,
        batch,
        context,
        f"s={splits}",
        timer(lambda: tp.paged_decode_attention(*args)),
        timer(lambda: ref.paged_decode_attention(*args)),
        moved,
    )


def bench_prefill(tp, ref, model: str, batch: int, q_len: int, context: int, dtype, device, timer) -> Row:
    """`batch` chunks of q_len new tokens at the end of `context`-token sequences (q_len == context: fresh prompt)."""
    num_heads, num_kv_heads, head_dim = MODELS[model]
    k_cache, v_cache, block_tables, context_lens = make_cache(batch, context, num_kv_heads, head_dim, dtype, device)
    q = torch.randn(batch * q_len, num_heads, head_dim, dtype=dtype, device=device)
    cu = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=device)
    args = (q, k_cache, v_cache, block_tables, cu, context_lens, head_dim**-0.5)
    visible_keys = q_len * (context - q_len) + q_len * (q_len + 1) // 2  # per sequence and head
    flops = 4 * batch * num_heads * head_dim * visible_keys  # QK^T and PV, 2 flops per multiply-add
    return Row(
        "prefill",
        model,
        batch,
        context,
        f"q={q_len}",
        timer(lambda: tp.paged_prefill_attention(*args, max_seqlen_q=q_len)),
        timer(lambda: ref.paged_prefill_attention(*args)),
        flops,
    )


def bench_store(tp, ref, model: str, num_tokens: int, dtype, device, timer) -> Row:
    _, num_kv_heads, head_dim = MODELS[model]
    k_cache, v_cache, _, _ = make_cache(1, 2 * num_tokens, num_kv_heads, head_dim, dtype, device)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    value = torch.randn_like(key)
    slots = torch.randperm(k_cache.shape[0] * BLOCK_SIZE, device=device)[:num_tokens]
    args = (key, value, k_cache, v_cache, slots)
    moved = 2 * 2 * key.numel() * key.element_size()  # read key/value, write both caches
    return Row(
        "store_kv",
        model,
        1,
        0,
        f"n={num_tokens}",
        timer(lambda: tp.store_kv(*args)),
        timer(lambda: ref.store_kv(*args)),
        moved,
    )


def tokens_per_second(step: Callable[[], int], seconds: float = 10.0, warmup_steps: int = 3) -> float:
    """End-to-end hook: call step() (returns tokens it produced, e.g. one LLMEngine.step()) for ~seconds."""
    for _ in range(warmup_steps):
        step()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        tokens += step()
    sync()
    return tokens / (time.perf_counter() - start)


def run(dtype: torch.dtype, device: torch.device, timer: Callable, quick: bool, smoke: bool) -> list[str]:
    from tokenweir.kernels.attention import reference as ref
    from tokenweir.kernels.attention import triton_paged as tp

    if smoke:
        decode = [("smollm2-135m", 2, 40)]
        prefill = [("smollm2-135m", 1, 24, 40)]
        stores = [("smollm2-135m", 8)]
    else:
        batches = (1, 16, 64) if quick else (1, 4, 16, 32, 64)
        contexts = (512, 8192) if quick else (512, 2048, 8192)
        decode = [(m, b, c) for m in MODELS for b in batches for c in contexts]
        prefill = [(m, b, c, c) for m in MODELS for b in (1, 4) for c in contexts]
        prefill += [(m, 4, 512, 8192) for m in MODELS]  # a chunk late in a long prompt
        stores = [(m, n) for m in MODELS for n in (64, 4096)]
    copy_gbps = copy_bandwidth_gbps(device, timer, nbytes=(1 << 20) if smoke else (1 << 30))
    lines = [f"device: {device} {_device_name(device)}  dtype: {dtype}  copy bandwidth: {copy_gbps:.0f} GB/s", HEADER]
    print("\n".join(lines), flush=True)
    jobs = [partial(bench_decode, tp, ref, m, b, c, dtype, device, timer) for m, b, c in decode]
    jobs += [partial(bench_prefill, tp, ref, m, b, q, c, dtype, device, timer) for m, b, q, c in prefill]
    jobs += [partial(bench_store, tp, ref, m, n, dtype, device, timer) for m, n in stores]
    for job in jobs:
        lines.append(job().format(copy_gbps))
        print(lines[-1], flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # each shape allocates its own cache; the 8B x 64 x 8k one is ~2 GiB
    return lines


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "(Triton interpreter)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--smoke", action="store_true", help="no GPU needed: tiny fp32 shapes, interpreted Triton")
    args = parser.parse_args(argv)
    if args.smoke:
        # Must precede the first import of kernels.attention.triton_paged (run() imports it).
        os.environ["TRITON_INTERPRET"] = "1"
        run(torch.float32, torch.device("cpu"), wall_timer, quick=True, smoke=True)
        return 0
    if not torch.cuda.is_available():
        print("loadtests/bench_kernels.py needs CUDA to time the Triton kernels; try --smoke for a CPU plumbing check.")
        return 0
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    run(dtype, torch.device("cuda"), cuda_timer, quick=args.quick, smoke=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
