"""Batch-1 decode speed of the in-process engine in each CPU weight format:

    .venv/bin/python loadtests/bench_decode_step.py                 # kernels, then decode steps
    .venv/bin/python loadtests/bench_decode_step.py --profile       # plus the top ops of a few profiled steps

"int8" (weight-only) widens int8 weights to float32 against float32 activations (kernels/cpu/int8_linear.cpp);
"w8a8" (q8) rounds the activations to int8 per 32 values and multiplies in integers (kernels/cpu/q8_linear.cpp);
"gguf" multiplies the GGUF's own Q4_1 blocks by activations rounded to Q8_1 (kernels/cpu/q4_linear.cpp) and its Q8_0
lm_head by the q8 kernel; "gguf-a16" the same blocks with the activations in two int8 planes (~15 bits). int8 and
w8a8 run on one engine, switched per projection; each gguf mode on an engine of its own in the same process. All
are alternated repetition by repetition, because the cores here are shared and their speed drifts: compare the
ratios, not the absolute numbers of two runs.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenweir.engine.config import EngineConfig  # noqa: E402
from tokenweir.engine.core.llm_engine import LLMEngine  # noqa: E402
from tokenweir.engine.model import linear as engine_linear  # noqa: E402
from tokenweir.engine.model.gguf_blocks import pack_q4_1  # noqa: E402
from tokenweir.engine.model.linear import Int8Linear, _grouped_int8  # noqa: E402
from tokenweir.engine.sched.sampling_params import SamplingParams  # noqa: E402
from tokenweir.kernels.cpu import ops as cpu_ops  # noqa: E402
from tokenweir.kernels.cpu.ops import int8_linear, q4_1_linear, q8_linear  # noqa: E402

KERNELS = {"weight-only": int8_linear, "q8": q8_linear, "q4_1": q4_1_linear}
SHAPES = [(576, 1536), (1536, 576), (576, 49152)]  # (K, N): o_proj-like, down_proj, lm_head (Q8_0 in the GGUF)
# --quantization -> its decode kernel
MODES = {"int8": "weight-only", "w8a8": "q8", "gguf": "q4_1 x q8_1", "gguf-a16": "q4_1 x 2 int8 planes"}


def time_call(fn, budget_s: float) -> float:
    """Seconds per call: the best of five rounds, each as many calls as fit about budget_s / 5."""
    fn()
    start = time.perf_counter()
    fn()
    calls = max(1, int(budget_s / 5 / max(time.perf_counter() - start, 1e-6)))
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls)
    return min(rounds)


def bench_kernels(reps: int) -> None:
    """Each shape with its weights hot (one copy, reused from the caches) and cold (copies cycled through, 96 MiB of
    int8 weights, more than the L3, and as many Q4_1 copies: what a decode step does, whose weights are read once
    each)."""
    print("| K | N | M | weights | weight-only ms | q8 ms | q4_1 ms | q8 speed-up | q4_1 speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k, n in SHAPES:
        w = torch.randn(n, k) * 0.05
        weight, scales = _grouped_int8(w)
        packed = pack_q4_1(torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType.Q4_1)))
        count = -(-96 * 2**20 // (n * k))
        copies = {
            "weight-only": [(weight, scales)] + [(weight.clone(), scales.clone()) for _ in range(count - 1)],
            "q4_1": [(packed,)] + [(packed.clone(),) for _ in range(count - 1)],
        }
        copies["q8"] = copies["weight-only"]
        for m in (1, 16):
            x = torch.randn(m, k)
            for cache in ("hot", "cold"):
                times = {name: [] for name in KERNELS}
                for _ in range(reps):  # alternated, so all see the same neighbours on the cores
                    for name, kernel in KERNELS.items():
                        weights = itertools.cycle(copies[name][:1] if cache == "hot" else copies[name])
                        times[name].append(time_call(lambda k=kernel, x=x, ws=weights: k(x, *next(ws)), 0.3))
                old, q8, q4 = (min(times[name]) * 1e3 for name in KERNELS)
                print(
                    f"| {k} | {n} | {m} | {cache} | {old:.3f} | {q8:.3f} | {q4:.3f} | {old / q8:.2f}x | "
                    f"{old / q4:.2f}x |",
                    flush=True,
                )


def projections(engine: LLMEngine) -> list[Int8Linear]:
    model = engine.model
    found = [p for layer in model.layers for p in layer.projections()] + [model.lm_head]
    assert all(isinstance(p, Int8Linear) for p in found), "the engine did not build int8 projections"
    return found


def decode_steps(engine: LLMEngine, prompt: list[int], tokens: int) -> list[float]:
    """Seconds of each decode step of one greedy request (the prefill step is not counted)."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine.add_request(f"bench-{time.monotonic_ns()}", prompt, params)
    engine.step()  # prefill and first token
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return steps


