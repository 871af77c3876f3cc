"""Copying one engine step to host memory, on the engine's critical path.

This is the only part of recording the engine waits for: tensors are cloned to host and vLLM
objects walked into plain data; compression and disk writes happen later on a background thread.
The pre-forward part runs just before the model call, after vLLM applied the step's scheduler
output (zeroed fresh blocks, CoW copies), so the KV blocks saved are exactly what the forward
reads. Everything read off the engine is read through the runner's adapter.
"""

import time
from enum import Enum
from typing import Any

import torch

from tracekit.format.schema import KVGroupSnapshot, KVSnapshot, Step, StepOutputs, StepTiming
from tracekit.integrations.vllm import runner_state
from tracekit.integrations.vllm.runner_adapter import RunnerAdapter, hidden_states_of


class KVMode(str, Enum):
    """Which KV blocks a bundle saves."""

    READ = "read"  # every block the forward reads: it replays exactly
    WRITTEN = "written"  # only those it writes
    NONE = "none"


KV_MODES = tuple(mode.value for mode in KVMode)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def capture_before_forward(
    adapter: RunnerAdapter,
    scheduler_output: Any,
    index: int,
    trigger: str,
    kv_mode: str,
    input_ids: torch.Tensor | None,
    positions: torch.Tensor | None,
) -> Step:
    """Everything the forward depends on, copied to host before it runs."""
    started = time.perf_counter()
    requests = adapter.request_states(scheduler_output, input_ids)
    groups = []
    for group_index, group in enumerate(adapter.kv_groups()):
        read, written = runner_state.blocks_read_and_written(requests, group_index, group.layout.block_size)
        saved = {KVMode.READ: read, KVMode.WRITTEN: written, KVMode.NONE: []}[KVMode(kv_mode)]
        groups.append(
            KVGroupSnapshot(
                layer_names=group.layer_names,
                layout=group.layout,
                read_block_ids=read,
                written_block_ids=written,
                saved_block_ids=saved,
                before=runner_state.blocks_to_host(group, saved) if saved else {},
            )
        )
    num_tokens = adapter.num_scheduled_tokens(scheduler_output)
    padded = int(input_ids.shape[0]) if input_ids is not None else num_tokens
    step = Step(
        index=index,
        trigger=trigger,
        scheduler_output=adapter.scheduler_output_record(scheduler_output),
        batch_order=adapter.batch_order(),
        requests=requests,
        input_ids=_to_host(input_ids) if input_ids is not None else None,
        positions=_to_host(positions) if positions is not None else None,
        kv=KVSnapshot(mode=KVMode(kv_mode).value, groups=groups),
        graph=adapter.graph_dispatch(num_tokens, padded),
        rng=adapter.rng_states(),
        timing=StepTiming(),
    )
    step.timing.host_copy_us = (time.perf_counter() - started) * 1e6
    return step


def capture_after_forward(adapter: RunnerAdapter, step: Step, output: Any) -> None:
    """The forward's output and the KV blocks it wrote."""
    started = time.perf_counter()
    hidden_states = hidden_states_of(output)
    step.outputs = StepOutputs(hidden_states=_to_host(hidden_states) if hidden_states is not None else None)
    if step.kv.mode != KVMode.NONE:
        for snapshot, group in zip(step.kv.groups, adapter.kv_groups()):
            if snapshot.written_block_ids:
                snapshot.after = runner_state.blocks_to_host(group, snapshot.written_block_ids)
    step.timing.host_copy_us += (time.perf_counter() - started) * 1e6


def capture_logits(step: Step, logits: torch.Tensor | None) -> None:
    if step.outputs is not None and logits is not None:
        step.outputs.logits = _to_host(logits)


def capture_sampled(step: Step, sampled_token_ids: list[list[int]] | None) -> None:
    if step.outputs is not None and sampled_token_ids is not None:
        step.outputs.sampled_token_ids = [list(map(int, ids)) for ids in sampled_token_ids]


def outputs_finite(step: Step) -> bool:
    """Whether the step's real rows of hidden states and its logits are finite (padding rows
    of a graph step hold whatever the padded size computed: they are not the step's output)."""
    outputs = step.outputs
    if outputs is None:
        return True
    tensors = [outputs.logits]
    if outputs.hidden_states is not None:
        tensors.append(outputs.hidden_states[: step.num_real_rows])
    finite = all(bool(torch.isfinite(t).all()) for t in tensors if t is not None and t.is_floating_point())
    outputs.finite = finite
    return finite
