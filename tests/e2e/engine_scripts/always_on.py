"""The event triggers left on (issue 20): a step is copied only when it fails, from what it left
in the live engine. All on one engine, in this order (the last part leaves the engine broken):

  reference  step 2 of the workload recorded the usual way (`steps="2"`: copied before its
             forward), and the unarmed token ids
  quiet      armed on=("exception", "nonfinite"), nothing goes wrong: nothing is written and
             the token ids are those of the unarmed run
  kv_nan     armed likewise; in step 2's forward, before the model runs, a KV block the step
             reads (not one it writes) is filled with NaN in the live cache: the step's outputs
             are not finite, and its bundle, copied at the step's end, holds the poisoned block,
             so its replay reproduces the NaNs bit for bit. Step 2 is every request's last: a
             token sampled from NaN logits may be no token at all (Model Runner V2 on a GPU), and
             the embedding of a next step would fail on the device
  recompute  step 2 recorded with kv="recompute" (no KV saved), replayed: the replay prefills
             the recorded tokens to rebuild the KV (refused, with the reason, where the bundle
             lacks them: a request that started before the recorder was armed, on V1 under async
             scheduling, whose runner holds its sampled ids as placeholders)
  lost       armed on=("exception",), step 2's forward raises an error a lost CUDA context
             raises: the step is kept from host memory alone (a recompute bundle, no inputs)

    python always_on.py RESULT.json WORK_DIR
"""

import sys
from pathlib import Path

import torch
from engine_common import REPEATABLE_PROMPTS, REPEATABLE_SAMPLING, eager_llm, generate_token_ids, write_result
from recorder_behaviour import inject_into_forward

from tracekit.errors import BundleError
from tracekit.integrations.vllm.engines.build import adapter_of
from tracekit.record.api import recording
from tracekit.replay.replayer import replay

MAX_TOKENS = 8
STEP = 2  # a decode step: every request reads blocks it does not write
LOST_CONTEXT = "CUDA error: an illegal memory access was encountered"


# Prompts longer than a KV block: a decode step reads blocks it does not write.
PROMPTS = [f"{prompt} {' and the story goes on' * 8}" for prompt in REPEATABLE_PROMPTS]


def generate(llm, max_tokens=MAX_TOKENS):
    llm.reset_prefix_cache()
    return generate_token_ids(llm, PROMPTS, REPEATABLE_SAMPLING, max_tokens)


def first_block(adapter, scheduler_output):
    """The first KV block of the batch's first request (longer than a block: a decode reads it
    and does not write it), read off the live runner (block ids differ from run to run)."""
    return adapter.request_states(adapter.mark(scheduler_output, None, None), None)[0].block_ids[0][0]


def poison_block(adapter, block, value):
    """Fill one KV block of every layer of the first group, in the live cache."""
    group = adapter.kv_groups()[0]
    for cache in group.caches:
        cache.select(group.layout.block_dim, block).fill_(value)


def replayed(path, llm):
    result = replay(path, llm=llm).to_plain()
    return {key: result[key] for key in ("verdict", "verdict_reason", "first_divergence", "kv", "notes", "checks")}


if __name__ == "__main__":
    from tracekit.format.content import load_step

    work = Path(sys.argv[2])
    llm = eager_llm(max_num_batched_tokens=512)  # every prompt prefilled whole (a seeded chunked prefill
    # meets vLLM 0.32's "CPU Generator does not use offset" bug, test_record_crash_in_sampling.py)
    adapter = adapter_of(llm)
    runner = adapter.runner
    result = {"unarmed": generate(llm), "step": STEP, "runner": adapter.kind.value}

    with recording(llm, f"{work}/reference.zst", steps=str(STEP)) as recorder:
        result["reference_outputs"] = generate(llm)
    result["reference"] = str(recorder.written[0])
    _, reference = load_step(recorder.written[0], None)

    with recording(llm, f"{work}/quiet{{step}}.zst", on=("exception", "nonfinite")) as recorder:
        result["quiet_outputs"] = generate(llm)
    result["quiet_written"] = [str(p) for p in recorder.written]
    result["quiet_failures"] = recorder.failures

    original_forward = runner.model.forward
    calls = [0]

    scheduled = []  # the scheduler output of the step under way, as the recorder sees it
    armed = []  # the recorder (its adapter holds what V2 keeps of the step under way)

    def forward(*args, **kwargs):
        calls[0] += 1
        if calls[0] == STEP + 1:
            result["poisoned_block"] = first_block(armed[-1].adapter, scheduled[-1])
            poison_block(adapter, result["poisoned_block"], float("nan"))
        return original_forward(*args, **kwargs)

    runner.model.forward = forward
    try:
        with recording(llm, f"{work}/kv_nan.zst", on=("exception", "nonfinite")) as recorder:
            armed.append(recorder)
            step_started = recorder.step_started
            recorder.step_started = lambda scheduler_output: (scheduled.append(scheduler_output),
                                                              step_started(scheduler_output))
            generate(llm, max_tokens=STEP + 1)  # step 0 samples each request's first token
    finally:
        del runner.model.forward
        poison_block(adapter, result["poisoned_block"], 0.0)
    result["kv_nan_written"] = [str(p) for p in recorder.written]
    result["kv_nan_failures"] = recorder.failures
    if recorder.written:
        _, poisoned = load_step(recorder.written[0], None)
        group = poisoned.kv.groups[0]
        result["kv_nan_mode"] = poisoned.kv.mode
        saved = result["poisoned_block"] in group.saved_block_ids
        result["kv_nan_block_is_nan"] = saved and all(
            bool(torch.isnan(tensor.select(group.layout.block_dim, group.saved_block_ids.index(result["poisoned_block"]))).all())
            for tensor in group.before.values()
        )
        result["kv_nan_replay"] = replayed(recorder.written[0], llm)

    with recording(llm, f"{work}/recompute.zst", steps=str(STEP), kv="recompute") as recorder:
        generate(llm)
    result["recompute_written"] = [str(p) for p in recorder.written]
    try:
        result["recompute_replay"] = replayed(recorder.written[0], llm)
    except BundleError as refused:
        result["recompute_replay"] = {"refused": str(refused)}

    with recording(llm, f"{work}/lost.zst", on=("exception",)) as recorder:
        inject_into_forward(runner.model, STEP + 1, error=RuntimeError(LOST_CONTEXT))
        try:
            generate(llm)
            result["lost_raised"] = None
        except Exception as error:
            result["lost_raised"] = f"{type(error).__name__}: {error}"
    result["lost_written"] = [str(p) for p in recorder.written]
    result["lost_failures"] = recorder.failures
    result["lost_context"] = LOST_CONTEXT
    write_result(result)
