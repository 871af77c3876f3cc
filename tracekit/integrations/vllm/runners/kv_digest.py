"""A digest of the KV a step wrote, per layer and per request, computed where the KV cache is:
a window's later steps keep no KV blocks, and the digest says which of them wrote other KV, for
which request and from which layer on (docs/GUIDE.md, "Windows"; docs/FORMAT.md, `KVWritten`,
defines it).

The slots a step writes are those of its input positions, as vLLM's slot mapping computes them;
where a slot's entries lie in the cache tensor is the attention backend's (`slot_views`: a backend
whose layout is not known gets no digest). Two writes that differ anywhere give another digest but
with odds of about 2^-31. The same function runs in the recording engine and in the replay, on the
same positions and block ids: rows whose slot cannot be known (a position past the request's
blocks) count for nothing on both sides, and nothing here can index outside the cache.
"""

import functools
from typing import Any, Callable

import torch

from tracekit.format.schema import KVWritten
from tracekit.integrations.vllm.runners.runner_state import CPU_VEC, SLOT_MAJOR, KVGroup

MODULUS = (1 << 31) - 1  # a prime: a row's weighted sum is kept below it, so sums never overflow
NULL_BLOCK = 0
_GOLDEN = 2654435761  # Knuth's multiplicative hash constant: weights that look random, the same everywhere


def digested_layers(groups: list[KVGroup], model: Any) -> list[list[str]] | None:
    """Per KV cache group, its layers whose writes a step's digest covers: the engine's model's
    own attention layers, by the names its KV cache knows them (a speculative drafter's layers
    share the KV cache groups but write their slots later in the step). None where the model
    cannot be walked."""
    try:
        names = {module.layer_name for module in model.modules() if isinstance(getattr(module, "layer_name", None), str)}
    except Exception:  # not a module tree: digest nothing rather than a drafter's stale slots
        return None
    return [[name for name in group.layer_names if name in names] for group in groups]


def slot_dim(group: KVGroup) -> int | None:
    """The cache dimension that indexes slots within a block: the one after the block dimension
    sized `block_size`. None where no dimension or several are (heads or head size equal to the
    block size): a digest of the wrong dimension would cover slots the step did not write."""
    layout = group.layout
    dims = [dim for dim in range(layout.block_dim + 1, len(layout.shape)) if layout.shape[dim] == layout.block_size]
    return dims[0] if len(dims) == 1 else None


