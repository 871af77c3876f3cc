"""What every vLLM model runner kind keeps alike: its KV caches and its graph tables.

Both runners (V1 and V2) allocate the KV caches from `kv_cache_config` and register each layer's
cache in the compilation config's static forward context, and both keep the capture-size tables
in `compilation_config`; the runner adapters (`v1_runner`, `v2_runner`) read the rest.
"""

from dataclasses import dataclass
from typing import Any

import torch

from tracekit.format.schema import GraphDispatch, KVLayout, RequestState, blocks_covering
from tracekit.graphs.device import get_device_backend
from tracekit.graphs.host_copy import HostCopy
from tracekit.integrations.vllm.records.serialize import to_plain

# What vLLM puts where a token id is not known: V1's sampled ids under async scheduling until the
# engine reads them, the drafts a runner holds (the scheduler's copy), a rejected draft position.
PLACEHOLDER_TOKEN = -1


@dataclass
class KVGroup:
    """One KV cache group of the live runner: its layers' cache tensors share a block table."""

    layer_names: list[str]
    caches: list[torch.Tensor]
    layout: KVLayout
    # How a cache tensor holds each slot's entries (`slot_layout`); None: not known here
    slot_layout: str | None = None


# Attention backends whose cache tensor gives each slot a dimension of its own (its entries for
# every head are indexed by block and slot); vLLM's CPU backend with its "vec" kernels keeps, per
# block and head, the keys head-dimension-major ([head size, slots]) and then the values
# slot-major, in a tensor shaped [blocks, heads, slots, 2 * head size]. Others: not known.
SLOT_MAJOR_BACKENDS = frozenset({
    "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLASHMLA", "FLASH_ATTN_MLA", "TRITON_MLA", "CUTLASS_MLA",
    "FLASHINFER_MLA",
})
SLOT_MAJOR, CPU_VEC = "slot_major", "cpu_vec"


def slot_layout(layer: Any) -> str | None:
    """How `layer`'s attention backend lays a slot out in its cache tensor (see above)."""
    backend = getattr(layer, "attn_backend", None)
    try:
        name = backend.get_name() if backend is not None else None
    except Exception:  # a backend without a name: not known
        return None
    if name in SLOT_MAJOR_BACKENDS:
        return SLOT_MAJOR
    if name == "CPU_ATTN" and getattr(layer, "isa", None) == "vec":
        return CPU_VEC
    return None


def hidden_states_of(output: Any) -> torch.Tensor | None:
    """The final hidden states of a model call's output (EAGLE-3 models return them first in a
    tuple; a non-last pipeline rank returns intermediate tensors, no hidden states)."""
    if isinstance(output, tuple):
        output = output[0]
    return output if isinstance(output, torch.Tensor) else None


def forward_context() -> Any:
    """vLLM's ForwardContext of the model call in progress (None outside one)."""
    from vllm import forward_context as context

    return context.get_forward_context() if context.is_forward_context_available() else None


def _splits_kv_across_ranks(runner: Any) -> bool:
    """Whether context parallelism spreads a request's KV over ranks (each writes some slots)."""
    parallel = getattr(getattr(runner, "vllm_config", None), "parallel_config", None)
    return any(int(getattr(parallel, name, 1) or 1) > 1
               for name in ("decode_context_parallel_size", "prefill_context_parallel_size"))


def kv_groups(runner: Any) -> list[KVGroup]:
    """The runner's KV cache tensors grouped as its KV cache config groups them (a slot's place in
    them not known where context parallelism writes a request's slots on several ranks)."""
    config = runner.kv_cache_config
    forward_context = runner.compilation_config.static_forward_context
    split = _splits_kv_across_ranks(runner)
    groups = []
    for group in config.kv_cache_groups:
        caches = [forward_context[name].kv_cache for name in group.layer_names]
        first = caches[0]
        groups.append(
            KVGroup(
                layer_names=list(group.layer_names),
                caches=caches,
                layout=KVLayout(
                    shape=list(first.shape),
                    dtype=str(first.dtype).removeprefix("torch."),
                    block_dim=block_dim(first, config.num_blocks),
                    num_blocks=config.num_blocks,
                    block_size=group.kv_cache_spec.block_size,
                ),
                slot_layout=None if split else slot_layout(forward_context[group.layer_names[0]]),
            )
        )
    return groups


