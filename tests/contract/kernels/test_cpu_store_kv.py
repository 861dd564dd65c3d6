"""The C++ store_kv (kernels/cpu/store_kv.cpp) writes exactly what the torch reference writes: random distinct slots
with -1 padding, key/value as strided views of a fused qkv row, int32 and int64 slots, every cache dtype the engine
uses; copies that would convert dtypes go to the reference through the "cpu" backend; a bad slot raises before any
write."""

import pytest
import torch

from tokenweir.kernels.attention import cpu_paged, reference
from tokenweir.kernels.cpu import ops as cpu_ops


def case(num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, slot_dtype: torch.dtype, seed: int):
    """(key, value, k_cache, v_cache, slots): key/value views into one [N, Hq + 2 Hkv, D] projection, as the model
    makes them, and about a third of the rows padding."""
    g = torch.Generator().manual_seed(seed)
    num_blocks, block_size = 8, 16
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    num_heads = 3 * num_kv_heads
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=g).to(dtype)
    key, value = qkv[:, num_heads : num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.3] = -1
    return key, value, k_cache, v_cache, slots.to(slot_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_tokens,num_kv_heads,head_dim", [(1, 3, 64), (7, 3, 64), (100, 4, 16), (5, 1, 24)])
def test_kernel_writes_what_the_reference_writes(num_tokens, num_kv_heads, head_dim, dtype, slot_dtype):
    key, value, k_cache, v_cache, slots = case(num_tokens, num_kv_heads, head_dim, dtype, slot_dtype, num_tokens)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, k_want, v_want, slots)
    assert cpu_ops.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


def test_a_copy_that_converts_falls_back_to_the_reference():
    key, value, k_cache, v_cache, slots = case(6, 3, 64, torch.bfloat16, torch.int64, 1)
    key, value = key.float(), value.float()  # float32 rows into a bfloat16 cache
    k_want, v_want = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, k_want, v_want, slots)
    before = k_cache.clone()
    assert not cpu_ops.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, before)  # declined without writing
    cpu_paged.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


def test_all_padding_and_an_empty_batch_write_nothing():
    k_cache, v_cache = torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64)
    ones = torch.ones(3, 2, 64)
    cpu_paged.store_kv(ones, ones, k_cache, v_cache, torch.full((3,), -1))
    cpu_paged.store_kv(ones[:0], ones[:0], k_cache, v_cache, torch.zeros(0, dtype=torch.int64))
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("bad_slot", [32, -2])
def test_a_slot_out_of_range_raises_before_writing(bad_slot):
    k_cache, v_cache = torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64)
    ones = torch.ones(2, 2, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_paged.store_kv(ones, ones, k_cache, v_cache, torch.tensor([0, bad_slot]))
    assert not k_cache.any() and not v_cache.any()