def slot_views(group: KVGroup, cache: torch.Tensor) -> list[torch.Tensor] | None:
    """Views of `cache` indexed `[block, slot, ...]` that together hold every entry of a slot
    (`KVGroup.slot_layout`); None where the layout is not known: a digest of bytes that are not
    the slot's would compare whatever the cache held before."""
    layout = group.layout
    if group.slot_layout == SLOT_MAJOR:
        dim = slot_dim(group)
        return [cache.movedim((layout.block_dim, dim), (0, 1))] if dim is not None else None
    if group.slot_layout == CPU_VEC and cache.dim() == 4 and cache.is_contiguous():
        blocks, heads, slots, width = cache.shape
        if slots != layout.block_size or width % 2:
            return None
        keys = cache.view(blocks, heads, 2, width // 2, slots)[:, :, 0].permute(0, 3, 1, 2)
        values = cache.view(blocks, heads, 2, slots, width // 2)[:, :, 1].permute(0, 2, 1, 3)
        return [keys, values]
    return None


@functools.lru_cache(maxsize=16)
def _weights(count: int, device: torch.device) -> torch.Tensor:
    return (torch.arange(1, count + 1, dtype=torch.int64, device=device) * _GOLDEN) % MODULUS + 1


def _on(device: torch.device, host: torch.Tensor) -> torch.Tensor:
    """A small host tensor on `device` without stalling the host on the device's stream."""
    if device.type == "cpu":
        return host
    try:
        return host.pin_memory().to(device, non_blocking=True)
    except RuntimeError:  # no pinned memory on this device
        return host.to(device)


def _written_slots(group: KVGroup, positions: torch.Tensor, rows: list[int],
                   block_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per input row (the first `sum(rows)` of `positions`, `rows[r]` of them request r's, whose
    blocks are `block_ids[r]`): its request, block and offset in the block (clamped into the
    cache), and whether it is a slot at all."""
    device, layout = positions.device, group.layout
    width = max(1, max((len(ids) for ids in block_ids), default=1))
    table = torch.full((len(rows), width), -1, dtype=torch.int64)
    for number, ids in enumerate(block_ids):
        table[number, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    owners = _on(device, torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(rows, dtype=torch.int64)))
    table = _on(device, table)
    position = positions[: owners.shape[0]].to(torch.int64)
    index = torch.div(position, layout.block_size, rounding_mode="floor")
    block = table[owners, index.clamp(0, width - 1)]
    # (vLLM's null block, 0, stands in for blocks a request no longer holds: no request's KV)
    valid = (position >= 0) & (index < width) & (block > NULL_BLOCK) & (block < layout.num_blocks)
    offset = torch.remainder(position, layout.block_size)
    return owners, block.clamp(0, layout.num_blocks - 1), offset, valid.to(torch.int64)


def kv_written_digest(group: KVGroup, layer_names: list[str], positions: Any, rows: list[int],
                      block_ids: list[list[int]]) -> torch.Tensor | None:
    """int64 `[len(layer_names), len(rows)]` on the cache's device: per layer (of the group, in
    `layer_names`' order) and per request, the digest of the KV the step's rows wrote. None where
    the slots cannot be found: positions that are not one per row (M-RoPE's), too few of them, or
    a cache layout not known (`slot_views`)."""
    caches = dict(zip(group.layer_names, group.caches))
    views = {name: slot_views(group, caches[name]) for name in layer_names}
    if (any(view is None for view in views.values()) or not isinstance(positions, torch.Tensor)
            or positions.dim() != 1 or not rows or positions.shape[0] < sum(rows) or len(block_ids) != len(rows)):
        return None
    owners, blocks, offsets, valid = _written_slots(group, positions, rows, block_ids)
    digests = []
    for name in layer_names:
        digest = torch.zeros(len(rows), dtype=torch.int64, device=owners.device)
        for start in range(0, owners.shape[0], ROWS_AT_ONCE):
            part = slice(start, start + ROWS_AT_ONCE)
            digest.index_add_(0, owners[part], _row_digests(views[name], blocks[part], offsets[part]) * valid[part])
        digests.append(digest)
    return torch.stack(digests)


# Rows digested at once: their entries widened to 64 bits take ~16 KiB a row for a model with 8
# KV heads of 128 (a step's rows at once could take GiBs on a device the engine has filled).
ROWS_AT_ONCE = 512


def _row_digests(views: list[torch.Tensor], blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each row's slot entries (across `views`), weighted and summed modulo `MODULUS`."""
    written = torch.cat([view[blocks, offsets].reshape(blocks.shape[0], -1) for view in views], dim=1)
    words = written.view(torch.uint8 if written.element_size() == 1 else torch.int16).to(torch.int64)
    return (words * _weights(words.shape[1], words.device)).sum(1) % MODULUS


def kv_written(groups: list[KVGroup], layers: list[list[str]] | None, positions: Any, rows: list[int],
               block_ids: list[list[list[int]]],
               keep: Callable[[Callable[[], torch.Tensor | None]], torch.Tensor | None]) -> list[KVWritten]:
    """Per KV cache group, the digest of what the step wrote (`layers`: `digested_layers`;
    `rows[r]` input rows and `block_ids[r][group]` blocks of the step's r-th request in batch
    order), each computed and kept by `keep` (a host copy: the recorder's, on its side stream).
    Empty where any group's slots cannot be found: a digest of part of the cache would say a
    step matched where it was not checked."""
    if layers is None or len(layers) != len(groups):
        return []
    kept = []
    for number, (group, names) in enumerate(zip(groups, layers)):
        ids = [blocks[number] if number < len(blocks) else [] for blocks in block_ids]
        digest = keep(functools.partial(kv_written_digest, group, names, positions, rows, ids))
        if digest is None:
            return []
        kept.append(KVWritten(layer_names=list(names), digests=digest))
    return kept