def blocks_to_host(group: KVGroup, block_ids: list[int], copy: HostCopy | None = None) -> dict[str, torch.Tensor]:
    """Each layer's rows `block_ids` (in that order, along the block dimension) as new host
    tensors, through `copy` (on a GPU: pinned memory, a side stream; see `HostCopy`), or at once."""
    copier = copy or HostCopy(get_device_backend("cpu"))
    copied = {name: copier.gather(cache, group.layout.block_dim, block_ids)
              for name, cache in zip(group.layer_names, group.caches)}
    if copy is None:
        copier.wait()
    return copied


def block_fingerprints(group: KVGroup) -> torch.Tensor:
    """One integer per KV block of the group, over every layer's bytes of that block: blocks
    whose fingerprint changes across a forward were written by it. Computed on the cache's
    device, one layer at a time: a wrapping sum of the block's raw bytes read as 64-bit words
    (or, where a row is not whole words, of its elements' bits widened to 64 bits: ~100x slower
    on a CPU, where a replay engine's cache can be tens of GiB)."""
    total = None
    for cache in group.caches:
        bits = _as_integers(cache)
        other_dims = [dim for dim in range(bits.dim()) if dim != group.layout.block_dim]
        summed = torch.sum(bits, dim=other_dims, dtype=torch.int64)
        total = summed if total is None else total + summed
    return total


def _as_integers(cache: torch.Tensor) -> torch.Tensor:
    """The cache's bytes as 64-bit words where its rows allow, else as integers of its width."""
    if cache.dim() and cache.stride(-1) == 1 and (cache.shape[-1] * cache.element_size()) % 8 == 0:
        try:
            return cache.view(torch.int64)
        except RuntimeError:  # an offset into its storage that is not whole words
            pass
    return cache.view(_SAME_WIDTH_INT[cache.element_size()])


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def changed_blocks(group: KVGroup, before: torch.Tensor) -> list[int]:
    """The blocks of `group` whose fingerprint differs from `before`."""
    return torch.nonzero(block_fingerprints(group) != before).flatten().tolist()


def block_dim(cache: torch.Tensor, num_blocks: int) -> int:
    """The dimension that indexes blocks: the one sized `num_blocks` (leading K/V dims of 2 are
    skipped when `num_blocks` is also 2)."""
    candidates = [dim for dim, size in enumerate(cache.shape) if size == num_blocks]
    if not candidates:
        raise ValueError(f"no dimension of size {num_blocks} in KV cache of shape {tuple(cache.shape)}")
    return candidates[-1] if num_blocks == 2 and len(candidates) > 1 else candidates[0]


def blocks_read_and_written(
    requests: list[RequestState], group_index: int, block_size: int
) -> tuple[list[int], list[int]]:
    """Blocks the step reads (everything up to computed+scheduled) and writes (the blocks
    covering positions [computed, computed+scheduled)), for one KV cache group."""
    read: set[int] = set()
    written: set[int] = set()
    for request in requests:
        ids = request.block_ids[group_index]
        end = request.num_computed_tokens + request.num_scheduled_tokens
        read.update(ids[: blocks_covering(end, block_size)])
        first_written = request.num_computed_tokens // block_size
        written.update(ids[first_written : blocks_covering(end, block_size)])
    return sorted(read), sorted(written)


# Attention metadata tensors whose contents decide the kernels' work split (the rest — block
# tables, slot mappings — hold stale entries past each request's blocks, and only their shape
# is kept).
_DIGESTED_ATTENTION_TENSORS = (
    "seq_lens", "query_start_loc", "scheduler_metadata", "prefix_scheduler_metadata", "prefix_kv_lens",
    "suffix_kv_lens", "cu_prefix_query_lens", "num_splits",
)


