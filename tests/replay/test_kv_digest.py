"""The digest of the KV a window's later step wrote (`kv_digest`): per layer and request, over
the slots the step's input positions name, whatever the cache layout; nothing else counts, and
nothing it is given can index outside the cache. Blocks here hold 4 slots.

    request A: blocks [3, 5], rows at positions 4, 5 (block 5, slots 0-1)
    request B: blocks [2],    row at position 2 (block 2, slot 2)
    then one padding row (position 0), which the digest leaves out
"""

import pytest
import torch

from tracekit.format.schema import KVLayout
from tracekit.integrations.vllm.runners.kv_digest import digested_layers, kv_written_digest, slot_dim, slot_views
from tracekit.integrations.vllm.runners.runner_state import CPU_VEC, SLOT_MAJOR, KVGroup

POSITIONS = torch.tensor([4, 5, 2, 0])
ROWS = [2, 1]
BLOCKS = [[3, 5], [2]]
# (shape, block dim, slot layout, dtype): flash attention's [K/V, blocks, slots, heads, head
# size], an MLA cache [blocks, slots, width], vLLM's CPU backend's [blocks, heads, slots, 2 * head
# size] (keys head-size-major, then values slot-major, per block and head)
LAYOUTS = {
    "flash": ([2, 8, 4, 2, 16], 1, SLOT_MAJOR, torch.bfloat16),
    "mla": ([8, 4, 24], 0, SLOT_MAJOR, torch.uint8),
    "cpu": ([8, 3, 4, 32], 0, CPU_VEC, torch.float32),
}


def _group(layout: str, layers: int = 2) -> KVGroup:
    shape, block_dim, slots, dtype = LAYOUTS[layout]
    caches = [torch.randint(0, 100, shape).to(dtype) for _ in range(layers)]
    kv_layout = KVLayout(shape=shape, dtype=str(dtype), block_dim=block_dim, num_blocks=shape[block_dim], block_size=4)
    return KVGroup([f"layers.{n}" for n in range(layers)], caches, kv_layout, slots)


def _slot(layout: str, cache: torch.Tensor, block: int, slot: int) -> torch.Tensor:
    """One slot's first entries (its key's, where keys and values lie apart), as a view."""
    return slot_views(_group(layout), cache)[0][block, slot]


def _digest(group: KVGroup, positions: torch.Tensor = POSITIONS) -> torch.Tensor:
    return kv_written_digest(group, group.layer_names, positions, ROWS, BLOCKS)


def _bumped(entries: torch.Tensor, index: int, step: int = 1) -> None:
    """Move one entry by `step` units in its last place (a one-ulp change for a float)."""
    element = entries[tuple(torch.unravel_index(torch.tensor(index), entries.shape))]
    element.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[element.element_size()]).add_(step)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_one_ulp_in_a_written_slot_moves_that_request_and_layer_alone(layout):
    group = _group(layout)
    before = _digest(group)
    assert before.shape == (2, 2) and before.dtype == torch.int64
    _bumped(_slot(layout, group.caches[1], 5, 1), 3)  # A's second row, second layer
    after = _digest(group)
    assert (after != before).tolist() == [[False, False], [True, False]]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_slots_the_step_did_not_write_do_not_count(layout):
    group = _group(layout)
    before = _digest(group)
    _bumped(_slot(layout, group.caches[0], 5, 2), 0)  # past A's rows in its block
    _bumped(_slot(layout, group.caches[0], 3, 0), 0)  # A's first block, written before the step
    _bumped(_slot(layout, group.caches[0], 0, 0), 0)  # the padding row's position, in no block of its own
    assert torch.equal(_digest(group), before)


def test_two_changes_that_cancel_in_a_sum_still_move_the_digest():
    group = _group("flash")
    before = _digest(group)
    entries = _slot("flash", group.caches[0], 2, 2)  # B's row
    _bumped(entries, 0, 1)
    _bumped(entries, 1, -1)
    assert (_digest(group) != before).tolist() == [[False, True], [False, False]]


def test_rows_without_a_slot_count_for_nothing_and_stay_inside_the_cache():
    group = _group("flash")
    # a negative position, one past the request's blocks, and vLLM's null block (0)
    positions = torch.tensor([-3, 9, 1])
    digest = kv_written_digest(group, group.layer_names, positions, [2, 1], [[3, 5], [0]])
    assert digest.tolist() == [[0, 0], [0, 0]]
    huge = kv_written_digest(group, group.layer_names, torch.tensor([4, 5, 2]), [2, 1], [[3, 1 << 40], [99]])
    assert huge[:, 1].tolist() == [0, 0]