def bench_decode(engines: dict[str, LLMEngine], reps: int, prompt_len: int, tokens: int) -> None:
    """engines: --quantization -> its engine (int8 and w8a8 may share one: its projections are switched)."""
    prompt = list(range(1000, 1000 + prompt_len))
    per_mode: dict[str, list[float]] = {mode: [] for mode in engines}
    print(f"\nbatch-1 decode, prompt {prompt_len} tokens, {tokens} new tokens per repetition, median step of each")
    print("| repetition | mode | kernel | ms/step | tok/s |\n|---|---|---|---|---|")
    for engine in set(engines.values()):
        decode_steps(engine, prompt, 8)  # warm-up
    for rep in range(reps):
        order = list(engines)[rep % len(engines) :] + list(engines)[: rep % len(engines)]  # rotated
        for mode in order:
            engine = engines[mode]
            if mode in ("int8", "w8a8"):
                for p in projections(engine):
                    p.int8_activations = mode == "w8a8"
            ms = statistics.median(decode_steps(engine, prompt, tokens)) * 1e3
            per_mode[mode].append(ms)
            print(f"| {rep + 1} | {mode} | {MODES[mode]} | {ms:.2f} | {1e3 / ms:.1f} |", flush=True)
    first = statistics.median(per_mode[next(iter(engines))])
    print(f"\n| mode | kernel | median ms/step | tok/s | speed-up over {next(iter(engines))} | weights MiB/step |")
    print("|---|---|---|---|---|---|")
    for mode, times in per_mode.items():
        ms, mib = statistics.median(times), engines[mode].model.weight_bytes_per_step() / 2**20
        print(f"| {mode} | {MODES[mode]} | {ms:.2f} | {1e3 / ms:.1f} | {first / ms:.2f}x | {mib:.0f} |")


class Labelled:
    """Every callable attribute of `target`, called inside a profiler range of its name: the C++ kernels are
    pybind functions, which the profiler would otherwise not see."""

    def __init__(self, target, prefix: str) -> None:
        self._target, self._prefix = target, prefix

    def __getattr__(self, name: str):
        attr = getattr(self._target, name)
        return labelled(attr, f"{self._prefix}.{name}") if callable(attr) else attr


def labelled(fn, label: str):
    from torch.profiler import record_function

    def call(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)

    return call


def profile_steps(engine: LLMEngine, mode: str, prompt_len: int, steps: int) -> None:
    """Decode steps of `mode`: w8a8 on the int8 engine, or gguf."""
    from torch.profiler import ProfilerActivity, profile, record_function

    if mode == "w8a8":
        for p in projections(engine):
            p.int8_activations = True
    model = engine.model
    engine_linear.q8_linear = labelled(engine_linear.q8_linear, "q8_linear")  # what Int8Linear calls
    cpu_ops.q4_1_linear = labelled(cpu_ops.q4_1_linear, "q4_1_linear")  # what Q4Linear calls
    model.lm_head = labelled(model.lm_head, "lm_head (q8_linear)")
    for attention in {id(layer.attention): layer.attention for layer in model.layers}.values():  # shared
        attention.ops = Labelled(attention.ops, "attention")
    for layer in model.layers:
        layer.fused = Labelled(layer.fused, "fused") if layer.fused is not None else None
    model.forward = labelled(model.forward, "model.forward")
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    engine.add_request("profiled", list(range(1000, 1000 + prompt_len)), params)
    engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished_requests():
            with record_function("engine.step"):
                engine.step()
    print(f"\nprofile of {steps} batch-1 decode steps ({mode}); C++ kernels labelled by their Python name")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=4, help="alternated repetitions of each kernel")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per repetition")
    parser.add_argument("--skip-kernels", action="store_true", help="only the decode steps")
    parser.add_argument("--profile", action="store_true", help="also profile decode steps (gguf, else w8a8)")
    parser.add_argument("--modes", default=",".join(MODES), help="--quantization modes to alternate, comma-separated")
    args = parser.parse_args()
    modes = args.modes.split(",")
    assert modes and set(modes) <= set(MODES), f"--modes: some of {', '.join(MODES)}"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}")
    if not args.skip_kernels:
        bench_kernels(max(2, args.reps // 2))
    config = {"dtype": "float32", "max_model_len": 2048, "num_kv_blocks": 256}
    int8 = LLMEngine(EngineConfig(quantization="int8", **config)) if {"int8", "w8a8"} & set(modes) else None
    engines = {
        mode: int8 if mode in ("int8", "w8a8") else LLMEngine(EngineConfig(quantization=mode, **config))
        for mode in modes
    }
    bench_decode(engines, args.reps, args.prompt, args.tokens)
    if args.profile and {"gguf", "w8a8"} & set(modes):
        mode = "gguf" if "gguf" in modes else "w8a8"
        profile_steps(engines[mode], mode, args.prompt, 32)


if __name__ == "__main__":
    main()
