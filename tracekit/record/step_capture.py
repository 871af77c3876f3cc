"""Copying one engine step to host memory: the only part of recording the engine waits for (its
cost: docs/GUIDE.md, "Recording"). A step is captured from its `StepMark`: for a step trigger just
before the model call, after vLLM applied the step's scheduler output (zeroed fresh blocks), so the
KV blocks saved are exactly what the forward reads; for an event trigger later in the same step
(`KVTaken.AFTER_STEP`). Everything read off the engine is read through the runner's adapter.
"""

import dataclasses
import time
from enum import Enum
from typing import Any

import torch

from tracekit.format.schema import (
    CarriedStep,
    KVGroupSnapshot,
    KVMode,
    KVSnapshot,
    RequestState,
    SchedulerOutputRecord,
    Step,
    StepOutputs,
    StepTiming,
)
from tracekit.graphs.host_copy import HostCopy
from tracekit.integrations.vllm.recording import (
    RunnerAdapter,
    StepMark,
    blocks_read_and_written,
    blocks_to_host,
    hidden_states_of,
    step_features,
)


class KVTaken(str, Enum):
    """When a bundle's `before` blocks were copied (`KVSnapshot.taken`)."""

    BEFORE_FORWARD = "before_forward"
    # After the step ran (an event trigger decides only then): the blocks the step reads are as
    # they were, and the slots of its own new tokens hold what it wrote there, which the replayed
    # forward writes again before it reads them.
    AFTER_STEP = "after_step"


def capture(
    adapter: RunnerAdapter,
    mark: StepMark,
    index: int,
    trigger: str,
    kv_mode: str,
    copy: HostCopy | None,
    taken: KVTaken = KVTaken.BEFORE_FORWARD,
    held: list[RequestState] = (),
) -> Step:
    """The marked step as a `Step`: its requests walked into plain data, its inputs and the KV
    blocks `kv_mode` names copied to host through `copy`. `held`: requests the runner holds
    outside the batch (the first of a bundle's several steps): in mode `read` the blocks they
    computed are saved too, as a later step may read them. `copy` None: the device context is lost
    (`capture_kinds.kept_from_host`): no KV blocks and no inputs, the RNG states the mark copied."""
    started = time.perf_counter()
    if copy is None:
        kv_mode = KVMode.RECOMPUTE.value
    marked = mark if copy is not None else dataclasses.replace(mark, input_ids=None)
    requests = adapter.request_states(marked, marked.input_ids)
    for request in requests if copy is not None else ():  # what the runner keeps on the device (draft probabilities)
        request.runner_state = {name: copy.copy(value) if isinstance(value, torch.Tensor) and value.device.type != "cpu"
                                else value for name, value in request.runner_state.items()}
    mode = KVMode(kv_mode)
    groups = []
    for group_index, group in enumerate(adapter.kv_groups()):
        read, written = blocks_read_and_written(requests, group_index, group.layout.block_size)
        saved = {KVMode.READ: read, KVMode.WRITTEN: written}.get(mode, [])
        if mode == KVMode.READ and held:
            held_read, _ = blocks_read_and_written(held, group_index, group.layout.block_size)
            saved = sorted(set(saved) | set(held_read))
        groups.append(
            KVGroupSnapshot(
                layer_names=group.layer_names,
                layout=group.layout,
                read_block_ids=read,
                written_block_ids=written,
                saved_block_ids=saved,
                before=blocks_to_host(group, saved, copy) if saved else {},
            )
        )
    step = Step(
        index=index,
        trigger=trigger,
        scheduler_output=adapter.scheduler_output_record(mark.scheduler_output),
        batch_order=[request.req_id for request in requests],
        requests=requests,
        kv=KVSnapshot(mode=mode.value, groups=groups, taken=taken.value),
        timing=StepTiming(),
        spec_decode=adapter.spec_decode_record(),
        features=step_features(adapter.request_objects(mark), mark.scheduler_output),
        lora_adapters=adapter.lora_adapters(mark),
        **_inputs(adapter, mark, copy),
    )
    step.timing.host_copy_us = (time.perf_counter() - started) * 1e6
    return step


