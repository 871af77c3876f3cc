"""What a vLLM model runner knows at the moment of a forward, read without changing it.

Called from inside the runner's `_model_forward` (where vLLM has already applied the step's
scheduler output: zeroed fresh blocks, copied CoW blocks, updated the persistent batch), these
functions read the batch order, each request's state, the KV cache geometry, and the graph
dispatch decision from the forward context.
"""

from dataclasses import dataclass
from typing import Any

import torch

from tracekit.format.schema import GraphDispatch, KVLayout, RequestState
from tracekit.integrations.vllm.serialize import to_plain


@dataclass
class KVGroup:
    """One KV cache group of the live runner: its layers' cache tensors share a block table."""

    layer_names: list[str]
    caches: list[torch.Tensor]
    layout: KVLayout


def batch_order(runner: Any) -> list[str]:
    return list(runner.input_batch.req_ids)


def request_states(runner: Any, scheduler_output: Any) -> list[RequestState]:
    """Per-request state in batch order, prompt and output tokens kept apart."""
    states = []
    batch = runner.input_batch
    for req_id in batch.req_ids:
        state = runner.requests[req_id]
        index = batch.req_id_to_index[req_id]
        generator = state.generator
        states.append(
            RequestState(
                req_id=req_id,
                prompt_token_ids=list(state.prompt_token_ids or []),
                output_token_ids=list(state.output_token_ids),
                block_ids=[list(ids) for ids in state.block_ids],
                num_computed_tokens=int(batch.num_computed_tokens_cpu[index]),
                num_scheduled_tokens=int(scheduler_output.num_scheduled_tokens[req_id]),
                sampling_params=to_plain(state.sampling_params, f"{req_id}.sampling_params"),
                generator_state=generator.get_state() if generator is not None else None,
            )
        )
    return states


def kv_groups(runner: Any) -> list[KVGroup]:
    """The runner's KV cache tensors grouped as its KV cache config groups them."""
    config = runner.kv_cache_config
    forward_context = runner.compilation_config.static_forward_context
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
            )
        )
    return groups


def blocks_to_host(group: KVGroup, block_ids: list[int]) -> dict[str, torch.Tensor]:
    """Each layer's rows `block_ids` (in that order, along the block dimension) as new host
    tensors; index_select already copies, so only a device cache is copied again."""
    index = torch.tensor(block_ids, dtype=torch.long, device=group.caches[0].device)
    return {
        name: cache.index_select(group.layout.block_dim, index).to("cpu")
        for name, cache in zip(group.layer_names, group.caches)
    }


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
        read.update(ids[: -(-end // block_size)])
        first_written = request.num_computed_tokens // block_size
        written.update(ids[first_written : -(-end // block_size)])
    return sorted(read), sorted(written)


def graph_dispatch(runner: Any, num_tokens: int) -> GraphDispatch:
    """The capture-size tables plus this step's dispatch, read from the live forward context."""
    from vllm.forward_context import get_forward_context

    compilation = runner.compilation_config
    context = get_forward_context()
    descriptor = context.batch_descriptor
    return GraphDispatch(
        compilation_mode=compilation.mode.name,
        cudagraph_mode=compilation.cudagraph_mode.name,
        capture_sizes=list(compilation.cudagraph_capture_sizes or []),
        compile_sizes=[int(size) for size in compilation.compile_sizes or [] if str(size).isdigit()],
        max_capture_size=compilation.max_cudagraph_capture_size,
        num_warmups=compilation.cudagraph_num_of_warmups,
        splitting_ops=list(compilation.splitting_ops or []),
        runtime_mode=context.cudagraph_runtime_mode.name,
        num_tokens=num_tokens,
        num_tokens_padded=descriptor.num_tokens if descriptor is not None else num_tokens,
        batch_descriptor=to_plain(descriptor, "batch_descriptor") if descriptor else None,
    )


def batch_summary(runner: Any, scheduler_output: Any) -> tuple[int, int, int, list[str]]:
    """(num_reqs, num_tokens, num_prefills, req_ids) of the batch about to run: cheap enough to
    compute on every step."""
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    computed = batch.num_computed_tokens_cpu[:num_reqs]
    prompt_lengths = batch.num_prompt_tokens[:num_reqs]
    num_prefills = int((computed < prompt_lengths).sum())
    return num_reqs, int(scheduler_output.total_num_scheduled_tokens), num_prefills, list(batch.req_ids)
