"""store_kv writes exactly the mapped slots (both backends) and leaves every other slot, -1 included, alone."""

import pytest
import torch

from tests.support.kernel_cases import DEVICE, randn
from tokenweir.kernels.attention import reference, triton_paged


@pytest.mark.parametrize("impl", [reference, triton_paged], ids=["torch", "triton"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_writes_mapped_slots_only(impl, slot_dtype):
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, num_kv_heads, head_dim = 6, 16, 3, 64
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = randn(shape, gen=gen)
    v_cache = randn(shape, gen=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    # key/value as strided views into one fused qkv projection, as the model produces them.
    qkv = randn(7, 9 + 2 * num_kv_heads, head_dim, gen=gen)
    key, value = qkv[:, 9 : 9 + num_kv_heads], qkv[:, 9 + num_kv_heads :]
    slots = torch.tensor([17, -1, 0, 95, -1, 50, 40], dtype=slot_dtype, device=DEVICE)  # -1 = padded batch rows

    impl.store_kv(key, value, k_cache, v_cache, slots)

    k_expected, v_expected = k_before.clone(), v_before.clone()
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_expected.view(-1, num_kv_heads, head_dim)[slot] = key[row]
            v_expected.view(-1, num_kv_heads, head_dim)[slot] = value[row]
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


def test_store_kv_all_padding_and_empty_batch():
    k_cache = torch.zeros(2, 16, 2, 64, device=DEVICE)
    v_cache = torch.zeros(2, 16, 2, 64, device=DEVICE)
    for impl in (reference, triton_paged):
        impl.store_kv(
            torch.ones(3, 2, 64, device=DEVICE),
            torch.ones(3, 2, 64, device=DEVICE),
            k_cache,
            v_cache,
            torch.full((3,), -1, device=DEVICE),
        )
        impl.store_kv(
            torch.ones(0, 2, 64, device=DEVICE),
            torch.ones(0, 2, 64, device=DEVICE),
            k_cache,
            v_cache,
            torch.zeros(0, dtype=torch.int64, device=DEVICE),
        )
    assert not k_cache.any() and not v_cache.any()
