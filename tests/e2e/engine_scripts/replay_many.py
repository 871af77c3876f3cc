"""Replay many bundles recorded with one engine configuration on ONE rebuilt engine, and show
the engine still serves: the same greedy request before and after all the replays.

    python replay_many.py RESULT.json BUNDLE [BUNDLE ...]

Writes {"replays": {bundle: ReplayResult.to_plain() or {"error": ...}},
        "serve_before": token ids, "serve_after": token ids}.
"""

import sys

from engine_common import generate_token_ids, write_result

from tracekit.format.content import load_step
from tracekit.integrations.vllm.engines.build import build_llm
from tracekit.replay.replayer import replay

SERVE_PROMPT = ["Tell me a story about a robot"]


def serve(llm):
    llm.reset_prefix_cache()
    return generate_token_ids(llm, SERVE_PROMPT, [{"temperature": 0.0}], 8)[0]


if __name__ == "__main__":
    bundles = sys.argv[2:]
    content, _ = load_step(bundles[0], None)
    llm = build_llm(dict(content.engine.engine_args))  # the engine every replay below reuses
    result = {"serve_before": serve(llm), "replays": {}}
    for bundle in bundles:
        try:
            result["replays"][bundle] = replay(bundle, llm=llm).to_plain()
        except Exception as error:  # reported per bundle; the test names what failed
            result["replays"][bundle] = {"error": f"{type(error).__name__}: {error}"}
    result["serve_after"] = serve(llm)
    write_result(result)
