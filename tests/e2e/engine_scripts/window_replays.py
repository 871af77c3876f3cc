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

Writes {"clean": ..., "clean_from": ..., "fault": ..., "fault_from_next": ..., "fault_from_fault": ...,
"singles": {bundle: ...}, "shrink": report, "shrunk_fault": ..., "shrunk_clean": ...}, each
replay's summary with how often the fault fired in it.
"""

import os
import sys
from contextlib import contextmanager

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


def summary(result, fired: list[str]) -> dict:
    steps = getattr(result, "steps", [result])
    sources = getattr(result, "kv_sources", {})
    return {
        "verdict": result.verdict.name.value,
        "first_divergence": result.first_divergence,
        "rebuilt": getattr(result, "rebuilt", None),
        "steps": {str(step.step_index): {"verdict": step.verdict.name.value, "first_divergence": step.first_divergence,
                                         "items": [check.name for check in step.checks],
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
    out["clean_from"] = run(window, none, from_step=fault_step + 1)
    if shrunk != "-":
        out["shrunk_clean"] = run(shrunk, none)
    write_result(out)
