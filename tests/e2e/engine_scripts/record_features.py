"""Record every step of a workload whose requests use more than tokens: structured outputs, LoRA
adapters, drafts, prompt embeddings — and what the recorder said when it armed.

    python record_features.py RESULT.json OUT_DIR SCENARIO [ADAPTER_DIR ...]

  grammar_lora   JSON-schema, choice and regex requests (greedy and seeded; on V1 only: Model
                 Runner V2's mask kernel does not run in Triton's interpreter), requests on two
                 LoRA adapters (ADAPTER_DIR a, b) and without one, one batch (after a short one
                 on adapter a alone)
  grammar_lora_window  the same workload, recorded as one window of WINDOW steps from the
                 second batch's first step
  grammar_drafts a regex request over digit prompts with ngram speculative decoding (drafts the
                 grammar mask must cover, one row per draft position); then, armed for failures
                 only, sampling fails in a drafted grammar step
  prompt_embeds  a request given as prompt embeddings beside a token prompt

Writes {"written": [...], "failures": [...], "outputs": token ids, "warnings": tracekit's log,
"failed_written": the failing step's bundle (grammar_drafts)}.
"""

import logging
import os
import sys
from pathlib import Path

from engine_common import eager_llm, write_result

from tracekit.integrations.vllm.engines.build import find_runner, generate
from tracekit.record.api import recording

JSON_SCHEMA = {"type": "object", "properties": {"count": {"type": "integer"}}, "required": ["count"]}
# A prompt longer than the engine's token budget (64): prefilled in chunks, sampled under its grammar after.
LONG_PROMPT = "the lighthouse keeper counts the ships that pass and writes each name in a book " * 4
DIGIT_TOKENS = list(range(18, 28))  # the embedded tokenizer's "0".."9"


def grammar_lora(llm, out_dir, adapter_a, adapter_b, window=1):
    on_v1 = os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "1"
    a, b = {"name": "a", "path": adapter_a}, {"name": "b", "path": adapter_b}
    requests = [  # (prompt, sampling, adapter, grammar)
        ("Hello, my name is", {"temperature": 0.0}, a, {"json": JSON_SCHEMA}),
        ("Pick one:", {"temperature": 0.0}, None, {"choice": ["yes", "no", "maybe"]}),
        ("A code:", {"temperature": 0.8, "seed": 5}, b, {"regex": "[0-9]{3}-[a-z]{2}"}),
        ("Once upon a time", {"temperature": 0.0}, a, None),
        ("The capital of France is", {"temperature": 0.9, "seed": 7}, None, None),
        (LONG_PROMPT, {"temperature": 0.0}, b, {"regex": "(yes|no) [0-9]{2}"}),
    ]
    sampling = [{**params, **({"structured_outputs": grammar} if grammar and on_v1 else {})}
                for _, params, _, grammar in requests]
    # A window starts at the second batch's first step (the first with more than two requests).
    triggers = {"steps": "0:", "max_bundles": 1000} if window == 1 else {"when": "num_reqs>=3", "max_bundles": 1}
    with recording(llm, f"{out_dir}/step{{step}}.zst", window=window, **triggers) as recorder:
        # First a batch on adapter a alone: its steps leave the second slot empty, and the request
        # without an adapter reads that slot on 0.32's CPU kernels (a replay after steps that filled
        # it must empty it again).
        generate(llm, ["Pick one:", "Once upon a time"], [{"max_tokens": 2, **sampling[1]}, {"max_tokens": 2, **sampling[3]}],
                 [None, a])
        outputs = generate(llm, [prompt for prompt, *_ in requests], [{"max_tokens": 8, **entry} for entry in sampling],
                           [adapter for _, _, adapter, _ in requests])
    return recorder, outputs


def grammar_drafts(llm, out_dir):
    """Every step recorded; then, armed for failures only, sampling made to fail in a drafted
    grammar step (the recorder keeps the mask of a step it only marked)."""
    prompts = [[DIGIT_TOKENS[(7 * i + 3 * (i // 10)) % 10] for i in range(60)], [5 + (11 * i) % 400 for i in range(40)]]
    sampling = [{"temperature": 0.0, "structured_outputs": {"regex": "[0-9]{12}"}}, {"temperature": 0.0}]
    with recording(llm, f"{out_dir}/step{{step}}.zst", steps="0:", max_bundles=1000) as recorder:
        outputs = generate(llm, prompts, [{"max_tokens": 12, **entry} for entry in sampling])
    llm.reset_prefix_cache()
    failed_dir = Path(out_dir) / "failed"
    failed_dir.mkdir()
    with recording(llm, f"{failed_dir}/step{{step}}.zst", on=("exception",)) as failing:
        fail_in_sampling(find_runner(llm), on_call=FAILING_SAMPLE)
        try:
            generate(llm, prompts, [{"max_tokens": 12, **entry} for entry in sampling])
        except Exception:  # the injected failure, as the engine passes it on: the step is what counts
            pass
    recorder.failed_written = [str(path) for path in failing.written]
    return recorder, outputs


FAILING_SAMPLE = 4  # the fourth step samples under the grammar, with drafts
INJECTED_ERROR = "injected failure in sampling"


def fail_in_sampling(runner, on_call):
    """The runner's `_sample` (over the recorder's shadow of it) raises on call `on_call`."""
    shadow, calls = runner._sample, [0]

    def sample(*args, **kwargs):
        calls[0] += 1
        if calls[0] == on_call:
            raise RuntimeError(INJECTED_ERROR)
        return shadow(*args, **kwargs)

    runner._sample = sample


def prompt_embeds(llm, out_dir):
    import torch

    embeds = torch.randn(6, llm.llm_engine.model_config.get_hidden_size(), generator=torch.Generator().manual_seed(3))
    with recording(llm, f"{out_dir}/step{{step}}.zst", steps="0:", max_bundles=1000) as recorder:
        outputs = llm.generate([{"prompt_embeds": embeds}, "Hello, my name is"], _greedy(llm, 3), use_tqdm=False)
    return recorder, [list(output.outputs[0].token_ids) for output in outputs]


def _greedy(llm, max_tokens):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


WINDOW = 6
LORA_ENGINE = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
SCENARIOS = {
    "grammar_lora": (grammar_lora, LORA_ENGINE),
    "grammar_lora_window": (lambda llm, out_dir, a, b: grammar_lora(llm, out_dir, a, b, window=WINDOW), LORA_ENGINE),
    "grammar_drafts": (grammar_drafts, {"speculative_config": {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}}),
    "prompt_embeds": (prompt_embeds, {"enable_prompt_embeds": True}),
}


class _Kept(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


if __name__ == "__main__":
    out_dir, name, adapters = sys.argv[2], sys.argv[3], sys.argv[4:]
    run, engine_overrides = SCENARIOS[name]
    warnings = _Kept()
    logging.getLogger("tracekit").addHandler(warnings)
    llm = eager_llm(**engine_overrides)
    recorder, outputs = run(llm, out_dir, *adapters)
    if not isinstance(outputs[0], list):
        outputs = [list(output.outputs[0].token_ids) for output in outputs]
    write_result({"written": [str(p) for p in recorder.written], "failures": recorder.failures, "outputs": outputs,
                  "warnings": warnings.messages, "failed_written": getattr(recorder, "failed_written", [])})