def test_no_digest_where_the_slots_cannot_be_found():
    group = _group("flash")
    assert kv_written_digest(group, group.layer_names, POSITIONS.expand(3, 4), ROWS, BLOCKS) is None  # M-RoPE
    assert kv_written_digest(group, group.layer_names, POSITIONS[:2], ROWS, BLOCKS) is None  # too few rows
    ambiguous = KVGroup(group.layer_names, group.caches,
                        KVLayout(shape=[2, 8, 4, 4, 16], dtype="bfloat16", block_dim=1, num_blocks=8, block_size=4),
                        SLOT_MAJOR)
    assert slot_dim(ambiguous) is None  # heads as many as slots: which dimension is which?
    unknown = KVGroup(group.layer_names, group.caches, group.layout)  # a backend whose layout is not known
    assert kv_written_digest(unknown, group.layer_names, POSITIONS, ROWS, BLOCKS) is None


def test_the_cpu_layout_is_where_vllms_cpu_kernel_writes_a_slot():
    """vLLM's own CPU cache write (`cpu_attn_reshape_and_cache`, "vec" kernels) of one token:
    its key and value are the slot's entries in `slot_views`, and nothing else moved."""
    ops = pytest.importorskip("vllm._custom_ops")
    blocks, heads, slots, head_size = 4, 2, 32, 64
    cache = torch.zeros(blocks, heads, slots, 2 * head_size)
    keys, values = cache.view(blocks, heads, slots * 2, head_size).chunk(2, dim=2)
    key = torch.arange(1.0, heads * head_size + 1).view(1, heads, head_size)
    ops.cpu_attn_reshape_and_cache(key, -key, keys, values, torch.tensor([2 * slots + 5]), "vec")
    group = KVGroup(["layers.0"], [cache], KVLayout(shape=list(cache.shape), dtype="float32", block_dim=0,
                                                    num_blocks=blocks, block_size=slots), CPU_VEC)
    key_view, value_view = slot_views(group, cache)
    assert torch.equal(key_view[2, 5], key[0]) and torch.equal(value_view[2, 5], -key[0])
    assert int((cache != 0).sum()) == 2 * heads * head_size


def test_a_drafters_layers_are_left_out():
    class Attention(torch.nn.Module):
        def __init__(self, name):
            super().__init__()
            self.layer_name = name

    model = torch.nn.Sequential(Attention("layers.0"), Attention("layers.1"))
    group = _group("flash", layers=3)  # layers.2: the drafter's, in the same KV cache group
    assert digested_layers([group], model) == [["layers.0", "layers.1"]]
    assert digested_layers([group], object()) is None


def test_rows_digested_a_few_at_a_time_give_the_same_digest(monkeypatch):
    from tracekit.integrations.vllm.runners import kv_digest

    group = _group("flash")
    whole = _digest(group)
    monkeypatch.setattr(kv_digest, "ROWS_AT_ONCE", 1)
    assert torch.equal(_digest(group), whole)


def test_a_request_moved_in_two_kv_cache_groups_is_named_at_its_first_layer_in_the_model():
    """KV cache groups (a sliding-window model's) list their layers group by group: the layer a
    request is named at is the model's first that moved, whichever group holds it."""
    from types import SimpleNamespace

    from tracekit.format.schema import KVWritten
    from tracekit.integrations.seam import ObservedStep
    from tracekit.replay.checks import KV_DIGEST_ITEM, _kv_digest_item

    groups = [["model.layers.1.attn", "model.layers.10.attn"], ["model.layers.2.attn", "model.layers.9.attn"]]
    recorded = [KVWritten(names, torch.zeros(len(names), 1, dtype=torch.int64)) for names in groups]
    moved = {"model.layers.10.attn", "model.layers.9.attn"}  # group 0 lists layer 10 before group 1's 9
    here = [KVWritten(names, torch.tensor([[int(name in moved)] for name in names])) for names in groups]
    step = SimpleNamespace(batch_order=["req"])
    item = _kv_digest_item(ObservedStep(kv_written=here), recorded, step)
    assert item.name == KV_DIGEST_ITEM and not item.bit_exact
    assert item.details == {"requests_moved": {"req": "model.layers.9.attn"}, "layers_moved": 2}
