"""Copying one engine step to host memory, on the engine's critical path.

This is the only part of recording the engine waits for: tensors are cloned to host and vLLM
objects walked into plain data; compression and disk writes happen later on a background thread.
The pre-forward part runs just before the model call, after vLLM applied the step's scheduler
output (zeroed fresh blocks, CoW copies), so the KV blocks saved are exactly what the forward
reads. What differs between runner kinds is read through the runner's adapter.
"""

import time
from typing import Any

import torch

from tracekit.format.schema import KVGroupSnapshot, KVSnapshot, Step, StepOutputs, StepTiming
from tracekit.integrations.vllm import runner_state
from tracekit.integrations.vllm.runner_adapter import RunnerAdapter
from tracekit.integrations.vllm.serialize import to_versioned_plain
from tracekit.integrations.vllm.version import installed_vllm_version

KV_MODES = ("read", "written", "none")


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
    runner = adapter.runner
    requests = adapter.request_states(scheduler_output)
    groups = []
    for group_index, group in enumerate(runner_state.kv_groups(runner)):
        read, written = runner_state.blocks_read_and_written(
            requests, group_index, group.layout.block_size
        )
        saved = {"read": read, "written": written, "none": []}[kv_mode]
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
    num_tokens = int(scheduler_output.total_num_scheduled_tokens)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and runner.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(runner.device)
    step = Step(
        index=index,
        trigger=trigger,
        scheduler_output=to_versioned_plain(scheduler_output, installed_vllm_version(), "scheduler_output"),
        batch_order=adapter.batch_order(),
        requests=requests,
        input_ids=_to_host(input_ids) if input_ids is not None else None,
        positions=_to_host(positions) if positions is not None else None,
        kv=KVSnapshot(mode=kv_mode, groups=groups),
        graph=adapter.graph_dispatch(num_tokens),
        rng=rng,
        timing=StepTiming(),
    )
    step.timing.host_copy_us = (time.perf_counter() - started) * 1e6
    return step


def capture_after_forward(runner: Any, step: Step, hidden_states: Any) -> None:
    """The forward's output and the KV blocks it wrote."""
    started = time.perf_counter()
    if isinstance(hidden_states, tuple):  # EAGLE-3 returns (hidden, aux_hidden)
        hidden_states = hidden_states[0]
    if not isinstance(hidden_states, torch.Tensor):  # a non-last pipeline rank's intermediates
        hidden_states = None
    step.outputs = StepOutputs(hidden_states=_to_host(hidden_states) if hidden_states is not None else None)
    if step.kv.mode != "none":
        for snapshot, group in zip(step.kv.groups, runner_state.kv_groups(runner)):
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
    outputs = step.outputs
    tensors = [t for t in (outputs.hidden_states, outputs.logits) if t is not None] if outputs else []
    finite = all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())
    if outputs is not None:
        outputs.finite = finite
    return finite
