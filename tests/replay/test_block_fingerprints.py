"""The replay's check that a forward wrote no KV block but its own: a fingerprint per block,
taken before and after. Read as 64-bit words where a cache row is whole words (a replay engine's
CPU cache can be tens of GiB: widening each element is ~100x slower), else element by element."""

import pytest
import torch

from tracekit.format.schema import KVLayout
from tracekit.integrations.vllm.runners.runner_state import KVGroup, block_fingerprints, changed_blocks


def group_of(*caches, block_dim=1):
    shape = list(caches[0].shape)
    layout = KVLayout(shape=shape, dtype=str(caches[0].dtype), block_dim=block_dim, num_blocks=shape[block_dim],
                      block_size=shape[block_dim + 1])
    return KVGroup([f"layer{i}" for i in range(len(caches))], list(caches), layout)


@pytest.mark.parametrize("head_size, dtype", [(64, torch.bfloat16), (3, torch.bfloat16), (5, torch.uint8)])
def test_a_change_anywhere_in_a_block_changes_that_block_alone(head_size, dtype):
    # [K/V, blocks, block size, heads, head size]: rows of 128 bytes are words; rows of 6 or 5 are not
    caches = [torch.zeros(2, 6, 4, 2, head_size, dtype=dtype) for _ in range(2)]
    group = group_of(*caches)
    before = block_fingerprints(group)
    assert before.shape == (6,) and before.dtype == torch.int64
    caches[1][1, 3, 2, 1, head_size - 1] = 1  # the last element of a row of the second layer's V
    caches[0][0, 5, 0, 0, 0] = 2
    assert changed_blocks(group, before) == [3, 5]


def test_a_cache_slice_that_is_not_whole_words_is_read_element_by_element():
    storage = torch.zeros(1 + 2 * 6 * 4 * 2 * 64, dtype=torch.bfloat16)
    cache = storage[1:].view(2, 6, 4, 2, 64)  # starts 2 bytes into its storage
    group = group_of(cache)
    before = block_fingerprints(group)
    cache[0, 2, 1, 0, 7] = 1
    assert changed_blocks(group, before) == [2]
