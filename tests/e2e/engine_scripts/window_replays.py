"""Replay a window of steps on one engine, as recorded and with a fault planted in the state the
model runner carries between steps; and single-step bundles of the same steps with the fault.

    python window_replays.py RESULT.json WINDOW.zst STEP PROMPT_LEN COMPUTED POSITION SHRUNK.zst|- [SINGLE.zst ...]

The fault is this test's, never tracekit's: while it is planted, in the step (STEP, in the
window) where the request with a PROMPT_LEN-token prompt has COMPUTED tokens computed, the runner's own copy of that
prompt's token at POSITION (which a later step computes) is changed, after the runner applied the
step's scheduler output: V1's persistent batch (`input_batch.token_ids_cpu`), Model Runner V2's
request slots (`req_states.all_token_ids`). A replay that lets the runner carry its state sees it
when that later step reads the token; a replay that rebuilds the state (a single step, `--from`
a later step) never does.

With SHRUNK.zst, the window is also shrunk (`--until diverges`) with the fault planted, and the
result replayed with and without it.

A second fault moves one value of the KV the long prompt's chunk wrote in step STEP, once the
model ran (`fault_in_written_kv`): the step's outputs are untouched, its KV writes are not.

Writes {"clean": ..., "clean_from": ..., "fault": ..., "fault_from_next": ..., "fault_from_fault": ...,
"singles": {bundle: ...}, "shrink": report, "shrunk_fault": ..., "shrunk_clean": ..., "kv_fault": ...},
each replay's summary with how often its fault fired in it.
"""

import os
import sys
from contextlib import contextmanager

import torch
from engine_common import write_result

from tracekit.replay.replayer import replay


@contextmanager
def fault_in_carried_state(prompt_len: int, computed: int, position: int):
    """Plant the fault (see the module doc) for the block; yields the list of its firings."""
    fired: list[str] = []
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1":
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        name = "update_requests"

        def plant(runner):
            states = runner.req_states
            for req_id, slot in states.req_id_to_index.items():
                if int(states.prompt_len.np[slot]) == prompt_len and int(states.num_computed_tokens_np[slot]) == computed:
                    token = states.all_token_ids.gpu[slot, position]
                    states.all_token_ids.gpu[slot, position] = (int(token) + 1) % 500
                    fired.append(req_id)
    else:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        name = "_update_states"

        def plant(runner):
            batch = runner.input_batch
            for row, req_id in enumerate(batch.req_ids):
                if int(batch.num_prompt_tokens[row]) == prompt_len and int(batch.num_computed_tokens_cpu[row]) == computed:
                    batch.token_ids_cpu[row, position] = (int(batch.token_ids_cpu[row, position]) + 1) % 500
                    fired.append(req_id)

    original = getattr(GPUModelRunner, name)

    def planted(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        plant(self)
        return result

    setattr(GPUModelRunner, name, planted)
    try:
        yield fired
    finally:
        setattr(GPUModelRunner, name, original)


@contextmanager
def fault_in_written_kv(computed: int, layer: str = "model.layers.1.self_attn.attn"):
    """For the block: in the forward whose rows include a chunk starting at position COMPUTED
    (the long prompt's in step STEP), once the model ran, one value that chunk wrote to `layer`'s
    KV cache moves by one unit in its last place, as a slot mapping or a cache write gone wrong
    would leave it; yields the list of its firings. (vLLM's CPU backend keeps, per block and
    head, the keys and then the values, each slot's value a row: `[blocks, heads, slots, 2 *
    head size]`.)"""
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.models.llama import LlamaForCausalLM

    fired: list[int] = []
    original = LlamaForCausalLM.forward

    def planted(self, input_ids, positions, *args, **kwargs):
        output = original(self, input_ids, positions, *args, **kwargs)
        at = positions.tolist()  # a chunk's first row: none before it in its request
        rows = [row for row in range(len(at) - 1)
                if at[row] == computed and at[row + 1] == computed + 1 and (row == 0 or at[row - 1] != computed - 1)]
        if rows:
            context = get_forward_context()
            slot = int(context.attn_metadata[layer].slot_mapping[rows[-1]])
            cache = context.no_compile_layers[layer].kv_cache
            blocks, heads, slots, width = cache.shape
            values = cache.view(blocks, heads, 2, slots, width // 2)[:, :, 1]
            entry = values[slot // slots, 0, slot % slots, 0:1]
            entry.view(torch.int32 if entry.element_size() == 4 else torch.int16).add_(1)
            fired.append(slot)
        return output

    LlamaForCausalLM.forward = planted
    try:
        yield fired
    finally:
        LlamaForCausalLM.forward = original


def summary(result, fired: list[str]) -> dict:
    steps, sources = result.steps, result.sequence.kv_sources
    return {
        "verdict": result.verdict.name.value,
        "first_divergence": result.first_divergence,
        "rebuilt": result.sequence.rebuilt,
        "steps": {str(step.step_index): {"verdict": step.verdict.name.value, "first_divergence": step.first_divergence,
                                         "items": [check.name for check in step.checks],
                                         "kv_written": next((check.details for check in step.checks
                                                             if check.name == "kv_written"), None),
                                         "kv_sources": {req_id: source.to_plain()
                                                        for req_id, source in sources.get(step.step_index, {}).items()}}
                  for step in steps},
        "fired": len(fired),
    }


if __name__ == "__main__":
    window, (fault_step, prompt_len, computed, position) = sys.argv[2], map(int, sys.argv[3:7])
    shrunk, singles = sys.argv[7], sys.argv[8:]
    engine = {"llm": None}

    def run(bundle, fired, **options):
        before = len(fired)
        result = replay(bundle, llm=engine["llm"], **options)
        engine["llm"] = result.llm
        return summary(result, fired[before:])

    none: list[str] = []
    out = {"clean": run(window, none)}
    with fault_in_carried_state(prompt_len, computed, position) as fired:
        out["fault"] = run(window, fired)
        out["fault_from_next"] = run(window, fired, from_step=fault_step + 1)
        out["fault_from_fault"] = run(window, fired, from_step=fault_step)
        out["singles"] = {bundle: run(bundle, fired) for bundle in singles}
        if shrunk != "-":
            from tracekit.share.shrink import shrink

            out["shrink"] = shrink(window, shrunk, "diverges", llm=engine["llm"]).to_plain()
            out["shrunk_fault"] = run(shrunk, fired)
    with fault_in_written_kv(computed) as fired:
        out["kv_fault"] = run(window, fired)
    out["clean_from"] = run(window, none, from_step=fault_step + 1)
    if shrunk != "-":
        out["shrunk_clean"] = run(shrunk, none)
    write_result(out)
