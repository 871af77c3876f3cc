"""Record a tensor-parallel (TP=2) engine of the embedded model, every rank, one way:

    record_tensor_parallel.py RESULT OUT_DIR plugin|api

`plugin`: the vLLM plugin, armed from TRACEKIT_RECORD_* variables inside each worker process.
`api`: `tracekit.record.api.recording(llm, ...)` on the LLM, whose runners are in the workers.
Either way steps 0 and 1 are recorded (a prefill of three prompts, then their decodes) as
`OUT_DIR/step{step}.zst` without `{rank}`: each rank's bundle gets its rank inserted.
"""

import os
import sys
from pathlib import Path

from engine_common import REPEATABLE_PROMPTS, REPEATABLE_SAMPLING, eager_llm, generate_token_ids, write_result

from tracekit.errors import UsageError
from tracekit.integrations.vllm.engines.build import find_runner, release_llm

STEPS = "0:2"

if __name__ == "__main__":
    out_dir, how = Path(sys.argv[2]), sys.argv[3]
    output = str(out_dir / "step{step}.zst")
    if how == "plugin":
        os.environ.update(TRACEKIT_RECORD_OUTPUT=output, TRACEKIT_RECORD_STEPS=STEPS)
    llm = eager_llm(tensor_parallel_size=2)
    try:  # the runners are in the worker processes: out of this process's reach
        find_runner(llm)
        unreachable = None
    except UsageError as error:
        unreachable = str(error)
    if how == "api":
        from tracekit.record.api import recording

        with recording(llm, output, steps=STEPS) as recorder:
            tokens = generate_token_ids(llm, REPEATABLE_PROMPTS, REPEATABLE_SAMPLING, max_tokens=3)
        written, failures = [str(path) for path in recorder.written], recorder.failures
    else:
        tokens = generate_token_ids(llm, REPEATABLE_PROMPTS, REPEATABLE_SAMPLING, max_tokens=3)
        written, failures = None, []
    release_llm(llm)  # the workers exit, and with them the plugin's recorders flush
    write_result({
        "tokens": tokens,
        "written": written,
        "failures": failures,
        "files": sorted(path.name for path in out_dir.iterdir()),
        "find_runner_refusal": unreachable,
    })
