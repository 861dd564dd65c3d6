"""--batch-invariant on CPU: a row's output never depends on the rest of its batch or chunk.

Each projection format gives a row the same bits in a batch of any size (1 to 300 rows: decode batches and prefill
chunks alike), where without the flag a prefill-sized batch of Q4_1 blocks takes bfloat16 GEMMs. Then the default
model with `--dtype auto` (bfloat16 prefill chunks on a CPU with native bf16): 32 prompts' greedy tokens are the same
decoded alone, batched together, after a prefix-cache hit, and across a prefill/decode split (the consumer fetching
the producer's KV), with the engines' kernels checked to be the invariant ones."""

import pytest
import torch

from tests.support.kv_transfer import PROMPTS, decode_hop, greedy, kv_engine, prefill_hops, run
from tokenweir.engine.model.gguf_blocks import BLOCK_BYTES, GGUFBlocks
from tokenweir.engine.model.linear import DenseLinear, Int8Linear, Q4Linear
from tokenweir.kernels.cpu import ops as cpu_ops

IN, OUT = 576, 192  # SmolLM2's hidden size; the output width only sets the test's cost
BATCH_SIZES = (1, 3, 16, 17, 64, 65, 129, 300)  # both sides of every size switch the projections have


def random_q4_1(rows: int, in_features: int, seed: int = 0) -> GGUFBlocks:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, in_features // 32, BLOCK_BYTES["Q4_1"]), dtype=torch.uint8, generator=g)
    scales = (torch.rand(rows, in_features // 32, 2, generator=g) * 0.02 - 0.01).to(torch.float16)
    raw[..., 0:4] = scales.view(torch.uint8)  # d and m of each block: small, so sums stay in float32's range
    return GGUFBlocks("Q4_1", raw.reshape(rows, -1))


def projections(batch_invariant: bool) -> dict[str, object]:
    weight = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(1)) * 0.05
    made = {"dense": DenseLinear(weight, batch_invariant)}
    if cpu_ops.load() is not None:
        made |= {
            "int8": Int8Linear(weight, batch_invariant=batch_invariant),
            "w8a8": Int8Linear(weight, int8_activations=True, batch_invariant=batch_invariant),
        }
        for planes in (1, 2):
            for prefill in (torch.bfloat16, torch.int8, torch.float32):
                name = f"q4_1 planes={planes} prefill={prefill}"
                made[name] = Q4Linear(random_q4_1(OUT, IN), planes, prefill, batch_invariant)
    return made


def moved_rows(linear, x: torch.Tensor) -> list[int]:
    """The batch sizes at which some row's output differs (in any bit) from that row computed alone."""
    alone = torch.cat([linear(x[i : i + 1]) for i in range(len(x))])
    return [m for m in BATCH_SIZES if not torch.equal(linear(x[:m]), alone[:m])]


def test_each_projection_gives_a_row_the_same_bits_in_any_batch():
    x = torch.randn(max(BATCH_SIZES), IN, generator=torch.Generator().manual_seed(2))
    moved = {name: moved_rows(linear, x) for name, linear in projections(batch_invariant=True).items()}
    assert moved == {name: [] for name in moved}
    # and the flag is what does it: without it a prefill-sized batch of Q4_1 blocks takes a bfloat16 GEMM
    if cpu_ops.load() is not None:
        plain = projections(batch_invariant=False)["q4_1 planes=2 prefill=torch.bfloat16"]
        assert moved_rows(plain, x) == [65, 129, 300]


@pytest.mark.slow
def test_greedy_tokens_are_the_same_alone_batched_after_a_prefix_hit_and_across_a_split():
    if cpu_ops.load() is None:
        pytest.skip("the CPU kernels could not be built here: there is no batch-invariant CPU path to test")
    producer, consumer = kv_engine("kv_producer"), kv_engine("kv_consumer")
    model = consumer.engine.runner.model
    assert model.batch_invariant and model.attention_backend == "cpu"
    layer = model.layers[0]
    assert layer.attention.decode_as_prefill and not layer.attention.prefill_bf16
    assert all(getattr(p, "small_m", 0) > 10**6 for p in layer.projections())  # the decode kernels for every batch

    prompts = [f"[invariant] {p}" for p in PROMPTS]  # a first block of their own: no engine has them cached yet
    batched = run(producer, prompts, [greedy()] * len(prompts))
    alone = [run(consumer, [p], [greedy()])[0] for p in prompts]
    assert alone == batched
    cached = run(consumer, prompts, [greedy()] * len(prompts))  # every full block of every prompt from its cache
    assert sum(out.num_cached_tokens for out in run.finals) > 16 * len(prompts)  # type: ignore[attr-defined]
    assert cached == batched

    prompts = [f"[split] {p}" for p in PROMPTS]  # new to the consumer: its decode hops fetch the producer's KV
    batched = run(producer, prompts, [greedy()] * len(prompts))
    answers = prefill_hops(producer, prompts)
    fetched = consumer.engine.kv_transfer.fetched_bytes
    split = run(consumer, prompts, [decode_hop(greedy(), a) for a in answers])
    assert split == batched
    assert consumer.engine.kv_transfer.fetched_bytes > fetched and consumer.engine.kv_transfer.num_fetch_failures == 0
