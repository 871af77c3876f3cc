"""A real CUDA error inside a live engine's step, with `--on exception` armed (issue 20): one
forward launches an out-of-bounds index, a device-side assert that poisons the CUDA context. The
recorder keeps the step from host memory alone (a `--kv recompute` bundle); the process cannot
use the device again, so it writes its result and leaves at once.

    python engine_cuda_error.py RESULT.json WORK_DIR [sync|async]

Under async scheduling (vLLM's default) the assert surfaces a step later than it fired, where the
engine waits for the step's sampled ids, not in the forward that launched it.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e" / "engine_scripts"))

import torch  # noqa: E402
from engine_common import REPEATABLE_PROMPTS, REPEATABLE_SAMPLING, eager_llm, generate_token_ids  # noqa: E402

from tracekit.integrations.vllm.engines.build import find_runner  # noqa: E402
from tracekit.record.api import recording  # noqa: E402

AT_CALL = 3  # engine step 2 after arming


if __name__ == "__main__":
    result_path, work = Path(sys.argv[1]), Path(sys.argv[2])
    scheduling = sys.argv[3] if len(sys.argv) > 3 else "sync"
    llm = eager_llm(dtype="bfloat16", async_scheduling=scheduling == "async")
    model = find_runner(llm).model
    original, calls = model.forward, [0]

    def forward(*args, **kwargs):
        calls[0] += 1
        output = original(*args, **kwargs)
        if calls[0] == AT_CALL:
            hidden = output[0] if isinstance(output, tuple) else output
            table = torch.zeros(4, device=hidden.device)
            hidden[0, 0] += table[torch.tensor([1 << 20], device=hidden.device)].sum()  # device-side assert
        return output

    model.forward = forward
    result = {"at_call": AT_CALL, "scheduling": scheduling}
    with recording(llm, f"{work}/lost.zst", on=("exception", "nonfinite")) as recorder:
        try:
            generate_token_ids(llm, REPEATABLE_PROMPTS, REPEATABLE_SAMPLING, 8)
            result["raised"] = None
        except Exception as error:
            result["raised"] = f"{type(error).__name__}: {error}"
        result["written"] = [str(p) for p in recorder.written]
        result["failures"] = recorder.failures
        result_path.write_text(json.dumps(result, indent=1))
        sys.stdout.flush()
        os._exit(0)  # the CUDA context is gone: no clean shutdown to wait for