def attention_summary(metadata: Any) -> dict[str, Any] | None:
    """What the attention metadata builder decided for the step, per metadata object (one per KV
    cache group): its class, every plain field, each tensor's dtype and shape, and a digest of
    the tensors that decide the kernels' work split. A replay that differs here ran other
    attention kernels (or the same ones split otherwise) on the same inputs."""
    if isinstance(metadata, list):  # micro-batches: the first one's
        metadata = metadata[0] if metadata else None
    if not isinstance(metadata, dict) or not metadata:
        return None
    summary: dict[str, Any] = {}
    seen: dict[int, str] = {}
    for item in metadata.values():
        if id(item) in seen:
            continue
        key = type(item).__name__
        if key in summary:
            key = f"{key}#{len(summary)}"
        seen[id(item)] = key
        summary[key] = _metadata_fields(item)
    return summary


# FlashAttention 3's scheduler metadata: per-request vectors, each padded to a multiple of 4
# requests, then the tile counter. Its kernel writes only the live requests' entries; the padding
# keeps what the allocator's block held before (a lean and a full engine differ there). Only the
# live entries are digested, by the request count of the tensor named here.
_PADDED_PER_REQUEST = {"scheduler_metadata": "seq_lens", "prefix_scheduler_metadata": "prefix_kv_lens"}
LIVE_DIGEST = "live:"  # marks a digest of the live entries alone


def _metadata_fields(item: Any) -> dict[str, Any]:
    fields = vars(item) if hasattr(item, "__dict__") else {}
    plain: dict[str, Any] = {}
    for name, value in sorted(fields.items()):
        if isinstance(value, (bool, int, float, str)) or value is None:
            plain[name] = value
        elif isinstance(value, torch.Tensor):
            shape = f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
            if name in _DIGESTED_ATTENTION_TENSORS and value.numel() <= 1 << 16:
                shape += ":" + _digest(value, fields.get(_PADDED_PER_REQUEST.get(name, "")))
            plain[name] = shape
        elif isinstance(value, tuple) and all(isinstance(v, (int, bool)) for v in value):
            plain[name] = list(value)
    return plain


def _digest(tensor: torch.Tensor, requests: Any) -> str:
    """A short digest of `tensor`'s bytes; of its live entries alone where it is padded per
    request (`requests`: the tensor holding one entry per request of the same call)."""
    import hashlib

    flat = tensor.detach().reshape(-1)
    prefix = ""
    if isinstance(requests, torch.Tensor) and requests.dim() == 1 and requests.numel() > 0:
        live = requests.numel()
        padded = -(-live // 4) * 4
        vectors, counter = divmod(flat.numel(), padded)
        if counter <= 1:  # the layout is as described above; else the whole tensor is digested
            flat = torch.cat([flat[start : start + live] for start in range(0, vectors * padded, padded)]
                             + [flat[vectors * padded :]])
            prefix = LIVE_DIGEST
    raw = flat.to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    return prefix + hashlib.blake2b(raw, digest_size=8).hexdigest()


def graph_dispatch(runner: Any, num_tokens: int, runtime_mode: str, num_tokens_padded: int,
                   batch_descriptor: Any = None, attention: Any = None) -> GraphDispatch:
    """The engine's capture-size tables plus what this step was dispatched to."""
    compilation = runner.compilation_config
    return GraphDispatch(
        compilation_mode=compilation.mode.name,
        cudagraph_mode=compilation.cudagraph_mode.name,
        capture_sizes=list(compilation.cudagraph_capture_sizes or []),
        compile_sizes=[int(size) for size in compilation.compile_sizes or [] if str(size).isdigit()],
        max_capture_size=compilation.max_cudagraph_capture_size,
        num_warmups=compilation.cudagraph_num_of_warmups,
        splitting_ops=list(compilation.splitting_ops or []),
        runtime_mode=runtime_mode,
        num_tokens=num_tokens,
        num_tokens_padded=num_tokens_padded,
        batch_descriptor=to_plain(batch_descriptor, "batch_descriptor") if batch_descriptor is not None else None,
        attention=attention_summary(attention),
    )