def capture_carried(adapter: RunnerAdapter, mark: StepMark, index: int, scheduler_output: SchedulerOutputRecord,
                    copy: HostCopy, known: list[set[int]]) -> CarriedStep:
    """A later step of a bundle, just before its forward, as docs/GUIDE.md ("Windows") lists what it
    holds; its KV blocks are those its new and resumed requests found in the prefix cache that the
    bundle neither saved nor wrote before (`known`, per KV cache group: the blocks saved here are added)."""
    started = time.perf_counter()
    found = [sorted(blocks - seen) for blocks, seen in zip(adapter.blocks_found_cached(mark.scheduler_output), known)]
    kv = None
    if any(found):
        groups = [KVGroupSnapshot(group.layer_names, group.layout, [], [], ids,
                                  blocks_to_host(group, ids, copy) if ids else {})
                  for group, ids in zip(adapter.kv_groups(), found)]
        kv = KVSnapshot(mode=KVMode.READ.value, groups=groups)
        for seen, ids in zip(known, found):
            seen.update(ids)
    carried = CarriedStep(index=index, scheduler_output=scheduler_output, batch_order=adapter.marked_req_ids(mark),
                          runner_states=adapter.runner_states(mark), kv=kv, **_inputs(adapter, mark, copy))
    carried.timing.host_copy_us = (time.perf_counter() - started) * 1e6
    return carried


def _inputs(adapter: RunnerAdapter, mark: StepMark, copy: HostCopy | None) -> dict[str, Any]:
    """The marked step's padded inputs copied to host (none where `copy` is None: the replay
    prepares them again), its dispatch (the attention metadata's device tensors only where they
    can be read) and its RNG states."""
    input_ids, positions = (mark.input_ids, mark.positions) if copy is not None else (None, None)
    num_tokens = adapter.num_scheduled_tokens(mark.scheduler_output)
    padded = int(input_ids.shape[0]) if input_ids is not None else num_tokens
    return {
        "input_ids": copy.copy(input_ids) if input_ids is not None else None,
        "positions": copy.copy(positions) if positions is not None else None,
        "graph": adapter.graph_dispatch(num_tokens, padded, mark, attention=copy is not None),
        "rng": dict(mark.rng),
    }


def capture_after_forward(adapter: RunnerAdapter, step: Step | CarriedStep, output: Any, copy: HostCopy) -> None:
    """The forward's output and, for a whole step, the KV blocks it wrote."""
    started = time.perf_counter()
    hidden_states = hidden_states_of(output)
    step.outputs = StepOutputs(hidden_states=copy.copy(hidden_states) if hidden_states is not None else None)
    if isinstance(step, Step) and step.kv.mode not in (KVMode.NONE, KVMode.RECOMPUTE):
        for snapshot, group in zip(step.kv.groups, adapter.kv_groups()):
            if snapshot.written_block_ids:
                snapshot.after = blocks_to_host(group, snapshot.written_block_ids, copy)
    step.timing.host_copy_us += (time.perf_counter() - started) * 1e6


def capture_output(step: Step | CarriedStep, name: str, tensor: torch.Tensor | None, copy: HostCopy) -> None:
    """One more output of the step (`StepOutputs`' `name`: the logits, the grammar mask as it
    reached them), copied to host once its forward's are in."""
    if step.outputs is not None and tensor is not None:
        started = time.perf_counter()
        setattr(step.outputs, name, copy.copy(tensor))
        step.timing.host_copy_us = (step.timing.host_copy_us or 0.0) + (time.perf_counter() - started) * 1e6


def capture_proposals(step: Step | CarriedStep, proposals: torch.Tensor | None, copy: HostCopy) -> None:
    """The drafter's proposals for the next step, copied to host (a bundle's first step keeps
    them with the drafter's calls, `SpecDecodeRecord.proposals`)."""
    kept = step.spec_decode if isinstance(step, Step) else step
    if kept is not None and proposals is not None:
        kept.proposals = copy.copy(proposals)
