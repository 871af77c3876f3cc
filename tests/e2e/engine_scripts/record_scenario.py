"""Record every step of a workload `tracekit record` cannot express: generate calls one after
another (a prefix-cache hit) or an engine too small for its requests (preemption and resume);
or both, as windows of steps tiling the run.

    python record_scenario.py RESULT.json OUT_DIR prefix_cache|preemption|windows
"""

import sys

from engine_common import eager_llm, generate_token_ids, write_result

from tracekit.record.api import recording

# 96 shared prompt tokens: three full KV blocks of 32 the second request finds cached.
SHARED_PREFIX = [3 + (7 * i) % 500 for i in range(96)]
# 10 blocks of 32 tokens (32 KiB each: 32 tokens x 1 KV head x (64 K + 64 V) x 2 layers x 4 bytes)
# for four requests that each grow to 4 blocks: the scheduler must preempt to make room.
PREEMPTION_KV_BYTES = 10 * 32 * 1 * 128 * 2 * 4


def prefix_cache(llm, out_dir):
    from vllm.inputs import TokensPrompt

    with recording(llm, f"{out_dir}/step{{step}}.zst", steps="0:", max_bundles=1000) as recorder:
        first = generate_token_ids(llm, [TokensPrompt(prompt_token_ids=SHARED_PREFIX + [400, 401, 402, 403])],
                                   [{"temperature": 0.0}], 4)
        second = generate_token_ids(llm, [TokensPrompt(prompt_token_ids=SHARED_PREFIX + [410, 411, 412, 413, 414])],
                                    [{"temperature": 0.0}], 4)
    return recorder, {"outputs": first + second}


def preemption(llm, out_dir):
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=[5 + r + (13 * i) % 480 for i in range(40)]) for r in range(4)]
    # Greedy only: vLLM 0.32 on CPU crashes when a seeded request is mid-prefill in a batch
    # ("CPU Generator does not use offset" in _bookkeeping_sync), which a resumed request is.
    sampling = [{"temperature": 0.0, "ignore_eos": True}] * 4
    with recording(llm, f"{out_dir}/step{{step}}.zst", steps="0:", max_bundles=1000) as recorder:
        outputs = generate_token_ids(llm, prompts, sampling, 80)
    return recorder, {"outputs": outputs}


def windows(llm, out_dir):
    """The preemption workload with one request sampling at random, unseeded, recorded as windows
    of 6 steps tiling the run: windows that start with requests preempted earlier (V1 holds them
    outside the batch), resume them (Model Runner V2 adds them again as new requests, finding
    their first blocks in the prefix cache, the random one with a seed the engine draws anew)."""
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=[5 + r + (13 * i) % 480 for i in range(40)]) for r in range(4)]
    sampling = [{"temperature": 0.0, "ignore_eos": True}] * 3 + [{"temperature": 1.0, "ignore_eos": True}]
    with recording(llm, f"{out_dir}/step{{step}}.zst", steps="0:", window=6, max_bundles=1000) as recorder:
        outputs = generate_token_ids(llm, prompts, sampling, 80)
    return recorder, {"outputs": outputs}


PREEMPTING = {"kv_cache_memory_bytes": PREEMPTION_KV_BYTES, "max_model_len": 256}
SCENARIOS = {
    "prefix_cache": (prefix_cache, {}),
    "preemption": (preemption, PREEMPTING),
    "windows": (windows, PREEMPTING),
}

if __name__ == "__main__":
    out_dir, name = sys.argv[2], sys.argv[3]
    run, engine_overrides = SCENARIOS[name]
    llm = eager_llm(**engine_overrides)
    recorder, result = run(llm, out_dir)
    write_result({**result, "written": [str(p) for p in recorder.written], "failures": recorder.failures})
