"""A recorded step cut down to fewer requests and shorter prefill chunks, still consistent.

`tracekit shrink` tries many such cuts. A cut keeps, for each request it keeps, the first
`n` of its scheduled tokens (a chunk can only end earlier: its start is fixed by the KV cache
already computed; a drafted request's tokens are its last sampled token and then its drafts, so
it keeps the drafts among its first `n`). Everything else follows from that choice: the batch order (the recorded one,
filtered), the input ids and positions (each kept request's slice of the recorded ones), the KV
blocks (only those the cut batch reads, from the recorded snapshot), and the scheduler output
record. What the forward produced for the whole batch (outputs, KV written, timing, graph
padding) is not known for the cut one and is dropped.
"""

import dataclasses
from typing import Any

import torch

from tracekit.errors import UsageError
from tracekit.format.schema import GrammarRecord, KVGroupSnapshot, KVSnapshot, RequestState, Step, StepTiming
from tracekit.integrations.vllm.records.step_records import rebuild_scheduler_output
from tracekit.integrations.vllm.runners.runner_state import blocks_read_and_written


def scheduled_tokens(step: Step) -> dict[str, int]:
    """Each request's scheduled token count, in batch order."""
    by_id = {request.req_id: request for request in step.requests}
    return {req_id: by_id[req_id].num_scheduled_tokens for req_id in step.batch_order}


def reduce_step(step: Step, keep: dict[str, int]) -> Step:
    """`step` with only the requests in `keep`, each scheduling its first `keep[id]` tokens."""
    by_id = {request.req_id: request for request in step.requests}
    unknown = set(keep) - set(by_id)
    if unknown or not keep:
        raise UsageError(f"cannot reduce the step to {sorted(keep)}: not a non-empty subset of its batch")
    offsets, offset = {}, 0
    for req_id in step.batch_order:
        offsets[req_id] = offset
        offset += by_id[req_id].num_scheduled_tokens
    order = [req_id for req_id in step.batch_order if req_id in keep]
    pairs = []
    for req_id in order:
        old, count = by_id[req_id], keep[req_id]
        if not 1 <= count <= old.num_scheduled_tokens:
            raise UsageError(f"request {req_id} schedules {old.num_scheduled_tokens} tokens, not {count}")
        pairs.append((old, dataclasses.replace(old, num_scheduled_tokens=count, draft_token_ids=drafts_kept(old, count),
                                               extras=dict(old.extras))))
    token_slices = [
        torch.arange(offsets[req_id], offsets[req_id] + keep[req_id], dtype=torch.long) for req_id in order
    ]
    rows = torch.cat(token_slices)
    return step_running(
        step, pairs,
        step.input_ids.index_select(-1, rows) if step.input_ids is not None else None,
        step.positions.index_select(-1, rows) if step.positions is not None else None,
    )


def drafts_kept(request: RequestState, count: int) -> list[int]:
    """The drafts among a request's first `count` scheduled tokens (its drafts come last)."""
    undrafted = request.num_scheduled_tokens - len(request.draft_token_ids)
    return list(request.draft_token_ids[:max(count - undrafted, 0)])


def step_running(step: Step, pairs: list[tuple[RequestState, RequestState]], input_ids: Any, positions: Any) -> Step:
    """`step` made to run another batch: `pairs` (the recorded request, or the new one, and the
    request as it runs now) in batch order, with these inputs. The scheduler output record, the
    KV blocks and the (unpadded) dispatch follow from them; the outputs and timing are dropped,
    since the recording engine never ran this batch."""
    requests = [new for _, new in pairs]
    num_tokens = sum(request.num_scheduled_tokens for request in requests)
    return dataclasses.replace(
        step,
        scheduler_output=rebuild_scheduler_output(step.scheduler_output, pairs),
        batch_order=[request.req_id for request in requests],
        requests=requests,
        input_ids=input_ids,
        positions=positions,
        kv=reduced_kv(step.kv, requests),
        graph=dataclasses.replace(
            step.graph, num_tokens=num_tokens, num_tokens_padded=num_tokens, batch_descriptor=None,
            extras=dict(step.graph.extras),
        ),
        outputs=None,
        timing=StepTiming(),
        # what the drafter did after sampling is an output too
        spec_decode=dataclasses.replace(step.spec_decode, proposals=None, drafter_calls=[]) if step.spec_decode else None,
        grammar=reduced_grammar(step.grammar, pairs),
        features=None if step.features is None else {
            name: kept for name, req_ids in step.features.items()
            if (kept := [req_id for req_id in req_ids if req_id in {request.req_id for request in requests}])
        },
        extras=dict(step.extras),
    )


def reduced_grammar(grammar: GrammarRecord | None, pairs: list[tuple[RequestState, RequestState]]) -> GrammarRecord | None:
    """The grammar mask rows of the requests that still sample (a prefill chunk cut short samples
    nothing: vLLM sends no mask for it), a drafted request's first row and those of the drafts it
    keeps (`pairs`: each request as recorded and as it runs now); None where none is left."""
    if grammar is None:
        return None
    cut = {new.req_id: len(old.draft_token_ids) - len(new.draft_token_ids) for old, new in pairs if new.samples}
    kept = [index for index, req_id in enumerate(grammar.request_ids) if req_id in cut]
    if not kept:
        return None
    counts = [max(grammar.rows_per_request[index] - cut[grammar.request_ids[index]], 1) for index in kept]
    rows = [row for index, count in zip(kept, counts) for row in grammar.rows_of(grammar.request_ids[index])[:count]]
    acceptable = grammar.num_acceptable_drafts
    return GrammarRecord(
        request_ids=[grammar.request_ids[index] for index in kept],
        rows_per_request=counts,
        bitmask=grammar.bitmask.index_select(0, torch.tensor(rows, dtype=torch.long)),
        num_acceptable_drafts=[min(acceptable[index], count - 1) for index, count in zip(kept, counts)]
        if acceptable is not None else None,
        extras=dict(grammar.extras),
    )


def reduced_kv(kv: KVSnapshot, requests: list[RequestState]) -> KVSnapshot:
    """The recorded KV snapshot cut to the blocks `requests` read and write (those saved)."""
    groups = []
    for index, group in enumerate(kv.groups):
        read, written = blocks_read_and_written(requests, index, group.layout.block_size)
        wanted = {"read": set(read), "written": set(written), "none": set()}.get(kv.mode, set(read))
        saved = [block for block in group.saved_block_ids if block in wanted]
        rows = torch.tensor([group.saved_block_ids.index(block) for block in saved], dtype=torch.long)
        before = {
            layer: tensor.index_select(group.layout.block_dim, rows) for layer, tensor in group.before.items()
        } if saved else {}
        groups.append(KVGroupSnapshot(
            layer_names=group.layer_names,
            layout=group.layout,
            read_block_ids=read,
            written_block_ids=written,
            saved_block_ids=saved,
            before=before,
            after={},
            extras=dict(group.extras),
        ))
    return dataclasses.replace(kv, groups=groups, extras=dict(kv.extras))

