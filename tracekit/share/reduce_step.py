"""A recorded step cut down to fewer requests and shorter prefill chunks, still consistent:
`tracekit shrink` tries many such cuts (what a cut keeps: docs/GUIDE.md#shrink), and `tracekit
invariance` runs the step in other batches. The rest of a step follows from the requests it keeps
(`step_running`); what the forward produced for the whole batch is dropped.
"""

import dataclasses
from typing import Any

import torch

from tracekit.errors import UsageError
from tracekit.format.schema import (
    CarriedStep,
    GrammarRecord,
    KVMode,
    KVSnapshot,
    RequestState,
    Step,
    StepOutputs,
    StepTiming,
)
from tracekit.integrations.vllm.records.step_records import rebuild_scheduler_output
from tracekit.integrations.vllm.runners.runner_state import blocks_read_and_written


def scheduled_tokens(*steps: Step) -> dict[str, int]:
    """Each request's scheduled token count over `steps`, in the order the requests first run."""
    counts: dict[str, int] = {}
    for step in steps:
        for req_id in step.batch_order:
            counts[req_id] = counts.get(req_id, 0) + step.request(req_id).num_scheduled_tokens
    return counts


def reduce_step(step: Step, keep: dict[str, int]) -> Step:
    """`step` with only the requests in `keep`, each scheduling its first `keep[id]` tokens."""
    by_id = {request.req_id: request for request in step.requests}
    unknown = set(keep) - set(by_id)
    if unknown or not keep:
        raise UsageError(f"cannot reduce the step to {sorted(keep)}: not a non-empty subset of its batch")
    order = [req_id for req_id in step.batch_order if req_id in keep]
    pairs = []
    for req_id in order:
        old, count = by_id[req_id], keep[req_id]
        if not 1 <= count <= old.num_scheduled_tokens:
            raise UsageError(f"request {req_id} schedules {old.num_scheduled_tokens} tokens, not {count}")
        pairs.append((old, dataclasses.replace(old, num_scheduled_tokens=count, draft_token_ids=drafts_kept(old, count),
                                               extras=dict(old.extras))))
    runs = step.request_rows()
    rows = torch.tensor([row for req_id in order for row in runs[req_id][:keep[req_id]]], dtype=torch.long)
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
        groups.append(dataclasses.replace(group, read_block_ids=read, written_block_ids=written, saved_block_ids=saved,
                                          before=before, after={}, extras=dict(group.extras)))
    return dataclasses.replace(kv, groups=groups, extras=dict(kv.extras))


def steps_between(first: Step, steps: list[Any], start: int, last: int, kv_read: list[dict[str, Any]] | None) -> Step:
    """The steps `start`..`last` of those `first` opens (`steps`: each whole, `expand_window`). A
    later step made the first holds the blocks it reads as a replay's forward read them (`kv_read`,
    per KV cache group; mode `read`)."""
    by_index = {each.index: each for each in steps}
    head = first
    if start != first.index:
        step = by_index[start].step
        groups = [dataclasses.replace(group, saved_block_ids=list(group.read_block_ids), before=blocks, after={})
                  for group, blocks in zip(step.kv.groups, kv_read)]
        head = dataclasses.replace(step, kv=KVSnapshot(mode=KVMode.READ.value, groups=groups), window=None)
    carried = [by_index[index].carried for index in range(start + 1, last + 1)]
    calls = [call for call in first.runner_calls if start <= call["step"] <= last]
    return head.with_later(carried, by_index[start].held, calls, requested=len(carried) + 1)


def cut_steps(steps: list[Any], first: Step, keep: set[str]) -> Step | None:
    """The steps `first` opens (`steps`: each whole) with only the requests in `keep` (None where a
    step would run none): each step's batch, scheduler output and inputs cut (`reduce_step`), its
    sampled ids kept for them (float outputs depend on the whole batch)."""
    reduced = []
    for each in steps:
        step = each.step
        counts = {request.req_id: request.num_scheduled_tokens for request in step.requests if request.req_id in keep}
        if not counts:
            return None
        sampled = step.outputs.sampled_token_ids if step.outputs is not None else None
        outputs = None if sampled is None else StepOutputs(
            sampled_token_ids=[ids for req_id, ids in zip(step.batch_order, sampled) if req_id in counts])
        reduced.append(dataclasses.replace(reduce_step(step, counts), outputs=outputs))
    held = [request for request in steps[0].held if request.req_id in keep]
    carried = [as_carried(cut, each.carried, keep) for cut, each in zip(reduced[1:], steps[1:])]
    return reduced[0].with_later(carried, held, first.runner_calls)


def as_carried(cut: Step, recorded: CarriedStep, keep: set[str]) -> CarriedStep:
    """A cut later step back as a carried one: the drafter's proposals of the kept requests (token
    ids, as the sampled ones), and no digest of its KV writes (floats: they depend on the batch)."""
    rows = [row for row, req_id in enumerate(recorded.batch_order) if req_id in keep]
    proposals = recorded.proposals
    if proposals is not None and proposals.dim() >= 1 and proposals.shape[0] == len(recorded.batch_order):
        proposals = proposals[rows]
    return dataclasses.replace(
        recorded,
        scheduler_output=cut.scheduler_output,
        batch_order=cut.batch_order,
        runner_states={req_id: state for req_id, state in recorded.runner_states.items() if req_id in keep},
        input_ids=cut.input_ids,
        positions=cut.positions,
        graph=cut.graph,
        outputs=cut.outputs,
        timing=dataclasses.replace(recorded.timing),
        proposals=proposals,
        kv_written=[],
    )
